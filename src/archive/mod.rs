//! The raw archive: a durable embedded store of every chat exchange, the audit queries over it, and
//! DPO/SFT export from the raw sessions.
//!
//! # Layout
//!
//! - [`crate::config::location`]: where the archive lives, a directory (SQLite) or a `postgres://` URL.
//! - [`db`]: one connection over either backend; the dialects differ only there and in the schema.
//! - [`store`]: the SQLite file (WAL, private permissions) or the PostgreSQL database, its schema
//!   and migrations, content-addressed blobs.
//! - [`body`]: splitting a body into message blobs + a template, so storage grows linearly.
//! - [`chain`]: the per-session hash chain that `verify` checks.
//! - `writer`: the background writer thread (group commit, fail-open on disk errors).
//! - [`read`]: reassembling exact body bytes from templates and blobs.
//! - [`response`]: the [`crate::exchange::ResponseSink`] that assembles the assistant's answer.
//! - [`sse`]: the one server-sent-events parser the answer dialects read streams with.
//! - [`usage`]: the provider's own token figures of an answer (prompt, cached, cache writes, output).
//! - [`plan`]: each session's compaction state, stored when an exchange changes it (resume).
//! - [`query`]: the audit side: list, load, delete sessions, and what the upstream reported per session.
//! - [`prefill`]: uncached prefill with and without pare, per request and per session.
//! - [`content`]: the contents markers name by id, stored when a forwarded marker names them.
//! - [`verify`]: recompute every body hash and the chains.
//! - [`export`]: SFT conversations and DPO pairs mined from the raw sessions.
//! - [`copy`]: `pare archive copy`, every session from one store to another, verified.
//! - [`retention`]: `pare archive prune` and `archive.retain_days`, whole sessions deleted by age.
//!
//! The request path hands a record to a channel ([`Archive::queue_exchange`]); in `strict`
//! durability it then waits for the record's commit ([`Archive::record_exchange_committed`]), at
//! most `archive.commit_timeout_ms` for room in the queue and the commit together.
//!
//! The archive lives in a directory (SQLite, the default) or a PostgreSQL database
//! (`archive.url`, [`Location`]); every operation runs the same code on both through [`db::Db`].
//! Several processes may write one archive: the writer checks its cached view of a session against
//! the store inside each transaction (the writer thread).
//!
//! # The queue and backpressure
//!
//! Records waiting for the writer hold room in a queue bounded in bytes (`archive.max_queue_bytes`,
//! [`DEFAULT_MAX_QUEUE_BYTES`]) from the moment they are handed over until the writer has written
//! them (a record larger than half the queue holds half of it, so others fit beside it). A request whose record does not fit waits for room (asynchronously, first come first
//! served) while the writer works through the queue. When the writer frees nothing for
//! [`QUEUE_WAIT`] (a stalled disk), the record is not stored: counted in `lost_records`, logged as
//! `ARCHIVE WRITE FAILED`, the archive reported not writable, and the request forwarded. Until the
//! writer frees room again, later records that do not fit are dropped the same way without waiting,
//! so a stalled disk costs one request [`QUEUE_WAIT`], not every request. An answer
//! ([`Archive::record_response`]) never waits: it takes room when there is some and is queued beyond
//! the bound otherwise (there is at most one per request in flight, usually a few KB, capped at
//! [`response::MAX_BODY`], and all of them together at `archive.max_held_answer_bytes` while they
//! stream: [`response::HeldAnswers`]).

pub mod body;
pub mod chain;
pub mod content;
pub mod copy;
pub mod db;
pub mod export;
pub mod gemini_sse;
pub mod messages_sse;
pub mod plan;
pub mod prefill;
pub mod query;
pub mod read;
pub mod response;
pub mod responses_sse;
pub mod retention;
pub mod sse;
pub mod store;
pub mod time;
pub mod usage;
pub mod verify;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::budget::compactor::SessionPlan;
pub use crate::config::location::{Location, LocationError};
use crate::config::{ArchiveConfig, Durability};
use crate::exchange::{CompactionSummary, StreamEnd};
use crate::wire::Spans;
pub use db::{Db, DbError};

/// Errors of the archive. Writing never surfaces them to the proxy (fail-open); the CLI reports them.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("cannot open archive {location}: {source}")]
    Open { location: String, source: DbError },
    #[error("no archive at {0} (run `pare serve` first, or pass --archive DIR|URL)")]
    NoStore(String),
    #[error("archive i/o on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("archive database: {0}")]
    Database(#[from] DbError),
    #[error(transparent)]
    Location(#[from] LocationError),
    #[error("blob {0} is missing")]
    MissingBlob(i64),
    #[error("exchange {0} is missing")]
    MissingExchange(i64),
    #[error("blob {id} is corrupt: {why}")]
    CorruptBlob { id: i64, why: String },
    #[error("the plan stored with exchange {exchange} is corrupt: {why}")]
    CorruptPlan { exchange: i64, why: &'static str },
    #[error("exchange {exchange} has a corrupt template: {why}")]
    CorruptTemplate { exchange: i64, why: &'static str },
    #[error("no session {0:?} in the archive")]
    NoSession(String),
    #[error("session {session:?} has no request {seq}")]
    NoRequest { session: String, seq: i64 },
    #[error("archive is closed")]
    Closed,
    #[error("archive is not writable: {0}")]
    NotWritable(String),
    #[error("archive queue is full ({0} bytes waiting)")]
    QueueFull(u64),
    #[error("archive writer did not confirm the commit within {0:?}")]
    CommitTimeout(Duration),
    /// The exchange was not written: its session has another number of archived requests than
    /// the writer of the record expected (another replica wrote to the session meanwhile).
    #[error("session {session:?} has {archived} archived request(s), the record expected {expected}")]
    Stale { session: String, expected: i64, archived: i64 },
}

impl From<rusqlite::Error> for ArchiveError {
    fn from(e: rusqlite::Error) -> ArchiveError {
        ArchiveError::Database(DbError::Sqlite(e))
    }
}

impl ArchiveError {
    fn open(location: &Location, source: DbError) -> ArchiveError {
        ArchiveError::Open { location: location.to_string(), source }
    }

    fn open_file(path: &Path, source: rusqlite::Error) -> ArchiveError {
        ArchiveError::Open { location: path.display().to_string(), source: DbError::Sqlite(source) }
    }
}

/// Request headers never stored, whatever the configuration says.
pub const ALWAYS_REDACTED: &[&str] =
    &["authorization", "proxy-authorization", "api-key", "x-api-key", "cookie", "set-cookie", "x-pare-token"];

/// Parts of a header name that mark it as a credential, whatever the vendor calls it
/// (`x-goog-api-key`, `x-auth-token`, `x-amz-security-token`, `ocp-apim-subscription-key`,
/// `x-client-secret`…): such headers are never stored either.
pub const CREDENTIAL_NAME_PARTS: &[&str] = &[
    "auth",
    "token",
    "secret",
    "password",
    "passwd",
    "cookie",
    "api-key",
    "apikey",
    "api_key",
    "access-key",
    "subscription-key",
    "private-key",
    "credential",
    "signature",
];

/// Endings of a header name that mark it as a credential (`x-custom-key`, `x-portkey-virtual-key`,
/// `x-session-token`, `x-basic-auth`…): such headers are never stored, unless named safe.
pub const CREDENTIAL_NAME_ENDINGS: &[&str] = &["key", "token", "secret", "auth"];

/// Whether a request header carries a credential: [`ALWAYS_REDACTED`], a name the configuration
/// lists in `archive.redact_headers`, or — unless `archive.safe_headers` names it — a name
/// containing one of [`CREDENTIAL_NAME_PARTS`] or ending in one of [`CREDENTIAL_NAME_ENDINGS`].
pub fn is_redacted(name: &str, redact: &[String], safe: &[String]) -> bool {
    // Header names arrive lowercase (`http::HeaderName`): no copy for them.
    let lower = if name.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(name.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(name)
    };
    if ALWAYS_REDACTED.contains(&lower.as_ref()) || redact.iter().any(|r| r.eq_ignore_ascii_case(name)) {
        return true;
    }
    if safe.iter().any(|s| s.eq_ignore_ascii_case(name)) {
        return false;
    }
    CREDENTIAL_NAME_PARTS.iter().any(|part| lower.contains(part))
        || CREDENTIAL_NAME_ENDINGS.iter().any(|ending| lower.ends_with(ending))
}

/// The request headers worth keeping, secrets removed ([`is_redacted`]).
pub fn keep_headers(headers: &HeaderMap, redact: &[String], safe: &[String]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !is_redacted(name.as_str(), redact, safe))
        .map(|(name, value)| (name.as_str().to_owned(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
        .collect()
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or_default()
}

/// One chat request, as handed to the archive.
#[derive(Debug)]
pub struct ExchangeRecord {
    pub session: String,
    pub at_ms: i64,
    pub method: String,
    pub path: String,
    pub model: Option<String>,
    /// Request headers, secrets already removed ([`keep_headers`]).
    pub headers: Vec<(String, String)>,
    /// Exactly what the agent sent.
    pub raw: Bytes,
    /// Where `raw`'s values lie, from the proxy's parse of it ([`crate::wire::Split::spans_in`]):
    /// the writer then splits it without a second parse. `None`: the writer parses `raw` itself.
    pub raw_spans: Option<Spans>,
    /// What was forwarded; `None` when it is `raw` unchanged.
    pub forwarded: Option<Bytes>,
    /// Where `forwarded`'s values lie, as the compactor wrote it (see `raw_spans`).
    pub forwarded_spans: Option<Spans>,
    pub summary: Option<CompactionSummary>,
    /// The exact summary, when `summary` still holds upper bounds of the new messages' tokens
    /// (see [`crate::exchange::CompactOutput::late`]): the writer waits for it before it stores the
    /// record.
    pub late_summary: Option<tokio::sync::oneshot::Receiver<CompactionSummary>>,
    /// Why compaction did not apply.
    pub skipped: Option<String>,
    /// Session key of the request's messages (see [`crate::session`]).
    pub key_req: Option<u64>,
    /// Compare-and-set: when `Some(n)`, the exchange is written only if its session has exactly
    /// `n` archived requests (0 for a session the archive does not know); otherwise it (and the
    /// plan riding with it) is not written and the waiter gets [`ArchiveError::Stale`].
    pub expect_requests: Option<i64>,
    /// Texts the forwarded markers name that compaction derived (elision markers' id lists,
    /// [`crate::exchange::CompactOutput::lists`]): stored as contents like the hidden outputs.
    pub lists: std::sync::Arc<[String]>,
}

impl ExchangeRecord {
    /// A chat request (`POST /v1/chat/completions`) forwarded as `raw` came, with nothing else
    /// known: no model, headers, spans or summary. Set what a caller knows with struct update syntax.
    pub fn unchanged(session: impl Into<String>, at_ms: i64, raw: Bytes) -> ExchangeRecord {
        ExchangeRecord {
            session: session.into(),
            at_ms,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: None,
            headers: Vec::new(),
            raw,
            raw_spans: None,
            forwarded: None,
            forwarded_spans: None,
            summary: None,
            late_summary: None,
            skipped: None,
            key_req: None,
            expect_requests: None,
            lists: std::sync::Arc::from([]),
        }
    }

    /// Take the exact summary in, waiting for it when it is still being counted (the writer's
    /// thread; a lost one leaves the bounds in place).
    fn settle_summary(&mut self) {
        if let Some(late) = self.late_summary.take()
            && let Ok(summary) = late.blocking_recv()
        {
            self.summary = Some(summary);
        }
    }
}

/// The upstream's answer to one exchange.
#[derive(Debug, Clone)]
pub struct ResponseRecord {
    pub at_ms: i64,
    /// `None` when no response head was received (pare answered itself).
    pub status: Option<u16>,
    pub headers: Vec<(String, String)>,
    pub stream: bool,
    pub end: StreamEnd,
    /// The body as received (for streams, the raw SSE bytes), possibly capped (see `truncated`).
    pub body: Vec<u8>,
    /// Why the body was cut, when it was: it reached [`response::MAX_BODY`], or the answers held for
    /// the archive reached their cap (see [`response::HeldAnswers`]).
    pub truncated: Option<response::Truncation>,
    /// The assistant message, assembled from the stream or read from the JSON body.
    pub assembled: Option<serde_json::Value>,
    /// Session key of the request plus this answer (see [`crate::session`]).
    pub key_ext: Option<u64>,
}

impl ResponseRecord {
    /// Whether the body is incomplete: the stream was cut short or the body was capped.
    pub fn partial(&self) -> bool {
        self.truncated.is_some() || self.end != StreamEnd::Complete
    }
}

/// Identifies an exchange handed to the writer, so its response can follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// The archive's state, for `/_pare/health` and the metrics.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ArchiveHealth {
    /// Where the archive is: its directory, or its URL with the password hidden.
    pub dir: String,
    /// False after a failed open or a commit the store failed as a whole (not one refused record),
    /// until the next successful commit.
    pub writable: bool,
    /// Records waiting for the writer.
    pub queue_depth: u64,
    /// Bytes of those records (bounded by `archive.max_queue_bytes`, answers aside).
    pub queue_bytes: u64,
    /// Records that waited for room in the queue since start.
    pub queue_waits: u64,
    /// Records committed since start.
    pub committed_records: u64,
    /// Transactions committed since start: several records share one when they arrive within
    /// `archive.flush_interval_ms` of each other.
    pub commits: u64,
    /// Records that could not be stored (disk full, read-only, queue full…) since start.
    pub lost_records: u64,
    /// Of those, records the store refused on their own (a value or constraint it rejects): the
    /// other records of their transaction were written one at a time. `writable` stays true
    /// when the others land; this count and `last_error` say what was refused.
    pub refused_records: u64,
    pub last_error: Option<String>,
}

pub use crate::config::DEFAULT_MAX_QUEUE_BYTES;

/// How long a record waits for room in the queue while the writer frees none, before it is dropped
/// (counted and logged) and its request forwarded.
pub const QUEUE_WAIT: Duration = Duration::from_secs(10);

/// Default of `archive.commit_timeout_ms`: how long a `strict` request waits for room in the queue
/// and its commit, together, before it is forwarded anyway (and counted).
pub const STRICT_COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Least time between two logs of lost records: a database that stays away for minutes logs its
/// losses once per interval, not once per record.
pub const LOSS_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// How long [`Archive::start_limited`] waits for the writer's first open of the store (a store busy
/// in another process can hold it up to SQLite's busy timeout).
pub const FIRST_OPEN_WAIT: Duration = Duration::from_secs(5);

/// What the writer tells the waiter of a committed exchange: its request number, or why it was
/// not written.
pub(crate) type Ack = Result<i64, WriteRefused>;

/// Why the writer did not write an awaited exchange.
#[derive(Debug, Clone)]
pub(crate) enum WriteRefused {
    Failed(String),
    Stale { expected: i64, archived: i64 },
}

pub(crate) enum Job {
    Exchange {
        ticket: Ticket,
        record: Box<ExchangeRecord>,
        /// The session's compaction state after this exchange, written in its transaction.
        plan: Option<Box<SessionPlan>>,
        ack: Option<tokio::sync::oneshot::Sender<Ack>>,
        /// Its room in the queue, given back when the writer drops the job.
        room: Option<OwnedSemaphorePermit>,
    },
    Response {
        ticket: Ticket,
        record: Box<ResponseRecord>,
        room: Option<OwnedSemaphorePermit>,
    },
    /// The compaction state the exchange of `ticket` left its session in.
    Plan {
        ticket: Ticket,
        plan: Box<SessionPlan>,
    },
    /// Answered once every record handed over before it is written; with a session, once every
    /// record of that session is (the writer may answer it before a huge body of another session).
    Flush(mpsc::Sender<()>, Option<String>),
    Shutdown(mpsc::Sender<()>),
}

impl Job {
    /// Whether someone waits for this job's commit: a strict-durability exchange, a flush, the shutdown.
    fn is_awaited(&self) -> bool {
        match self {
            Job::Exchange { ack, .. } => ack.is_some(),
            Job::Response { .. } | Job::Plan { .. } => false,
            Job::Flush(..) | Job::Shutdown(_) => true,
        }
    }

    fn set_room(&mut self, permit: OwnedSemaphorePermit) {
        if let Job::Exchange { room, .. } | Job::Response { room, .. } = self {
            *room = Some(permit);
        }
    }

    fn size(&self) -> u64 {
        match self {
            Job::Exchange { record, plan, .. } => {
                (record.raw.len() + record.forwarded.as_ref().map_or(0, Bytes::len) + 512) as u64
                    + plan.as_ref().map_or(0, |plan| plan_size(plan))
            }
            Job::Response { record, .. } => (record.body.len() + 512) as u64,
            Job::Plan { plan, .. } => plan_size(plan),
            Job::Flush(..) | Job::Shutdown(_) => 0,
        }
    }
}

fn plan_size(plan: &SessionPlan) -> u64 {
    let prefix = plan.frozen.as_ref().map_or(0, |f| f.prefix.iter().map(String::len).sum::<usize>());
    (prefix + 512) as u64
}

/// State shared between the handle and the writer thread.
#[derive(Debug)]
pub(crate) struct Shared {
    location: Location,
    queue_depth: AtomicU64,
    queue_bytes: AtomicU64,
    committed: AtomicU64,
    commits: AtomicU64,
    lost: AtomicU64,
    /// Of the lost records, those the store refused on their own.
    refused: AtomicU64,
    /// Records the writer is done with (committed or lost): its progress.
    finished: AtomicU64,
    /// Exchanges handed to the writer, and those it is done with (committed or lost, not held for
    /// a database away): what [`Archive::settled`] compares.
    exchanges_sent: AtomicU64,
    exchanges_done: AtomicU64,
    /// Woken when the writer is done with a batch.
    batch_done: tokio::sync::Notify,
    queue_waits: AtomicU64,
    writable: AtomicBool,
    last_error: Mutex<Option<String>>,
    /// The memory budget the writer charges its cursors to, once shared.
    budget: std::sync::OnceLock<Arc<crate::memory::StateBudget>>,
    /// When lost records were last logged, and how many were lost since then unlogged.
    loss_log: Mutex<(Option<std::time::Instant>, u64)>,
}

impl Shared {
    /// Count `n_lost` records as lost and the archive as not writable, for `error`. Logged at most
    /// once per [`LOSS_LOG_INTERVAL`] (with the records lost since the last log).
    fn fail(&self, n_lost: u64, error: String) {
        self.lost.fetch_add(n_lost, Ordering::Relaxed);
        self.not_writable(error);
    }

    /// Count `n_refused` records the store refused on their own (a value or constraint it rejects)
    /// as lost, for `error`, logged as [`Shared::fail`] logs. The archive stays writable: the
    /// other records of their transaction were written.
    fn refuse(&self, n_refused: u64, error: String) {
        self.lost.fetch_add(n_refused, Ordering::Relaxed);
        self.refused.fetch_add(n_refused, Ordering::Relaxed);
        self.report(error);
    }

    /// Mark the archive not writable for `error` (records may wait for it, not lost yet), logged as
    /// [`Shared::fail`] logs.
    fn not_writable(&self, error: String) {
        self.writable.store(false, Ordering::Relaxed);
        self.report(error);
    }

    /// Log `error` (at most once per [`LOSS_LOG_INTERVAL`], with the records lost since the last
    /// log) and keep it as the last error.
    fn report(&self, error: String) {
        let total = self.lost.load(Ordering::Relaxed);
        let mut log = self.loss_log.lock().unwrap_or_else(|p| p.into_inner());
        let lost_since = total - log.1.min(total);
        if log.0.is_none_or(|at| at.elapsed() >= LOSS_LOG_INTERVAL) {
            let waiting = self.queue_depth.load(Ordering::Relaxed);
            tracing::error!(archive = %self.location, error = %error, lost_since_last_log = lost_since,
                lost_total = total, records_waiting = waiting,
                "ARCHIVE WRITE FAILED: records were not stored; pare keeps proxying");
            *log = (Some(std::time::Instant::now()), total);
        }
        drop(log);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }
}

/// Handle on the archive: cheap to share (`Arc`), safe to call from any thread or task.
pub struct Archive {
    shared: Arc<Shared>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    /// The queue's room, one permit per KiB.
    room: Arc<Semaphore>,
    room_kib: u32,
    /// The writer's progress ([`Shared::finished`]) when a record last gave up waiting for room;
    /// `u64::MAX`: none did. While it has not moved, records that do not fit are dropped at once.
    stalled_at: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The writer thread, woken when a job someone waits for is queued.
    writer: std::thread::Thread,
    next_ticket: AtomicU64,
    durability: Durability,
    /// How long a strict request waits for room and its commit together (`archive.commit_timeout_ms`).
    commit_timeout: Duration,
    /// Stops the `archive.retain_days` thread when dropped ([`retention::spawn`]).
    retention: Mutex<Option<mpsc::Sender<()>>>,
}

impl Archive {
    /// Start the archive for a configuration. Never fails: a store that cannot be opened (read-only
    /// directory, a file where the directory should be…) gives an archive that counts every record as
    /// lost, reports it in [`Archive::health`], and retries opening every few seconds.
    pub fn open(config: &ArchiveConfig) -> Arc<Archive> {
        let location = match config.location() {
            Ok(location) => location,
            Err(e) => {
                // The configuration check refuses a bad location before this; a caller that skipped
                // it gets an archive that reports why it cannot write.
                tracing::error!(error = %e, "the archive location is not valid");
                Location::Dir(config.resolved_dir())
            }
        };
        let archive = Archive::launch(
            location.clone(),
            config.durability,
            Duration::from_millis(config.flush_interval_ms),
            config.max_bytes,
            config.max_queue_bytes,
            Duration::from_millis(config.commit_timeout_ms),
        );
        if let Some(days) = config.retain_days {
            let (stop, stopped) = mpsc::channel();
            match retention::spawn(location, days, stopped) {
                Ok(()) => *archive.retention.lock().unwrap_or_else(|p| p.into_inner()) = Some(stop),
                Err(e) => tracing::error!(error = %e, "cannot start the archive.retain_days thread"),
            }
        }
        archive
    }

    /// Start the archive at `location` with the default queue bound and commit timeout.
    pub fn start_at(location: Location, durability: Durability, flush_interval: Duration) -> Arc<Archive> {
        Archive::launch(location, durability, flush_interval, None, DEFAULT_MAX_QUEUE_BYTES, STRICT_COMMIT_TIMEOUT)
    }

    /// Start the archive in `dir`, without a size limit.
    pub fn start(dir: PathBuf, durability: Durability, flush_interval: Duration) -> Arc<Archive> {
        Archive::start_limited(dir, durability, flush_interval, None)
    }

    /// Start the archive in `dir`; past `max_bytes` the store refuses records as a full disk would.
    /// Returns once the writer's first open of the store is over (at most [`FIRST_OPEN_WAIT`]), so that
    /// a reader opened afterwards finds the schema, never a store being created.
    pub fn start_limited(
        dir: PathBuf,
        durability: Durability,
        flush_interval: Duration,
        max_bytes: Option<u64>,
    ) -> Arc<Archive> {
        Archive::launch(
            Location::Dir(dir),
            durability,
            flush_interval,
            max_bytes,
            DEFAULT_MAX_QUEUE_BYTES,
            STRICT_COMMIT_TIMEOUT,
        )
    }

    /// Start the archive at `location` with every limit given (`archive.max_queue_bytes`,
    /// `archive.commit_timeout_ms`).
    pub fn launch(
        location: Location,
        durability: Durability,
        flush_interval: Duration,
        max_bytes: Option<u64>,
        max_queue_bytes: u64,
        commit_timeout: Duration,
    ) -> Arc<Archive> {
        let shared = Arc::new(Shared {
            location: location.clone(),
            queue_depth: AtomicU64::new(0),
            queue_bytes: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            exchanges_sent: AtomicU64::new(0),
            exchanges_done: AtomicU64::new(0),
            batch_done: tokio::sync::Notify::new(),
            queue_waits: AtomicU64::new(0),
            writable: AtomicBool::new(true),
            last_error: Mutex::new(None),
            budget: std::sync::OnceLock::new(),
            loss_log: Mutex::new((None, 0)),
        });
        let (tx, rx) = mpsc::channel();
        let (opened_tx, opened_rx) = mpsc::sync_channel(1);
        let writer = writer::Writer::new(location, Arc::clone(&shared), flush_interval, max_bytes);
        let thread = std::thread::Builder::new()
            .name("pare-archive".into())
            .spawn(move || writer.run(rx, opened_tx))
            .expect("spawning the archive writer thread");
        if opened_rx.recv_timeout(FIRST_OPEN_WAIT).is_err() {
            tracing::warn!(archive = %shared.location, "the archive store is still opening; starting without waiting for it");
        }
        let room_kib = u32::try_from(max_queue_bytes.div_ceil(1024)).unwrap_or(u32::MAX).max(1);
        Arc::new(Archive {
            shared,
            tx: Mutex::new(Some(tx)),
            room: Arc::new(Semaphore::new(room_kib as usize)),
            room_kib,
            stalled_at: AtomicU64::new(u64::MAX),
            writer: thread.thread().clone(),
            thread: Mutex::new(Some(thread)),
            next_ticket: AtomicU64::new(1),
            durability,
            commit_timeout,
            retention: Mutex::new(None),
        })
    }

    /// Keep the writer's per-session cursors (per message of each session's last bodies: blob id,
    /// separator, digest) as the sessions' parts in `budget`; an evicted cursor is reloaded from the
    /// store when its session writes again. Once, before the first write: later calls are ignored
    /// (a writer that wrote first keeps its cursors in a default budget of its own).
    pub fn share_budget(&self, budget: Arc<crate::memory::StateBudget>) {
        let _ = self.shared.budget.set(budget);
    }

    /// Where the archive is.
    pub fn location(&self) -> &Location {
        &self.shared.location
    }

    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Room for a record of `size` bytes, in KiB. A record larger than half the queue takes half of
    /// it: the writer may take seconds over one huge body (its blobs stored ahead, other sessions'
    /// records written meanwhile), and the records that come during those seconds keep room beside
    /// it rather than waiting for it.
    fn kib(&self, size: u64) -> u32 {
        u32::try_from(size.div_ceil(1024)).unwrap_or(u32::MAX).clamp(1, (self.room_kib / 2).max(1))
    }

    fn try_room(&self, size: u64) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.room).try_acquire_many_owned(self.kib(size)).ok()
    }

    /// Room for a record of `size` bytes: at once if there is some, else after waiting for the writer
    /// (see the module docs). An error means the record is dropped; it is counted and logged.
    async fn wait_for_room(&self, size: u64, wait_at_most: Duration) -> Result<OwnedSemaphorePermit, ArchiveError> {
        if let Some(room) = self.try_room(size) {
            return Ok(room);
        }
        let progress = self.shared.finished.load(Ordering::Relaxed);
        if self.stalled_at.load(Ordering::Relaxed) != progress {
            self.shared.queue_waits.fetch_add(1, Ordering::Relaxed);
            let wait = Arc::clone(&self.room).acquire_many_owned(self.kib(size));
            match tokio::time::timeout(wait_at_most, wait).await {
                Ok(Ok(room)) => return Ok(room),
                Ok(Err(_)) => return Err(ArchiveError::Closed),
                Err(_) => self.stalled_at.store(self.shared.finished.load(Ordering::Relaxed), Ordering::Relaxed),
            }
        }
        let waiting = self.shared.queue_bytes.load(Ordering::Relaxed);
        self.shared.fail(
            1,
            format!(
                "queue full: {waiting} bytes waiting and the writer freed none for {wait_at_most:?} (disk stalled or database unreachable?)"
            ),
        );
        Err(ArchiveError::QueueFull(waiting))
    }

    fn send(&self, job: Job) -> Result<(), ArchiveError> {
        let size = job.size();
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref() else {
            if size > 0 {
                self.shared.lost.fetch_add(1, Ordering::Relaxed);
            }
            return Err(ArchiveError::Closed);
        };
        self.shared.queue_bytes.fetch_add(size, Ordering::Relaxed);
        self.shared.queue_depth.fetch_add(1, Ordering::Relaxed);
        if let Job::Exchange { .. } = job {
            self.shared.exchanges_sent.fetch_add(1, Ordering::AcqRel);
        }
        let awaited = job.is_awaited();
        tx.send(job).map_err(|_| {
            self.shared.lost.fetch_add(1, Ordering::Relaxed);
            ArchiveError::Closed
        })?;
        if awaited {
            self.writer.unpark();
        }
        Ok(())
    }

    fn ticket(&self) -> Ticket {
        Ticket(self.next_ticket.fetch_add(1, Ordering::Relaxed))
    }

    /// Hand an exchange to the writer without waiting: when the queue has no room for it, the record
    /// is dropped (counted and logged). For callers that cannot wait; the proxy uses
    /// [`Archive::queue_exchange`].
    pub fn record_exchange(&self, record: ExchangeRecord) -> Ticket {
        let ticket = self.ticket();
        let mut job = Job::Exchange { ticket, record: Box::new(record), plan: None, ack: None, room: None };
        match self.try_room(job.size()) {
            Some(room) => {
                job.set_room(room);
                let _ = self.send(job);
            }
            None => {
                let waiting = self.shared.queue_bytes.load(Ordering::Relaxed);
                self.shared.fail(1, format!("queue full: {waiting} bytes waiting for the disk"));
            }
        }
        ticket
    }

    /// Hand an exchange to the writer, waiting for room in the queue when it is full (at most
    /// [`QUEUE_WAIT`] without the writer freeing any; then the record is dropped, counted and logged).
    pub async fn queue_exchange(&self, record: ExchangeRecord) -> Ticket {
        let ticket = self.ticket();
        let mut job = Job::Exchange { ticket, record: Box::new(record), plan: None, ack: None, room: None };
        if let Ok(room) = self.wait_for_room(job.size(), QUEUE_WAIT).await {
            job.set_room(room);
            let _ = self.send(job);
        }
        ticket
    }

    /// Hand an exchange, and the compaction state it left its session in (`plan`), to the writer
    /// and wait until both are committed in one transaction: another replica reading after the
    /// commit sees both. Waiting for room in the queue and for the commit together last at most
    /// `archive.commit_timeout_ms`. Gives the exchange's request number (1-based) in its session.
    /// An error means the record may not be stored: [`ArchiveError::Stale`] when its
    /// `expect_requests` did not hold (not written, not counted as lost); otherwise it is already
    /// counted and logged, and the caller forwards anyway (fail-open).
    pub async fn record_exchange_committed(
        &self,
        record: ExchangeRecord,
        plan: Option<SessionPlan>,
    ) -> (Ticket, Result<i64, ArchiveError>) {
        let ticket = self.ticket();
        let deadline = tokio::time::Instant::now() + self.commit_timeout;
        let session = record.session.clone();
        let (ack, done) = tokio::sync::oneshot::channel();
        let mut job =
            Job::Exchange { ticket, record: Box::new(record), plan: plan.map(Box::new), ack: Some(ack), room: None };
        match self.wait_for_room(job.size(), self.commit_timeout.min(QUEUE_WAIT)).await {
            Ok(room) => job.set_room(room),
            Err(e) => return (ticket, Err(e)),
        }
        if let Err(e) = self.send(job) {
            return (ticket, Err(e));
        }
        let result = match tokio::time::timeout_at(deadline, done).await {
            Ok(Ok(Ok(seq))) => Ok(seq),
            Ok(Ok(Err(WriteRefused::Failed(e)))) => Err(ArchiveError::NotWritable(e)),
            Ok(Ok(Err(WriteRefused::Stale { expected, archived }))) => {
                Err(ArchiveError::Stale { session, expected, archived })
            }
            Ok(Err(_)) => Err(ArchiveError::Closed),
            Err(_) => Err(ArchiveError::CommitTimeout(self.commit_timeout)),
        };
        (ticket, result)
    }

    /// Hand the response of an exchange to the writer; never waits: it takes room in the queue when
    /// there is some and is queued beyond the bound otherwise (see the module docs).
    pub fn record_response(&self, ticket: Ticket, record: ResponseRecord) {
        let mut job = Job::Response { ticket, record: Box::new(record), room: None };
        if let Some(room) = self.try_room(job.size()) {
            job.set_room(room);
        }
        let _ = self.send(job);
    }

    /// Hand the writer the compaction state the exchange of `ticket` left its session in (see
    /// [`plan`]). It never waits for room in the queue: a session stores one when an epoch starts,
    /// not one per request.
    pub fn record_plan(&self, ticket: Ticket, plan: SessionPlan) {
        let _ = self.send(Job::Plan { ticket, plan: Box::new(plan) });
    }

    /// Wait until every record handed over before this call is committed, counted as lost, or held
    /// for a PostgreSQL database that cannot be reached (written when it is back).
    pub fn flush(&self) -> Result<(), ArchiveError> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Flush(tx, None))?;
        rx.recv().map_err(|_| ArchiveError::Closed)
    }

    /// [`Archive::flush`] for the records of one session: what reading that session back needs.
    /// The writer may answer it while it works through a huge body of another session.
    pub fn flush_session(&self, session: &str) -> Result<(), ArchiveError> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Flush(tx, Some(session.to_owned())))?;
        rx.recv().map_err(|_| ArchiveError::Closed)
    }

    /// [`Archive::flush_session`] for async callers (runs on the blocking pool).
    pub async fn flush_session_async(self: &Arc<Self>, session: &str) -> Result<(), ArchiveError> {
        let me = Arc::clone(self);
        let session = session.to_owned();
        tokio::task::spawn_blocking(move || me.flush_session(&session)).await.unwrap_or(Err(ArchiveError::Closed))
    }

    /// Wait until the writer is done with every exchange handed over before this call (committed
    /// or lost), at most `archive.commit_timeout_ms`, without hurrying it: a flush makes the writer
    /// commit at once, this waits for the commit it makes anyway (within
    /// `archive.flush_interval_ms`). False when there was nothing to wait for.
    pub async fn settled(&self) -> bool {
        let target = self.shared.exchanges_sent.load(Ordering::Acquire);
        let deadline = tokio::time::Instant::now() + self.commit_timeout;
        let mut waited = false;
        loop {
            let done = self.shared.batch_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.shared.exchanges_done.load(Ordering::Acquire) >= target {
                return waited;
            }
            waited = true;
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return true;
            }
        }
    }

    /// [`Archive::flush`] for async callers (runs on the blocking pool).
    pub async fn flush_async(self: &Arc<Self>) -> Result<(), ArchiveError> {
        let me = Arc::clone(self);
        tokio::task::spawn_blocking(move || me.flush()).await.unwrap_or(Err(ArchiveError::Closed))
    }

    /// Commit everything queued, stop the writer and wait for it. Later records are counted as lost.
    /// Called on graceful shutdown; also done on drop.
    pub fn close(&self) {
        self.retention.lock().unwrap_or_else(|p| p.into_inner()).take();
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(tx) = tx {
            let (done_tx, done) = mpsc::channel();
            if tx.send(Job::Shutdown(done_tx)).is_ok() {
                self.writer.unpark();
                let _ = done.recv();
            }
        }
        if let Some(thread) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = thread.join();
        }
    }

    /// [`Archive::close`] for async callers.
    pub async fn close_async(self: &Arc<Self>) {
        let me = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || me.close()).await;
    }

    pub fn health(&self) -> ArchiveHealth {
        ArchiveHealth {
            dir: self.shared.location.to_string(),
            writable: self.shared.writable.load(Ordering::Relaxed),
            queue_depth: self.shared.queue_depth.load(Ordering::Relaxed),
            queue_bytes: self.shared.queue_bytes.load(Ordering::Relaxed),
            queue_waits: self.shared.queue_waits.load(Ordering::Relaxed),
            committed_records: self.shared.committed.load(Ordering::Relaxed),
            commits: self.shared.commits.load(Ordering::Relaxed),
            lost_records: self.shared.lost.load(Ordering::Relaxed),
            refused_records: self.shared.refused.load(Ordering::Relaxed),
            last_error: self.shared.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

impl Drop for Archive {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: i64) -> ExchangeRecord {
        ExchangeRecord::unchanged(
            "s",
            n,
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#),
        )
    }

    /// A name is redacted in any case: header names arrive lowercase, configured ones as written.
    #[test]
    fn names_are_redacted_in_any_case() {
        for name in ["authorization", "Authorization", "X-Goog-Api-Key", "x-custom-KEY"] {
            assert!(is_redacted(name, &[], &[]), "{name}");
        }
        assert!(is_redacted("X-Internal", &["x-internal".to_owned()], &[]));
        assert!(!is_redacted("X-Portkey-Virtual-Key", &[], &["x-portkey-virtual-key".to_owned()]));
        assert!(!is_redacted("Content-Type", &[], &[]));
    }

    /// Regression: credential headers of other vendors (`x-goog-api-key`, `x-auth-token`), then
    /// generic ones (`x-custom-key`, `x-portkey-virtual-key`) were stored. Names that say "key",
    /// "token", "secret"… or end in them are dropped, and so are the names the configuration adds;
    /// a name listed as safe is kept.
    #[test]
    fn credential_headers_of_any_vendor_are_not_stored() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("x-goog-api-key", "AIza-secret"),
            ("x-auth-token", "t0ken"),
            ("x-amz-security-token", "aws"),
            ("ocp-apim-subscription-key", "azure"),
            ("x-client-secret", "cs"),
            ("x-corp-gateway", "corp-secret-value"),
            ("x-custom-key", "ck"),
            ("x-portkey-virtual-key", "pk"),
            ("x-basic-auth", "ba"),
            ("idempotency-key", "retry-1"),
            ("authorization", "Bearer sk-1"),
            ("content-type", "application/json"),
            ("user-agent", "agent/1.0"),
            ("x-pare-session", "s1"),
            ("openai-organization", "org-1"),
        ] {
            headers.insert(http::HeaderName::from_static(name), http::HeaderValue::from_static(value));
        }
        let kept = keep_headers(&headers, &["X-Corp-Gateway".to_owned()], &["Idempotency-Key".to_owned()]);
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["idempotency-key", "content-type", "user-agent", "x-pare-session", "openai-organization"]);
        let none_safe = keep_headers(&headers, &[], &[]);
        assert!(!none_safe.iter().any(|(n, _)| n == "idempotency-key" || n.ends_with("-key")), "{none_safe:?}");
    }

    /// Regression: each failed write wrapped the previous failure's message once more ("archive is
    /// not writable: archive is not writable: …"). The reported error names the cause once, however
    /// many writes fail.
    #[test]
    fn the_error_of_an_unwritable_archive_does_not_nest() {
        let parent = tempfile::tempdir().unwrap();
        let not_a_dir = parent.path().join("archive");
        std::fs::write(&not_a_dir, b"a file where the archive directory should be").unwrap();
        let archive = Archive::start(not_a_dir.clone(), Durability::Buffered, Duration::from_millis(1));
        for n in 0..4 {
            archive.record_exchange(record(n));
            archive.flush().unwrap();
        }
        let health = archive.health();
        assert_eq!((health.writable, health.lost_records), (false, 4), "{health:?}");
        let error = health.last_error.unwrap();
        assert_eq!(error.matches("not writable").count(), 1, "{error}");
        assert!(error.contains(&not_a_dir.display().to_string()), "{error}");
        archive.close();
    }
}
