//! What one connection worker owns for the requests it serves, handed down with each
//! connection (`ConnInfo::worker`) rather than kept in thread-locals: two servers in one
//! process, or two workers on one thread (a test's runtime), never share it.

use crate::key::IpBucketCache;

pub struct Worker {
    index: usize,
    ip_buckets: IpBucketCache,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Worker `index` of its server (0 runs on the caller's runtime).
    pub fn new(index: usize) -> Self {
        Worker {
            index,
            ip_buckets: IpBucketCache::default(),
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
}
