//! Mode `observe` (`compaction.mode: observe`): every request is forwarded byte for byte, as in mode
//! `off`, while the session compactor computes what epoch mode would have forwarded — the same
//! compactor, its state kept per session as in epoch mode — so that a team can measure pare on its
//! own traffic before letting it change a request.
//!
//! The projection runs on a thread of its own at batch priority ([`crate::batch_thread`]), after the
//! request is on its way upstream: one queue, so a session's requests are projected in the order
//! they arrived. Its figures ([`Observed`]) reach the archived summary (the archive's writer waits
//! for them as it waits for late token counts) and the `pare_observed_*` series; the projected state
//! is stored as a plan marked observed (`archive::plan::OBSERVED`). In `strict` durability the
//! record is committed with its figures before it is forwarded, so there the projection runs before
//! forwarding, at what epoch mode's compaction costs.
//!
//! The uncached prefill of a request is what `pare eval` estimates: its tokens less what a prefix
//! cache reuses from the session's previous request (the tools when unchanged, then the longest run
//! of leading messages the two share), for the raw request and for the projected one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;

use crate::archive::{Archive, Ticket};
use crate::budget::compactor::{SessionCompactor, SessionPlan};
use crate::exchange::{CompactInput, CompactionSummary, Observed, compact_fail_open};
use crate::memory::{Holder, StateBudget};
use crate::neutral::message_hashes;
use crate::tokens::{CountTokens, REPLY_PRIMING, TokenCounter};
use crate::wire::Wire;

/// Requests waiting for their projection at most; past it a request is forwarded unprojected
/// (counted in `pare_observed_skipped`), and its session's next projection starts from the state
/// the ones before it left.
pub const MAX_QUEUED: u64 = 256;

/// How long a closing pipeline waits for the projections still queued.
pub const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What a prefix cache can reuse of one prompt from the one before it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shape {
    /// [`message_hashes`] of the messages.
    hashes: Vec<u128>,
    /// Tokens of each message.
    tokens: Vec<u64>,
    /// xxh3-128 of the tools' text, when the request has tools.
    tools: Option<u128>,
    tools_tokens: u64,
    /// Messages, tools and reply priming.
    total: u64,
}

impl Shape {
    /// The shape of a request of `messages` (hashed in `hashes`) and `tools`, counted by `counter`.
    pub fn of(messages: &[&str], hashes: &[u128], tools: Option<&str>, counter: &TokenCounter) -> Shape {
        let tokens = counter.message_counts(messages, hashes, &[]);
        let tools_tokens = tools.map_or(0, |t| counter.tools(t));
        let total = tokens.iter().sum::<u64>() + tools_tokens + REPLY_PRIMING;
        let tools = tools.map(|t| xxhash_rust::xxh3::xxh3_128(t.as_bytes()));
        Shape { hashes: hashes.to_vec(), tokens, tools, tools_tokens, total }
    }

    /// Tokens of this prompt.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Tokens of this prompt a prefix cache holding `previous` does not cover: all of them after
    /// the first request, else all but the tools (when unchanged; they are rendered first) and the
    /// longest run of leading messages the two share.
    pub fn uncached(&self, previous: Option<&Shape>) -> u64 {
        let Some(previous) = previous.filter(|p| p.tools == self.tools) else { return self.total };
        let common = previous.hashes.iter().zip(&self.hashes).take_while(|(a, b)| a == b).count();
        self.total - self.tools_tokens - self.tokens[..common].iter().sum::<u64>()
    }

    fn bytes(&self) -> u64 {
        (size_of::<Shape>() + self.hashes.capacity() * size_of::<u128>() + self.tokens.capacity() * size_of::<u64>())
            as u64
    }
}

/// A session's last raw and projected prompts, the observer's part of it in the memory budget.
#[derive(Debug, Default)]
struct Last {
    raw: Option<Shape>,
    projected: Option<Shape>,
}

/// The `pare_observed_*` series: sums over the requests mode `observe` projected.
#[derive(Debug, Default)]
pub struct ObservedStats {
    pub requests: AtomicU64,
    /// Prompt tokens as the agent sent them (and as they were forwarded).
    pub tokens_raw: AtomicU64,
    /// Prompt tokens epoch mode would have forwarded.
    pub tokens_forwarded: AtomicU64,
    pub epochs: AtomicU64,
    pub uncached_raw: AtomicU64,
    pub uncached_forwarded: AtomicU64,
    /// Requests forwarded without a projection: the queue was full, or compaction failed.
    pub skipped: AtomicU64,
}

impl ObservedStats {
    fn add(&self, observed: &Observed, tokens_raw: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.tokens_raw.fetch_add(tokens_raw, Ordering::Relaxed);
        self.tokens_forwarded.fetch_add(observed.tokens_forwarded, Ordering::Relaxed);
        self.epochs.fetch_add(u64::from(observed.epoch_started), Ordering::Relaxed);
        self.uncached_raw.fetch_add(observed.uncached_raw, Ordering::Relaxed);
        self.uncached_forwarded.fetch_add(observed.uncached_forwarded, Ordering::Relaxed);
    }
}

/// One request to project.
pub struct Request {
    pub session: String,
    pub wire: Wire,
    /// Where it was sent (a Gemini request names its model in the path).
    pub path: String,
    pub raw: Bytes,
    /// The window the pipeline resolved for it.
    pub window: Option<u64>,
}

/// The request's own summary (it was forwarded unchanged), or where its exact counts come from
/// when they were left for after forwarding.
pub enum Actual {
    Known(CompactionSummary),
    Late(CompactionSummary, tokio::sync::oneshot::Receiver<CompactionSummary>),
}

impl Actual {
    /// The exact summary, waited for.
    pub async fn settled(self) -> CompactionSummary {
        match self {
            Actual::Known(summary) => summary,
            Actual::Late(provisional, late) => late.await.unwrap_or(provisional),
        }
    }

    fn settle(self) -> CompactionSummary {
        match self {
            Actual::Known(summary) => summary,
            Actual::Late(provisional, late) => late.blocking_recv().unwrap_or(provisional),
        }
    }
}

/// A projection queued for the observe thread.
pub struct Job {
    pub request: Request,
    pub actual: Actual,
    /// Where the summary with the projection goes (the archive record waits for it).
    pub done: Option<tokio::sync::oneshot::Sender<CompactionSummary>>,
    /// The archive and the request's ticket there: the projected state is stored with it.
    pub archive: Option<(Arc<Archive>, Ticket)>,
}

/// Projects requests for mode `observe`.
pub struct Observer {
    compactor: Arc<SessionCompactor>,
    budget: Arc<StateBudget>,
    pub stats: ObservedStats,
    queue: OnceLock<Option<Queue>>,
}

struct Queue {
    jobs: Mutex<std::sync::mpsc::Sender<Job>>,
    /// Jobs queued or running.
    busy: Arc<AtomicU64>,
}

impl Observer {
    pub fn new(compactor: Arc<SessionCompactor>, budget: Arc<StateBudget>) -> Arc<Observer> {
        Arc::new(Observer { compactor, budget, stats: ObservedStats::default(), queue: OnceLock::new() })
    }

    /// Project `request` now: `actual` (the summary of the request as forwarded) with
    /// [`CompactionSummary::observed`] set, and the projected state when the request changed it.
    /// A request that cannot be projected (the compactor failed or panicked) keeps `actual` alone.
    pub fn project(&self, request: &Request, actual: CompactionSummary) -> (CompactionSummary, Option<SessionPlan>) {
        let projected = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.try_project(request)))
            .unwrap_or_else(|_| Err("projecting it panicked".to_owned()));
        match projected {
            Ok((observed, plan)) => {
                self.stats.add(&observed, actual.tokens_raw);
                if observed.epoch_started {
                    tracing::info!(session = %request.session, epoch = observed.epoch,
                        tokens_raw = actual.tokens_raw, tokens_forwarded = observed.tokens_forwarded,
                        "observe: epoch mode would have started an epoch here");
                }
                (CompactionSummary { observed: Some(observed), ..actual }, plan)
            }
            Err(why) => {
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(session = %request.session, reason = %why, "observe: no projection for this request");
                (actual, None)
            }
        }
    }

    fn try_project(&self, request: &Request) -> Result<(Observed, Option<SessionPlan>), String> {
        let Request { session, wire, path, raw, window } = request;
        let body = crate::wire::parse_at(*wire, path, raw).map_err(|e| e.to_string())?;
        let messages = body.messages();
        let hashes = message_hashes(&messages);
        let input = CompactInput {
            session,
            raw,
            body: body.as_ref(),
            messages: &messages,
            hashes: &hashes,
            window: *window,
            defer_counts: false,
        };
        let out = compact_fail_open(self.compactor.as_ref(), &input);
        // Taken whatever became of the compaction: a plan left behind would ride with a later request.
        let plan = self.compactor.take_plan(session);
        let out = out?;
        let counter = self.compactor.counter(body.model().as_deref());
        let raw_shape = Shape::of(&messages, &hashes, body.tools(), counter);
        let projected = match &out.body {
            Some(bytes) => {
                let forwarded = crate::wire::parse_at(*wire, path, bytes).map_err(|e| e.to_string())?;
                let messages = forwarded.messages();
                Shape::of(&messages, &message_hashes(&messages), forwarded.tools(), counter)
            }
            None => raw_shape.clone(),
        };
        let last = self.budget.part(Holder::Observer, session, || Mutex::new(Last::default()));
        let mut last = last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let observed = Observed {
            tokens_forwarded: projected.total(),
            epoch: out.summary.epoch,
            epoch_started: out.summary.epoch_started,
            over_window: out.summary.over_window,
            uncached_raw: raw_shape.uncached(last.raw.as_ref()),
            uncached_forwarded: projected.uncached(last.projected.as_ref()),
        };
        let bytes = raw_shape.bytes() + projected.bytes();
        *last = Last { raw: Some(raw_shape), projected: Some(projected) };
        drop(last);
        self.budget.charge(Holder::Observer, session, bytes);
        Ok((observed, plan))
    }

    /// Hand `job` to the observe thread; `Err` gives it back when the queue is full or there is no
    /// thread (the caller forwards the request unprojected).
    pub fn queue(self: &Arc<Self>, job: Job) -> Result<(), Box<Job>> {
        let Some(queue) = self.queue.get_or_init(|| self.start()) else { return Err(Box::new(job)) };
        if queue.busy.fetch_add(1, Ordering::AcqRel) >= MAX_QUEUED {
            queue.busy.fetch_sub(1, Ordering::AcqRel);
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(job));
        }
        let sent = queue.jobs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).send(job);
        sent.map_err(|std::sync::mpsc::SendError(job)| {
            queue.busy.fetch_sub(1, Ordering::AcqRel);
            Box::new(job)
        })
    }

    /// [`Observer::queue`], else (the queue is full) hand the request's own summary on unprojected.
    pub fn queue_or_settle(self: &Arc<Self>, job: Job) {
        if let Err(job) = self.queue(job) {
            let Job { actual, done, .. } = *job;
            tokio::spawn(async move {
                let summary = actual.settled().await;
                if let Some(done) = done {
                    let _ = done.send(summary);
                }
            });
        }
    }

    /// Wait until every queued projection is done (its figures handed to the archive's record, its
    /// state to the archive), at most `limit`; false past it. The pipeline waits so before its
    /// archive closes.
    pub fn drain(&self, limit: std::time::Duration) -> bool {
        let Some(Some(queue)) = self.queue.get() else { return true };
        let deadline = std::time::Instant::now() + limit;
        while queue.busy.load(Ordering::Acquire) > 0 {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        true
    }

    /// The observe thread. It holds the observer weakly: it ends with the pipeline.
    fn start(self: &Arc<Self>) -> Option<Queue> {
        let (jobs, incoming) = std::sync::mpsc::channel::<Job>();
        let busy = Arc::new(AtomicU64::new(0));
        let observer = Arc::downgrade(self);
        let running = Arc::clone(&busy);
        let spawned = std::thread::Builder::new().name("pare-observe".into()).spawn(move || {
            crate::batch_thread();
            for job in incoming {
                let Some(observer) = observer.upgrade() else { break };
                observer.run(job);
                running.fetch_sub(1, Ordering::AcqRel);
            }
        });
        match spawned {
            Ok(_) => Some(Queue { jobs: Mutex::new(jobs), busy }),
            Err(err) => {
                tracing::warn!(error = %err, "cannot start the observe thread: requests are forwarded unprojected");
                None
            }
        }
    }

    fn run(&self, job: Job) {
        let Job { request, actual, done, archive } = job;
        let (summary, plan) = self.project(&request, actual.settle());
        if let (Some((archive, ticket)), Some(plan)) = (archive, plan) {
            archive.record_plan(ticket, plan);
        }
        if let Some(done) = done {
            let _ = done.send(summary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::CounterConfig;

    fn shape(messages: &[&str], tools: Option<&str>) -> Shape {
        let counter = TokenCounter::new(&CounterConfig::default());
        Shape::of(messages, &message_hashes(messages), tools, &counter)
    }

    #[test]
    fn the_first_request_is_all_uncached() {
        let first = shape(&[r#"{"role":"user","content":"fix the test"}"#], Some("[]"));
        assert_eq!(first.uncached(None), first.total());
    }

    #[test]
    fn an_append_costs_what_it_adds_and_the_reply_priming() {
        let system = r#"{"role":"system","content":"You are a coding agent."}"#;
        let user = r#"{"role":"user","content":"fix the test in src/lib.rs"}"#;
        let answer = r#"{"role":"assistant","content":"Reading the file now."}"#;
        let tools = r#"[{"type":"function","function":{"name":"bash"}}]"#;
        let first = shape(&[system, user], Some(tools));
        let second = shape(&[system, user, answer], Some(tools));
        let counter = TokenCounter::new(&CounterConfig::default());
        assert_eq!(second.uncached(Some(&first)), counter.message(answer) + REPLY_PRIMING);
    }

    #[test]
    fn a_changed_message_makes_the_rest_uncached() {
        let system = r#"{"role":"system","content":"You are a coding agent."}"#;
        let user = r#"{"role":"user","content":"fix the test"}"#;
        let marker = r#"{"role":"user","content":"[tool: read_file → 200 OK]"}"#;
        let first = shape(&[system, user, user], None);
        let second = shape(&[system, marker, user], None);
        let counter = TokenCounter::new(&CounterConfig::default());
        assert_eq!(second.uncached(Some(&first)), second.total() - counter.message(system));
    }

    #[test]
    fn changed_tools_reuse_nothing() {
        let user = r#"{"role":"user","content":"fix the test"}"#;
        let first = shape(&[user], Some("[1]"));
        let second = shape(&[user], Some("[2]"));
        assert_eq!(second.uncached(Some(&first)), second.total());
    }
}
