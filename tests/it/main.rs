//! The integration tests, one binary: each file a module, each capability a file (the
//! harness is `tests/common/`). One binary links the crate and the harness once; the suite
//! used to link them once per file. Three tests keep a process of their own beside it:
//! `fd_limit` (it lowers the process's open-file limit), `request_id` (it installs the
//! process-wide log subscriber) and `memory_bounds` (it counts the heap with its own global
//! allocator). `cargo test --test it MODULE::` runs one file's tests.

#[path = "../common/mod.rs"]
mod common;

mod bench_summary;
mod body_size;
mod bounds;
mod breaker_timeouts;
mod charge_after;
mod cli;
mod compose;
mod cost;
mod denial_members;
mod direct_upstream;
mod failover;
mod grafana;
mod grpc;
mod h1_wire;
mod h1_wire_fields;
mod h2_streams;
mod hop_by_hop_paths;
mod kubernetes;
mod limit_policies;
mod limits;
mod local_fallback;
mod log_capture;
mod log_format;
mod migrate_cli;
mod msrv;
mod normalisation;
mod operations;
mod origin_failover;
mod overrides;
mod pg_tls;
mod pgbouncer;
mod prometheus;
mod properties;
mod proxy;
mod proxy_protocol;
mod quick_start;
mod request_target;
mod reserve;
mod reset;
mod review_bypasses;
mod server_state;
mod simple_h1_attacks;
mod simple_tls_attacks;
mod sliding;
mod smuggling;
mod store;
mod store_failures;
mod tls;
mod upgrades;
mod usage;
