//! What became of a request, in one word: the `decision` field of the access log and the
//! `decision` label of `tollgate_decisions_total` and `tollgate_policy_decisions_total`
//! (docs/operations.md, "Metrics" and "Logs"). One list, so that the log and the metrics can
//! never name one outcome two ways.

/// The limiter's decisions come first, in the order the per-route metric slots keep them;
/// the rest are requests that ended before a decision, which only the log names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    ShadowLimited,
    Limited,
    FailedOpen,
    FailedClosed,
    LocalAllowed,
    LocalLimited,
    /// Admitted by the check of a limit charged after the response (contract §3d), whether or
    /// not the response is then charged.
    CountedAfter,
    BadRequest,
    NoRoute,
    UriTooLong,
    BodyTooLarge,
    MethodNotAllowed,
    UpstreamError,
    UpstreamTimeout,
}

impl Decision {
    /// How many of the first variants are the limiter's decisions (the metrics' slots).
    pub const COUNTED: usize = 8;

    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::ShadowLimited => "shadow_limited",
            Decision::Limited => "limited",
            Decision::FailedOpen => "failed_open",
            Decision::FailedClosed => "failed_closed",
            Decision::LocalAllowed => "local_allowed",
            Decision::LocalLimited => "local_limited",
            Decision::CountedAfter => "counted_after",
            Decision::BadRequest => "bad_request",
            Decision::NoRoute => "no_route",
            Decision::UriTooLong => "uri_too_long",
            Decision::BodyTooLarge => "body_too_large",
            Decision::MethodNotAllowed => "method_not_allowed",
            Decision::UpstreamError => "upstream_error",
            Decision::UpstreamTimeout => "upstream_timeout",
        }
    }

    /// Its slot among the limiter's decisions, or `None` for an ending that is not one.
    pub fn counted_index(self) -> Option<usize> {
        let index = self as usize;
        (index < Self::COUNTED).then_some(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Decision; 15] = [
        Decision::Allowed,
        Decision::ShadowLimited,
        Decision::Limited,
        Decision::FailedOpen,
        Decision::FailedClosed,
        Decision::LocalAllowed,
        Decision::LocalLimited,
        Decision::CountedAfter,
        Decision::BadRequest,
        Decision::NoRoute,
        Decision::UriTooLong,
        Decision::BodyTooLarge,
        Decision::MethodNotAllowed,
        Decision::UpstreamError,
        Decision::UpstreamTimeout,
    ];

    #[test]
    fn every_word_is_distinct_and_only_the_limiters_decisions_have_slots() {
        let mut words: Vec<&str> = ALL.iter().map(|d| d.as_str()).collect();
        words.sort_unstable();
        words.dedup();
        assert_eq!(words.len(), ALL.len());
        for (i, decision) in ALL.into_iter().enumerate() {
            let slot = decision.counted_index();
            assert_eq!(slot, (i < Decision::COUNTED).then_some(i), "{decision:?}");
        }
        assert_eq!(Decision::LocalLimited.counted_index(), Some(6));
        assert_eq!(Decision::CountedAfter.counted_index(), Some(7));
        assert_eq!(Decision::BadRequest.counted_index(), None);
    }
}
