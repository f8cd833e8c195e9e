//! Bounds that hold across requests: every connection is bounded from accept (one that sends no
//! request within the header timeout, or stays silent between requests past the idle timeout, is
//! closed, whatever protocol it claimed), and the request bytes all connections hold in memory at
//! once are capped ([`BufferBudget`]): the bodies as they are read and decoded, compaction's
//! working set from before it starts to its end ([`working_set`]), and retrieved contents.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// How long a connection may go without a request in flight.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionTimeouts {
    /// From accept to its first request's head: protocol detection, an HTTP/2 preface and
    /// SETTINGS that are never followed by a request, a head that never ends.
    pub first_request: Duration,
    /// After a request ended, until the next one starts (keep-alive, HTTP/2).
    pub idle: Duration,
}

impl ConnectionTimeouts {
    pub fn from_config(server: &crate::config::ServerConfig) -> ConnectionTimeouts {
        ConnectionTimeouts {
            first_request: Duration::from_secs(server.header_read_timeout_secs.max(1)),
            idle: Duration::from_secs(server.idle_timeout_secs.max(1)),
        }
    }
}

/// The requests of one connection: how many are in flight, and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    accepted: Instant,
    /// Requests started (high 32 bits) and requests ended (low 32 bits), wrapping: one word, so a
    /// snapshot is consistent.
    counts: AtomicU64,
    /// Milliseconds from `accepted` to the end of the last request.
    last_end_ms: AtomicU64,
    /// Woken when a request ends, so that the watcher's deadline follows it.
    ended: tokio::sync::Notify,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Snapshot {
    started: u32,
    ended: u32,
    last_end_ms: u64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            accepted: Instant::now(),
            counts: AtomicU64::new(0),
            last_end_ms: AtomicU64::new(0),
            ended: tokio::sync::Notify::new(),
        })
    }

    /// A request started on this connection; it is in flight until the returned value is dropped
    /// (give it to [`Tracked`], so that it lasts until the answer's last byte).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.counts.fetch_add(1 << 32, Ordering::AcqRel);
        InFlight { activity: Arc::clone(self) }
    }

    fn snapshot(&self) -> Snapshot {
        let counts = self.counts.load(Ordering::Acquire);
        Snapshot {
            started: (counts >> 32) as u32,
            ended: counts as u32,
            last_end_ms: self.last_end_ms.load(Ordering::Acquire),
        }
    }
}

/// One request in flight on a connection.
#[derive(Debug)]
pub struct InFlight {
    activity: Arc<Activity>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let elapsed = u64::try_from(self.activity.accepted.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.activity.last_end_ms.fetch_max(elapsed, Ordering::AcqRel);
        // The end is stored before it is counted: a snapshot that sees the count sees the time.
        self.activity.counts.fetch_add(1, Ordering::AcqRel);
        self.activity.ended.notify_one();
    }
}

/// Run `connection` until it ends, or close it (by dropping it) once it has had no request in
/// flight for longer than `timeouts` allow: `None` when it was closed for silence.
pub async fn watch<C>(connection: C, activity: Arc<Activity>, timeouts: ConnectionTimeouts) -> Option<C::Output>
where
    C: Future,
{
    tokio::pin!(connection);
    loop {
        let before = activity.snapshot();
        let wake = if before.started != before.ended {
            // A request is in flight: look again after a while (its own limits bound it).
            Instant::now() + timeouts.idle
        } else if before.started == 0 {
            activity.accepted + timeouts.first_request
        } else {
            activity.accepted + Duration::from_millis(before.last_end_ms) + timeouts.idle
        };
        tokio::select! {
            output = &mut connection => return Some(output),
            () = activity.ended.notified() => {}
            () = tokio::time::sleep_until(wake) => {
                let after = activity.snapshot();
                if after == before && after.started == after.ended {
                    return None;
                }
            }
        }
    }
}

/// A response body that keeps its request in flight until it is done or dropped.
pub struct Tracked<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, in_flight: InFlight) -> Tracked<B> {
        Tracked { inner, _in_flight: in_flight }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request bytes held in memory by all connections together, capped.
#[derive(Debug)]
pub struct BufferBudget {
    limit: u64,
    held: AtomicU64,
}

impl BufferBudget {
    pub fn new(limit: u64) -> Arc<BufferBudget> {
        Arc::new(BufferBudget { limit, held: AtomicU64::new(0) })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes held right now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// An empty share of the budget, grown as bytes arrive.
    pub fn share(self: &Arc<Self>) -> Share {
        Share { budget: Arc::clone(self), bytes: 0 }
    }
}

/// Bytes one request holds of a [`BufferBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Share {
    budget: Arc<BufferBudget>,
    bytes: u64,
}

impl Share {
    /// Hold `more` bytes besides those held; `false` (and nothing more held) when the budget has
    /// not that much left.
    #[must_use]
    pub fn grow(&mut self, more: u64) -> bool {
        let budget = &self.budget;
        let grown = budget.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(more).filter(|total| *total <= budget.limit)
        });
        if grown.is_ok() {
            self.bytes += more;
        }
        grown.is_ok()
    }

    /// Give back `less` of the bytes held (all of them at most).
    pub fn shrink(&mut self, less: u64) {
        let less = less.min(self.bytes);
        self.budget.held.fetch_sub(less, Ordering::AcqRel);
        self.bytes -= less;
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The whole budget's limit (for the refusal's message).
    pub fn budget_limit(&self) -> u64 {
        self.budget.limit
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Bytes the engine's working set is estimated to take while it compacts `body`, besides the body:
/// a parsed message costs about a fixed amount whatever its text weighs (its neutral form, its
/// token counts, its salience and plan entries), so the estimate counts the body's JSON objects
/// as well as its bytes (BENCHMARKS.md, *Limits under attack and at scale*). Linear in the body,
/// and fast (one `memchr` pass).
pub fn working_set(body: &[u8]) -> u64 {
    const PER_BYTE: u64 = 2;
    const PER_OBJECT: u64 = 2048;
    let n_objects = memchr::memchr_iter(b'{', body).count() as u64;
    (body.len() as u64).saturating_mul(PER_BYTE).saturating_add(n_objects.saturating_mul(PER_OBJECT))
}

/// Hold in `share` the working set of compacting `body` ([`working_set`]); false, and nothing more
/// held, when it does not fit in the budget beside what the others hold. A request whose working
/// set alone passes the whole budget is charged what the budget can hold at most: it runs when
/// nothing else is held, rather than never.
#[must_use]
pub fn charge_working_set(share: &mut Share, body: &[u8]) -> bool {
    let at_most = share.budget_limit().saturating_sub(share.bytes());
    share.grow(working_set(body).min(at_most))
}

/// A whole body held in one piece: one chunk as it came, several copied together.
pub fn join(mut chunks: Vec<Bytes>, total: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut joined = Vec::with_capacity(total);
            for chunk in &chunks {
                joined.extend_from_slice(chunk);
            }
            Bytes::from(joined)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUTS: ConnectionTimeouts =
        ConnectionTimeouts { first_request: Duration::from_secs(5), idle: Duration::from_secs(60) };

    /// A connection that never sends a request (nothing, a partial HTTP/2 preface, or the preface
    /// and SETTINGS) is closed after the header timeout.
    #[tokio::test(start_paused = true)]
    async fn a_connection_without_a_request_is_closed_after_the_header_timeout() {
        let activity = Activity::new();
        let started = Instant::now();
        let closed = watch(std::future::pending::<()>(), activity.clone(), TIMEOUTS).await;
        assert!(closed.is_none());
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    /// A request in flight keeps a connection open for as long as it runs; once it ends, the
    /// connection may stay silent for the idle timeout, then it is closed.
    #[tokio::test(start_paused = true)]
    async fn in_flight_requests_hold_the_connection_and_idle_ones_close_it() {
        let activity = Activity::new();
        let started = Instant::now();
        let request = activity.begin();
        let ends = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(300)).await;
            drop(request);
        });
        let closed = watch(std::future::pending::<()>(), activity.clone(), TIMEOUTS).await;
        assert!(closed.is_none());
        ends.await.unwrap();
        // Closed one idle timeout after the request ended (within one look-again interval).
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_secs(360) && elapsed <= Duration::from_secs(421), "{elapsed:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_ends_by_itself_returns_its_output() {
        let activity = Activity::new();
        let output = watch(async { 7 }, activity, TIMEOUTS).await;
        assert_eq!(output, Some(7));
    }

    #[test]
    fn shares_are_capped_together_and_given_back_on_drop() {
        let budget = BufferBudget::new(100);
        let mut a = budget.share();
        let mut b = budget.share();
        assert!(a.grow(60));
        assert!(!b.grow(50), "60 + 50 is over 100");
        assert_eq!(budget.held(), 60);
        assert!(b.grow(40));
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(b.grow(60));
        b.shrink(30);
        assert_eq!((b.bytes(), budget.held()), (70, 70));
        b.shrink(500);
        assert_eq!((b.bytes(), budget.held()), (0, 0));
        assert!(b.grow(10));
        drop(b);
        assert_eq!(budget.held(), 0);
    }

    /// A working set is charged whole when it fits beside the others, refused when it does not, and
    /// capped at the whole budget when it alone passes it (then it runs when nothing else is held).
    #[test]
    fn working_sets_are_charged_beside_the_others() {
        let body = br#"{"messages": [{"role": "tool", "content": "ok"}, {"role": "tool", "content": "ok"}]}"#;
        assert_eq!(working_set(body), 2 * body.len() as u64 + 3 * 2048);
        let budget = BufferBudget::new(100_000);
        let mut share = budget.share();
        assert!(charge_working_set(&mut share, body));
        assert_eq!(budget.held(), working_set(body));
        drop(share);
        let huge = "{}".repeat(100);
        let mut other = budget.share();
        assert!(other.grow(10));
        let mut share = budget.share();
        assert!(!charge_working_set(&mut share, huge.as_bytes()), "past the budget beside another");
        assert_eq!(budget.held(), 10);
        drop(other);
        assert!(charge_working_set(&mut share, huge.as_bytes()), "alone, capped at the budget");
        assert_eq!(budget.held(), 100_000);
    }

    #[test]
    fn join_keeps_a_single_chunk_and_copies_several() {
        let one = Bytes::from_static(b"abc");
        assert_eq!(join(vec![one.clone()], 3).as_ptr(), one.as_ptr());
        assert_eq!(join(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")], 3), "abc");
        assert_eq!(join(Vec::new(), 0), "");
    }
}
