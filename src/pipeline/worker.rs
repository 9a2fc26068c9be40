//! What one connection worker owns for the requests it serves, handed down with each
//! connection (`ConnInfo::worker`) rather than kept in thread-locals: two servers in one
//! process, or two workers on one thread (a test's runtime), never share it.

use crate::access_log::{AccessLog, WorkerLog};
use crate::key::IpBucketCache;
use crate::log_format::{self, AccessLine};

pub struct Worker {
    index: usize,
    ip_buckets: IpBucketCache,
    /// Its block of access-log lines when its server writes the access log itself
    /// (`crate::access_log`); `None`: the lines are `tracing` events.
    access_log: Option<WorkerLog>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Worker `index` of its server (0 runs on the caller's runtime), writing its access-log
    /// lines into `access_log`, or through `tracing` without one.
    pub fn new(index: usize, access_log: Option<&AccessLog>) -> Self {
        Worker {
            index,
            ip_buckets: IpBucketCache::default(),
            access_log: access_log.map(WorkerLog::new),
        }
    }

    /// Which of its server's workers this is: its lane in every upstream pool
    /// (`forward::UpstreamPool`), so a request and the upstream connection that carries it
    /// stay on one thread.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Its recent `ip` buckets (`key::IpBucketCache`).
    pub fn ip_buckets(&self) -> &IpBucketCache {
        &self.ip_buckets
    }

    /// Writes the access-log line of one of its requests.
    pub fn log_access(&self, line: &AccessLine<'_>) {
        match &self.access_log {
            Some(block) => block.write(line),
            None => log_format::access(line),
        }
    }

    /// Its block of access-log lines, if it has one.
    pub fn access_log(&self) -> Option<&WorkerLog> {
        self.access_log.as_ref()
    }
}
