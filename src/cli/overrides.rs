//! `tollgate override set|remove|list` (contract §1 and §3e; docs/operations.md, "Overrides"):
//! per-subject `requests` kept in the database, by bucket. The subject is given as `explain`
//! takes it (`--ip`, `--header`) and turned into its bucket by the proxy's own derivation
//! ([`key::bucket_for`]), so the override is stored under the very bucket the proxy counts
//! in; only the digest is stored and printed.

use std::net::IpAddr;
use std::process::ExitCode;
use std::sync::Arc;

use http::HeaderMap;
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, UtcOffset};

use crate::config::{Config, KeyPart, LimitConfig};
use crate::key::{self, BucketHasher, RequestIdentity};
use crate::store::postgres::{ListedOverride, OverrideKey, OverrideSet, PostgresStore};

use super::output::{say, Out};
use super::request::{command_headers, command_store, usage_error};
use super::{OverrideAction, SubjectArgs};

/// `tollgate override ...`: one clear line and exit 2 for a usage error, exit 1 when the
/// database is not there to hold overrides.
pub async fn overrides(out: &mut Out<'_>, config: Config, action: &OverrideAction) -> ExitCode {
    let command = action.command();
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let work = match Work::of(&config, &hasher, action) {
        Ok(work) => work,
        Err(message) => return usage_error(command, &message),
    };
    if config.store.url.is_none() {
        eprintln!(
            "tollgate {command}: {}: overrides need the database (store.url), where every \
             instance reads them; the memory store keeps nothing another process can change",
            config.source.display()
        );
        return ExitCode::from(1);
    }
    let pg = match command_store(&config, &hasher).await {
        Ok(pg) => pg,
        Err(problem) => {
            eprintln!(
                "tollgate {command}: cannot reach the database: {}",
                problem.cause
            );
            return ExitCode::from(1);
        }
    };
    match work.run(&pg, &config, out).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tollgate {command}: {err}");
            ExitCode::from(1)
        }
    }
}

impl OverrideAction {
    fn command(&self) -> &'static str {
        match self {
            OverrideAction::Set { .. } => "override set",
            OverrideAction::Remove { .. } => "override remove",
            OverrideAction::List { .. } => "override list",
        }
    }
}

/// What a command line asks, checked against the configuration.
enum Work<'c> {
    Set {
        limit: &'c LimitConfig,
        set: OverrideSet,
    },
    Remove {
        limit: &'c LimitConfig,
        key: OverrideKey,
    },
    List {
        limit: Option<&'c LimitConfig>,
    },
}

impl<'c> Work<'c> {
    fn of(
        config: &'c Config,
        hasher: &BucketHasher,
        action: &OverrideAction,
    ) -> Result<Work<'c>, String> {
        match action {
            OverrideAction::Set {
                subject,
                requests,
                until,
                note,
            } => {
                let (limit, key) = subject_key(config, hasher, subject)?;
                let requests = requests_of(requests)?;
                let until = until.as_deref().map(until_of).transpose()?;
                let note = note.clone();
                let set = OverrideSet {
                    key,
                    requests,
                    until,
                    note,
                };
                Ok(Work::Set { limit, set })
            }
            OverrideAction::Remove { subject } => {
                let (limit, key) = subject_key(config, hasher, subject)?;
                Ok(Work::Remove { limit, key })
            }
            OverrideAction::List { limit } => {
                let limit = limit
                    .as_deref()
                    .map(|l| find_limit(config, l))
                    .transpose()?;
                Ok(Work::List { limit })
            }
        }
    }

    async fn run(
        self,
        pg: &PostgresStore,
        config: &Config,
        out: &mut Out<'_>,
    ) -> Result<(), crate::store::StoreError> {
        match self {
            Work::Set { limit, set } => run_set(pg, limit, &set, out).await,
            Work::Remove { limit, key } => run_remove(pg, limit, &key, out).await,
            Work::List { limit } => {
                let policy = limit.map(|l| (l.scope.as_str(), l.key.label()));
                let policy = policy.as_ref().map(|(s, l)| (*s, l.as_str()));
                for row in pg.list_overrides(policy).await? {
                    say!(out, "{}", listed_line(&row, config));
                }
                Ok(())
            }
        }
    }
}

const NOTIFIED: &str = "notified    every running instance applies it within a second";

/// `override set`: the bucket, the `requests` it had and has now.
async fn run_set(
    pg: &PostgresStore,
    limit: &LimitConfig,
    set: &OverrideSet,
    out: &mut Out<'_>,
) -> Result<(), crate::store::StoreError> {
    let old = pg.set_override(set).await?;
    let until = set
        .until
        .as_ref()
        .map_or(String::new(), |u| format!(" until {u}"));
    let blocked = if set.requests == 0 { " (blocked)" } else { "" };
    say!(
        out,
        "override    bucket {}: requests {} -> {}{until}{blocked}",
        set.key.bucket(),
        requests_text(old, limit),
        set.requests,
    );
    say!(out, "{NOTIFIED}");
    Ok(())
}

/// `override remove`: the bucket, the `requests` it had and has now (the file's).
async fn run_remove(
    pg: &PostgresStore,
    limit: &LimitConfig,
    key: &OverrideKey,
    out: &mut Out<'_>,
) -> Result<(), crate::store::StoreError> {
    let bucket = key.bucket();
    let file = limit.requests;
    match pg.remove_override(key).await? {
        Some((requests, true)) => {
            say!(out, "removed     bucket {bucket}: requests {requests} -> {file} (the file's)");
            say!(out, "{NOTIFIED}");
        }
        Some((requests, false)) => {
            say!(
                out,
                "removed     bucket {bucket}: an ended override (requests {requests}); requests stay {file} (the file's)"
            );
            say!(out, "{NOTIFIED}");
        }
        None => say!(
            out,
            "removed     nothing: bucket {bucket} has no override; requests stay {file} (the file's)"
        ),
    }
    Ok(())
}

/// `120 (the file's)` or the override's `requests` it replaced.
fn requests_text(old: Option<u32>, limit: &LimitConfig) -> String {
    match old {
        Some(requests) => requests.to_string(),
        None => format!("{} (the file's)", limit.requests),
    }
}

/// One line of `override list`: fields as `name=value`, the note quoted, so that a note
/// cannot break the line.
fn listed_line(row: &ListedOverride, config: &Config) -> String {
    let until = row.until.as_deref().unwrap_or("-");
    let ended = if row.ended { " (ended)" } else { "" };
    let orphan = if limit_named(config, &row.policy).is_none() {
        " (no such limit in this configuration)"
    } else {
        ""
    };
    format!(
        "{}  requests={}  until={until}{ended}  set_at={}  note={:?}{orphan}",
        row.bucket, row.requests, row.set_at, row.note
    )
}

fn limit_named<'c>(config: &'c Config, policy: &str) -> Option<&'c LimitConfig> {
    config
        .routes
        .iter()
        .flat_map(|route| &route.limits)
        .find(|limit| limit.policy_name() == policy)
}

/// The limit `--limit SCOPE:LABEL` names, or the usage error that says which exist.
fn find_limit<'c>(config: &'c Config, policy: &str) -> Result<&'c LimitConfig, String> {
    limit_named(config, policy).ok_or_else(|| {
        let mut known: Vec<String> = config
            .routes
            .iter()
            .flat_map(|route| &route.limits)
            .map(LimitConfig::policy_name)
            .collect();
        known.dedup();
        format!(
            "--limit {policy}: no such limit in {} (its limits: {})",
            config.source.display(),
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        )
    })
}

/// The limit and the bucket of the subject given by `args`, as the proxy derives it; a
/// subject the limit's key cannot take is a usage error.
fn subject_key<'c>(
    config: &'c Config,
    hasher: &BucketHasher,
    args: &SubjectArgs,
) -> Result<(&'c LimitConfig, OverrideKey), String> {
    let limit = find_limit(config, &args.limit)?;
    let policy = limit.policy_name();
    let headers = command_headers(&args.headers)?;
    let ip = args
        .ip
        .as_deref()
        .map(|ip| {
            ip.parse::<IpAddr>()
                .map_err(|_| format!("--ip {ip}: not an IP address"))
        })
        .transpose()?;
    check_subject(limit, &policy, ip, &headers)?;
    let who = RequestIdentity {
        client: ip.unwrap_or(IpAddr::from([0, 0, 0, 0])),
        ipv6_prefix: config.server.ipv6_prefix,
        headers: &headers,
        ip_buckets: None,
    };
    let bucket: Arc<str> = key::bucket_for(&limit.scope, &limit.key, &who, hasher)
        .ok_or_else(|| format!("--limit {policy}: the subject given does not make a bucket"))?;
    let digest = bucket
        .strip_prefix(policy.as_str())
        .and_then(|rest| rest.strip_prefix(':'))
        .unwrap_or("");
    let key = OverrideKey {
        scope: limit.scope.clone(),
        label: limit.key.label(),
        digest: digest.to_owned(),
    };
    Ok((limit, key))
}

/// Whether `ip` and `headers` are exactly the subject of `limit`'s key (contract §3): its
/// address if it keys on `ip`, each header it keys on once, with a value the proxy would
/// count, and nothing else.
fn check_subject(
    limit: &LimitConfig,
    policy: &str,
    ip: Option<IpAddr>,
    headers: &HeaderMap,
) -> Result<(), String> {
    let parts = &limit.key.parts;
    if limit.key.is_global() {
        return match (ip, headers.is_empty()) {
            (None, true) => Ok(()),
            _ => Err(format!(
                "--limit {policy} is global (one bucket for every client): it takes no --ip or --header"
            )),
        };
    }
    let keys_on_ip = parts.contains(&KeyPart::Ip);
    match (ip, keys_on_ip) {
        (Some(_), false) => {
            return Err(format!(
                "--limit {policy} does not key on the client address: leave out --ip"
            ))
        }
        (None, true) => {
            return Err(format!(
                "--limit {policy} keys on the client address: give --ip ADDR"
            ))
        }
        _ => {}
    }
    let keyed = key::keyed_headers(std::slice::from_ref(limit));
    if let Some(other) = headers.keys().find(|name| !keyed.contains(name)) {
        return Err(format!(
            "--limit {policy} does not key on header {other}: give only {}",
            names(&keyed)
        ));
    }
    if let Some(missing) = keyed.iter().find(|name| !headers.contains_key(*name)) {
        return Err(format!(
            "--limit {policy} keys on header {missing}: give --header '{missing}: VALUE'"
        ));
    }
    match key::keyed_header_problem(headers, &keyed, false) {
        Some(why) => Err(format!(
            "--header: {why}; the proxy would answer such a request 400"
        )),
        None => Ok(()),
    }
}

fn names(keyed: &[http::HeaderName]) -> String {
    let names: Vec<String> = keyed
        .iter()
        .map(|n| format!("--header '{n}: VALUE'"))
        .collect();
    names.join(" and ")
}

/// `--requests`: a whole number the `requests` column holds (0 blocks the subject).
fn requests_of(text: &str) -> Result<u32, String> {
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| i32::try_from(*n).is_ok())
        .ok_or_else(|| {
            format!(
                "--requests {text}: give a whole number from 0 (blocks the subject) to 2147483647"
            )
        })
}

/// `--until`: an RFC 3339 time still to come, as UTC text for the database. One that has
/// passed already is a usage error (contract §3e): it would never apply.
fn until_of(text: &str) -> Result<String, String> {
    let bad = || format!("--until {text}: give an RFC 3339 time, such as 2027-01-31T00:00:00Z");
    let at = OffsetDateTime::parse(text.trim(), &Rfc3339).map_err(|_| bad())?;
    let utc = at.to_offset(UtcOffset::UTC);
    if utc <= OffsetDateTime::now_utc() {
        return Err(format!(
            "--until {text}: that time has passed; an override must end in the future"
        ));
    }
    utc.format(&Rfc3339).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
        [[routes]]\nname = \"api\"\npath_prefix = \"/\"\nupstream = \"a\"\n\
        [[routes.limits]]\nkey = \"header:authorization\"\nrequests = 100\nwindow = \"1m\"\n\
        [[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1m\"\n\
        [[routes.limits]]\nkey = \"global\"\nrequests = 1000\nwindow = \"1m\"\n\
        [[routes.limits]]\nkey = [\"header:x-tenant\", \"ip\"]\nrequests = 50\nwindow = \"1m\"\n";

    fn config() -> Config {
        crate::config::load_str(std::path::Path::new("p.toml"), CONFIG, &|_| None).expect("valid")
    }

    fn subject(limit: &str, ip: Option<&str>, headers: &[&str]) -> SubjectArgs {
        SubjectArgs {
            limit: limit.to_owned(),
            ip: ip.map(str::to_owned),
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
        }
    }

    fn key_of(args: &SubjectArgs) -> Result<OverrideKey, String> {
        let hasher = BucketHasher::new(Some(b"s"));
        subject_key(&config(), &hasher, args).map(|(_, key)| key)
    }

    /// The stored bucket is the one the proxy counts in: its derivation, not a copy of it.
    #[test]
    fn the_subject_becomes_the_proxys_bucket() {
        let key = key_of(&subject(
            "api:authorization",
            None,
            &["Authorization: Bearer abc"],
        ))
        .expect("a bucket");
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer abc".parse().expect("value"));
        let who = RequestIdentity {
            client: IpAddr::from([192, 0, 2, 7]),
            ipv6_prefix: 64,
            headers: &headers,
            ip_buckets: None,
        };
        let config = config();
        let limit = &config.routes[0].limits[0];
        let hasher = BucketHasher::new(Some(b"s"));
        let bucket = key::bucket_for("api", &limit.key, &who, &hasher).expect("bucket");
        assert_eq!(key.bucket(), *bucket);
        assert_eq!(key.digest.len(), 64);
        assert!(!key.bucket().contains("abc"));
        let global = key_of(&subject("api:global", None, &[])).expect("global");
        assert_eq!(
            (global.bucket().as_str(), global.digest.as_str()),
            ("api:global", "")
        );
        let ip = key_of(&subject("api:ip", Some("192.0.2.7"), &[])).expect("ip");
        assert!(ip.bucket().starts_with("api:ip:"), "{}", ip.bucket());
        // A list key takes all of its parts, and makes the proxy's bucket of them.
        let both = key_of(&subject(
            "api:x-tenant+ip",
            Some("192.0.2.7"),
            &["X-Tenant: t1"],
        ))
        .expect("both parts");
        let mut tenant = HeaderMap::new();
        tenant.insert("x-tenant", "t1".parse().expect("value"));
        let who = RequestIdentity {
            client: IpAddr::from([192, 0, 2, 7]),
            ipv6_prefix: 64,
            headers: &tenant,
            ip_buckets: None,
        };
        let list = &config.routes[0].limits[3].key;
        let expected = key::bucket_for("api", list, &who, &hasher).expect("bucket");
        assert_eq!(both.bucket(), *expected);
        assert!(key_of(&subject("api:x-tenant+ip", None, &["X-Tenant: t1"])).is_err());
    }

    #[test]
    fn a_subject_the_key_cannot_take_is_refused_in_one_line() {
        let refused = |args: SubjectArgs| key_of(&args).expect_err("refused");
        let cases = [
            (subject("api:nope", None, &[]), "no such limit"),
            (
                subject("api:authorization", None, &["X-Other: 1"]),
                "does not key on header x-other",
            ),
            (
                subject("api:authorization", None, &[]),
                "give --header 'authorization: VALUE'",
            ),
            (
                subject(
                    "api:authorization",
                    Some("192.0.2.7"),
                    &["Authorization: a"],
                ),
                "leave out --ip",
            ),
            (subject("api:ip", None, &[]), "give --ip ADDR"),
            (subject("api:ip", Some("nope"), &[]), "not an IP address"),
            (
                subject("api:global", Some("192.0.2.7"), &[]),
                "takes no --ip",
            ),
            (
                subject(
                    "api:authorization",
                    None,
                    &["Authorization: a", "Authorization: b"],
                ),
                "more than once",
            ),
        ];
        for (args, says) in cases {
            let message = refused(args);
            assert!(message.contains(says), "{message:?} should say {says:?}");
            assert_eq!(message.lines().count(), 1, "{message}");
        }
    }

    #[test]
    fn requests_and_until_are_checked() {
        assert_eq!(requests_of("0"), Ok(0));
        assert_eq!(requests_of("10000"), Ok(10_000));
        for bad in ["-1", "x", "1.5", "2147483648", ""] {
            assert!(requests_of(bad).is_err(), "{bad}");
        }
        assert_eq!(
            until_of("2999-01-31T01:00:00+01:00"),
            Ok("2999-01-31T00:00:00Z".to_owned())
        );
        assert!(
            until_of("2001-01-01T00:00:00Z").is_err_and(|e| e.contains("has passed")),
            "a time that has passed"
        );
        for bad in ["2027-01-31", "tomorrow", "2027-13-01T00:00:00Z"] {
            assert!(until_of(bad).is_err(), "{bad}");
        }
    }
}
