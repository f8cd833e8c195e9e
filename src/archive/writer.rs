//! The background writer: one thread that owns the read-write connection, takes records from a channel
//! and commits them in groups: what arrives within `flush_interval` of a group's first record, or
//! what is already queued when someone waits for the commit (strict durability, a flush, shutdown).
//!
//! Fail-open: when the store cannot be opened or a commit fails (disk full, read-only, I/O error), the
//! batch is rolled back, its records are counted as lost and logged loudly, and the writer carries on
//! (retrying the open every few seconds). Earlier commits are never touched. A PostgreSQL archive
//! that cannot be reached (the server is down, the connection dropped) is waited for instead: the
//! batch is kept, in order, and written when a reconnect (with backoff) succeeds; the records keep
//! their room in the queue meanwhile, so what waits stays within `archive.max_queue_bytes` and
//! what does not fit is counted lost (`super::Archive`).
//!
//! Many writers, one chain: several pare processes (replicas) may append to one session. The
//! cursor a writer caches for a session (request count, chain length, head hash, last message
//! lists) is checked against the session's row inside every write transaction, and reloaded when
//! another writer moved it. The row is locked for the transaction (SQLite's write lock is taken at
//! `BEGIN IMMEDIATE`; PostgreSQL's `SELECT … FOR UPDATE`, the row inserted first when missing), so
//! two writers of one session serialize, and a transaction that loses a race (a serialization
//! failure, a deadlock, a unique conflict) is retried.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lru::LruCache;

use super::body::{self, Item, Part, Piece, StoredMessages};
use super::chain::{self, ExchangeFields, ResponseFields};
use super::content::ContentIndex;
use super::db::{Db, Dialect, params, storable, storable_json};
use super::read::{self, BodyKind};
use super::retention;
use super::{Ack, ArchiveError, ExchangeRecord, Job, Location, ResponseRecord, Shared, Ticket, WriteRefused, store};
use crate::budget::compactor::SessionPlan;
use crate::exchange::Usage;
use crate::memory::{Holder, StateBudget};
use crate::wire::{Spans, Wire};

/// Most records in one transaction.
const MAX_BATCH: usize = 4096;
/// Blob hashes → ids kept in memory (skips a lookup for messages seen recently).
const BLOB_ID_CACHE: usize = 65_536;
/// (session, blob) links known stored (skips re-linking the blobs a session's requests repeat).
const LINKED_CACHE: usize = 65_536;
/// Exchanges waiting for their response.
const PENDING_TICKETS: usize = 65_536;
/// Time between attempts to open a store that failed to open (SQLite; PostgreSQL starts there and
/// doubles it up to [`REOPEN_AT_MOST`] while the database stays away).
const REOPEN_EVERY: Duration = Duration::from_secs(2);
const REOPEN_AT_MOST: Duration = Duration::from_secs(30);
/// Attempts of one transaction that loses a race with another writer.
const CONFLICT_ATTEMPTS: usize = 5;
/// The writer gives way to the other threads after each record it writes while fewer records than
/// this wait behind the group: a group commit is then not one burst of milliseconds that holds a core
/// while requests wait for it. When records pile up (a burst, saturation), it writes at full speed:
/// a writer that always gives way falls behind under load and its queue fills (BENCHMARKS.md,
/// *Memory, real sessions and the binary*).
const GIVE_WAY_BELOW_QUEUED: u64 = 8;
/// New messages a record's bodies hold from which the writer stores their blobs ahead of the
/// record, in transactions of their own ([`Writer::store_ahead`]): one transaction over a body of
/// 240,000 tiny messages lasts seconds, and every session queued behind it would wait that long.
const STORE_AHEAD_FROM: usize = 2_000;
/// Blobs per transaction when they are stored ahead of their record; between two, the writer
/// commits what other sessions queued meanwhile.
const STORE_AHEAD_SLICE: usize = 500;
/// The fewest bytes a message takes in a body (`{"role":"x"}` and a separator).
const MIN_MESSAGE_BYTES: usize = 13;

/// The last message list of one kind written for a session: what the next body is a delta against.
/// It holds ids and digests, never the body: ≈ 30 bytes per message, whatever the messages weigh,
/// in four allocations (a cursor lives long: one small allocation per message would scatter
/// survivors over the allocator's pages).
#[derive(Clone)]
struct ListState {
    exchange: i64,
    /// Each message's blob id.
    blobs: Vec<i64>,
    /// The separators before the messages, end to end: message `i`'s ends at `sep_ends[i]`.
    seps: Vec<u8>,
    sep_ends: Vec<u32>,
    /// Each message's [`Writer::digest`] (empty after a reload): a message whose digest equals the
    /// one at the same index reuses that blob id without SHA-256 and without a lookup. A collision
    /// would store the wrong blob; `pare sessions verify` would then report the body's SHA-256.
    digests: Vec<u128>,
    /// Where the body's last message ends (0 without messages).
    end: usize,
    /// The body's SHA-256 state at `end`, and the [`Writer::digest`] of the bytes before `end`: the
    /// next body that starts with the same bytes (compared by that digest) hashes only the rest.
    /// `None` after a reload.
    sha_mid: Option<(body::Midstate, u128)>,
    since_keyframe: u64,
}

impl ListState {
    fn new(items: &[Item], digests: Vec<u128>, end: usize, since_keyframe: u64) -> ListState {
        let mut seps = Vec::with_capacity(items.iter().map(|item| item.sep.len()).sum());
        let mut sep_ends = Vec::with_capacity(items.len());
        for item in items {
            seps.extend_from_slice(&item.sep);
            sep_ends.push(u32::try_from(seps.len()).unwrap_or(u32::MAX));
        }
        let blobs = items.iter().map(|item| item.blob).collect();
        ListState { exchange: 0, blobs, seps, sep_ends, digests, end, sha_mid: None, since_keyframe }
    }

    fn sep(&self, idx: usize) -> Option<&[u8]> {
        let start = if idx == 0 { 0 } else { *self.sep_ends.get(idx - 1)? as usize };
        self.seps.get(start..*self.sep_ends.get(idx)? as usize)
    }

    /// Whether message `idx` has this separator and blob.
    fn holds(&self, idx: usize, item: &Item) -> bool {
        self.blobs.get(idx) == Some(&item.blob) && self.sep(idx) == Some(&item.sep[..])
    }

    fn bytes(&self) -> usize {
        let mid = self.sha_mid.as_ref().map_or(0, |_| std::mem::size_of::<(body::Midstate, u128)>());
        self.blobs.capacity() * 8
            + self.seps.capacity()
            + self.sep_ends.capacity() * 4
            + self.digests.capacity() * 16
            + mid
    }
}

/// A session's cursor as the memory budget holds it: taken while a write uses it.
type CursorPart = std::sync::Mutex<Option<Cursor>>;

#[derive(Clone)]
struct Cursor {
    n_requests: i64,
    n_records: i64,
    head: [u8; 32],
    raw: Option<ListState>,
    fwd: Option<ListState>,
}

impl Cursor {
    /// Bytes the cursor keeps alive: its blob ids, separators and digests.
    fn bytes(&self) -> u64 {
        let lists = self.raw.as_ref().map_or(0, ListState::bytes) + self.fwd.as_ref().map_or(0, ListState::bytes);
        (std::mem::size_of::<Cursor>() + lists) as u64
    }
}

#[derive(Clone)]
struct Pending {
    exchange: i64,
    session: String,
    seq: i64,
    /// The request's format, which says how to read the answer's usage.
    wire: Option<Wire>,
}

/// A session's row as the write transaction locked it.
struct SessionRow {
    n_requests: i64,
    n_records: i64,
    head: [u8; 32],
}

/// What became of one exchange of a batch.
enum Written {
    Seq(i64),
    Stale { expected: i64, archived: i64 },
}

pub(crate) struct Writer {
    location: Location,
    shared: Arc<Shared>,
    flush_interval: Duration,
    max_bytes: Option<u64>,
    conn: Option<Db>,
    last_open_attempt: Option<Instant>,
    /// Time to wait before the next open attempt.
    reopen_after: Duration,
    /// A batch kept for a database that cannot be reached, written first when it can.
    held: Vec<Job>,
    /// Exchanges not written because their `expect_requests` did not hold: their answers and
    /// plans are dropped too.
    stale: LruCache<Ticket, ()>,
    /// Answers of such exchanges dropped in the current transaction (neither committed nor lost).
    n_stale_answers: u64,
    /// Why the last open failed: what a write before the next attempt reports.
    open_error: Option<String>,
    blob_ids: LruCache<[u8; 32], i64>,
    /// (xxh3 of the session id, blob id) pairs whose `session_blobs` row is stored: each request
    /// repeats most of its session's blobs, and linking them again is a statement each (a round
    /// trip on PostgreSQL).
    linked: LruCache<(u64, i64), ()>,
    pending: LruCache<Ticket, Pending>,
    /// Seed of [`Writer::digest`], drawn per process.
    digest_seed: u64,
    /// The archive's prune generation as the last transaction read it ([`retention`]): when it
    /// moves, sessions were pruned and the blob caches may name freed blobs.
    prune_generation: Option<i64>,
    /// Which contents named by markers are stored ([`super::content`]).
    /// (`None` only while [`ContentIndex::index`] runs.)
    contents: Option<ContentIndex>,
    /// Blobs stored ahead of the batch being written ([`Writer::store_ahead`]): their session, and
    /// each message's [`Writer::digest`] → blob id (stored and linked to that session).
    ahead: Vec<(String, std::collections::HashMap<u128, i64>)>,
    /// Jobs taken off the queue while blobs were stored ahead, that could not be written before
    /// the batch (its sessions' records, or behind one of them): the next batch starts with them.
    deferred: Vec<Job>,
}

impl Writer {
    pub(crate) fn new(
        location: Location,
        shared: Arc<Shared>,
        flush_interval: Duration,
        max_bytes: Option<u64>,
    ) -> Writer {
        Writer {
            location,
            shared,
            flush_interval,
            max_bytes,
            conn: None,
            last_open_attempt: None,
            reopen_after: REOPEN_EVERY,
            held: Vec::new(),
            stale: LruCache::new(NonZeroUsize::new(PENDING_TICKETS).expect("non-zero")),
            n_stale_answers: 0,
            open_error: None,
            blob_ids: LruCache::new(NonZeroUsize::new(BLOB_ID_CACHE).expect("non-zero")),
            linked: LruCache::new(NonZeroUsize::new(LINKED_CACHE).expect("non-zero")),
            pending: LruCache::new(NonZeroUsize::new(PENDING_TICKETS).expect("non-zero")),
            digest_seed: std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), 0u8),
            prune_generation: None,
            contents: Some(ContentIndex::new()),
            ahead: Vec::new(),
            deferred: Vec::new(),
        }
    }

    /// The digest a cursor keeps of one message (or of a body's first bytes): xxh3-128 with a
    /// per-process seed, a fast check that bytes are unchanged (SHA-256 names blobs and bodies).
    fn digest(&self, message: &[u8]) -> u128 {
        xxhash_rust::xxh3::xxh3_128_with_seed(message, self.digest_seed)
    }

    /// SHA-256 of `bytes`, going on from the session's previous body of the same kind where `bytes`
    /// starts with the bytes its midstate covers ([`body::sha256_resume`]); `state` (the list `bytes`
    /// was split into) keeps the new midstate.
    fn body_sha256(
        &self,
        bytes: &Bytes,
        state: Option<ListState>,
        prev: Option<&ListState>,
    ) -> ([u8; 32], Option<ListState>) {
        let Some(mut state) = state else { return (store::sha256(bytes), None) };
        let earlier = prev.and_then(|p| p.sha_mid.as_ref()).filter(|(mid, prefix)| {
            mid.at() <= state.end && bytes.get(..mid.at()).is_some_and(|b| self.digest(b) == *prefix)
        });
        let (sha, mid) = body::sha256_resume(bytes, state.end, earlier.map(|(mid, _)| mid));
        state.sha_mid = Some((mid, self.digest(&bytes[..state.end])));
        (sha, Some(state))
    }

    fn ensure_open(&mut self) -> Result<(), String> {
        if self.conn.is_some() {
            return Ok(());
        }
        if self.last_open_attempt.is_some_and(|t| t.elapsed() < self.reopen_after) {
            return Err(self.open_error.clone().unwrap_or_else(|| "the store is not open".into()));
        }
        let retry = self.last_open_attempt.is_some();
        self.last_open_attempt = Some(Instant::now());
        match store::open_location_rw(&self.location).and_then(|db| {
            // `archive.max_bytes` bounds the SQLite file; a PostgreSQL database is bounded by its server.
            if let (Some(max), Some(conn)) = (self.max_bytes, db.as_sqlite()) {
                let page_size: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
                let pages = (max / page_size.max(512) as u64).max(1);
                conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))?;
            }
            Ok(db)
        }) {
            Ok(db) => {
                self.conn = Some(db);
                self.open_error = None;
                self.reopen_after = REOPEN_EVERY;
                if retry && matches!(self.location, Location::Postgres(_)) {
                    tracing::warn!(archive = %self.location, "the archive database is reachable again");
                }
                Ok(())
            }
            Err(e) => {
                if matches!(self.location, Location::Postgres(_)) && retry {
                    self.reopen_after = (self.reopen_after * 2).min(REOPEN_AT_MOST);
                }
                self.open_error = Some(e.to_string());
                Err(e.to_string())
            }
        }
    }

    /// Whether a batch that failed with `e` waits for the database rather than being lost: a
    /// PostgreSQL archive that cannot be reached or whose connection dropped.
    fn waits_for(&self, e: &ArchiveError) -> bool {
        matches!(self.location, Location::Postgres(_))
            && match e {
                ArchiveError::NotWritable(_) | ArchiveError::Open { .. } => self.conn.is_none(),
                ArchiveError::Database(d) => d.is_connection_lost(),
                _ => false,
            }
    }

    /// Open the store, say on `opened` that the first attempt is over (the store and its schema exist,
    /// or the failure is counted and the open retried), then write jobs until the shutdown.
    pub(crate) fn run(mut self, rx: Receiver<Job>, opened: SyncSender<()>) {
        if let Err(e) = self.ensure_open() {
            self.shared.fail(0, e);
        }
        let _ = opened.send(());
        loop {
            // Jobs deferred while blobs were stored ahead start the next batch, before what is queued.
            let mut arrived = std::mem::take(&mut self.deferred);
            // A held batch is retried when the reopen delay has passed, whether or not records arrive.
            if arrived.is_empty() && self.held.is_empty() {
                match rx.recv() {
                    Ok(job) => arrived.push(job),
                    Err(_) => break,
                }
            } else if arrived.is_empty() {
                let wait =
                    self.reopen_after.saturating_sub(self.last_open_attempt.map_or(Duration::ZERO, |t| t.elapsed()));
                match rx.recv_timeout(wait.max(Duration::from_millis(10))) {
                    Ok(job) => arrived.push(job),
                    Err(RecvTimeoutError::Timeout) => {
                        let held = std::mem::take(&mut self.held);
                        self.commit(held, false, None);
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            // Gather a group: records keep arriving for up to `flush_interval` after the first, so
            // that a steady trickle of requests shares one commit (each commit writes its pages to the
            // WAL again) instead of paying one per record. Whoever waits for the commit — a strict
            // request, a flush, the shutdown — ends the gathering: only what is already queued joins.
            // The writer sleeps through the gathering rather than waiting on the queue, so that
            // handing it a record costs the request no wake-up; a job someone waits for wakes it
            // ([`super::Archive`] unparks it).
            let deadline = Instant::now() + self.flush_interval;
            let mut urgent = arrived.iter().any(Job::is_awaited) || !self.held.is_empty();
            let mut batch = std::mem::take(&mut self.held);
            batch.append(&mut arrived);
            loop {
                while batch.len() < MAX_BATCH && !matches!(batch.last(), Some(Job::Shutdown(_))) {
                    let Ok(job) = rx.try_recv() else { break };
                    urgent |= job.is_awaited();
                    batch.push(job);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if urgent
                    || left.is_zero()
                    || batch.len() >= MAX_BATCH
                    || matches!(batch.last(), Some(Job::Shutdown(_)))
                {
                    break;
                }
                std::thread::park_timeout(left);
            }
            let stop = matches!(batch.last(), Some(Job::Shutdown(_)));
            self.commit(batch, stop, Some(&rx));
            if stop {
                break;
            }
        }
        if !self.held.is_empty() {
            let held = std::mem::take(&mut self.held);
            self.commit(held, true, None);
        }
        if let Some(db) = self.conn.take()
            && let Some(conn) = db.as_sqlite()
        {
            let _ = conn.execute_batch("PRAGMA wal_checkpoint(PASSIVE)");
        }
    }

    /// Where the sessions' cursors are their parts: the memory budget shared with the proxy's
    /// sessions, or one of the writer's own (the default budget) when none was shared before it
    /// wrote.
    fn budget(&self) -> &Arc<StateBudget> {
        self.shared.budget.get_or_init(|| Arc::new(StateBudget::default()))
    }

    /// Keep `session`'s cursor as its part in the memory budget.
    fn keep(&mut self, session: String, cursor: Cursor) {
        let bytes = cursor.bytes();
        let part = self.budget().part(Holder::Archive, &session, CursorPart::default);
        *part.lock().unwrap_or_else(|p| p.into_inner()) = Some(cursor);
        self.budget().charge(Holder::Archive, &session, bytes);
    }

    /// Write a batch in one transaction. `last`: no retry follows (the shutdown), so a batch that
    /// cannot be written is lost rather than held. With the queue (`rx`), the blobs of a record
    /// with many new messages are stored ahead, and what other sessions queue meanwhile is
    /// committed before the batch ([`Writer::store_ahead`]).
    fn commit(&mut self, batch: Vec<Job>, last: bool, rx: Option<&Receiver<Job>>) {
        if last && self.conn.is_none() {
            // The last chance for records held for the database: try it now, whatever the backoff.
            self.last_open_attempt = None;
        }
        let mut records = Vec::with_capacity(batch.len());
        let mut waiters = Vec::new();
        let n_exchanges = batch.iter().filter(|job| matches!(job, Job::Exchange { .. })).count() as u64;
        for job in batch {
            self.shared.queue_depth.fetch_sub(1, Ordering::Relaxed);
            self.shared.queue_bytes.fetch_sub(job.size(), Ordering::Relaxed);
            match job {
                Job::Flush(done, _) | Job::Shutdown(done) => waiters.push(done),
                Job::Exchange { ticket, mut record, plan, ack, room } => {
                    record.settle_summary();
                    records.push(Job::Exchange { ticket, record, plan, ack, room });
                }
                other => records.push(other),
            }
        }
        if let Some(rx) = rx.filter(|_| !last) {
            self.store_ahead(&records, rx);
        }
        if !records.is_empty() {
            self.write_records(records, last);
            if rx.is_some() {
                self.ahead.clear();
            }
            // Done with, for `Archive::settled`: committed, refused, or held for a database that is
            // away (a retrieval then waits no longer for what cannot be read anyway).
            self.shared.exchanges_done.fetch_add(n_exchanges, Ordering::AcqRel);
            self.shared.batch_done.notify_waiters();
        }
        for done in waiters {
            let _ = done.send(());
        }
    }

    /// Store ahead the blobs of each record of `records` whose bodies hold at least
    /// [`STORE_AHEAD_FROM`] messages the session's cursor does not hold, [`STORE_AHEAD_SLICE`] per
    /// transaction; after each, commit what the queue holds that may go before `records`
    /// ([`Writer::write_queued`]). The record's own transaction then finds its blobs stored
    /// ([`Writer::ahead`]) and lasts milliseconds. Blobs are content-addressed and linked to their
    /// session, so what is stored ahead of a record that is then not written is stored once and
    /// pruned with its session. A slice that fails ends this: the record's own transaction
    /// stores the rest and reports the failure.
    fn store_ahead(&mut self, records: &[Job], rx: &Receiver<Job>) {
        let mut busy: std::collections::HashSet<String> = std::collections::HashSet::new();
        for job in records {
            match job {
                Job::Exchange { record, .. } => {
                    busy.insert(record.session.clone());
                }
                Job::Response { ticket, .. } | Job::Plan { ticket, .. } => {
                    if let Some(pending) = self.pending.peek(ticket) {
                        busy.insert(pending.session.clone());
                    }
                }
                Job::Flush(..) | Job::Shutdown(_) => {}
            }
        }
        for job in records {
            let Job::Exchange { record, .. } = job else { continue };
            let messages = self.new_messages(record);
            if messages.len() < STORE_AHEAD_FROM {
                continue;
            }
            let mut stored = std::collections::HashMap::with_capacity(messages.len());
            for slice in messages.chunks(STORE_AHEAD_SLICE) {
                if self.ensure_open().is_err() {
                    return;
                }
                let conn = self.conn.take().expect("opened above");
                let result = (|| -> Result<(), ArchiveError> {
                    if self.begin(&conn)? {
                        stored.clear();
                    }
                    for (digest, message) in slice {
                        if !stored.contains_key(digest) {
                            let id = self.blob_id(&conn, &record.session, message)?;
                            stored.insert(*digest, id);
                        }
                    }
                    Ok(conn.commit()?)
                })();
                let failed = result.is_err();
                if failed {
                    let _ = conn.rollback();
                    self.blob_ids.clear();
                    self.linked.clear();
                }
                self.conn = Some(conn);
                if failed {
                    return;
                }
                self.write_queued(rx, &mut busy);
            }
            self.ahead.push((record.session.clone(), stored));
        }
    }

    /// The messages of `record`'s bodies whose blobs its session's cursor does not hold, with
    /// their [`Writer::digest`]s, in order (large top-level values included); none when the bytes
    /// past the cursor's lists are too few to hold [`STORE_AHEAD_FROM`] messages (the common
    /// case: a request that appends a few messages is not split twice).
    fn new_messages<'r>(&self, record: &'r ExchangeRecord) -> Vec<(u128, &'r [u8])> {
        let part = self.budget().peek_part::<CursorPart>(Holder::Archive, &record.session);
        let cursor = part.as_ref().map(|part| part.lock().unwrap_or_else(|p| p.into_inner()));
        let cursor = cursor.as_ref().and_then(|c| c.as_ref());
        let forwarded = record.forwarded.as_ref().filter(|f| **f != record.raw);
        let bodies = [
            Some((&record.raw, record.raw_spans.as_ref(), cursor.and_then(|c| c.raw.as_ref()))),
            forwarded.map(|f| (f, record.forwarded_spans.as_ref(), cursor.and_then(|c| c.fwd.as_ref()))),
        ];
        let beyond: usize =
            bodies.iter().flatten().map(|(bytes, _, prev)| bytes.len().saturating_sub(prev.map_or(0, |p| p.end))).sum();
        if beyond < STORE_AHEAD_FROM * MIN_MESSAGE_BYTES {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (bytes, spans, prev) in bodies.into_iter().flatten() {
            for piece in body::split_along(bytes, spans) {
                match piece {
                    Piece::Lit(_) => {}
                    Piece::Blob(b) => out.push((self.digest(b), b)),
                    Piece::Messages(m) => {
                        for (idx, (sep, msg)) in m.items.iter().enumerate() {
                            let digest = self.digest(msg);
                            let held =
                                prev.is_some_and(|p| p.digests.get(idx) == Some(&digest) && p.sep(idx) == Some(*sep));
                            if !held {
                                out.push((digest, *msg));
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Commit the jobs queued that may go before the batch being written: exchanges of sessions
    /// not in it (`busy`), and the answers and plans of exchanges already stored or committed
    /// here. The others keep their order in [`Writer::deferred`], and their sessions join `busy`.
    fn write_queued(&mut self, rx: &Receiver<Job>, busy: &mut std::collections::HashSet<String>) {
        let mut now = Vec::new();
        let mut moved: std::collections::HashSet<Ticket> = std::collections::HashSet::new();
        while !matches!(self.deferred.last(), Some(Job::Shutdown(_))) {
            let Ok(job) = rx.try_recv() else { break };
            let goes = match &job {
                Job::Exchange { ticket, record, .. } => {
                    let goes = !busy.contains(&record.session);
                    if goes {
                        moved.insert(*ticket);
                    } else {
                        busy.insert(record.session.clone());
                    }
                    goes
                }
                Job::Response { ticket, .. } | Job::Plan { ticket, .. } => {
                    moved.contains(ticket) || self.pending.peek(ticket).is_some_and(|p| !busy.contains(&p.session))
                }
                // A flush of one session goes first when nothing of that session waits.
                Job::Flush(_, Some(session)) => !busy.contains(session),
                Job::Flush(..) | Job::Shutdown(_) => false,
            };
            if goes { now.push(job) } else { self.deferred.push(job) }
        }
        if !now.is_empty() {
            self.commit(now, false, None);
        }
    }

    /// Write `records` in one transaction. When that fails for a reason that may be one record's
    /// (a value the database refuses, a constraint: not a store that cannot be opened or written
    /// at all, [`store_wide`]), each record is written in a transaction of its own, so that one
    /// bad record never costs the others; a record that still fails is counted as refused (and
    /// lost). A database that cannot be reached holds the records for its return.
    fn write_records(&mut self, mut records: Vec<Job>, last: bool) {
        // A plan rides with its exchange: it is not a record of the chain, counted or lost.
        let count = |jobs: &[Job]| jobs.iter().filter(|job| !matches!(job, Job::Plan { .. })).count() as u64;
        let error = match self.write_batch(&mut records) {
            Ok(written) => {
                self.settle_written(&mut records, &written);
                self.shared.finished.fetch_add(count(&records), Ordering::Relaxed);
                return;
            }
            Err(e) if !last && self.waits_for(&e) => return self.hold(records, &e),
            Err(e) => e,
        };
        if records.len() == 1 || store_wide(&error) {
            self.refuse(&mut records, &error);
            self.shared.finished.fetch_add(count(&records), Ordering::Relaxed);
            return;
        }
        tracing::warn!(archive = %self.location, error = %error, records = records.len(),
            "an archive transaction failed; writing its records one at a time");
        let mut rest = records.into_iter();
        while let Some(job) = rest.next() {
            let mut one = vec![job];
            match self.write_batch(&mut one) {
                Ok(written) => self.settle_written(&mut one, &written),
                Err(e) if !last && self.waits_for(&e) => {
                    one.extend(rest);
                    return self.hold(one, &e);
                }
                Err(e) => self.refuse(&mut one, &e),
            }
            self.shared.finished.fetch_add(count(&one), Ordering::Relaxed);
        }
    }

    /// Count a committed transaction and tell its waiting exchanges.
    fn settle_written(&mut self, records: &mut [Job], written: &[(Ticket, Written)]) {
        let n = records.iter().filter(|job| !matches!(job, Job::Plan { .. })).count() as u64;
        let n_stale =
            written.iter().filter(|(_, w)| matches!(w, Written::Stale { .. })).count() as u64 + self.n_stale_answers;
        self.shared.committed.fetch_add(n - n_stale, Ordering::Relaxed);
        self.shared.commits.fetch_add(1, Ordering::Relaxed);
        if !self.shared.writable.swap(true, Ordering::Relaxed) {
            tracing::warn!(archive = %self.location, "archive is writable again");
        }
        ack_written(records, written);
    }

    /// Keep `records`, in order, with their room in the queue, for when the database is back.
    fn hold(&mut self, records: Vec<Job>, e: &ArchiveError) {
        let n = records.iter().filter(|job| !matches!(job, Job::Plan { .. })).count();
        self.shared.not_writable(format!("{e}; {n} record(s) wait for the database"));
        for job in &records {
            self.shared.queue_depth.fetch_add(1, Ordering::Relaxed);
            self.shared.queue_bytes.fetch_add(job.size(), Ordering::Relaxed);
        }
        // Records written ahead of a batch (`Writer::write_queued`) may be held already: these follow.
        self.held.extend(records);
    }

    /// Count `records` as lost for `e` and tell their waiters; as refused too when the store
    /// refused them, not the store's state ([`store_wide`]).
    fn refuse(&mut self, records: &mut [Job], e: &ArchiveError) {
        let n = records.iter().filter(|job| !matches!(job, Job::Plan { .. })).count() as u64;
        let message = e.to_string();
        if store_wide(e) {
            self.shared.fail(n, message.clone());
        } else {
            self.shared.refuse(n, message.clone());
        }
        ack_all(records, Err(WriteRefused::Failed(message)));
    }

    /// Write `records` in one transaction, retried when it loses a race with another writer.
    /// Gives what became of each exchange.
    fn write_batch(&mut self, records: &mut [Job]) -> Result<Vec<(Ticket, Written)>, ArchiveError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.ensure_open().map_err(ArchiveError::NotWritable)?;
            let conn = self.conn.take().expect("opened above");
            let mut answered = Vec::new();
            let result = self.write_in_transaction(&conn, records, &mut answered);
            match result {
                Ok(written) => {
                    self.conn = Some(conn);
                    for ticket in answered {
                        self.pending.pop(&ticket);
                    }
                    return Ok(written);
                }
                Err(e) => {
                    let _ = conn.rollback();
                    // The in-memory cursors may describe rows that were rolled back: start afresh
                    // from the store.
                    self.budget().release_all(Holder::Archive);
                    self.blob_ids.clear();
                    self.linked.clear();
                    if let Some(contents) = &mut self.contents {
                        contents.clear();
                    }
                    for job in records.iter() {
                        if let Job::Exchange { ticket, .. } = job {
                            self.pending.pop(ticket);
                            self.stale.pop(ticket);
                        }
                    }
                    let lost = matches!(&e, ArchiveError::Database(d) if d.is_connection_lost());
                    if !lost {
                        self.conn = Some(conn);
                    }
                    let conflict = matches!(&e, ArchiveError::Database(d) if d.is_conflict());
                    if conflict && attempt < CONFLICT_ATTEMPTS {
                        tracing::debug!(archive = %self.location, error = %e, attempt, "archive transaction lost a race; retrying");
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }

    fn write_in_transaction(
        &mut self,
        conn: &Db,
        records: &[Job],
        answered: &mut Vec<Ticket>,
    ) -> Result<Vec<(Ticket, Written)>, ArchiveError> {
        self.begin(conn)?;
        self.n_stale_answers = 0;
        let mut written = Vec::new();
        for job in records {
            match job {
                Job::Exchange { ticket, record, plan, ack, .. } => {
                    // The check serves a request still waiting to compact again; one forwarded
                    // without its commit (its wait timed out, or it never waited) is a fact to keep.
                    let checked = ack.as_ref().is_some_and(|ack| !ack.is_closed());
                    let outcome = self.put_exchange(conn, *ticket, record, checked)?;
                    if let (Written::Seq(_), Some(plan)) = (&outcome, plan) {
                        self.put_plan(conn, *ticket, plan)?;
                    }
                    written.push((*ticket, outcome));
                }
                Job::Response { ticket, record, .. } => {
                    if self.put_response(conn, *ticket, record)? {
                        answered.push(*ticket);
                    }
                }
                Job::Plan { ticket, plan } => self.put_plan(conn, *ticket, plan)?,
                Job::Flush(..) | Job::Shutdown(_) => {}
            }
            if self.shared.queue_depth.load(Ordering::Relaxed) < GIVE_WAY_BELOW_QUEUED {
                std::thread::yield_now();
            }
        }
        conn.commit()?;
        Ok(written)
    }

    /// Begin a write transaction; when sessions were pruned since the last one, forget the blobs
    /// the caches name (they may be freed) and say so.
    fn begin(&mut self, conn: &Db) -> Result<bool, ArchiveError> {
        let generation = retention::begin_reading_generation(conn)?;
        let pruned = self.prune_generation.replace(generation).is_some_and(|seen| seen != generation);
        if pruned {
            self.blob_ids.clear();
            self.linked.clear();
            self.ahead.clear();
            if let Some(contents) = &mut self.contents {
                contents.clear();
            }
        }
        Ok(pruned)
    }

    /// The session's row, locked for the rest of the transaction (PostgreSQL: `FOR UPDATE`; SQLite
    /// holds its write lock since `BEGIN IMMEDIATE`).
    fn session_row(&self, conn: &Db, session: &str) -> Result<Option<SessionRow>, ArchiveError> {
        let sql = match conn.dialect() {
            Dialect::Sqlite => "SELECT n_requests, n_records, head_hash FROM sessions WHERE id = ?1",
            Dialect::Postgres => "SELECT n_requests, n_records, head_hash FROM sessions WHERE id = ?1 FOR UPDATE",
        };
        let Some(row) = conn.query_opt(sql, params![session])? else { return Ok(None) };
        let head: Vec<u8> = row.get(2)?;
        Ok(Some(SessionRow {
            n_requests: row.get(0)?,
            n_records: row.get(1)?,
            head: head.try_into().unwrap_or(chain::GENESIS),
        }))
    }

    /// The session's cursor: the cached one when it still describes `row`, else read from the store
    /// (another writer appended to the session, or the cursor was evicted).
    fn cursor(&mut self, conn: &Db, session: &str, row: &SessionRow) -> Result<Cursor, ArchiveError> {
        let cached = self.budget().peek_part::<CursorPart>(Holder::Archive, session);
        if let Some(c) = cached.and_then(|part| part.lock().unwrap_or_else(|p| p.into_inner()).take())
            && c.n_requests == row.n_requests
            && c.n_records == row.n_records
            && c.head == row.head
        {
            return Ok(c);
        }
        let (n_requests, n_records, head) = (row.n_requests, row.n_records, row.head);
        if n_records == 0 {
            return Ok(Cursor { n_requests, n_records, head, raw: None, fwd: None });
        }
        let last: Option<i64> = conn
            .query_opt("SELECT id FROM exchanges WHERE session = ?1 ORDER BY seq DESC LIMIT 1", params![session])?
            .map(|row| row.get(0))
            .transpose()?;
        let mut cursor = Cursor { n_requests, n_records, head, raw: None, fwd: None };
        if let Some(exchange) = last {
            let reload = |kind| -> Result<ListState, ArchiveError> {
                let items = read::resolve_items(conn, exchange, kind)?;
                // Unknown after a reload: the next list is written as a key frame.
                Ok(ListState { exchange, ..ListState::new(&items, Vec::new(), 0, body::KEYFRAME_EVERY) })
            };
            cursor.raw = Some(reload(BodyKind::Raw)?);
            cursor.fwd = Some(reload(BodyKind::Forwarded)?);
        }
        Ok(cursor)
    }

    fn blob_id(&mut self, conn: &Db, session: &str, content: &[u8]) -> Result<i64, ArchiveError> {
        let hash = store::sha256(content);
        let id = match self.blob_ids.get(&hash) {
            Some(id) => *id,
            None => {
                let id = store::put_blob_linked(conn, &hash, content, session)?;
                self.blob_ids.put(hash, id);
                self.linked.put((xxhash_rust::xxh3::xxh3_64(session.as_bytes()), id), ());
                return Ok(id);
            }
        };
        let link = (xxhash_rust::xxh3::xxh3_64(session.as_bytes()), id);
        if self.linked.get(&link).is_none() {
            conn.execute("INSERT OR IGNORE INTO session_blobs (session, blob) VALUES (?1, ?2)", params![session, id])?;
            self.linked.put(link, ());
        }
        Ok(id)
    }

    /// Store one body's blobs and build its template against `prev` (the session's previous list).
    fn encode_body(
        &mut self,
        conn: &Db,
        session: &str,
        bytes: &Bytes,
        spans: Option<&Spans>,
        prev: Option<&ListState>,
    ) -> Result<(Vec<u8>, Option<ListState>), ArchiveError> {
        let pieces = body::split_along(bytes, spans);
        let mut parts = Vec::with_capacity(pieces.len());
        let mut state = None;
        for piece in pieces {
            match piece {
                Piece::Lit(b) => parts.push(Part::Lit(b.to_vec())),
                Piece::Blob(b) => parts.push(Part::Blob(self.blob_id(conn, session, b)?)),
                Piece::Messages(m) => {
                    let mut items = Vec::with_capacity(m.items.len());
                    let mut digests = Vec::with_capacity(m.items.len());
                    for (idx, (sep, msg)) in m.items.iter().enumerate() {
                        let digest = self.digest(msg);
                        digests.push(digest);
                        let same_as_prev = prev.and_then(|p| {
                            (p.digests.get(idx) == Some(&digest) && p.sep(idx) == Some(*sep))
                                .then_some(*p.blobs.get(idx)?)
                        });
                        let stored_ahead = || {
                            let (_, ids) = self.ahead.iter().find(|(owner, _)| owner == session)?;
                            ids.get(&digest).copied()
                        };
                        let blob = match same_as_prev.or_else(stored_ahead) {
                            Some(id) => id,
                            None => self.blob_id(conn, session, msg)?,
                        };
                        items.push(Item { sep: sep.to_vec(), blob });
                    }
                    let keyframe = prev.is_none_or(|p| p.since_keyframe + 1 >= body::KEYFRAME_EVERY);
                    let (base, n_shared, since_keyframe) = match prev {
                        Some(p) if !keyframe => {
                            let n = items.iter().enumerate().take_while(|(idx, item)| p.holds(*idx, item)).count();
                            (p.exchange, n, p.since_keyframe + 1)
                        }
                        _ => (0, 0, 0),
                    };
                    parts.push(Part::Messages(StoredMessages {
                        base,
                        n_shared: n_shared as u64,
                        open: m.open.to_vec(),
                        new: items[n_shared..].to_vec(),
                        close: m.close.to_vec(),
                    }));
                    let end = m
                        .items
                        .last()
                        .map_or(0, |(_, msg)| msg.as_ptr() as usize - bytes.as_ptr() as usize + msg.len());
                    state = Some(ListState::new(&items, digests, end, since_keyframe));
                }
            }
        }
        Ok((body::encode(&parts), state))
    }

    /// Write one exchange; when `checked`, only if its session holds `rec.expect_requests`.
    fn put_exchange(
        &mut self,
        conn: &Db,
        ticket: Ticket,
        rec: &ExchangeRecord,
        checked: bool,
    ) -> Result<Written, ArchiveError> {
        let expect = rec.expect_requests.filter(|_| checked);
        let mut row = self.session_row(conn, &rec.session)?;
        if row.is_none() && expect.is_none_or(|n| n == 0) {
            // Inserted first so that it can be locked: another writer of a new session waits here.
            conn.execute(
                "INSERT OR IGNORE INTO sessions (id, started_ms, last_ms, n_requests, n_records, head_hash)
                 VALUES (?1, ?2, ?2, 0, 0, ?3)",
                params![&rec.session, rec.at_ms, &chain::GENESIS],
            )?;
            row = self.session_row(conn, &rec.session)?;
        }
        let archived = row.as_ref().map_or(0, |r| r.n_requests);
        if let Some(expected) = expect
            && expected != archived
        {
            self.stale.put(ticket, ());
            return Ok(Written::Stale { expected, archived });
        }
        let Some(row) = row else { return Err(ArchiveError::NoSession(rec.session.clone())) };
        let mut cursor = self.cursor(conn, &rec.session, &row)?;
        let (raw_template, raw_state) =
            self.encode_body(conn, &rec.session, &rec.raw, rec.raw_spans.as_ref(), cursor.raw.as_ref())?;
        let (raw_sha, raw_state) = self.body_sha256(&rec.raw, raw_state, cursor.raw.as_ref());
        let forwarded = rec.forwarded.as_ref().filter(|f| **f != rec.raw);
        let (fwd_sha, fwd_template, fwd_state) = match forwarded {
            Some(f) => {
                let (tpl, state) =
                    self.encode_body(conn, &rec.session, f, rec.forwarded_spans.as_ref(), cursor.fwd.as_ref())?;
                let (sha, state) = self.body_sha256(f, state, cursor.fwd.as_ref());
                (Some(sha), Some(tpl), state)
            }
            None => (None, None, raw_state.clone()),
        };
        let headers = headers_json(&rec.headers);
        let summary = rec.summary.as_ref().map(|s| storable_json(serde_json::to_string(s).unwrap_or_default()));
        // Text the database stores as the chain hashes it (the bodies keep the exact bytes).
        let (method, path) = (storable(&rec.method), storable(&rec.path));
        let model = rec.model.as_deref().map(storable);
        let skipped = rec.skipped.as_deref().map(storable);
        let seq = cursor.n_requests + 1;
        let fields = ExchangeFields {
            session: &rec.session,
            seq,
            chain_idx: cursor.n_records,
            at_ms: rec.at_ms,
            method: &method,
            path: &path,
            model: model.as_deref(),
            headers: &headers,
            raw_sha256: &raw_sha,
            raw_len: rec.raw.len() as i64,
            fwd_sha256: fwd_sha.as_ref().map(|h| &h[..]),
            fwd_len: forwarded.map(|f| f.len() as i64),
            summary: summary.as_deref(),
            skipped: skipped.as_deref(),
            key_req: rec.key_req.map(|k| k as i64),
        };
        let hash = chain::exchange_hash(&cursor.head, &fields);
        let exchange = conn.insert_id(
            "INSERT INTO exchanges (session, seq, chain_idx, at_ms, method, path, model, headers, raw_sha256, raw_len,
                raw_template, fwd_sha256, fwd_len, fwd_template, summary, skipped, key_req, prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
            params![
                fields.session,
                fields.seq,
                fields.chain_idx,
                fields.at_ms,
                fields.method,
                fields.path,
                fields.model,
                fields.headers,
                fields.raw_sha256,
                fields.raw_len,
                &raw_template,
                fields.fwd_sha256,
                fields.fwd_len,
                fwd_template.as_ref(),
                fields.summary,
                fields.skipped,
                fields.key_req,
                &cursor.head,
                &hash,
            ],
        )?;
        let (tokens_raw, tokens_fwd) = rec.summary.as_ref().map_or((0, 0), |s| (s.tokens_raw, s.tokens_forwarded));
        conn.execute(
            "INSERT INTO sessions (id, started_ms, last_ms, n_requests, n_records, head_hash, model, tokens_raw, tokens_forwarded)
             VALUES (?1, ?2, ?2, 1, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (id) DO UPDATE SET
                last_ms = CASE WHEN sessions.last_ms > ?2 THEN sessions.last_ms ELSE ?2 END,
                n_requests = sessions.n_requests + 1, n_records = ?3, head_hash = ?4,
                model = coalesce(?5, sessions.model), tokens_raw = sessions.tokens_raw + ?6,
                tokens_forwarded = sessions.tokens_forwarded + ?7",
            params![
                &rec.session,
                rec.at_ms,
                cursor.n_records + 1,
                &hash,
                fields.model,
                tokens_raw as i64,
                tokens_fwd as i64
            ],
        )?;
        // The contents its markers name, stored as blobs of the session.
        let mut contents = self.contents.take().unwrap_or_else(ContentIndex::new);
        let indexed = contents.index(conn, rec, |text| self.blob_id(conn, &rec.session, text));
        self.contents = Some(contents);
        indexed?;
        cursor.n_requests = seq;
        cursor.n_records += 1;
        cursor.head = hash;
        cursor.raw = raw_state.map(|s| ListState { exchange, ..s });
        cursor.fwd = fwd_state.map(|s| ListState { exchange, ..s });
        self.keep(rec.session.clone(), cursor);
        self.pending
            .put(ticket, Pending { exchange, session: rec.session.clone(), seq, wire: Wire::of_path(&rec.path) });
        Ok(Written::Seq(seq))
    }

    /// Store the compaction state the exchange of `ticket` left its session in; its prefix
    /// messages are the session's blobs.
    fn put_plan(&mut self, conn: &Db, ticket: Ticket, plan: &SessionPlan) -> Result<(), ArchiveError> {
        if self.stale.contains(&ticket) {
            return Ok(());
        }
        let Some(Pending { exchange, session, .. }) = self.pending.peek(&ticket) else {
            // Its exchange was lost (disk failure): the next restart resumes from an earlier state.
            tracing::warn!("archive: compaction plan without a stored request, not stored");
            return Ok(());
        };
        let (exchange, session) = (*exchange, session.clone());
        super::plan::put(conn, exchange, &session, plan, |message| self.blob_id(conn, &session, message))
    }

    /// Store the answer of the exchange of `ticket`; false when there is no stored exchange to
    /// attach it to.
    fn put_response(&mut self, conn: &Db, ticket: Ticket, rec: &ResponseRecord) -> Result<bool, ArchiveError> {
        if self.stale.pop(&ticket).is_some() {
            // Its exchange was not written (compare-and-set): neither is the answer.
            self.n_stale_answers += 1;
            return Ok(false);
        }
        let Some(pending) = self.pending.peek(&ticket).cloned() else {
            // Its exchange was lost (disk failure) or answered twice: nothing to attach it to.
            self.shared.lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("archive: response without a stored request, not stored");
            return Ok(false);
        };
        let row = self
            .session_row(conn, &pending.session)?
            .ok_or_else(|| ArchiveError::NoSession(pending.session.clone()))?;
        let mut cursor = self.cursor(conn, &pending.session, &row)?;
        let body_sha = store::sha256(&rec.body);
        let body_blob =
            if rec.body.is_empty() { None } else { Some(self.blob_id(conn, &pending.session, &rec.body)?) };
        let headers = headers_json(&rec.headers);
        let assembled = rec.assembled.as_ref().map(|v| storable_json(v.to_string()));
        let end_reason = storable(&end_reason(rec)).into_owned();
        let fields = ResponseFields {
            session: &pending.session,
            seq: pending.seq,
            chain_idx: cursor.n_records,
            at_ms: rec.at_ms,
            status: rec.status.map(i64::from),
            headers: &headers,
            stream: rec.stream,
            partial: rec.partial(),
            end_reason: &end_reason,
            body_sha256: &body_sha,
            body_len: rec.body.len() as i64,
            assembled: assembled.as_deref(),
            key_ext: rec.key_ext.map(|k| k as i64),
        };
        let hash = chain::response_hash(&cursor.head, &fields);
        conn.execute(
            "INSERT INTO responses (exchange, session, chain_idx, at_ms, status, headers, stream, partial, end_reason,
                body_blob, body_sha256, body_len, assembled, key_ext, prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
            params![
                pending.exchange,
                fields.session,
                fields.chain_idx,
                fields.at_ms,
                fields.status,
                fields.headers,
                fields.stream,
                fields.partial,
                fields.end_reason,
                body_blob,
                fields.body_sha256,
                fields.body_len,
                fields.assembled,
                fields.key_ext,
                &cursor.head,
                &hash,
            ],
        )?;
        conn.execute(
            "UPDATE sessions SET n_records = ?2, head_hash = ?3,
                last_ms = CASE WHEN last_ms > ?4 THEN last_ms ELSE ?4 END WHERE id = ?1",
            params![&pending.session, cursor.n_records + 1, &hash, rec.at_ms],
        )?;
        let usage = pending.wire.zip(rec.assembled.as_ref()).and_then(|(wire, answer)| Usage::of_answer(wire, answer));
        if let Some(usage) = usage {
            let figure = |n: Option<u64>| n.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
            conn.execute(
                "INSERT INTO response_usage (exchange, session, prompt, cached, cache_write, output)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    pending.exchange,
                    &pending.session,
                    figure(usage.prompt),
                    figure(usage.cached),
                    figure(usage.cache_write),
                    figure(usage.output)
                ],
            )?;
        }
        cursor.n_records += 1;
        cursor.head = hash;
        self.keep(pending.session, cursor);
        Ok(true)
    }
}

/// Whether `e` fails every record alike (the store cannot be opened, the disk is full or
/// read-only, the database is out of resources or gone), so that writing records one at a time
/// would only fail each again.
fn store_wide(e: &ArchiveError) -> bool {
    match e {
        ArchiveError::Database(db) => {
            db.is_connection_lost()
                || match db {
                    super::DbError::Sqlite(rusqlite::Error::SqliteFailure(f, _)) => matches!(
                        f.code,
                        rusqlite::ErrorCode::DiskFull
                            | rusqlite::ErrorCode::ReadOnly
                            | rusqlite::ErrorCode::SystemIoFailure
                            | rusqlite::ErrorCode::CannotOpen
                            | rusqlite::ErrorCode::DatabaseCorrupt
                            | rusqlite::ErrorCode::NotADatabase
                            | rusqlite::ErrorCode::DatabaseBusy
                            | rusqlite::ErrorCode::DatabaseLocked
                            | rusqlite::ErrorCode::OutOfMemory
                            | rusqlite::ErrorCode::PermissionDenied
                    ),
                    // Insufficient resources (53: disk full, out of memory, too many
                    // connections) and system errors (58).
                    super::DbError::Postgres(pg) => {
                        pg.code().is_some_and(|code| code.code().starts_with("53") || code.code().starts_with("58"))
                    }
                    _ => false,
                }
        }
        ArchiveError::NotWritable(_) | ArchiveError::Open { .. } | ArchiveError::Io { .. } | ArchiveError::Closed => {
            true
        }
        _ => false,
    }
}

/// Tell each waiting exchange what became of it.
fn ack_written(records: &mut [Job], written: &[(Ticket, Written)]) {
    for job in records {
        if let Job::Exchange { ticket, ack, .. } = job
            && let Some(ack) = ack.take()
        {
            let outcome = match written.iter().find(|(t, _)| t == ticket).map(|(_, w)| w) {
                Some(Written::Seq(seq)) => Ok(*seq),
                Some(Written::Stale { expected, archived }) => {
                    Err(WriteRefused::Stale { expected: *expected, archived: *archived })
                }
                None => Err(WriteRefused::Failed("the exchange was not written".into())),
            };
            let _ = ack.send(outcome);
        }
    }
}

fn ack_all(records: &mut [Job], result: Ack) {
    for job in records {
        if let Job::Exchange { ack, .. } = job
            && let Some(ack) = ack.take()
        {
            let _ = ack.send(result.clone());
        }
    }
}

/// Stored headers as a JSON object (a repeated header keeps its last value), storable on either
/// backend ([`storable_json`]).
fn headers_json(headers: &[(String, String)]) -> String {
    let map: serde_json::Map<String, serde_json::Value> =
        headers.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
    storable_json(serde_json::Value::Object(map).to_string())
}

fn end_reason(rec: &ResponseRecord) -> String {
    use crate::exchange::StreamEnd;
    let base = match &rec.end {
        StreamEnd::Complete => "complete".to_string(),
        StreamEnd::ClientGone => "client_gone".to_string(),
        StreamEnd::UpstreamError(e) => format!("upstream_error: {e}"),
        StreamEnd::NoResponse(e) => format!("no_response: {e}"),
    };
    match rec.truncated {
        Some(why) => format!("{base}; body truncated: {}", why.reason()),
        None => base,
    }
}
