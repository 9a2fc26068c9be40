//! What the integration tests, the examples and the fuzz targets check beyond the
//! public API: the one list of the internals they reach, by the paths of their modules. It is
//! not API (hidden from the docs, no stability promised).

pub mod config {
    pub use crate::config::{
        load_str, Algorithm, CertConfig, Config, KeyPart, KeySpec, StoreConfig, StoreErrorPolicy,
        DEFAULT_MEMORY_BUCKETS,
    };
}

pub mod store {
    pub use crate::store::{
        Clock, Counted, Increment, InstanceRegistry, ManualClock, ResetEvent, Store, StoreError,
    };

    pub mod memory {
        pub use crate::store::memory::MemoryStore;
    }

    pub mod postgres {
        pub use crate::store::postgres::{
            decide_sql, fixed_upsert_sql, increment_sql, sliding_one_sql, sliding_upsert_sql,
            ConnectionInspection, FingerprintChange, InitError, PostgresStore,
        };
    }
}

pub mod key {
    pub use crate::key::{
        bucket_for, client_addr, ip_subject, BucketHasher, IpBucketCache, RequestIdentity,
    };
}

pub mod normalise {
    pub use crate::normalise::{
        host_without_port, normalise_path, request_authority, routing_path,
    };
}

pub mod route {
    pub use crate::route::{path_matches, strip};
}

pub mod limit {
    pub use crate::limit::{Limiter, Outcomes, PlannedLimit, Verdict};
}

pub mod metrics {
    pub use crate::metrics::{MemoryStoreMetrics, Metrics};
}

pub mod log_format {
    pub use crate::log_format::{access, AccessLine, LineFormat, LineWriter};
}

pub mod access_log {
    pub use crate::access_log::{AccessLog, BLOCK_BYTES, FLUSH_EVERY};
    pub use crate::log_writer::{FlushOnDrop, LogWriter};
}

pub mod tls {
    pub use crate::tls::{client_config, server_config};
}

/// tollgate's own HTTP/1.1 code, for the differential fuzz targets and the wire tests.
pub mod http1 {
    pub mod guard {
        pub use crate::http1::guard::FramingGuard;
    }

    pub mod server {
        pub use crate::http1::server::simple_request;
    }

    pub mod client {
        pub use crate::http1::client::{lines_against_the_map, read_response};
    }
}
