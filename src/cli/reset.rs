//! `tollgate reset`: forget what a request's buckets counted, in the database and in every
//! running instance within a second (docs/operations.md, "Reset").

use std::process::ExitCode;
use std::sync::Arc;

use crate::config::Config;
use crate::key::BucketHasher;

use super::output::{say, Out};
use super::request::{command_store, plan_and_say_route, request_of, say_not_applying};
use super::RequestArgs;

/// `tollgate reset`: the buckets `explain` names, deleted for the current and the previous
/// window, and every running instance told to forget them.
pub async fn reset(out: &mut Out<'_>, config: Config, args: &RequestArgs) -> ExitCode {
    let request = match request_of(args, "reset") {
        Ok(r) => r,
        Err(code) => return code,
    };
    if config.store.url.is_none() {
        eprintln!(
            "tollgate reset: {}: the memory store's counters live inside the running tollgate \
             process, which another process cannot reach; restart it to forget them",
            config.source.display()
        );
        return ExitCode::from(1);
    }
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let plan = match plan_and_say_route(&config, &hasher, args.ip, &request, "reset", out) {
        Ok(plan) => plan,
        Err(code) => return code,
    };
    for (limit, planned) in plan.limits() {
        if planned.is_none() {
            say_not_applying(limit, &request.headers, out);
        }
    }
    // Two limits of one route may share a bucket (same scope and key): reset it once.
    let mut buckets: Vec<(Arc<str>, u32)> = Vec::new();
    for planned in plan.planned() {
        if !buckets.iter().any(|(b, _)| *b == planned.bucket) {
            buckets.push((planned.bucket.clone(), planned.window_secs));
        }
    }
    if buckets.is_empty() {
        say!(out, "reset       nothing: no limit applies to this request");
        return ExitCode::SUCCESS;
    }
    let pg = match command_store(&config, &hasher).await {
        Ok(pg) => pg,
        Err(problem) => {
            eprintln!(
                "tollgate reset: cannot reset the counters: {}",
                problem.cause
            );
            return ExitCode::from(1);
        }
    };
    match pg.reset(&buckets).await {
        Ok(done) => {
            for bucket in done {
                let previous = match bucket.previous {
                    Some(count) => format!(", previous window {count}"),
                    None => String::new(),
                };
                say!(
                    out,
                    "reset       bucket {}: count was {}{previous}",
                    bucket.bucket,
                    bucket.count
                );
            }
            say!(
                out,
                "notified    every running instance forgets these buckets within a second"
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("tollgate reset: cannot reset the counters: {err}");
            ExitCode::from(1)
        }
    }
}
