//! Keeping this instance's overrides current (contract §3e; docs/architecture.md,
//! "Overrides"): the table is read whole into the decision path's map
//! ([`crate::limit::overrides`]) at start, when the `LISTEN` session hears a change or
//! (re)starts (it may have missed one), and every [`REREAD_EVERY`] whatever it hears, so that
//! a lost notification, a lost session or a pooler in transaction mode (where `LISTEN` cannot
//! work) still converges within 30 s. A read that fails keeps the map as it was.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;

use crate::limit::overrides::Overrides;
use crate::store::postgres::PostgresStore;
use crate::store::{unix_now_ms, ResetEvent};

/// How often the table is read again without a notification: the 30 s of contract §3e with
/// room for a slow read and a reconnect.
pub const REREAD_EVERY: Duration = Duration::from_secs(10);

/// Reads the overrides into the map and keeps `tollgate_overrides` current.
pub struct OverrideReader {
    pg: Arc<PostgresStore>,
    overrides: Arc<Overrides>,
    /// `tollgate_overrides`: overrides in force.
    gauge: Gauge,
    /// Rung by the `LISTEN` session ([`OverrideReader::hears`]).
    wake: Arc<Notify>,
    /// Whether a read has succeeded yet (the first one is logged with its count).
    loaded: bool,
    /// Whether the last read failed (a failure is logged once, not at every try).
    failing: bool,
}

impl OverrideReader {
    pub fn new(pg: Arc<PostgresStore>, overrides: Arc<Overrides>, gauge: Gauge) -> Self {
        OverrideReader {
            pg,
            overrides,
            gauge,
            wake: Arc::new(Notify::new()),
            loaded: false,
            failing: false,
        }
    }

    /// What the `LISTEN` session's events ask of the reader: a read now after a change, or
    /// after the session (re)started, since changes may have been missed meanwhile.
    pub fn hears(&self) -> impl Fn(ResetEvent<'_>) + Send + Sync + 'static {
        let wake = self.wake.clone();
        move |event| {
            if matches!(event, ResetEvent::Overrides | ResetEvent::Missed) {
                wake.notify_one();
            }
        }
    }

    /// One read of the table, if the store is ready; the map is replaced only by a read that
    /// succeeded.
    pub async fn read(&mut self) {
        if self.pg.is_initialized() {
            match self.pg.load_overrides().await {
                Ok(map) => self.loaded(map),
                Err(err) => {
                    if !self.failing {
                        tracing::warn!(error = %err, "overrides: cannot read them from the database; the last ones read stay in force");
                    }
                    self.failing = true;
                }
            }
        }
        let in_force = self.overrides.in_force(unix_now_ms());
        self.gauge.set(i64::try_from(in_force).unwrap_or(i64::MAX));
    }

    fn loaded(&mut self, map: crate::limit::overrides::OverrideMap) {
        let count = map.len();
        let changed = self.overrides.replace(map);
        if !self.loaded {
            tracing::info!(count, "overrides: loaded from the database");
        } else if self.failing || changed > 0 {
            tracing::info!(count, changed, "overrides: read again");
        }
        self.loaded = true;
        self.failing = false;
    }

    /// Reads again whenever woken, and every [`REREAD_EVERY`], for as long as the server runs.
    pub async fn run(mut self) {
        loop {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(REREAD_EVERY) => {}
            }
            self.read().await;
        }
    }
}
