//! What `explain`, `usage` and `reset` share: the request given on the command line, the
//! route and buckets the proxy would give it (`crate::pipeline::plan`), and the store they
//! read or reset.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};

use crate::config::{self, Config, KeyPart, LimitConfig};
use crate::key::BucketHasher;
use crate::limit::overrides::Overrides;
use crate::limit::{PlannedLimit, Plans};
use crate::pipeline::plan::{self, Rules};
use crate::store::postgres::{self, InitError, PostgresStore};

use super::output::{say, Out};
use super::RequestArgs;
use std::process::ExitCode;

/// A request given on the command line (`explain`, `reset`): the method, URL and headers
/// parsed, or a usage error.
pub struct CommandRequest {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
}

/// The request of `args`, or the exit code of a usage error of `command` (its one line on
/// stderr already written).
pub fn request_of(args: &RequestArgs, command: &str) -> Result<CommandRequest, ExitCode> {
    command_request(&args.method, &args.url, &args.headers)
        .map_err(|message| usage_error(command, &message))
}

/// A usage error of `tollgate COMMAND`: one line on stderr, exit 2.
pub fn usage_error(command: &str, message: &str) -> ExitCode {
    eprintln!("tollgate {command}: {message}");
    ExitCode::from(2)
}

pub fn command_request(
    method: &str,
    url: &str,
    header_args: &[String],
) -> Result<CommandRequest, String> {
    let Ok(method) = Method::from_bytes(method.to_ascii_uppercase().as_bytes()) else {
        return Err(format!("not an HTTP method: {method}"));
    };
    let Ok(uri) = url.parse::<Uri>() else {
        return Err("URL does not parse".to_string());
    };
    Ok(CommandRequest {
        method,
        uri,
        headers: command_headers(header_args)?,
    })
}

/// The `--header 'Name: value'` arguments of a command (`explain`, `reset`, `override`), as
/// a request would carry them: a repeated name is kept twice.
pub fn command_headers(header_args: &[String]) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for arg in header_args {
        let Some((name, value)) = arg.split_once(':') else {
            return Err("--header takes 'Name: value'".to_string());
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.trim().as_bytes()),
            HeaderValue::from_str(value.trim()),
        ) else {
            return Err("--header has an invalid name or value".to_string());
        };
        headers.append(name, value);
    }
    Ok(headers)
}

/// The one-off commands' budget for a call to the store beyond making its connection: the
/// request path's `store.timeout` (100 ms by default) is a decision's budget, pool connect
/// included, and a command that connects afresh on a loaded machine or to a distant database
/// cannot keep to it (issue 19: `explain` failed under load).
pub const COMMAND_STORE_GRACE: Duration = Duration::from_secs(5);

/// Why a command could not use the store: the `store` line of `explain`'s output
/// (`unreachable (...)`), and the cause for the command's one stderr line.
pub struct StoreProblem {
    pub line: String,
    pub cause: String,
}

impl StoreProblem {
    /// A store that was reached but did not answer as needed, or could not be set up.
    pub fn failed(err: impl std::fmt::Display) -> StoreProblem {
        StoreProblem {
            line: format!("not usable ({err})"),
            cause: err.to_string(),
        }
    }

    fn from_init(err: InitError) -> StoreProblem {
        match err {
            // `run`'s message for this says how to rotate the secret; a command that only
            // reads or resets must not send an operator off rotating keys: most likely it was
            // given another file (or secret) than the running instances'.
            InitError::FingerprintMismatch(_) => StoreProblem {
                line: "key fingerprint mismatch: the database's counters were made with another \
                       keys.secret; the buckets below are this configuration's, not the ones the \
                       running instances count in"
                    .to_owned(),
                cause: "this configuration's keys.secret is not the one the database's instances \
                        use (key fingerprint mismatch): give the command the same configuration, \
                        and TOLLGATE_KEY_SECRET, as the running instances"
                    .to_owned(),
            },
            InitError::Unreachable(ref m) => StoreProblem {
                line: format!("unreachable ({m})"),
                cause: err.to_string(),
            },
            other => StoreProblem::failed(other),
        }
    }
}

/// The Postgres store for a command that reads or writes counters: no migration, but the key
/// fingerprint must match, or the buckets would not be the ones the running instances use.
/// Every call gets the time to make a connection plus [`COMMAND_STORE_GRACE`].
pub async fn command_store(
    config: &Config,
    hasher: &BucketHasher,
) -> Result<Arc<PostgresStore>, StoreProblem> {
    let mut store = config.store.clone();
    let connect = postgres::connect_deadline_for(&store).map_err(StoreProblem::failed)?;
    store.timeout = store.timeout.max(connect + COMMAND_STORE_GRACE);
    let pg = PostgresStore::new(&store).map_err(StoreProblem::failed)?;
    pg.initialize(&hasher.fingerprint(), false)
        .await
        .map_err(StoreProblem::from_init)?;
    Ok(pg)
}

/// A request planned as the proxy plans it, with the rules it was planned on.
pub struct CommandPlan {
    pub rules: Rules,
    /// The limits that apply, with their buckets.
    pub limits: Plans,
    /// The index of the route it matched.
    pub route: usize,
}

impl CommandPlan {
    /// Each limit of the route, with what the request would count in it (`None`: the limit
    /// does not apply).
    pub fn limits(&self) -> impl Iterator<Item = (&LimitConfig, Option<&PlannedLimit>)> {
        let route = &self.rules.routes[self.route];
        route
            .config
            .limits
            .iter()
            .enumerate()
            .map(move |(i, limit)| (limit, plan::limit_in(&self.limits, route, i)))
    }

    /// The limits that apply, with their buckets.
    pub fn planned(&self) -> impl Iterator<Item = &PlannedLimit> {
        self.limits.iter()
    }
}

/// What the proxy would do with a command's request before counting, from [`plan::plan`].
pub enum Planned {
    /// The proxy answers it itself (status and reason), counts nothing and forwards nothing.
    Refused(crate::error::RequestError),
    /// No route matches: the proxy answers 404.
    NoRoute,
    /// It matches a route (whose limits may be none, or none that apply).
    Route(CommandPlan),
}

/// A command's request planned as the proxy plans it, and its `request` line.
pub struct PlannedRequest {
    /// `METHOD authority path from ADDR`, without the query (it may carry credentials).
    pub line: String,
    pub planned: Planned,
}

/// Plans `request` with the proxy's own [`plan::plan`], for every command that names a
/// request (`explain`, `usage`, `reset`), with `overrides` as the proxy would apply them
/// (contract §3e). `Err` is the exit code of a usage error of `command`, its one line on
/// stderr already written.
pub fn plan_request(
    config: &Config,
    hasher: &BucketHasher,
    ip: IpAddr,
    request: &CommandRequest,
    command: &str,
    overrides: &Overrides,
) -> Result<PlannedRequest, ExitCode> {
    // The proxy answers such a request 400; here it is a command line that says too little.
    if request.uri.authority().is_none() && !request.headers.contains_key(http::header::HOST) {
        return Err(usage_error(
            command,
            "the request has no host (give an absolute URL or a Host header)",
        ));
    }
    let rules = Rules::compile(Arc::new(config.clone()));
    let mut req = Request::builder()
        .method(request.method.clone())
        .uri(request.uri.clone())
        // No body: the commands describe a request by its head.
        .body(String::new())
        .map_err(|e| usage_error(command, &e.to_string()))?;
    *req.headers_mut() = request.headers.clone();
    let asker = plan::Asker {
        peer: ip,
        ip_buckets: None,
        overrides,
    };
    let mut limits = Plans::new();
    let method = &request.method;
    let planned = match plan::plan(&rules, hasher, &mut req, asker, &mut limits) {
        Ok(plan) => plan,
        Err(refusal) => {
            let authority = request.uri.authority().map_or("", |a| a.as_str());
            return Ok(PlannedRequest {
                line: format!("{method} {authority}{} from {ip}", request.uri.path()),
                planned: Planned::Refused(refusal.error),
            });
        }
    };
    let authority = planned.authority.as_ref().map_or("", |a| a.as_str());
    let line = format!("{method} {authority}{} from {ip}", planned.path);
    let planned = match planned.route {
        None => Planned::NoRoute,
        Some(route) => Planned::Route(CommandPlan {
            rules,
            limits,
            route,
        }),
    };
    Ok(PlannedRequest { line, planned })
}

/// The first half of `reset`: [`plan_request`] and [`say_planned`]. `Err` is the exit code
/// to stop with: a usage error, or success when no limit is to be shown.
pub fn plan_and_say_route(
    config: &Config,
    hasher: &BucketHasher,
    ip: IpAddr,
    request: &CommandRequest,
    command: &str,
    out: &mut Out<'_>,
) -> Result<CommandPlan, ExitCode> {
    // The buckets are all `reset` needs: the file's `requests` do (contract §3e).
    let planned = plan_request(config, hasher, ip, request, command, &Overrides::default())?;
    say_planned(config, &planned, out)?;
    match planned.planned {
        Planned::Route(plan) => Ok(plan),
        _ => Err(ExitCode::SUCCESS),
    }
}

/// The `request` and `route` lines of `explain` and `reset`. `Err(success)` when there is no
/// limit to show: no route, no limits, or a request the proxy answers itself.
pub fn say_planned(
    config: &Config,
    planned: &PlannedRequest,
    out: &mut Out<'_>,
) -> Result<(), ExitCode> {
    say!(out, "request     {}", planned.line);
    let plan = match &planned.planned {
        Planned::Refused(error) => {
            say!(
                out,
                "refused     {} ({error}): the proxy answers it itself, counts nothing and \
                 forwards nothing",
                error.status().as_u16(),
            );
            return Err(ExitCode::SUCCESS);
        }
        Planned::NoRoute => {
            say!(
                out,
                "route       none: the request would get 404 and not be forwarded"
            );
            return Err(ExitCode::SUCCESS);
        }
        Planned::Route(plan) => plan,
    };
    let route_config = &config.routes[plan.route];
    say!(
        out,
        "route       {} -> upstream {}",
        route_config.name,
        config.upstream(route_config).name
    );
    if route_config.limits.is_empty() {
        say!(out, "limits      none: the request would be forwarded");
        return Err(ExitCode::SUCCESS);
    }
    Ok(())
}

/// `limit ...: does not apply (no X header)` for a limit whose key the request lacks.
pub fn say_not_applying(limit: &config::LimitConfig, headers: &HeaderMap, out: &mut Out<'_>) {
    let missing: Vec<String> = limit
        .key
        .parts
        .iter()
        .filter_map(|p| match p {
            KeyPart::Header(h) if !headers.contains_key(h) => Some(h.to_string()),
            _ => None,
        })
        .collect();
    say!(
        out,
        "limit       {}: does not apply (no {} header)",
        limit.policy_name(),
        missing.join("/")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_request_is_parsed_like_a_request() {
        let request = command_request(
            "post",
            "http://api.example.com/login?x=1",
            &[
                "Authorization: Bearer abc".to_owned(),
                "X-Tenant:  a ".to_owned(),
            ],
        )
        .expect("valid");
        assert_eq!(request.method, Method::POST);
        assert_eq!(request.uri.path(), "/login");
        assert_eq!(request.headers["authorization"], "Bearer abc");
        assert_eq!(request.headers["x-tenant"], "a");
    }

    #[test]
    fn a_repeated_header_is_kept_twice() {
        let request = command_request("GET", "/", &["X-Key: a".to_owned(), "X-Key: b".to_owned()])
            .expect("valid");
        assert_eq!(request.headers.get_all("x-key").iter().count(), 2);
    }

    #[test]
    fn bad_arguments_are_usage_errors_that_say_what_is_wrong() {
        let err = |method: &str, url: &str, header: &str| {
            command_request(method, url, &[header.to_owned()])
                .err()
                .expect("refused")
        };
        assert_eq!(
            err("GET", "http://a/", "no colon"),
            "--header takes 'Name: value'"
        );
        assert_eq!(
            err("GET", "http://a/", "Bad Name: x"),
            "--header has an invalid name or value"
        );
        assert_eq!(err("GET", "http://a b/", "X: y"), "URL does not parse");
        assert_eq!(err("G(T", "http://a/", "X: y"), "not an HTTP method: G(T");
    }
}
