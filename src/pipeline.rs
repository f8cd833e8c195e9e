//! The seam the proxy calls for one chat-completions request: which session it belongs to, the raw
//! record for the archive, and the compacted body to forward. Also where fail-open is enforced: any
//! error or panic inside compaction forwards the original bytes and is counted.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::HeaderMap;

use crate::archive::response::ArchiveSink;
use crate::archive::{self, Archive, ExchangeRecord, keep_headers, now_ms};
use crate::budget::epoch::SessionCompactor;
use crate::budget::window::{DetectConfig, ModelTable, WindowResolver};
use crate::config::{Config, Durability};
use crate::session::SessionTracker;
use crate::wire::{ChatBody, Spans};

/// A session's id (time-sortable, see [`crate::session`]).
pub type SessionId = String;

/// What compaction reports for one request; carried into headers, the log line and the archive.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompactionSummary {
    pub tokens_raw: u64,
    pub tokens_forwarded: u64,
    /// Epoch number of the session after this request (0 = never compacted).
    pub epoch: u64,
    /// This request started an epoch (eager: an advance that changed the forwarded prefix). Said by
    /// the compactor, so a restart that seeds sessions at their archived epoch numbers counts none.
    pub epoch_started: bool,
    /// The forwarded request is over the usable window (window − answer reserve): in epoch and eager
    /// mode, compaction could not bring it under — what pare never shrinks (first system message,
    /// user messages, protected tail, tools, messages a rule keeps whole) does not fit, or at a very
    /// small window the markers left in place of what went; in off mode, the raw request is over.
    /// Forwarded anyway, and said so in the `x-pare-over-window` header, the log line, the archived
    /// summary and `pare_over_window_requests_total`.
    pub over_window: bool,
    /// The engine's detailed report (per rule savings, messages changed…).
    pub report: serde_json::Value,
}

/// Input of one compaction.
pub struct CompactInput<'a> {
    pub session: &'a str,
    pub raw: &'a [u8],
    pub body: &'a ChatBody<'a>,
    /// Context window of the request's model when the pipeline resolved one (config or detection).
    pub window: Option<u64>,
}

/// Output of one compaction: `body` is `None` when the request is forwarded unchanged.
pub struct CompactOutput {
    pub body: Option<Vec<u8>>,
    /// Where `body`'s values lie, when the compactor wrote it with [`ChatBody::to_vec_and_spans`]:
    /// the archive then stores it without parsing it. `None`: the archive parses `body` itself.
    pub spans: Option<Spans>,
    pub summary: CompactionSummary,
}

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
}

/// Anything that can compact a chat request. The engine is pure; implementations may keep
/// per-session state (epochs, stickiness) behind interior mutability.
pub trait ChatCompactor: Send + Sync {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput>;
}

/// Forwards every request unchanged (mode `off`, and the seam's default until wired).
pub struct IdentityCompactor;

impl ChatCompactor for IdentityCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(CompactOutput { body: None, spans: None, summary: CompactionSummary::default() })
    }
}

/// Receives the upstream's answer to a chat request as it streams (for the archive).
/// The proxy calls `finish` exactly once: on end of body, on error, or when the body is dropped.
pub trait ResponseSink: Send {
    fn head(&mut self, status: u16, headers: &HeaderMap);
    fn chunk(&mut self, bytes: &Bytes);
    fn finish(self: Box<Self>, end: StreamEnd);
}

/// How a response body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    Complete,
    /// The client went away before the end.
    ClientGone,
    /// The upstream failed mid-body (reset, timeout).
    UpstreamError(String),
    /// pare answered itself (502/504…) and the upstream never did.
    NoResponse(String),
}

/// What the proxy needs to forward one chat request.
pub struct PreparedChat {
    /// The body to forward (the original bytes when nothing changed).
    pub body: Bytes,
    pub session: Option<SessionId>,
    /// The request's `model`, when the body parsed (labels metrics per model).
    pub model: Option<String>,
    pub summary: Option<CompactionSummary>,
    /// Why compaction did not apply (unparseable body, engine failure), for the log line.
    pub skipped: Option<String>,
    pub sink: Option<Box<dyn ResponseSink>>,
}

/// Counters the pipeline keeps (exported on `/_pare/metrics`).
#[derive(Debug, Default)]
pub struct PipelineStats {
    pub fail_open: AtomicU64,
    pub unparseable: AtomicU64,
    /// `strict` requests forwarded although their raw record was not confirmed committed.
    pub strict_unconfirmed: AtomicU64,
}

/// Session → archive → compaction for one chat request.
pub struct Pipeline {
    pub config: Arc<Config>,
    compactor: Arc<dyn ChatCompactor>,
    pub stats: PipelineStats,
    sessions: Arc<SessionTracker>,
    archive: Option<Arc<Archive>>,
    /// Resolves the model's context window (config, detection, default) before compaction.
    windows: Option<Arc<WindowResolver>>,
}

/// The path recorded for a chat request when the caller does not give one.
pub const DEFAULT_CHAT_PATH: &str = "/v1/chat/completions";

impl Pipeline {
    pub fn new(config: Arc<Config>, compactor: Arc<dyn ChatCompactor>) -> Pipeline {
        let sessions = Arc::new(SessionTracker::new(&config.archive));
        Pipeline { config, compactor, stats: PipelineStats::default(), sessions, archive: None, windows: None }
    }

    /// Record every exchange in `archive`, and rebuild the session tracker from the sessions it holds
    /// (so a restarted pare keeps assigning requests to their sessions). Reads the store: call at start.
    pub fn with_archive(mut self, archive: Arc<Archive>) -> Pipeline {
        match archive::query::ArchiveReader::open(archive.dir())
            .and_then(|r| r.recent_session_keys(self.config.archive.tracked_sessions))
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

    /// The archive exchanges are recorded in, if any.
    pub fn archive(&self) -> Option<&Arc<Archive>> {
        self.archive.as_ref()
    }

    /// The session tracker.
    pub fn sessions(&self) -> &Arc<SessionTracker> {
        &self.sessions
    }

    /// A pipeline that forwards everything unchanged.
    pub fn identity(config: Arc<Config>) -> Pipeline {
        Pipeline::new(config, Arc::new(IdentityCompactor))
    }

    /// Prepare one chat request for forwarding. Never fails: the worst case forwards `raw` unchanged.
    pub async fn prepare_chat(&self, headers: &HeaderMap, raw: Bytes) -> PreparedChat {
        self.prepare_chat_at("POST", DEFAULT_CHAT_PATH, headers, raw).await
    }

    /// [`Pipeline::prepare_chat`] recording the request's method and path.
    ///
    /// Order: assign the session, compact (pure, in memory, fail-open), hand the raw and forwarded
    /// bodies to the archive — in `strict` durability wait until that record is committed — and return
    /// the body to forward with a [`ResponseSink`] that records the answer.
    pub async fn prepare_chat_at(&self, method: &str, path: &str, headers: &HeaderMap, raw: Bytes) -> PreparedChat {
        // Parsing a large body is about a millisecond (800 KB): it leaves the reactor too.
        let parsed = off_the_reactor(raw.len(), || ChatBody::parse(&raw));
        let assignment = self.sessions.assign(headers, parsed.as_ref().ok());
        let session = assignment.session.clone();
        let (model, request_stream) = match &parsed {
            Ok(body) => (body.model(), body.field("stream").is_some_and(|v| v.get().trim() == "true")),
            Err(_) => (None, false),
        };
        let Compaction { body: changed, spans: forwarded_spans, summary, skipped } = match &parsed {
            Err(err) => {
                self.stats.unparseable.fetch_add(1, Ordering::Relaxed);
                Compaction { skipped: Some(err.to_string()), ..Compaction::default() }
            }
            Ok(body) => {
                let window = match &self.windows {
                    Some(windows) => Some(windows.window(model.as_deref()).await),
                    None => None,
                };
                off_the_reactor(raw.len(), || self.compact(&session, &raw, body, window))
            }
        };
        // Where the raw body's values lie, for the archive: its writer then does not parse it again
        // (nor the forwarded body, whose spans the compactor gave).
        let raw_spans = match (&self.archive, &parsed) {
            (Some(_), Ok(body)) => body.spans_in(&raw),
            _ => None,
        };
        drop(parsed);
        let forward = changed.clone().unwrap_or_else(|| raw.clone());
        let ticket = match &self.archive {
            None => None,
            Some(archive) => {
                let record = ExchangeRecord {
                    session: session.clone(),
                    at_ms: now_ms(),
                    method: method.to_owned(),
                    path: path.to_owned(),
                    model: model.clone(),
                    headers: keep_headers(headers, &self.config.archive.redact_headers),
                    raw: raw.clone(),
                    raw_spans,
                    forwarded: changed,
                    forwarded_spans,
                    summary: summary.clone(),
                    skipped: skipped.clone(),
                    key_req: assignment.key_req,
                };
                let ticket = match archive.durability() {
                    Durability::Buffered => archive.record_exchange(record),
                    Durability::Strict => {
                        let (ticket, committed) = archive.record_exchange_committed(record).await;
                        if let Err(err) = committed {
                            self.stats.strict_unconfirmed.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(session = %session, error = %err,
                                "strict archive: raw request not confirmed committed; forwarding anyway");
                        }
                        ticket
                    }
                };
                Some((Arc::clone(archive), ticket))
            }
        };
        let sink =
            ArchiveSink::new(ticket, Arc::clone(&self.sessions), session.clone(), assignment.key_req, request_stream);
        PreparedChat { body: forward, session: Some(session), model, summary, skipped, sink: Some(Box::new(sink)) }
    }

    /// Run the compactor with fail-open: any error or panic forwards `raw` unchanged, counted and logged.
    fn compact(&self, session: &str, raw: &Bytes, body: &ChatBody<'_>, window: Option<u64>) -> Compaction {
        let input = CompactInput { session, raw, body, window };
        match compact_fail_open(self.compactor.as_ref(), &input) {
            Ok(out) => Compaction {
                spans: out.body.as_ref().and(out.spans),
                body: out.body.map(Bytes::from),
                summary: Some(out.summary),
                skipped: None,
            },
            Err(skipped) => {
                self.stats.fail_open.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(reason = %skipped, "forwarding the original request");
                Compaction { skipped: Some(skipped), ..Compaction::default() }
            }
        }
    }
}

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

/// One compaction under `catch_unwind`: the proxy and `pare replay` both go through here, so that they
/// forward the same bytes. `Err` says why compaction did not apply (an error or a panic); the caller
/// then forwards the original body.
pub fn compact_fail_open(compactor: &dyn ChatCompactor, input: &CompactInput<'_>) -> Result<CompactOutput, String> {
    match catch_unwind(AssertUnwindSafe(|| compactor.compact(input))) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(err)) => Err(format!("compaction failed: {err:#}")),
        Err(panic) => Err(format!("compaction panicked: {}", panic_message(&panic))),
    }
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
        let compactor = Arc::new(
            SessionCompactor::new(&config, Arc::new(engine))?
                .with_wall_clock(&config, crate::budget::epoch::system_clock()),
        );
        crate::proxy::upstream::install_crypto_provider();
        let client = reqwest::Client::builder()
            // Upstream logs (and pare's e2e suite) can tell pare's own probes from the agent's requests.
            .user_agent(concat!("pare/", env!("CARGO_PKG_VERSION"), " window-detection"))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(config.upstream.connect_timeout())
            .build()?;
        let windows = WindowResolver::new(
            client,
            &config.upstream.url,
            ModelTable::from_config(&config)?,
            DetectConfig::from_budget(&config.budget),
        );
        let mut pipeline = Pipeline::new(config.clone(), compactor.clone());
        pipeline.windows = Some(Arc::new(windows));
        if config.archive.enabled {
            let archive = Archive::open(&config.archive);
            pipeline = pipeline.with_archive(archive.clone());
            seed_compaction_state(&compactor, &archive, config.budget.max_sessions);
        }
        Ok(pipeline)
    }
}

/// Rebuild the compacted prefix of the most recently active sessions from their last archived
/// (raw, forwarded) pair. Best effort: a session that cannot be rebuilt starts a fresh epoch.
fn seed_compaction_state(compactor: &SessionCompactor, archive: &Archive, limit: usize) {
    let reader = match archive::query::ArchiveReader::open(archive.dir()) {
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
        let last = match reader.last_bodies(&session) {
            Ok(Some(last)) => last,
            Ok(None) => continue,
            Err(err) => {
                tracing::warn!(session = %session, error = %err, "cannot read the session's last request");
                continue;
            }
        };
        let epoch = reader
            .exchanges(&session)
            .ok()
            .and_then(|xs| xs.into_iter().rev().find_map(|x| x.summary))
            .and_then(|summary| summary.get("epoch").and_then(serde_json::Value::as_u64))
            .unwrap_or(0);
        match compactor.seed(&session, &last.raw, &last.forwarded, epoch) {
            Ok(()) => n_seeded += 1,
            Err(err) => tracing::warn!(session = %session, error = %err, "cannot rebuild compaction state"),
        }
    }
    if n_seeded > 0 {
        tracing::info!(sessions = n_seeded, "compaction state rebuilt from the archive");
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}
