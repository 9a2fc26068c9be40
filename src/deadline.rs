//! Coarse deadlines: an upstream's `response_timeout` (contract §5) and the decision budget
//! `store.timeout` (contract §2, §5b).
//!
//! `tokio::time::timeout` arms a timer per request: an entry put into and taken out of the
//! runtime's timer wheel, about 735 instructions per request in the benchmarks (callgrind;
//! docs/performance.md, row "Coarse deadlines"), for a timer that almost never fires. Here a waiting request takes a
//! slot in its worker's [`Deadlines`] lane instead (a few dozen instructions: a lock nobody else
//! holds, a vector slot, a waker), and one task per set of deadlines looks the lanes over every
//! tick and wakes what has expired. A timeout therefore fires between its duration and its
//! duration plus one tick (plus scheduling) after the wait began, where tokio's timer rounds to
//! the millisecond. The tick is [`TICK`] for `response_timeout` (30 s by default: the
//! difference is nothing); the decision budget, 100 ms by default, gets a tenth of itself
//! ([`tick_for`]).
//!
//! Bounds: a lane holds one slot per request in flight on that worker, reused when the request
//! ends (by answer, timeout or cancellation), so it never outgrows the connection and stream
//! bounds. When no request is waiting, the sweeper sleeps until one is registered, so an idle
//! proxy costs no wake-ups.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How often the sweeper looks for expired deadlines while some are registered, unless the
/// deadlines were made with a finer tick ([`Deadlines::with_tick`]).
pub const TICK: Duration = Duration::from_millis(20);

/// The tick for timeouts of `timeout`: a tenth of it, between 1 ms and [`TICK`], so a timeout
/// fires at most about 10 % late.
pub fn tick_for(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(1), TICK)
}

/// One set of deadlines (an upstream pool's, the limiter's), one lane per connection worker (a
/// worker only takes slots in its own lane, so its lock is contended only by the sweeper, once
/// per tick).
pub struct Deadlines {
    lanes: Box<[Mutex<Lane>]>,
    /// How often the sweeper looks while deadlines are registered.
    tick: Duration,
    /// Whether the sweeper sleeps until `wake` is notified.
    asleep: AtomicBool,
    /// Shared with the sweeper, which holds no strong reference while it sleeps: dropping
    /// the pool notifies it, and it ends.
    wake: Arc<Notify>,
    /// This set, weakly: what the sweeper it starts holds.
    me: Weak<Deadlines>,
    /// Whether the sweeper has been started: at the first registration, on the runtime that
    /// polls it, so a set made where no runtime runs still times out.
    sweeping: AtomicBool,
}

#[derive(Default)]
struct Lane {
    slots: Vec<Slot>,
    /// Indices of free slots.
    free: Vec<usize>,
    /// Slots taken (the sweeper sleeps when every lane has none). Kept under the lane's lock
    /// rather than in a shared atomic counter: a locked read-modify-write per request costs
    /// more than the instructions suggest.
    taken: usize,
}

struct Slot {
    deadline: Instant,
    /// `None`: free, or expired and woken.
    waker: Option<Waker>,
    expired: bool,
    /// Bumped at every release, so a stale index held by a finished request never frees the
    /// slot of the request that reuses it.
    generation: u64,
    taken: bool,
}

/// The error of a request whose deadline passed first.
#[derive(Debug, PartialEq, Eq)]
pub struct Elapsed;

impl Deadlines {
    /// `workers` lanes. The sweeper starts with the first registration, on the runtime of the
    /// request that registers, and ends when the returned `Arc` is dropped.
    pub fn new(workers: usize) -> Arc<Deadlines> {
        Deadlines::with_tick(workers, TICK)
    }

    /// As [`Deadlines::new`], looked over every `tick` (at least 1 ms).
    pub fn with_tick(workers: usize, tick: Duration) -> Arc<Deadlines> {
        Arc::new_cyclic(|me| Deadlines {
            lanes: (0..workers.max(1))
                .map(|_| Mutex::new(Lane::default()))
                .collect(),
            tick: tick.max(Duration::from_millis(1)),
            asleep: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
            me: me.clone(),
            sweeping: AtomicBool::new(false),
        })
    }

    /// Starts the sweeper if it is not running yet. Called from a registration, i.e. from a
    /// poll on some runtime; if somehow there is none, the next registration tries again.
    fn start_sweeper(&self) {
        if self.sweeping.load(Ordering::Relaxed) || self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(sweep(self.me.clone(), self.wake.clone(), self.tick));
            }
            Err(_) => self.sweeping.store(false, Ordering::Release),
        }
    }

    /// `future`, failing with [`Elapsed`] once `timeout` has passed, counted in `worker`'s
    /// lane. The clock starts at the first poll that finds `future` pending.
    pub fn timeout<F: Future>(
        &self,
        worker: usize,
        timeout: Duration,
        future: F,
    ) -> Timeout<'_, F> {
        Timeout {
            future,
            deadlines: self,
            lane: worker % self.lanes.len(),
            timeout,
            slot: None,
        }
    }

    fn lane(&self, index: usize) -> MutexGuard<'_, Lane> {
        // A panic while a lane was held leaves at worst a slot unreleased until its deadline.
        self.lanes[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn register(&self, lane: usize, deadline: Instant, waker: Waker) -> (usize, u64) {
        self.start_sweeper();
        let taken = {
            let mut lane = self.lane(lane);
            let index = match lane.free.pop() {
                Some(index) => index,
                None => {
                    lane.slots.push(Slot {
                        deadline,
                        waker: None,
                        expired: false,
                        generation: 0,
                        taken: false,
                    });
                    lane.slots.len() - 1
                }
            };
            let slot = &mut lane.slots[index];
            slot.deadline = deadline;
            slot.waker = Some(waker);
            slot.expired = false;
            slot.taken = true;
            let generation = slot.generation;
            lane.taken += 1;
            (index, generation)
        };
        // The sweeper raises `asleep` before it counts the lanes (under their locks): if it
        // counted this lane before the slot was taken, this lock came after its, so this read
        // sees `asleep` up and wakes it; else it saw the slot. Either way nobody waits unseen.
        if self.asleep.load(Ordering::SeqCst) && self.asleep.swap(false, Ordering::SeqCst) {
            self.wake.notify_one();
        }
        taken
    }

    /// Whether the slot expired; if not, keeps `waker` as the one to wake.
    fn check(&self, lane: usize, (index, generation): (usize, u64), waker: &Waker) -> bool {
        let mut lane = self.lane(lane);
        let Some(slot) = lane.slots.get_mut(index) else {
            return false;
        };
        if !slot.taken || slot.generation != generation {
            return false;
        }
        if slot.expired {
            return true;
        }
        match &slot.waker {
            Some(current) if current.will_wake(waker) => {}
            _ => slot.waker = Some(waker.clone()),
        }
        false
    }

    fn release(&self, lane: usize, (index, generation): (usize, u64)) {
        let mut lane = self.lane(lane);
        if let Some(slot) = lane.slots.get_mut(index) {
            if slot.taken && slot.generation == generation {
                slot.taken = false;
                slot.waker = None;
                slot.generation = slot.generation.wrapping_add(1);
                lane.free.push(index);
                lane.taken -= 1;
            }
        }
    }

    /// Slots taken over all lanes.
    fn waiting(&self) -> usize {
        (0..self.lanes.len()).map(|i| self.lane(i).taken).sum()
    }

    /// Wakes every waiting request whose deadline is not after `now` (outside the lane's
    /// lock); how many are still registered.
    fn expire(&self, now: Instant) -> usize {
        let mut due = Vec::new();
        for index in 0..self.lanes.len() {
            let mut lane = self.lane(index);
            for slot in lane.slots.iter_mut() {
                if slot.taken && !slot.expired && slot.deadline <= now {
                    slot.expired = true;
                    due.extend(slot.waker.take());
                }
            }
        }
        due.into_iter().for_each(Waker::wake);
        self.waiting()
    }
}

/// The sweeper of one [`Deadlines`]: every tick while requests wait, asleep otherwise. It
/// ends once its deadlines are gone.
async fn sweep(deadlines: Weak<Deadlines>, wake: Arc<Notify>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let Some(strong) = deadlines.upgrade() else {
            return;
        };
        if strong.expire(Instant::now()) > 0 {
            continue;
        }
        // Nothing waits: sleep until a registration says so (see `register` for the order).
        // A notification sent before the wait begins is kept by `Notify`, so none is lost.
        strong.asleep.store(true, Ordering::SeqCst);
        if strong.waiting() > 0 {
            strong.asleep.store(false, Ordering::SeqCst);
            continue;
        }
        drop(strong);
        wake.notified().await;
    }
}

impl Drop for Deadlines {
    fn drop(&mut self) {
        // Wakes a sleeping sweeper, which then finds the pool gone.
        self.wake.notify_one();
    }
}

pin_project_lite::pin_project! {
    /// [`Deadlines::timeout`]'s future.
    pub struct Timeout<'a, F> {
        #[pin]
        future: F,
        deadlines: &'a Deadlines,
        lane: usize,
        timeout: Duration,
        slot: Option<(usize, u64)>,
    }

    impl<F> PinnedDrop for Timeout<'_, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(slot) = this.slot.take() {
                this.deadlines.release(*this.lane, slot);
            }
        }
    }
}

impl<F: Future> Future for Timeout<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            if let Some(slot) = this.slot.take() {
                this.deadlines.release(*this.lane, slot);
            }
            return Poll::Ready(Ok(output));
        }
        match *this.slot {
            None => {
                let deadline = Instant::now() + *this.timeout;
                *this.slot = Some(this.deadlines.register(
                    *this.lane,
                    deadline,
                    cx.waker().clone(),
                ));
            }
            Some(slot) => {
                if this.deadlines.check(*this.lane, slot, cx.waker()) {
                    this.deadlines.release(*this.lane, slot);
                    *this.slot = None;
                    return Poll::Ready(Err(Elapsed));
                }
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pending_future_times_out_within_a_tick_of_its_deadline() {
        let deadlines = Deadlines::new(2);
        let started = std::time::Instant::now();
        let result = deadlines
            .timeout(1, Duration::from_millis(100), std::future::pending::<()>())
            .await;
        let took = started.elapsed();
        assert_eq!(result, Err(Elapsed));
        assert!(took >= Duration::from_millis(100), "fired early: {took:?}");
        assert!(
            took < Duration::from_millis(100) + 10 * TICK,
            "fired late: {took:?}"
        );
        assert_eq!(deadlines.waiting(), 0, "slot released");
    }

    #[tokio::test]
    async fn a_future_that_finishes_first_keeps_its_output_and_frees_its_slot() {
        let deadlines = Deadlines::new(1);
        let result = deadlines
            .timeout(0, Duration::from_secs(5), async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                7
            })
            .await;
        assert_eq!(result, Ok(7));
        assert_eq!(deadlines.waiting(), 0);
        // Ready at once: no slot taken at all (a fresh set, so a slot would show).
        let fresh = Deadlines::new(1);
        assert_eq!(
            fresh.timeout(0, Duration::from_secs(5), async { 8 }).await,
            Ok(8)
        );
        assert!(fresh.lane(0).slots.is_empty(), "nothing registered");
    }

    #[tokio::test]
    async fn a_dropped_request_frees_its_slot_and_slots_are_reused() {
        let deadlines = Deadlines::new(1);
        for _ in 0..100 {
            let waiting =
                deadlines.timeout(0, Duration::from_secs(60), std::future::pending::<()>());
            // Polled once (registers), then cancelled.
            let _ = tokio::time::timeout(Duration::from_millis(1), waiting).await;
        }
        assert_eq!(deadlines.waiting(), 0);
        assert_eq!(deadlines.lane(0).slots.len(), 1, "one slot, reused");
    }

    #[tokio::test]
    async fn a_stale_slot_index_never_frees_its_successor() {
        let deadlines = Deadlines::new(1);
        let waker = futures_waker();
        let first = deadlines.register(0, Instant::now() + Duration::from_secs(60), waker.clone());
        deadlines.release(0, first);
        let second = deadlines.register(0, Instant::now() + Duration::from_secs(60), waker.clone());
        assert_eq!(first.0, second.0, "the slot is reused");
        deadlines.release(0, first);
        assert_eq!(deadlines.waiting(), 1, "still taken");
        assert!(!deadlines.check(0, second, &waker));
        deadlines.release(0, second);
        assert_eq!(deadlines.waiting(), 0);
    }

    #[tokio::test]
    async fn the_sweeper_wakes_again_after_sleeping_through_an_idle_spell() {
        let deadlines = Deadlines::new(1);
        // A first deadline starts the sweeper; once it has expired, nothing waits.
        let first = deadlines.timeout(0, Duration::from_millis(1), std::future::pending::<()>());
        assert_eq!(first.await, Err(Elapsed));
        // Long enough for the sweeper to find nothing and go to sleep.
        tokio::time::sleep(5 * TICK).await;
        assert!(
            deadlines.asleep.load(Ordering::Acquire),
            "asleep while idle"
        );
        // Bounded, so that a sweeper that never wakes fails the test instead of hanging it.
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(
            Duration::from_secs(5),
            deadlines.timeout(0, Duration::from_millis(50), std::future::pending::<()>()),
        )
        .await
        .expect("the sweeper woke for the new deadline");
        assert_eq!(result, Err(Elapsed));
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "not before its deadline"
        );
    }

    /// A set made where no runtime runs (a `Limiter` built before the server's runtime, say)
    /// still times out once it is used on one: its sweeper starts at the first registration.
    #[test]
    fn deadlines_made_outside_a_runtime_still_time_out() {
        let deadlines = Deadlines::with_tick(1, Duration::from_millis(5));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let waited = runtime.block_on(async {
            let waiting =
                deadlines.timeout(0, Duration::from_millis(50), std::future::pending::<()>());
            tokio::time::timeout(Duration::from_secs(5), waiting).await
        });
        assert_eq!(
            waited.expect("the deadline never fired: no sweeper watched it"),
            Err(Elapsed)
        );
    }

    fn futures_waker() -> Waker {
        Waker::noop().clone()
    }
}
