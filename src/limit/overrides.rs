//! Per-subject overrides in memory (contract §3e; docs/architecture.md, "Overrides"): the
//! rows of `public.tollgate_overrides` as a map from bucket to the `requests` that replaces
//! the limit's, which [`crate::pipeline::plan`] asks for each bucket it derives.
//!
//! The decision path pays nothing while no override is loaded (one relaxed atomic load) and a
//! hash look-up per limit otherwise: never a statement. The map is replaced whole, never
//! changed in place (`ArcSwap`), by whoever reads the table (`server/overrides.rs`); a request
//! sees the map as it was when it looked. Its size is the table's: operators add rows, clients
//! cannot. The caches of the limiter need no word of a change: a cached denial is held against
//! the `requests` of the request's plan ([`super::Exhausted`]), and a reserved share taken
//! under another `requests` is given back at its next use ([`super::reserve::Shares::take`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use crate::store::OverrideMap;

/// The overrides this instance applies (see the module notes).
#[derive(Default)]
pub struct Overrides {
    map: ArcSwap<OverrideMap>,
    /// Whether `map` has an entry: what the decision path asks first.
    any: AtomicBool,
}

impl Overrides {
    /// Overrides holding `map`.
    #[cfg(test)]
    pub fn of(map: OverrideMap) -> Overrides {
        let overrides = Overrides::default();
        overrides.replace(map);
        overrides
    }

    /// The `requests` that replaces the limit's for `bucket` now, if an override of it is in
    /// force.
    pub fn requests(&self, bucket: &str) -> Option<u32> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let found = self.map.load().get(bucket).copied()?;
        found
            .in_force(crate::store::unix_now_ms())
            .then_some(found.requests)
    }

    /// Puts `map` in place of what was held; answers how many entries changed (added, removed
    /// or altered), for the log.
    pub fn replace(&self, map: OverrideMap) -> usize {
        let any = !map.is_empty();
        let old = self.map.swap(Arc::new(map));
        self.any.store(any, Ordering::Relaxed);
        let new = self.map.load();
        let gone = old.keys().filter(|b| !new.contains_key(*b)).count();
        gone + new.iter().filter(|(b, o)| old.get(*b) != Some(*o)).count()
    }

    /// Overrides in force at `now_ms` (the `tollgate_overrides` gauge).
    pub fn in_force(&self, now_ms: i64) -> usize {
        self.map
            .load()
            .values()
            .filter(|o| o.in_force(now_ms))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Override;

    fn map(entries: &[(&str, u32, Option<i64>)]) -> OverrideMap {
        entries
            .iter()
            .map(|(b, requests, until_ms)| {
                (
                    Box::from(*b),
                    Override {
                        requests: *requests,
                        until_ms: *until_ms,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn an_override_applies_to_its_bucket_until_it_ends() {
        let now = crate::store::unix_now_ms();
        let overrides = Overrides::of(map(&[
            ("api:ip:aa", 10, None),
            ("api:ip:bb", 0, Some(now + 60_000)),
            ("api:ip:cc", 7, Some(now - 1)),
        ]));
        assert_eq!(overrides.requests("api:ip:aa"), Some(10));
        assert_eq!(overrides.requests("api:ip:bb"), Some(0), "0 blocks");
        assert_eq!(overrides.requests("api:ip:cc"), None, "ended");
        assert_eq!(overrides.requests("api:ip:dd"), None);
        assert_eq!(overrides.in_force(now), 2);
        assert_eq!(overrides.in_force(now + 120_000), 1);
    }

    #[test]
    fn a_replacement_counts_what_changed() {
        let overrides = Overrides::of(map(&[("a", 1, None), ("b", 2, None)]));
        assert_eq!(
            overrides.replace(map(&[("a", 1, None), ("b", 3, None), ("c", 4, None)])),
            2,
            "b altered, c added"
        );
        assert_eq!(overrides.replace(map(&[("c", 4, None)])), 2, "a and b gone");
        assert_eq!(overrides.replace(OverrideMap::default()), 1);
        assert_eq!(overrides.requests("c"), None);
    }
}
