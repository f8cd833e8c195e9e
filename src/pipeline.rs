//! The seam the proxy calls for one request of a wire format pare compacts: which session it belongs to, the raw
//! record for the archive, and the compacted body to forward. Also where fail-open is enforced: any
//! error or panic inside compaction forwards the original bytes and is counted.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use http::HeaderMap;

pub use crate::exchange::{
    CompactInput, CompactOutput, CompactionSummary, ConversationCompactor, IdentityCompactor, LateCount, ResponseSink,
    StreamEnd, compact_fail_open,
};

use crate::archive::response::{ArchiveSink, HeldAnswers};
use crate::archive::{self, Archive, ExchangeRecord, keep_headers, now_ms};
use crate::budget::compactor::{CaughtUp, SessionCompactor, SessionPlan, Unchanged};
use crate::budget::price::Prices;
use crate::budget::window::{DetectConfig, ModelTable, WindowResolver};
use crate::config::{Config, Durability, Mode};
use crate::memory::{BudgetStats, StateBudget};
use crate::neutral::message_hashes;
use crate::observe::{self, Observer};
use crate::session::{Assigned, Assignment, SessionTracker};
use crate::wire::recent::RecentBodies;
use crate::wire::{Spans, Wire, WireBody};

/// A session's id (time-sortable, see [`crate::session`]).
pub type SessionId = String;

/// What [`Pipeline::compact`] made of one request.
#[derive(Default)]
struct Compaction {
    /// The body to forward; `None`: forward the raw body.
    body: Option<Bytes>,
    /// Where `body`'s values lie, when the compactor said.
    spans: Option<Spans>,
    summary: Option<CompactionSummary>,
    /// Why compaction did not apply.
    skipped: Option<String>,
    /// The counts `summary` still holds bounds for ([`CompactOutput::late`]).
    late: Option<LateCount>,
    /// The session's compaction state, when this request changed it (stored with the exchange).
    plan: Option<SessionPlan>,
    /// The derived texts the forwarded markers name ([`CompactOutput::lists`]).
    lists: Arc<[String]>,
}

/// What the proxy needs to forward one request.
pub struct PreparedRequest {
    pub wire: Wire,
    /// The body to forward (the original bytes when nothing changed).
    pub body: Bytes,
    pub session: Option<SessionId>,
    /// The request's `model`, when the body parsed (labels metrics per model).
    pub model: Option<String>,
    /// What compaction did. Its token counts may still be upper bounds while
    /// [`PreparedRequest::late_summary`] is set: [`PreparedRequest::settle`] waits for the exact ones.
    pub summary: Option<CompactionSummary>,
    /// The exact summary, being counted on the counting thread while the request is forwarded.
    pub late_summary: Option<tokio::sync::oneshot::Receiver<CompactionSummary>>,
    /// Why compaction did not apply (unparseable body, engine failure), for the log line.
    pub skipped: Option<String>,
    pub sink: Option<Box<dyn ResponseSink>>,
}

impl PreparedRequest {
    /// Wait for the exact summary when its counts were left for after the forwarding decision.
    pub async fn settle(&mut self) {
        if let Some(late) = self.late_summary.take()
            && let Ok(summary) = late.await
        {
            self.summary = Some(summary);
        }
    }
}

/// The thread that counts what requests left for later ([`CompactOutput::late`]), apart from the
/// rayon pool a cold request tokenizes its history on, so that a warm request never waits behind
/// one. It sleeps on its queue (it does not spin between jobs, which would take the core the
/// upstream and the client share on a small machine), and it is a batch thread
/// ([`crate::batch_thread`]): handing it a count never takes the CPU from the request on its way to
/// the upstream.
struct Counting {
    jobs: std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>,
    /// Jobs queued or running.
    busy: Arc<AtomicU64>,
}

/// Requests whose counts wait in the queue at most: past it, a request counts its own.
const MAX_QUEUED_COUNTS: u64 = 2;

static COUNTING: LazyLock<Option<Counting>> = LazyLock::new(|| {
    let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
    let spawned = std::thread::Builder::new().name("pare-count".into()).spawn(move || {
        crate::batch_thread();
        for job in queue {
            job();
        }
    });
    match spawned {
        Ok(_) => Some(Counting { jobs, busy: Arc::new(AtomicU64::new(0)) }),
        Err(err) => {
            tracing::warn!(error = %err, "cannot start the counting thread: requests count their own tokens");
            None
        }
    }
});

/// Count what `late` left: on the counting thread, or here when it is missing or has a queue; the
/// exact summary goes to both receivers (the archive record and the response headers). A panic keeps
/// `provisional`, logged.
fn count_late(
    late: LateCount,
    provisional: CompactionSummary,
) -> (tokio::sync::oneshot::Receiver<CompactionSummary>, tokio::sync::oneshot::Receiver<CompactionSummary>) {
    let (to_archive, for_archive) = tokio::sync::oneshot::channel();
    let (to_proxy, for_proxy) = tokio::sync::oneshot::channel();
    let job = move || {
        let summary = catch_unwind(AssertUnwindSafe(|| late(provisional.clone()))).unwrap_or_else(|_| {
            tracing::error!("counting a request's new messages panicked: its summary keeps their upper bounds");
            provisional
        });
        let _ = to_archive.send(summary.clone());
        let _ = to_proxy.send(summary);
    };
    match COUNTING.as_ref() {
        Some(counting) if counting.busy.fetch_add(1, Ordering::AcqRel) < MAX_QUEUED_COUNTS => {
            let busy = Arc::clone(&counting.busy);
            let job = Box::new(move || {
                job();
                busy.fetch_sub(1, Ordering::AcqRel);
            });
            if let Err(std::sync::mpsc::SendError(job)) = counting.jobs.send(job) {
                job();
            }
        }
        Some(counting) => {
            counting.busy.fetch_sub(1, Ordering::AcqRel);
            job();
        }
        None => job(),
    }
    (for_archive, for_proxy)
}

/// A request carrying this header with the value `1` (or `true`) is archived and forwarded
/// uncompacted, and counted; its session goes on as before for the requests after it.
pub const BYPASS_HEADER: &str = "x-pare-bypass";

/// Whether the agent asked pare not to compact this request ([`BYPASS_HEADER`]).
pub fn bypass_requested(headers: &HeaderMap) -> bool {
    headers.get(BYPASS_HEADER).and_then(|v| v.to_str().ok()).is_some_and(|v| {
        let v = v.trim();
        v == "1" || v.eq_ignore_ascii_case("true")
    })
}

/// Counters the pipeline keeps (exported on `/_pare/metrics`).
#[derive(Debug, Default)]
pub struct PipelineStats {
    pub fail_open: AtomicU64,
    pub unparseable: AtomicU64,
    /// Requests that asked not to be compacted ([`BYPASS_HEADER`]).
    pub bypassed: AtomicU64,
    /// `strict` requests forwarded although their raw record was not confirmed committed.
    pub strict_unconfirmed: AtomicU64,
    /// `strict` requests compacted again because another process had served their session since
    /// this one last did (its state caught up from the archive after the request was compacted).
    pub stale_state: AtomicU64,
    /// Requests whose session's compaction state caught up from the archive (its plan and the raw
    /// head of its last request) before they were compacted: a session this process did not hold
    /// in memory, or one another process serves too.
    pub caught_up: AtomicU64,
}

/// Session → archive → compaction for one chat request.
pub struct Pipeline {
    pub config: Arc<Config>,
    compactor: Arc<dyn ConversationCompactor>,
    pub stats: PipelineStats,
    sessions: Arc<SessionTracker>,
    archive: Option<Arc<Archive>>,
    /// Resolves the model's context window (config, detection, default) before compaction.
    windows: Option<Arc<WindowResolver>>,
    /// The byte budget of all per-session state (tracker, compactor, archive writer).
    budget: Arc<StateBudget>,
    /// The session compactor, when the pipeline was built from a configuration: a known session it
    /// does not remember (evicted by the budget, or older than a restart) is reseeded from the archive.
    stateful: Option<Arc<SessionCompactor>>,
    /// Recent bodies: a warm request is split only after the history it shares with its session's
    /// previous request, in every format.
    recent: RecentBodies,
    /// The answers held in memory for the archive, under `archive.max_held_answer_bytes`.
    answers: Arc<HeldAnswers>,
    /// Each model's price (the built-in table under `models:` prices), for the cost metrics.
    prices: Arc<Prices>,
    /// Mode `observe`: projects what epoch mode would have forwarded.
    observer: Option<Arc<Observer>>,
}

/// The path recorded for a chat request when the caller does not give one.
pub const DEFAULT_CHAT_PATH: &str = "/v1/chat/completions";

impl Pipeline {
    pub fn new(config: Arc<Config>, compactor: Arc<dyn ConversationCompactor>) -> Pipeline {
        let budget = Arc::new(StateBudget::new(config.memory.max_state_bytes));
        Pipeline::with_budget(config, compactor, budget)
    }

    /// [`Pipeline::new`] whose session tracker charges `budget` (shared with the compactor).
    pub fn with_budget(
        config: Arc<Config>,
        compactor: Arc<dyn ConversationCompactor>,
        budget: Arc<StateBudget>,
    ) -> Pipeline {
        let sessions = Arc::new(SessionTracker::with_budget(&config.archive, budget.clone()));
        budget.reserve(RecentBodies::MAX_BYTES);
        let answers = Arc::new(HeldAnswers::new(config.archive.max_held_answer_bytes));
        let prices = Arc::new(Prices::from_config(&config));
        Pipeline {
            config,
            compactor,
            stats: PipelineStats::default(),
            sessions,
            archive: None,
            windows: None,
            budget,
            stateful: None,
            recent: RecentBodies::new(),
            answers,
            prices,
            observer: None,
        }
    }

    /// What the per-session state weighs against its budget.
    pub fn memory(&self) -> BudgetStats {
        self.budget.stats()
    }

    /// Record every exchange in `archive`, and rebuild the session tracker from the sessions it holds
    /// (so a restarted pare keeps assigning requests to their sessions). Reads the store: call at start.
    pub fn with_archive(mut self, archive: Arc<Archive>) -> Pipeline {
        archive.share_budget(self.budget.clone());
        match archive::query::ArchiveReader::open(archive.location())
            .and_then(|r| r.recent_session_keys(SEEDED_SESSIONS))
        {
            Ok(sessions) => {
                for (session, keys) in sessions {
                    self.sessions.seed(&session, keys);
                }
            }
            Err(archive::ArchiveError::NoStore(_)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot rebuild sessions from the archive; starting empty")
            }
        }
        self.archive = Some(archive);
        self
    }

    /// Where each model's window comes from ([`WindowResolver::sources`]); `None` when this pipeline
    /// resolves no windows (it does not compact).
    pub fn window_sources(&self) -> Option<String> {
        self.windows.as_ref().map(|w| w.sources())
    }

    /// Each model's price ([`Prices`]).
    pub fn prices(&self) -> &Arc<Prices> {
        &self.prices
    }

    /// The archive exchanges are recorded in, if any.
    pub fn archive(&self) -> Option<&Arc<Archive>> {
        self.archive.as_ref()
    }

    /// The answers held in memory for the archive (bytes, cap, truncations).
    pub fn held_answers(&self) -> &HeldAnswers {
        &self.answers
    }

    /// Mode `observe`'s projections, when the pipeline observes.
    pub fn observer(&self) -> Option<&Arc<Observer>> {
        self.observer.as_ref()
    }

    /// The session tracker.
    pub fn sessions(&self) -> &Arc<SessionTracker> {
        &self.sessions
    }

    /// A pipeline that forwards everything unchanged.
    pub fn identity(config: Arc<Config>) -> Pipeline {
        Pipeline::new(config, Arc::new(IdentityCompactor))
    }

    /// Prepare one chat request for forwarding, its summary settled. Never fails: the worst case
    /// forwards `raw` unchanged.
    pub async fn prepare_chat(&self, headers: &HeaderMap, raw: Bytes) -> PreparedRequest {
        self.prepare_chat_at("POST", DEFAULT_CHAT_PATH, headers, raw).await
    }

    /// [`Pipeline::prepare_chat`] recording the request's method and path.
    pub async fn prepare_chat_at(&self, method: &str, path: &str, headers: &HeaderMap, raw: Bytes) -> PreparedRequest {
        let mut prepared = self.prepare_at(Wire::Chat, method, path, headers, raw).await;
        prepared.settle().await;
        prepared
    }

    /// Prepare one request of format `wire` for forwarding, recording its method and path. Never
    /// fails: the worst case forwards `raw` unchanged.
    ///
    /// Order: assign the session, compact (pure, in memory, fail-open), hand the raw and forwarded
    /// bodies to the archive — in `strict` durability wait until that record is committed — and return
    /// the body to forward with a [`ResponseSink`] that records the answer. A request that surely
    /// appends is forwarded before its new messages are counted: they are counted on the counting
    /// thread meanwhile, and the archive record and [`PreparedRequest::settle`] wait for them.
    pub async fn prepare_at(
        &self,
        wire: Wire,
        method: &str,
        path: &str,
        headers: &HeaderMap,
        raw: Bytes,
    ) -> PreparedRequest {
        // Parsing a large body is about a millisecond (800 KB): it leaves the reactor too. The
        // neutral messages are read and hashed once, for the session tracker and the compactor.
        // A Gemini request names its model and streaming in the path.
        let parsed = off_the_reactor(raw.len(), || self.recent.parse(wire, path, &raw));
        let messages: Option<Vec<&str>> = parsed.as_ref().ok().map(|body| body.messages());
        let hashes = messages.as_deref().map(message_hashes).unwrap_or_default();
        let assignment = self.assign(headers, messages.as_deref().map(|m| (m, hashes.as_slice()))).await;
        let session = assignment.session.clone();
        if assignment.how != Assigned::New {
            self.reseed(&session, messages.as_deref().map(|m| (m, hashes.as_slice()))).await;
        }
        let (model, request_stream) = match &parsed {
            Ok(body) => (body.model(), body.stream()),
            Err(_) => (None, false),
        };
        let compacts = matches!(&parsed, Ok(body) if body.server_compaction().is_none()) && !bypass_requested(headers);
        let (window, window_source) = match &self.windows {
            Some(windows) if compacts => {
                let (window, source) = windows.resolve(wire, model.as_deref()).await;
                (Some(window), Some(source))
            }
            _ => (None, None),
        };
        let messages = messages.as_deref().unwrap_or_default();
        // Where the raw body's values lie, for the archive: its writer then does not parse it again
        // (nor the forwarded body, whose spans the compactor gave).
        let raw_spans = match (&self.archive, &parsed) {
            (Some(_), Ok(body)) => body.spans_in(&raw),
            _ => None,
        };
        let strict = self.archive.as_ref().is_some_and(|archive| archive.durability() == Durability::Strict);
        // In strict durability the archive is where replicas agree on a session: the record is
        // written only if the archive holds as many of the session's requests as this process's
        // state reflects; otherwise another process served the session meanwhile: the state catches
        // up from the archive and the request is compacted again. (A session found served elsewhere
        // catches up before it is compacted, above, so that this is rare.)
        let mut expected = if strict { self.archived_requests(&session, assignment.how) } else { None };
        let skipped = match &parsed {
            Err(err) => {
                self.stats.unparseable.fetch_add(1, Ordering::Relaxed);
                Some(err.to_string())
            }
            Ok(body) if body.server_compaction().is_some() => body.server_compaction().map(str::to_owned),
            Ok(_) if !compacts => {
                self.stats.bypassed.fetch_add(1, Ordering::Relaxed);
                Some(format!("{BYPASS_HEADER}: forwarded uncompacted"))
            }
            Ok(_) => None,
        };
        let mut stale_retries = 0;
        let (compaction, late_summary, ticket) = loop {
            let mut compaction = match (&parsed, &skipped) {
                (Ok(body), None) => off_the_reactor(raw.len(), || {
                    self.compact(&session, &raw, body.as_ref(), messages, &hashes, window)
                }),
                (_, skipped) => Compaction { skipped: skipped.clone(), ..Compaction::default() },
            };
            if let Some(report) = compaction.summary.as_mut().and_then(|s| s.report.as_mut()) {
                report.window_source = window_source;
            }
            let (mut late_archive, late_summary) = match (compaction.late.take(), &compaction.summary) {
                (Some(late), Some(provisional)) => {
                    let (archive, proxy) = count_late(late, provisional.clone());
                    (Some(archive), Some(proxy))
                }
                _ => (None, None),
            };
            // Mode `observe`: what epoch mode would have forwarded, projected after forwarding
            // (before it in strict durability, where the record is committed with its figures).
            let observing = match (&self.observer, &compaction.summary) {
                (Some(observer), Some(summary)) if compaction.skipped.is_none() => {
                    let request = observe::Request {
                        session: session.clone(),
                        wire,
                        path: path.to_owned(),
                        raw: raw.clone(),
                        window,
                    };
                    let actual = match late_archive.take() {
                        Some(late) => observe::Actual::Late(summary.clone(), late),
                        None => observe::Actual::Known(summary.clone()),
                    };
                    if strict {
                        let actual = actual.settled().await;
                        let (summary, plan) = off_the_reactor(raw.len(), || observer.project(&request, actual));
                        (compaction.summary, compaction.plan) = (Some(summary), plan);
                        None
                    } else {
                        Some((Arc::clone(observer), request, actual))
                    }
                }
                _ => None,
            };
            let Some(archive) = &self.archive else {
                if let Some((observer, request, actual)) = observing {
                    observer.queue_or_settle(observe::Job { request, actual, done: None, archive: None });
                }
                break (compaction, late_summary, None);
            };
            // The record waits for the projection as it waits for late counts.
            let (projected, observed_summary) = match observing {
                Some(observing) => {
                    let (done, summary) = tokio::sync::oneshot::channel();
                    (Some((observing, done)), Some(summary))
                }
                None => (None, None),
            };
            let late_archive = observed_summary.or(late_archive);
            let record = ExchangeRecord {
                session: session.clone(),
                at_ms: now_ms(),
                method: method.to_owned(),
                path: path.to_owned(),
                model: model.clone(),
                headers: keep_headers(headers, &self.config.archive.redact_headers, &self.config.archive.safe_headers),
                raw: raw.clone(),
                raw_spans: raw_spans.clone(),
                forwarded: compaction.body.clone(),
                forwarded_spans: compaction.spans.take(),
                summary: compaction.summary.clone(),
                late_summary: late_archive,
                skipped: compaction.skipped.clone(),
                key_req: assignment.key_req,
                // The last try is recorded whatever the archive holds: a request is never left out.
                expect_requests: expected.filter(|_| stale_retries < STALE_RETRIES).map(|n| n as i64),
                lists: compaction.lists.clone(),
            };
            if !strict {
                let ticket = archive.queue_exchange(record).await;
                if let Some(plan) = compaction.plan.take() {
                    archive.record_plan(ticket, plan);
                }
                if let Some(((observer, request, actual), done)) = projected {
                    let archive = Some((Arc::clone(archive), ticket));
                    observer.queue_or_settle(observe::Job { request, actual, done: Some(done), archive });
                }
                break (compaction, late_summary, Some((Arc::clone(archive), ticket)));
            }
            let plan = compaction.plan.take();
            let plan_stored = plan.is_some();
            let (ticket, committed) = archive.record_exchange_committed(record, plan).await;
            match committed {
                Ok(seq) => {
                    if let Some(compactor) = &self.stateful {
                        compactor.set_archived(&session, seq as u64, plan_stored);
                    }
                }
                Err(archive::ArchiveError::Stale { archived, .. }) if stale_retries < STALE_RETRIES => {
                    stale_retries += 1;
                    self.stats.stale_state.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(session = %session, archived, "another process served this session: catching up");
                    let caught_up = match &parsed {
                        Ok(_) => self.catch_up(&session, messages, &hashes).await,
                        Err(_) => false,
                    };
                    if !caught_up {
                        if let Some(compactor) = &self.stateful {
                            compactor.forget(&session);
                        }
                        self.reseed(&session, None).await;
                    }
                    expected = self.archived_requests(&session, Assigned::Extends).or(Some(archived as u64));
                    continue;
                }
                Err(err) => {
                    self.stats.strict_unconfirmed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(session = %session, error = %err,
                        "strict archive: raw request not confirmed committed; forwarding anyway");
                }
            }
            break (compaction, late_summary, Some((Arc::clone(archive), ticket)));
        };
        drop(parsed);
        let Compaction { body: changed, summary, skipped, .. } = compaction;
        let forward = changed.unwrap_or_else(|| raw.clone());
        let sink = ArchiveSink::new(
            ticket,
            Arc::clone(&self.sessions),
            session.clone(),
            assignment.key_req,
            request_stream,
            wire,
            Arc::clone(&self.answers),
        );
        PreparedRequest {
            wire,
            body: forward,
            session: Some(session),
            model,
            summary,
            late_summary,
            skipped,
            sink: Some(Box::new(sink)),
        }
    }

    /// The session of a request ([`SessionTracker`]). In strict durability the archive is where
    /// processes sharing it record their sessions: a request that would start a new session is first
    /// looked up there by its message prefixes (another process may have served its session), within
    /// `archive.commit_timeout_ms`; past that, or when the archive cannot be read, it starts one.
    async fn assign(&self, headers: &HeaderMap, messages: Option<(&[&str], &[u128])>) -> Assignment {
        let archive = match &self.archive {
            Some(archive) if archive.durability() == Durability::Strict => Arc::clone(archive),
            _ => return self.sessions.assign_hashed(headers, messages),
        };
        let keys = match self.sessions.assign_known(headers, messages) {
            Ok(assignment) => return assignment,
            Err(keys) => keys,
        };
        let lookup = tokio::task::spawn_blocking(move || {
            archive::query::ArchiveReader::open(archive.location().clone())
                .and_then(|reader| reader.sessions_with_keys(&keys, LOOKED_UP_SESSIONS))
        });
        match tokio::time::timeout(std::time::Duration::from_millis(self.config.archive.commit_timeout_ms), lookup)
            .await
        {
            Ok(Ok(Ok(sessions))) => {
                for (session, keys) in sessions {
                    self.sessions.seed(&session, keys);
                }
            }
            Ok(Ok(Err(archive::ArchiveError::NoStore(_)))) => {}
            Ok(Ok(Err(err))) => tracing::warn!(error = %err, "cannot look a request's session up in the archive"),
            Ok(Err(err)) => tracing::warn!(error = %err, "the archive lookup of a request's session failed"),
            Err(_) => tracing::warn!("the archive lookup of a request's session timed out; starting a new session"),
        }
        self.sessions.assign_hashed(headers, messages)
    }

    /// How many of `session`'s requests the archive holds as far as this process's compaction state
    /// knows (`None`: not known, or no state to keep in step). A new session has none.
    fn archived_requests(&self, session: &str, how: Assigned) -> Option<u64> {
        let compactor = self.stateful.as_ref()?;
        if compactor.policy().mode == Mode::Off {
            return None;
        }
        if how == Assigned::New { Some(0) } else { compactor.archived(session) }
    }

    /// A known session whose compaction state is not in memory (the budget evicted it, or it is older
    /// than a restart), or that another process serves too (strict durability: the last catch-up
    /// found requests this process had not served), catches up from the archive before `request`
    /// (its messages and their hashes) is compacted ([`Pipeline::catch_up`]), so that forwarding
    /// goes on as if this process had served every request; a session the catch-up cannot bring
    /// up (an archive written by a pare that did not store each request's raw head) gets its
    /// frozen prefix back from its stored plan and its last request's body. In buffered
    /// durability, waits for the archive to commit what is queued of the session first (its
    /// last exchange may be among it).
    async fn reseed(&self, session: &str, request: Option<(&[&str], &[u128])>) {
        let (Some(compactor), Some(archive)) = (&self.stateful, &self.archive) else { return };
        let strict = archive.durability() == Durability::Strict;
        if compactor.policy().mode == Mode::Off || compactor.remembers(session) && !(strict && compactor.roams(session))
        {
            return;
        }
        // In strict durability every exchange is committed with its plan before it is forwarded:
        // nothing a catch-up reads waits in the queue.
        if !strict && let Err(err) = archive.flush_session_async(session).await {
            tracing::warn!(session = %session, error = %err, "cannot flush the archive to rebuild a session");
        }
        if let Some((messages, hashes)) = request
            && self.catch_up(session, messages, hashes).await
        {
            return;
        }
        if compactor.remembers(session) {
            return;
        }
        let rebuild = async {
            let archive = Arc::clone(archive);
            let session = session.to_owned();
            let compactor = Arc::clone(compactor);
            let _ = tokio::task::spawn_blocking(move || seed_session(&compactor, &archive, &session)).await;
        };
        // Bounded: an archive that does not answer leaves the session to start afresh (fail-open).
        if tokio::time::timeout(std::time::Duration::from_millis(self.config.archive.commit_timeout_ms), rebuild)
            .await
            .is_err()
        {
            tracing::warn!(session = %session, "rebuilding a session from the archive timed out; it goes on from what is in memory");
        }
    }

    /// Bring `session`'s compaction state up to what the archive holds, for a request of `messages`
    /// (hashed `hashes`) about to be compacted: one read of the session's request count, the raw
    /// head of its last compacted request and its latest plan when that is not the one the state
    /// holds (its rewritten messages in one more; the messages kept as sent are the request's own),
    /// never the session's bodies ([`archive::plan::read_catch_up`]). The state then is what the
    /// process that served the session's last requests holds, and the request is compacted once.
    /// False when the archive cannot say (not read within `archive.commit_timeout_ms`, or the
    /// session's last compacted request was archived without its head).
    async fn catch_up(&self, session: &str, messages: &[&str], hashes: &[u128]) -> bool {
        let (Some(compactor), Some(archive)) = (&self.stateful, &self.archive) else { return false };
        let known = compactor.plan_seq(session);
        let read = {
            let (archive, session, hashes) = (Arc::clone(archive), session.to_owned(), hashes.to_vec());
            tokio::task::spawn_blocking(move || {
                let reader = archive::query::ArchiveReader::open(archive.location())?;
                archive::plan::read_catch_up(reader.conn(), &session, known, &hashes)
            })
        };
        let timeout = std::time::Duration::from_millis(self.config.archive.commit_timeout_ms);
        let stored = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(Ok(stored))) => stored,
            Ok(Ok(Err(archive::ArchiveError::NoStore(_)))) => None,
            Ok(Ok(Err(err))) => {
                tracing::warn!(session = %session, error = %err, "cannot read the session's state from the archive");
                return false;
            }
            Ok(Err(err)) => {
                tracing::warn!(session = %session, error = %err, "reading the session's state from the archive failed");
                return false;
            }
            Err(_) => {
                tracing::warn!(session = %session, "reading the session's state from the archive timed out");
                return false;
            }
        };
        // A session the archive does not hold (named by a header, or not yet written) is in the
        // empty state.
        let caught = match stored {
            Some(stored) if !stored.head_known => return false,
            Some(stored) => CaughtUp {
                requests: stored.requests,
                plan: stored.plan.map(|plan| (plan.seq, plan.resolve(messages))),
                head: stored.head,
            },
            None => CaughtUp { requests: 0, plan: Some((0, SessionPlan::default())), head: None },
        };
        compactor.catch_up(session, caught);
        self.stats.caught_up.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Run the compactor with fail-open: any error or panic forwards `raw` unchanged, counted and logged.
    fn compact(
        &self,
        session: &str,
        raw: &Bytes,
        body: &dyn WireBody,
        messages: &[&str],
        hashes: &[u128],
        window: Option<u64>,
    ) -> Compaction {
        let input = CompactInput { session, raw, body, messages, hashes, window, defer_counts: true };
        // Mode `observe` forwards the request unchanged; its projection takes the plans.
        let (outcome, plan) = match (&self.observer, &self.stateful) {
            (Some(_), Some(compactor)) => (compact_fail_open(&Unchanged(compactor), &input), None),
            _ => (
                compact_fail_open(self.compactor.as_ref(), &input),
                self.stateful.as_ref().and_then(|compactor| compactor.take_plan(session)),
            ),
        };
        let compaction = match outcome {
            Ok(out) => {
                let (failed, unchanged) = why_forwarded_raw(&out.summary);
                if let Some(reason) = &failed {
                    self.stats.fail_open.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(session = %session, reason = %reason, "forwarding the original request");
                } else if let Some(reason) = &unchanged {
                    tracing::info!(session = %session, reason = %reason, "forwarding the request unchanged");
                }
                Compaction {
                    spans: out.body.as_ref().and(out.spans),
                    body: out.body.map(Bytes::from),
                    summary: Some(out.summary),
                    skipped: failed.or(unchanged),
                    late: out.late,
                    plan: None,
                    lists: out.lists,
                }
            }
            Err(skipped) => {
                self.stats.fail_open.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(reason = %skipped, "forwarding the original request");
                Compaction { skipped: Some(skipped), ..Compaction::default() }
            }
        };
        Compaction { plan, ..compaction }
    }
}

impl Drop for Pipeline {
    /// The projections still queued (mode `observe`) finish while the archive is open: their
    /// records wait for them.
    fn drop(&mut self) {
        if let Some(observer) = &self.observer
            && !observer.drain(observe::DRAIN_LIMIT)
        {
            tracing::warn!("observe: projections still queued at shutdown are left out");
        }
    }
}

/// Why a compaction that returned forwards the raw request: a failure of pare's own (its compacted
/// conversation broke tool-call pairing, or has no valid form in the wire format: counted as
/// fail-open), or an input pare leaves alone (the request itself breaks tool-call pairing, or holds
/// a message that is not a chat message object: pare does not repair what it did not break).
fn why_forwarded_raw(summary: &CompactionSummary) -> (Option<String>, Option<String>) {
    let Some(report) = &summary.report else { return (None, None) };
    let engine = report.engine.as_ref();
    let failed =
        report.write_failed.as_ref().map(|why| format!("compacted request has no valid form: {why}")).or_else(|| {
            engine.and_then(|e| e.validation_failed.as_ref()).map(|why| format!("compacted request invalid: {why}"))
        });
    let unchanged = engine.and_then(|e| e.input_invalid.as_ref()).map(|why| format!("request left unchanged: {why}"));
    (failed, unchanged)
}

/// Times a strict request is compacted again after another process served its session meanwhile;
/// past them it is recorded without the check (two processes racing on one session).
const STALE_RETRIES: u32 = 3;

/// Sessions a request that matches none in memory is looked up among in the archive (the most recent
/// that stored one of its prefix keys).
const LOOKED_UP_SESSIONS: usize = 8;

/// Bodies from this size on are compacted with [`tokio::task::block_in_place`].
pub const BLOCKING_COMPACTION_BYTES: usize = 256 * 1024;

/// Run the parse or the compaction of a `bytes`-long body. A large body may start an epoch or arrive
/// cold (a new session, a restart: its whole history is tokenized), which is tens of milliseconds of
/// CPU, and its parse alone is about a millisecond; on the multi-threaded runtime `pare serve` uses,
/// that work leaves the worker first, so the other connections this worker serves are not stalled
/// behind it. Small bodies (a warm request costs well under a millisecond) and other runtimes run it
/// in place.
fn off_the_reactor<T>(bytes: usize, work: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi_threaded = Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if multi_threaded && bytes >= BLOCKING_COMPACTION_BYTES { tokio::task::block_in_place(work) } else { work() }
}

/// Why the pipeline of a configuration cannot be built (reported at start, before listening).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Engine(#[from] crate::compact::EngineConfigError),
    #[error(transparent)]
    Models(#[from] crate::budget::window::ModelTableError),
    #[error("cannot build the http client for window detection: {0}")]
    Client(#[from] reqwest::Error),
}

impl Pipeline {
    /// Everything `pare serve` runs for chat requests, built from a configuration: the engine with its
    /// rule pack, the per-session compactor (epochs, stickiness; mode `off` forwards unchanged), the
    /// window resolver, and — when `archive.enabled` — the archive, from which the session tracker and
    /// each recent session's compacted prefix are rebuilt so that a restart does not break the
    /// upstream's prompt cache.
    pub fn from_config(config: Arc<Config>) -> Result<Pipeline, BuildError> {
        let engine = crate::compact::Engine::from_config(&config)?;
        // The proxy knows when each message arrives: recency on the wall clock when the config asks.
        let budget = Arc::new(StateBudget::new(config.memory.max_state_bytes));
        let mut compactor = SessionCompactor::new(&config, Arc::new(engine))?
            .with_wall_clock(&config, crate::budget::compactor::system_clock())
            .with_budget(budget.clone());
        if config.archive.enabled {
            compactor = compactor.recording_plans();
        }
        let compactor = Arc::new(compactor);
        let client = crate::outbound::client_builder(config.upstream.connect_timeout())
            // Upstream logs (and pare's e2e suite) can tell pare's own probes from the agent's requests.
            .user_agent(concat!("pare/", env!("CARGO_PKG_VERSION"), " window-detection"))
            .build()?;
        let windows = WindowResolver::new(
            client,
            &config.upstream.url,
            ModelTable::from_config(&config)?,
            DetectConfig::from_budget(&config.budget),
        );
        let mut pipeline = Pipeline::with_budget(config.clone(), compactor.clone(), budget.clone());
        pipeline.windows = Some(Arc::new(windows));
        pipeline.stateful = Some(compactor.clone());
        if config.compaction.mode == Mode::Observe {
            pipeline.observer = Some(Observer::new(compactor.clone(), budget));
        }
        if config.archive.enabled {
            let archive = Archive::open(&config.archive);
            if config.archive.durability == Durability::Buffered
                && matches!(archive.location(), archive::Location::Postgres(_))
            {
                tracing::warn!(
                    "replicas sharing a PostgreSQL archive keep a session in step only with archive.durability: strict; \
                    with buffered, route each session to one replica (sticky routing)"
                );
            }
            pipeline = pipeline.with_archive(archive.clone());
            seed_compaction_state(&compactor, &archive, SEEDED_SESSIONS);
        }
        Ok(pipeline)
    }
}

/// Rebuild the compacted prefix of the most recently active sessions from their stored plans. Best
/// effort: a session that cannot be rebuilt starts a fresh epoch.
fn seed_compaction_state(compactor: &SessionCompactor, archive: &Archive, limit: usize) {
    let reader = match archive::query::ArchiveReader::open(archive.location()) {
        Ok(reader) => reader,
        Err(archive::ArchiveError::NoStore(_)) => return,
        Err(err) => {
            tracing::warn!(error = %err, "cannot read the archive; compaction state starts fresh");
            return;
        }
    };
    let sessions = match reader.recent_session_keys(limit) {
        Ok(sessions) => sessions,
        Err(err) => {
            tracing::warn!(error = %err, "cannot list archived sessions; compaction state starts fresh");
            return;
        }
    };
    let mut n_seeded = 0usize;
    for (session, _) in sessions {
        if seed_from(compactor, &reader, &session) {
            n_seeded += 1;
        }
    }
    if n_seeded > 0 {
        tracing::info!(sessions = n_seeded, "compaction state rebuilt from the archive");
    }
}

/// Sessions whose tracker keys and compacted prefix are rebuilt from the archive at start (the most
/// recently active; the memory budget may evict some of them again).
const SEEDED_SESSIONS: usize = 256;

/// Rebuild one session's compacted prefix from the archive; best effort.
fn seed_session(compactor: &SessionCompactor, archive: &Archive, session: &str) {
    match archive::query::ArchiveReader::open(archive.location()) {
        Ok(reader) => {
            seed_from(compactor, &reader, session);
        }
        Err(err) => tracing::warn!(session = %session, error = %err, "cannot read the archive to rebuild a session"),
    }
}

/// Seed `session` from the archive: from the plan stored with the exchange that last changed its
/// compaction state (any wire format) and its last request's raw messages. False when there is
/// nothing to seed from or it cannot be read (the session then starts a fresh epoch).
fn seed_from(compactor: &SessionCompactor, reader: &archive::query::ArchiveReader, session: &str) -> bool {
    // Counted first: a request another process archives meanwhile makes the count older than the
    // state read after it, never newer (a strict commit then finds it stale and reads again).
    let requests = match reader.session_requests(session) {
        Ok(requests) => Some(requests.unwrap_or(0) as u64),
        Err(err) => {
            tracing::warn!(session = %session, error = %err, "cannot count the session's archived requests");
            None
        }
    };
    let seeded = seed_state(compactor, reader, session);
    if let Some(requests) = requests {
        compactor.set_archived(session, requests, false);
    }
    seeded
}

/// [`seed_from`]'s compaction state.
fn seed_state(compactor: &SessionCompactor, reader: &archive::query::ArchiveReader, session: &str) -> bool {
    let last = match reader.last_bodies(session) {
        Ok(Some(last)) => last,
        Ok(None) => return false,
        Err(err) => {
            tracing::warn!(session = %session, error = %err, "cannot read the session's last request");
            return false;
        }
    };
    let exchanges = reader.exchanges(session).unwrap_or_default();
    let path = exchanges.last().map(|x| x.path.as_str()).unwrap_or_default();
    let wire = Wire::of_path(path).unwrap_or_default();
    match archive::plan::latest(reader.conn(), session) {
        Ok(Some((_, plan))) => {
            // The upstream holds the last request's messages cached: the next request's epoch
            // keeps as much of them as it can.
            let last_raw = match crate::wire::parse_at(wire, path, &last.raw) {
                Ok(body) => message_hashes(&body.messages()),
                Err(_) => Vec::new(),
            };
            // A projected state (mode `observe`) is not what the upstream was sent: a compacting
            // pare goes on from the raw requests the upstream holds, the next epoch keeping as
            // much of them as it can.
            let plan = match plan.observed && compactor.policy().mode.changes_requests() {
                true => SessionPlan::default(),
                false => plan,
            };
            compactor.resume(session, plan, &last_raw);
            true
        }
        Ok(None) => false,
        Err(err) => {
            tracing::warn!(session = %session, error = %err, "cannot read the session's stored plan");
            false
        }
    }
}
