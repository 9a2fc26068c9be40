//! Coalescing and batching of increments in front of a store (the database half of the
//! performance design in DESIGN.md).
//!
//! One hot bucket serialises on its row lock in PostgreSQL: a statement per request tops out
//! near 2k/s on one row. Instead, at most one statement per bucket is in flight, and at most
//! one per pooled connection overall. Increments that cannot leave yet wait; when their
//! bucket's statement returns (or a connection frees), everything waiting goes out as ONE
//! statement: increments of the same bucket become a single row with `count = count + n`,
//! different buckets become rows of one multi-row upsert, ordered by bucket so that
//! concurrent statements lock rows in the same order and cannot deadlock. There is no timer:
//! when the store is idle the first increment leaves at once.
//!
//! Exactness survives coalescing. A row incremented by `n` returns the count `c` after the
//! increment; the `n` waiters that made it up get the positions `c-n+1 ..= c`, in arrival
//! order. Statements on one row are serialised by the database, so their ranges never overlap,
//! and every request gets a position of its own, exactly as if each had sent its own
//! statement. An increment is sent in exactly one statement: a caller that stops waiting
//! (timeout, client gone) does not cancel it, so nothing is lost or applied twice.
//!
//! The statement's requests go to the store as a list ([`Store::increment_each`]), each
//! request with all of its limits: the store decides them one after another in arrival order,
//! so a sliding window counts only the requests that every enforced limit allowed (contract §3a).
//! [`Folded`] is how a store turns that list into rows and hands each request its share.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::{
    Charge, Counted, GiveBack, Increment, Peeked, ShareGrant, ShareWant, Store, StoreError,
    StoreFuture,
};

/// Queued requests at most (in the channel, and again waiting for their bucket); beyond it
/// callers wait for room, within their decision timeout.
const QUEUE: usize = 16 * 1024;
/// Requests folded into one statement at most.
const MAX_JOBS_PER_STATEMENT: usize = 2048;

struct Job {
    increments: Vec<Increment>,
    reply: oneshot::Sender<Result<Vec<Counted>, StoreError>>,
}

/// One caller's share grants (contract §3c). Grants of many buckets go out together as one
/// statement, as increments do: a burst of buckets seen for the first time (10,000 clients
/// starting their windows) costs a statement per round trip, not one per bucket.
struct GrantJob {
    wants: Vec<ShareWant>,
    instances: u32,
    reply: oneshot::Sender<Result<Vec<ShareGrant>, StoreError>>,
}

/// One caller's charges after a response (contract §3d): coalesced like increments, the
/// charges of one bucket summed into one row.
struct ChargeJob {
    charges: Vec<Charge>,
    reply: oneshot::Sender<Result<(), StoreError>>,
}

/// What the dispatcher is handed.
enum Queued {
    Decide(Job),
    Grant(GrantJob),
    Charge(ChargeJob),
}

/// Wraps a store so that concurrent increments share statements.
pub struct CoalescingStore {
    inner: Arc<dyn Store>,
    queue: mpsc::Sender<Queued>,
    /// Share grants and give-backs go straight to the store (one per share, not per
    /// request), counted here.
    on_statement: OnStatement,
}

/// Called once per statement sent (for `tollgate_store_round_trips_total`).
pub type OnStatement = Arc<dyn Fn() + Send + Sync>;

impl CoalescingStore {
    /// `statements`: how many statements may be in flight at once (the pool size). Must be
    /// called inside a tokio runtime: it starts the dispatcher.
    pub fn new(inner: Arc<dyn Store>, statements: usize, on_statement: OnStatement) -> Self {
        let (queue, jobs) = mpsc::channel(QUEUE);
        tokio::spawn(dispatch(
            inner.clone(),
            jobs,
            statements,
            on_statement.clone(),
        ));
        CoalescingStore {
            inner,
            queue,
            on_statement,
        }
    }
}

impl CoalescingStore {
    /// Hands `work` to the dispatcher and waits for the answer it sends on `answer`.
    async fn queued<T>(
        &self,
        work: Queued,
        answer: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.queue
            .send(work)
            .await
            .map_err(|_| StoreError::Unavailable("the store queue is closed".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Unavailable("the store call was dropped".into()))?
    }
}

impl Store for CoalescingStore {
    fn increment<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Counted>> {
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            let job = Job {
                increments: batch.to_vec(),
                reply,
            };
            self.queued(Queued::Decide(job), answer).await
        })
    }

    fn peek<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Peeked>> {
        self.inner.peek(batch)
    }

    fn reserves(&self) -> bool {
        self.inner.reserves()
    }

    fn reserve<'a>(
        &'a self,
        wants: &'a [ShareWant],
        instances: u32,
    ) -> StoreFuture<'a, Vec<ShareGrant>> {
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            let job = GrantJob {
                wants: wants.to_vec(),
                instances,
                reply,
            };
            self.queued(Queued::Grant(job), answer).await
        })
    }

    fn give_back<'a>(&'a self, back: &'a [GiveBack]) -> StoreFuture<'a, Vec<u32>> {
        (self.on_statement)();
        self.inner.give_back(back)
    }

    fn charge<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            let job = ChargeJob {
                charges: charges.to_vec(),
                reply,
            };
            self.queued(Queued::Charge(job), answer).await
        })
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn probe(&self) -> StoreFuture<'_, ()> {
        self.inner.probe()
    }

    fn decision_outcome(&self, succeeded: bool) {
        self.inner.decision_outcome(succeeded)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

/// Sends queued increments as statements: at most `slots` statements in flight, and at most
/// one per bucket. A job whose bucket is already in flight waits for that statement to
/// finish, and then leaves together with everything else that queued up for the bucket
/// meanwhile: a hot bucket costs one statement per round trip, whatever the request rate.
async fn dispatch(
    inner: Arc<dyn Store>,
    mut jobs: mpsc::Receiver<Queued>,
    slots: usize,
    on_statement: OnStatement,
) {
    let (done_tx, mut done) = mpsc::unbounded_channel::<Vec<Arc<str>>>();
    let mut pending: Vec<Job> = Vec::new();
    let mut grants: Vec<GrantJob> = Vec::new();
    let mut charges: Vec<ChargeJob> = Vec::new();
    // The jobs of the statement being built.
    let mut ready: Vec<Job> = Vec::new();
    // Bucket names are tollgate's own (see postgres/statements.rs): hashed with foldhash, not
    // SipHash.
    let mut in_flight: HashSet<Arc<str>, foldhash::fast::RandomState> = HashSet::default();
    let mut free = slots.max(1);
    let mut open = true;
    loop {
        // Wait for something to do: a new job, or a statement coming back.
        tokio::select! {
            job = jobs.recv(), if open && pending.len() + grants.len() + charges.len() < QUEUE => {
                match job {
                    Some(queued) => take(queued, &mut pending, &mut grants, &mut charges),
                    None => open = false,
                }
            }
            Some(finished) = done.recv() => {
                free += 1;
                for bucket in finished {
                    in_flight.remove(&bucket);
                }
            }
        }
        let idle = pending.is_empty() && grants.is_empty() && charges.is_empty();
        if !open && idle && free == slots.max(1) {
            return;
        }
        // Everything already queued joins in.
        while pending.len() + grants.len() + charges.len() < QUEUE {
            match jobs.try_recv() {
                Ok(queued) => take(queued, &mut pending, &mut grants, &mut charges),
                Err(_) => break,
            }
        }
        let mut sent = Sent {
            in_flight: &mut in_flight,
            free: &mut free,
            on_statement: &on_statement,
            done: &done_tx,
        };
        if *sent.free > 0 && !charges.is_empty() {
            if let Some(statement) = ChargeStatement::build(&mut charges, sent.in_flight) {
                let buckets = statement.rows.keys().cloned().collect();
                sent.launch(buckets, statement.run(inner.clone()));
            }
        }
        if *sent.free > 0 && !grants.is_empty() {
            if let Some(statement) = GrantStatement::build(&mut grants, sent.in_flight) {
                let buckets = statement.buckets().cloned().collect();
                sent.launch(buckets, statement.run(inner.clone()));
            }
        }
        while *sent.free > 0 && !pending.is_empty() {
            // The jobs whose buckets are free move out in order and the others keep their
            // places; both vectors keep their allocations from round to round (a new vector
            // per round, grown one push at a time, cost several allocations per statement).
            let in_flight = &*sent.in_flight;
            let in_use =
                |job: &mut Job| job.increments.iter().any(|i| in_flight.contains(&i.bucket));
            ready.extend(pending.extract_if(.., |job| !in_use(job)));
            if ready.is_empty() {
                break;
            }
            if ready.len() > MAX_JOBS_PER_STATEMENT {
                pending.extend(ready.drain(MAX_JOBS_PER_STATEMENT..));
            }
            let statement = Statement::build(ready.drain(..), &mut pending);
            if statement.jobs.is_empty() {
                continue;
            }
            let buckets = statement.rows.keys().cloned().collect();
            sent.launch(buckets, statement.run(inner.clone()));
        }
    }
}

/// What the dispatcher keeps of the statements under way.
struct Sent<'a> {
    /// Buckets of statements under way: no second statement of a bucket leaves meanwhile.
    in_flight: &'a mut HashSet<Arc<str>, foldhash::fast::RandomState>,
    /// Statements that may still leave (pool connections not in use).
    free: &'a mut usize,
    on_statement: &'a OnStatement,
    /// Where a finished statement hands its buckets back.
    done: &'a mpsc::UnboundedSender<Vec<Arc<str>>>,
}

impl Sent<'_> {
    /// Sends one statement (`run`), whose `buckets` stay in flight until it returns.
    fn launch(&mut self, buckets: Vec<Arc<str>>, run: impl Future<Output = ()> + Send + 'static) {
        self.in_flight.extend(buckets.iter().cloned());
        *self.free -= 1;
        (self.on_statement)();
        let done = self.done.clone();
        tokio::spawn(async move {
            run.await;
            let _ = done.send(buckets);
        });
    }
}

/// Files a queued job with its kind.
fn take(
    queued: Queued,
    pending: &mut Vec<Job>,
    grants: &mut Vec<GrantJob>,
    charges: &mut Vec<ChargeJob>,
) {
    match queued {
        Queued::Decide(job) => pending.push(job),
        Queued::Grant(job) => grants.push(job),
        Queued::Charge(job) => charges.push(job),
    }
}

/// What a statement knows of one of its buckets: every request in it must agree.
struct Row {
    window_secs: u32,
    /// The sliding limit, or `None` for a fixed window (one bucket is counted one way).
    sliding: Option<u32>,
}

struct Statement {
    jobs: Vec<Job>,
    rows: BTreeMap<Arc<str>, Row>,
}

impl Statement {
    /// Takes `jobs` into one statement. A job that names a bucket already in the statement
    /// with another window (possible right after a reload changed a window) waits for the
    /// next statement, so every bucket appears once per statement.
    fn build(jobs: impl ExactSizeIterator<Item = Job>, carried: &mut Vec<Job>) -> Statement {
        let mut rows: BTreeMap<Arc<str>, Row> = BTreeMap::new();
        let mut kept = Vec::with_capacity(jobs.len());
        for job in jobs {
            let conflicts = job.increments.iter().any(|inc| {
                rows.get(&inc.bucket).is_some_and(|row| {
                    row.window_secs != inc.window_secs || row.sliding != inc.sliding
                })
            });
            let repeated = job
                .increments
                .iter()
                .enumerate()
                .any(|(i, inc)| job.increments[..i].iter().any(|o| o.bucket == inc.bucket));
            if conflicts || repeated {
                if repeated {
                    // The store contract: buckets in one request are distinct.
                    let _ = job.reply.send(Err(StoreError::Query(
                        "one request named the same bucket twice".into(),
                    )));
                } else {
                    carried.push(job);
                }
                continue;
            }
            for inc in &job.increments {
                rows.entry(inc.bucket.clone()).or_insert(Row {
                    window_secs: inc.window_secs,
                    sliding: inc.sliding,
                });
            }
            kept.push(job);
        }
        Statement { jobs: kept, rows }
    }

    async fn run(self, inner: Arc<dyn Store>) {
        if self.jobs.is_empty() {
            return;
        }
        let requests: Vec<&[Increment]> = self.jobs.iter().map(|j| &j.increments[..]).collect();
        let result = inner.increment_each(&requests).await;
        drop(requests);
        let answers = match result {
            Ok(answers) if answers.len() == self.jobs.len() => answers,
            Ok(_) => return fail_all(self.jobs, StoreError::Query("short answer".into())),
            Err(err) => return fail_all(self.jobs, err),
        };
        for (job, answer) in self.jobs.into_iter().zip(answers) {
            let reply = if answer.len() == job.increments.len() {
                Ok(answer)
            } else {
                Err(StoreError::Query("missing row".into()))
            };
            let _ = job.reply.send(reply);
        }
    }
}

/// Requests folded into rows, for a store that counts rows (PostgreSQL): one row per
/// distinct bucket, its `by` the sum of the requests' units, and for every request's
/// increment the row it went into and the offset of its first unit there (arrival order).
pub(crate) struct Folded {
    /// In bucket order: concurrent statements lock rows in the same order.
    pub rows: Vec<Increment>,
    /// Per request, per increment: (row, offset of its first unit in the row).
    pub places: Vec<Vec<(usize, u32)>>,
    /// Some request has an enforced limit next to another limit (a request that one limit
    /// denies is counted in none of its rows, contract §3d, so whether a row counts it depends
    /// on the other rows), takes several units of a limit (they are counted all together or
    /// not at all), or checks a limit charged after the response (nothing is added), or two
    /// requests enforce different limits on one row: the store must decide request by
    /// request. Otherwise each row is counted on its own, its units in arrival order while
    /// they fit under the row's `enforce` (its requests' common enforced limit).
    pub joint: bool,
}

impl Folded {
    /// Folds `requests`; a bucket must have one window and algorithm across them, and appear
    /// once per request.
    pub fn new(requests: &[&[Increment]]) -> Result<Folded, StoreError> {
        let mut index: BTreeMap<Arc<str>, usize> = BTreeMap::new();
        for inc in requests.iter().flat_map(|r| r.iter()) {
            let next = index.len();
            index.entry(inc.bucket.clone()).or_insert(next);
        }
        // Row numbers in bucket order.
        let mut rows: Vec<Option<Increment>> = vec![None; index.len()];
        for (ord, slot) in index.values_mut().enumerate() {
            *slot = ord;
        }
        let mut joint = false;
        let mut places = Vec::with_capacity(requests.len());
        for request in requests {
            let mut place = Vec::with_capacity(request.len());
            for inc in request.iter() {
                let ord = index[&inc.bucket];
                let row = rows[ord].get_or_insert_with(|| Increment {
                    by: 0,
                    ..inc.clone()
                });
                joint |= row.enforce != inc.enforce;
                if row.window_secs != inc.window_secs || row.sliding != inc.sliding {
                    return Err(StoreError::Query(
                        "one bucket with two windows in one statement".into(),
                    ));
                }
                if place.iter().any(|&(r, _)| r == ord) {
                    return Err(StoreError::Query(
                        "one request named the same bucket twice".into(),
                    ));
                }
                place.push((ord, row.by));
                row.by = row.by.saturating_add(inc.by);
            }
            // A request of several units (contract §3d) is counted whole or not at all, which
            // a row's prefix of units cannot say; a check adds nothing, which a row's sum
            // cannot say either. Several limits of which none is enforced never deny: each
            // row counts them on its own.
            joint |= request.len() > 1 && request.iter().any(|inc| inc.enforce.is_some());
            joint |= request.iter().any(|inc| inc.by > 1 || inc.check);
            places.push(place);
        }
        Ok(Folded {
            rows: rows.into_iter().flatten().collect(),
            places,
            joint,
        })
    }

    /// Each request's answers from its rows' answers (in row order), when every row was
    /// counted on its own (not [`Folded::joint`]).
    pub fn share(&self, requests: &[&[Increment]], counted: &[Counted]) -> Vec<Vec<Counted>> {
        requests
            .iter()
            .zip(&self.places)
            .map(|(request, place)| {
                request
                    .iter()
                    .zip(place)
                    .map(|(inc, &(row, offset))| {
                        share(counted[row], self.rows[row].by, offset, inc.by)
                    })
                    .collect()
            })
            .collect()
    }
}

/// Grants of several callers in one statement: each bucket once (a second caller's grant of a
/// bucket waits for the next statement, and then sees what the first one's left).
struct GrantStatement {
    jobs: Vec<GrantJob>,
}

impl GrantStatement {
    /// Takes from `queued` the grants whose buckets are neither in flight nor asked by an
    /// earlier grant of this statement, up to [`MAX_JOBS_PER_STATEMENT`] callers.
    fn build(
        queued: &mut Vec<GrantJob>,
        in_flight: &HashSet<Arc<str>, foldhash::fast::RandomState>,
    ) -> Option<GrantStatement> {
        let mut taken: HashSet<Arc<str>, foldhash::fast::RandomState> = HashSet::default();
        let jobs: Vec<GrantJob> = queued
            .extract_if(.., |job| {
                let free = taken.len() < MAX_JOBS_PER_STATEMENT
                    && job
                        .wants
                        .iter()
                        .all(|w| !in_flight.contains(&w.bucket) && !taken.contains(&w.bucket));
                if free {
                    taken.extend(job.wants.iter().map(|w| w.bucket.clone()));
                }
                free
            })
            .collect();
        (!jobs.is_empty()).then_some(GrantStatement { jobs })
    }

    fn buckets(&self) -> impl Iterator<Item = &Arc<str>> {
        self.jobs
            .iter()
            .flat_map(|j| j.wants.iter().map(|w| &w.bucket))
    }

    async fn run(self, inner: Arc<dyn Store>) {
        let wants: Vec<ShareWant> = self.jobs.iter().flat_map(|j| j.wants.clone()).collect();
        let instances = self.jobs.iter().map(|j| j.instances).max().unwrap_or(1);
        let answer = inner.reserve(&wants, instances).await.and_then(|grants| {
            if grants.len() == wants.len() {
                Ok(grants)
            } else {
                Err(StoreError::Query("short grant".into()))
            }
        });
        match answer {
            Ok(grants) => {
                let mut rest = &grants[..];
                for job in self.jobs {
                    let (mine, after) = rest.split_at(job.wants.len());
                    rest = after;
                    let _ = job.reply.send(Ok(mine.to_vec()));
                }
            }
            Err(err) => {
                for job in self.jobs {
                    let _ = job.reply.send(Err(err.clone()));
                }
            }
        }
    }
}

/// Charges of several callers in one statement, one row per bucket (their units summed).
struct ChargeStatement {
    jobs: Vec<ChargeJob>,
    rows: BTreeMap<Arc<str>, Charge>,
}

impl ChargeStatement {
    /// Takes from `queued` the charges whose buckets are not in flight, up to
    /// [`MAX_JOBS_PER_STATEMENT`] callers; a charge whose bucket is already in the statement with
    /// another window (right after a reload) waits for the next one.
    fn build(
        queued: &mut Vec<ChargeJob>,
        in_flight: &HashSet<Arc<str>, foldhash::fast::RandomState>,
    ) -> Option<ChargeStatement> {
        let mut rows: BTreeMap<Arc<str>, Charge> = BTreeMap::new();
        let mut taken = 0;
        let jobs: Vec<ChargeJob> = queued
            .extract_if(.., |job| {
                let fits = taken < MAX_JOBS_PER_STATEMENT
                    && job.charges.iter().all(|c| {
                        !in_flight.contains(&c.bucket)
                            && rows.get(&c.bucket).is_none_or(|row| {
                                (row.window_secs, row.sliding) == (c.window_secs, c.sliding)
                            })
                    });
                if fits {
                    taken += 1;
                    for c in &job.charges {
                        let row = rows.entry(c.bucket.clone()).or_insert(Charge {
                            units: 0,
                            ..c.clone()
                        });
                        row.units = row.units.saturating_add(c.units);
                    }
                }
                fits
            })
            .collect();
        (!jobs.is_empty()).then_some(ChargeStatement { jobs, rows })
    }

    async fn run(self, inner: Arc<dyn Store>) {
        let rows: Vec<Charge> = self.rows.into_values().collect();
        let answer = inner.charge(&rows).await;
        for job in self.jobs {
            let _ = job.reply.send(answer.clone());
        }
    }
}

fn fail_all(jobs: Vec<Job>, err: StoreError) {
    for job in jobs {
        let _ = job.reply.send(Err(err.clone()));
    }
}

/// One waiter's part of its row's answer. A row that counted all its units (far from its
/// limit, or without an enforced one): the waiter's count is where its last unit landed
/// ([`position`]). Otherwise the row admitted a prefix of its units (unit `k` is admitted while
/// the count, or a sliding window's estimate, stays within the limit, and both grow with `k`),
/// so units `1 ..= added` were admitted in arrival order: a waiter whose units all fall in that
/// prefix was admitted, at its position; the others were not counted and see the row's count
/// without them (contract §3d: a denied unit is not added).
///
/// Only for rows counted on their own: a row's requests have no other enforced limit, so what
/// its limit admits is what is counted (`fits` = `added`).
fn share(after: Counted, total: u32, offset: u32, by: u32) -> Counted {
    if after.added >= total {
        return Counted {
            count: position(after.count, total, offset, by),
            added: by,
            fits: by,
            ..after
        };
    }
    let before = after.count.saturating_sub(after.added);
    let admitted = after.added.saturating_sub(offset).min(by);
    Counted {
        count: if admitted == by {
            before.saturating_add(offset).saturating_add(by)
        } else {
            after.count
        },
        added: admitted,
        fits: admitted,
        ..after
    }
}

/// The count a waiter sees: the row reached `after` by adding `total`; this waiter's units
/// were `offset+1 ..= offset+by` of them, so its count is where its last unit landed.
pub(crate) fn position(after: u32, total: u32, offset: u32, by: u32) -> u32 {
    if after >= i32::MAX as u32 {
        // Saturated: every waiter is far past any limit.
        return after;
    }
    let before = after.saturating_sub(total);
    before.saturating_add(offset).saturating_add(by)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;

    #[test]
    fn positions_split_a_row_among_its_waiters() {
        // Row went from 10 to 13 by three single increments.
        assert_eq!(position(13, 3, 0, 1), 11);
        assert_eq!(position(13, 3, 1, 1), 12);
        assert_eq!(position(13, 3, 2, 1), 13);
        assert_eq!(position(i32::MAX as u32, 3, 0, 1), i32::MAX as u32);
    }

    #[test]
    fn a_sliding_row_admits_its_first_waiters_only() {
        // Row went from 10 to 12: of three waiters, the first two were admitted.
        let after = Counted {
            count: 12,
            window_end_ms: 0,
            now_ms: 0,
            added: 2,
            previous: 7,
            fits: 2,
        };
        let seen: Vec<(u32, u32)> = (0..3)
            .map(|offset| {
                let c = share(after, 3, offset, 1);
                (c.count, c.added)
            })
            .collect();
        assert_eq!(seen, [(11, 1), (12, 1), (12, 0)]);
        assert_eq!(share(after, 3, 2, 1).previous, 7);
        // Fixed rows: every waiter counted.
        let fixed = Counted {
            added: 3,
            count: 13,
            ..after
        };
        assert_eq!(share(fixed, 3, 2, 1).count, 13);
        assert_eq!(share(fixed, 3, 2, 1).added, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_increments_get_distinct_positions() {
        let statements = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = statements.clone();
        let on_statement: OnStatement = Arc::new(move || {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        let store = Arc::new(CoalescingStore::new(
            Arc::new(MemoryStore::new()),
            2,
            on_statement,
        ));
        let mut tasks = Vec::new();
        for i in 0..500u32 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut batch = vec![Increment {
                    bucket: Arc::from("hot"),
                    window_secs: 3600,
                    by: 1,
                    sliding: None,
                    enforce: Some(1000),
                    check: false,
                }];
                if i % 2 == 0 {
                    batch.push(Increment {
                        bucket: Arc::from(format!("cold-{i}")),
                        window_secs: 3600,
                        by: 1,
                        sliding: None,
                        enforce: Some(1000),
                        check: false,
                    });
                }
                store.increment(&batch).await.expect("counted")
            }));
        }
        let mut hot = Vec::new();
        for task in tasks {
            let counted = task.await.expect("task");
            hot.push(counted[0].count);
            if counted.len() == 2 {
                assert_eq!(counted[1].count, 1);
            }
        }
        hot.sort_unstable();
        assert_eq!(hot, (1..=500).collect::<Vec<u32>>());
        let sent = statements.load(std::sync::atomic::Ordering::Relaxed);
        assert!((1..=500).contains(&sent), "{sent} statements");
    }
}
