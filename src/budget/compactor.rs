//! The stateful compactor the proxy calls: per-session epochs, stickiness and the three modes.
//!
//! A session remembers one *frozen prefix*: the raw messages `0..n` it covers (by hash) and their
//! forwarded form. While a request's raw messages still start with those `n` messages, pare forwards
//! `frozen prefix ++ raw[n..]`, so successive forwarded requests extend each other as a pure append
//! and the upstream's prompt cache stays warm.
//!
//! - **epoch** (default): when that forwarded request crosses the high-water mark (a share of the
//!   usable window, i.e. window − answer reserve), the engine compacts it in one step down to the
//!   low-water mark; the result becomes the new frozen prefix and the epoch number goes up. An epoch
//!   that cannot get under the high-water mark (what the engine never compacts fills the window)
//!   is followed by appends: an epoch over the usable window is kept only when it gains
//!   (`SessionCompactor::gains`: it fits the window, or frees what an ordinary epoch frees), never
//!   an epoch per request. Appending never crosses the model's window
//!   (`SessionCompactor::hard_limit`): such a request is compacted whatever the epoch frees, and
//!   when the protected tail alone does not fit, its older turns yield, oldest first. An epoch's
//!   depth follows the session's growth (`EpochPolicy::epoch_floor`).
//! - **eager**: the engine's rules run every `polling` turns even below the high-water mark (with a
//!   token target only above it, and the history budget `budget.eager_history` on every advance);
//!   between advances the frozen forms are reused.
//! - **off**: forwarded unchanged; tokens are still counted for the headers.
//!
//! The engine is fed the *forwarded* form (frozen prefix + new raw messages), not the raw request:
//! compacting compacted messages changes nothing, so the parts of the prefix an epoch does not need
//! to touch stay byte-identical and the upstream keeps reusing their cache.

use std::sync::{Arc, Mutex, OnceLock};

use super::window::{ModelTable, ModelTableError, answer_reserve};
use crate::compact::report::Report;
use crate::compact::{CompactOptions, Compacted, Engine, Fate, HistoryBudget, HistoryFloor, prefix_spans};
use crate::config::{Config, HistoryFloorConfig, HistoryShare, Mode};
use crate::exchange::{
    Action, BudgetReport, CompactInput, CompactOutput, CompactionSummary, ConversationCompactor, LateCount,
    PrefillEstimate, RawHead,
};
use crate::memory::{Holder, StateBudget};
use crate::neutral::{Message, Typed, View, message_hashes, role_of};
use crate::tokens::CountTokens;
use crate::tokens::{CounterConfig, Encoding, REPLY_PRIMING, TokenCounter};
use crate::wire::{Forward, Wire, WireBody, WrittenReads};

/// One engine run over a fixed view and options, given [`CompactOptions::keep_first`].
pub type HeadRun<'a> = dyn Fn(usize) -> Compacted + 'a;

/// What the state machine needs from the engine: the pure `compact` seam. Implemented by
/// [`Engine`]; tests substitute small engines with known behaviour.
pub trait CompactEngine: Send + Sync {
    fn compact(&self, view: &View<'_>, options: &CompactOptions, counter: &dyn CountTokens) -> Compacted;
    /// Runs of [`CompactEngine::compact`] over one view with one set of options but for
    /// [`CompactOptions::keep_first`]: `runs` is handed the run for each `keep_first` it asks for.
    /// [`Engine`] analyses the conversation and applies the rules once for all of them.
    fn compact_heads(
        &self,
        view: &View<'_>,
        options: &CompactOptions,
        counter: &dyn CountTokens,
        runs: &mut dyn FnMut(&HeadRun<'_>),
    ) {
        runs(&|keep_first| self.compact(view, &CompactOptions { keep_first, ..options.clone() }, counter));
    }
    /// How many turns the engine never compacts (the protected tail), for the warning that they
    /// alone exceed the window. 0 when unknown.
    fn protected_turns(&self) -> u32 {
        0
    }
}

impl CompactEngine for Engine {
    fn compact(&self, view: &View<'_>, options: &CompactOptions, counter: &dyn CountTokens) -> Compacted {
        Engine::compact(self, view, options, counter)
    }

    fn compact_heads(
        &self,
        view: &View<'_>,
        options: &CompactOptions,
        counter: &dyn CountTokens,
        runs: &mut dyn FnMut(&HeadRun<'_>),
    ) {
        let prepared = self.prepare(view, options, counter);
        runs(&|keep_first| prepared.compact(keep_first));
    }

    fn protected_turns(&self) -> u32 {
        self.policy.spec.protect_last_turns
    }
}

/// When compaction runs and how far it goes.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochPolicy {
    pub mode: Mode,
    /// Share of the usable window at which an epoch starts (eager: tiers and elision run).
    pub high_water: f64,
    /// Share of the usable window an epoch (eager: tiers and elision) compacts down to.
    pub low_water: f64,
    /// Eager mode: turns between two advances of the frozen frontier.
    pub polling: u32,
    /// Eager mode: the history's own budget, a share of the usable window, applied on every advance.
    pub history: Option<HistoryShare>,
    /// Epoch mode: the least history an epoch's target leaves, in tokens, and how far it may raise
    /// the low-water mark.
    pub history_floor: Option<HistoryFloorConfig>,
    /// Epoch mode: requests of the session's growth an epoch leaves room for below `high_water`
    /// (see [`EpochPolicy::epoch_floor`]); 0: the history floor alone.
    pub epoch_room: u32,
}

impl EpochPolicy {
    pub fn from_config(config: &Config) -> EpochPolicy {
        let b = &config.budget;
        let (high_water, low_water) = match config.compaction.mode {
            Mode::Eager => (b.eager_high_water, b.eager_low_water),
            Mode::Epoch | Mode::Observe | Mode::Off => (b.high_water, b.low_water),
        };
        let history = match config.compaction.mode {
            Mode::Eager => b.eager_history,
            Mode::Epoch | Mode::Observe | Mode::Off => None,
        };
        let history_floor = match config.compaction.mode {
            Mode::Epoch | Mode::Observe | Mode::Off => b.history_floor,
            Mode::Eager => None,
        };
        EpochPolicy {
            mode: config.compaction.mode,
            high_water,
            low_water,
            polling: b.polling.max(1),
            history,
            history_floor,
            epoch_room: b.epoch_room,
        }
    }

    /// The history floor in tokens for a usable window of `usable` tokens.
    pub fn history_floor(&self, usable: u64) -> Option<HistoryFloor> {
        let highest = |rise: f64| self.low_water + rise * (self.high_water - self.low_water);
        self.history_floor
            .map(|f| HistoryFloor { tokens: f.tokens, max_target: (highest(f.max_rise) * usable as f64) as u64 })
    }

    /// The history floor of an epoch in a session that grows by `growth` tokens per request
    /// ([`turn_growth`]): [`EpochPolicy::history_floor`], raising the target no higher than leaves
    /// `epoch_room` requests of that growth below the high-water mark (never below `low_water`),
    /// so that the epoch pays for itself over several appends instead of landing just under the
    /// next one.
    pub fn epoch_floor(&self, usable: u64, growth: u64) -> Option<HistoryFloor> {
        let floor = self.history_floor(usable)?;
        if self.epoch_room == 0 {
            return Some(floor);
        }
        let low = (self.low_water * usable as f64) as u64;
        let room = u64::from(self.epoch_room).saturating_mul(growth);
        let ceiling = ((self.high_water * usable as f64) as u64).saturating_sub(room).max(low);
        Some(HistoryFloor { max_target: floor.max_target.min(ceiling), ..floor })
    }

    /// The history budget in tokens for a usable window of `usable` tokens.
    pub fn history_budget(&self, usable: u64) -> Option<HistoryBudget> {
        self.history.map(|h| h.tokens(usable)).map(|(high, low)| HistoryBudget { high, low })
    }
}

/// The forwarded form of the first `raw_hashes.len()` raw messages of a session. Shared (`Arc`) by
/// the session's state and the request being forwarded, which borrows its messages.
#[derive(Debug, Clone)]
struct Frozen {
    raw_hashes: Box<[u128]>,
    prefix: Packed,
    /// With a wall clock: when pare first received each prefix message (an elided run: its youngest
    /// message), in clock milliseconds. Empty without one (or after a restart: taken as "now").
    prefix_seen: Box<[u64]>,
    /// Tokens of `prefix`'s messages in an encoding, counted on the first request that needs them.
    prefix_tokens: OnceLock<(Encoding, u64)>,
    /// The texts the engine derived that `prefix` names ([`crate::compact::Compacted::lists`]),
    /// handed to the archive with every request that forwards the prefix. Empty for a prefix
    /// restored after a restart: the archive stored them with the request that made it.
    lists: Arc<[String]>,
    /// What became of each raw message the prefix covers: the request's body is written from it.
    plan: Box<[Fate]>,
    /// The typed forms of the entries pare wrote, read once for as long as the prefix lives, the
    /// first time a turn adapter writes from one.
    reads: WrittenReads,
}

impl Frozen {
    fn new<M: AsRef<str>>(raw_hashes: &[u128], prefix: &[M], prefix_seen: Vec<u64>, plan: Vec<Fate>) -> Frozen {
        Frozen {
            raw_hashes: raw_hashes.into(),
            prefix: Packed::new(prefix),
            prefix_seen: prefix_seen.into_boxed_slice(),
            prefix_tokens: OnceLock::new(),
            lists: Arc::from([]),
            plan: plan.into_boxed_slice(),
            reads: WrittenReads::new(prefix.len()),
        }
    }

    /// Bytes allocated for this prefix.
    fn bytes(&self) -> usize {
        size_of::<Frozen>()
            + size_of_val(&*self.raw_hashes)
            + self.prefix.bytes()
            + size_of_val(&*self.prefix_seen)
            + self.lists.iter().map(String::len).sum::<usize>()
            + size_of_val(&*self.plan)
            + self.reads.bytes(|at| self.prefix.len_of(at))
    }

    /// Tokens of the prefix's messages as `counter` counts them.
    fn tokens(&self, counter: &TokenCounter) -> u64 {
        let count = || {
            let prefix: Vec<&str> = self.prefix.iter().collect();
            counter.message_counts(&prefix, &message_hashes(&prefix), &[]).iter().sum()
        };
        match self.prefix_tokens.get_or_init(|| (counter.encoding(), count())) {
            (encoding, n) if *encoding == counter.encoding() => *n,
            _ => count(),
        }
    }
}

/// A session's compaction state as data: what [`SessionCompactor::resume`] needs to go on forwarding
/// exactly what it would have forwarded had the process not stopped or the state not been evicted.
/// The archive stores one with the exchange after which it changed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionPlan {
    pub epoch: u64,
    /// Raw message count when the eager frontier last advanced.
    pub advanced_at_len: usize,
    /// The last epoch could not get under the high-water mark (see `SessionCompactor::gains`).
    pub saturated: bool,
    pub frozen: Option<FrozenPlan>,
    /// Mode `observe` projected this state: the upstream was sent the raw requests, not this
    /// prefix, so a pare that compacts does not resume from it (the pipeline's `seed_state`); mode
    /// `observe` does.
    pub observed: bool,
}

/// A frozen prefix as data: a request whose raw messages start with the messages hashed in
/// `raw_hashes` is forwarded as `prefix` followed by its raw messages after those.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FrozenPlan {
    /// [`message_hashes`] of the raw messages the prefix covers.
    pub raw_hashes: Vec<u128>,
    /// The forwarded neutral messages standing for them.
    pub prefix: Vec<String>,
    /// With a wall clock: when pare first received each prefix message (clock milliseconds); may
    /// be empty.
    pub prefix_seen: Vec<u64>,
    /// What became of each raw message the prefix covers (`None`: not known).
    pub plan: Option<Vec<Fate>>,
}

impl FrozenPlan {
    fn of(frozen: &Frozen) -> FrozenPlan {
        FrozenPlan {
            raw_hashes: frozen.raw_hashes.to_vec(),
            prefix: frozen.prefix.iter().map(str::to_owned).collect(),
            prefix_seen: frozen.prefix_seen.to_vec(),
            plan: Some(frozen.plan.to_vec()),
        }
    }
}

/// Messages laid end to end in one allocation. A frozen prefix lives as long as its session, among
/// the short-lived allocations of the requests in flight: one block per session instead of one per
/// message leaves the allocator's pages to the transient work, which it returns when the work is done
/// (BENCHMARKS.md, *Memory*), and what the budget is charged is what is allocated.
#[derive(Debug, Clone, PartialEq, Default)]
struct Packed {
    text: Box<str>,
    /// Where each message ends in `text`.
    ends: Box<[usize]>,
}

impl Packed {
    fn new<M: AsRef<str>>(messages: &[M]) -> Packed {
        let mut text = String::with_capacity(messages.iter().map(|m| m.as_ref().len()).sum());
        let ends = messages
            .iter()
            .map(|m| {
                text.push_str(m.as_ref());
                text.len()
            })
            .collect();
        Packed { text: text.into_boxed_str(), ends }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    /// The length of message `at`.
    fn len_of(&self, at: usize) -> usize {
        self.ends[at] - at.checked_sub(1).map_or(0, |before| self.ends[before])
    }

    fn iter(&self) -> impl Iterator<Item = &str> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(self.ends.iter()).map(|(start, &end)| &self.text[start..end])
    }

    /// Bytes allocated for the messages (the struct itself aside).
    fn bytes(&self) -> usize {
        self.text.len() + size_of_val(&*self.ends)
    }
}

/// Milliseconds on the wall clock. The proxy reads the system clock; tests substitute their own.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system clock, as a [`Clock`].
pub fn system_clock() -> Clock {
    Arc::new(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64))
}

/// What pare remembers about one session.
#[derive(Debug, Clone, Default)]
struct SessionState {
    epoch: u64,
    frozen: Option<Arc<Frozen>>,
    /// Raw message count when the eager frontier last advanced.
    advanced_at_len: usize,
    /// The last compaction could not get under the high-water mark (system + user + tail too large);
    /// until the frozen prefix is rebuilt, compact again only when the window itself is exceeded
    /// and the epoch gains ([`SessionCompactor::gains`]), instead of re-compacting (and breaking
    /// the cache) on every request.
    saturated: bool,
    /// The warning that an epoch could not bring this session under its usable window was logged.
    warned_over_window: bool,
    /// With a wall clock: each raw message of the last request (hash) and when pare first received
    /// it (clock milliseconds).
    seen: Vec<(u128, u64)>,
    /// Each raw message of the last request (hash) and its tokens: the next request's unchanged
    /// history takes its counts from here.
    counts: Vec<(u128, u64)>,
    /// How many raw messages the last request had, and [`hashes_digest`] of their hashes: while a
    /// request starts with those, the upstream holds all of them cached, in their forwarded form.
    last_raw: (usize, u128),
    /// The hash of the last request's tools (`None`: it had none, or the state was resumed):
    /// unchanged tools are a cached prefix ([`super::prefill`]).
    last_tools: Option<u128>,
    /// How many times `frozen` was replaced or dropped.
    frozen_changes: u64,
    /// What the last [`SessionPlan`] handed out (or resumed from) described; a step that leaves it
    /// as it is hands out none.
    planned: Option<PlanMark>,
    /// How many requests of the session the shared archive held when this state was last known to
    /// match it (`archive.durability: strict`): a replica whose count is behind the archive's holds a
    /// stale state. `None`: not known.
    archived: Option<u64>,
    /// The request (number in the session) the archive stored this state's plan with, 0 for a state
    /// with none stored (the session never changed it); `None` when not known (a state this process
    /// changed and has not yet seen committed). A catch-up reads the stored plan only when a newer
    /// one is stored.
    plan_seq: Option<u64>,
    /// The last catch-up found requests of the session this process had not served (another
    /// replica serves it too): its next request catches up before it is compacted.
    roams: bool,
}

/// What identifies a [`SessionPlan`]: its numbers and which frozen prefix it holds.
#[derive(Debug, Clone, PartialEq)]
struct PlanMark {
    epoch: u64,
    advanced_at_len: usize,
    saturated: bool,
    frozen_changes: u64,
}

impl SessionState {
    fn plan_mark(&self) -> PlanMark {
        PlanMark {
            epoch: self.epoch,
            advanced_at_len: self.advanced_at_len,
            saturated: self.saturated,
            frozen_changes: self.frozen_changes,
        }
    }

    fn plan(&self) -> SessionPlan {
        SessionPlan {
            epoch: self.epoch,
            advanced_at_len: self.advanced_at_len,
            saturated: self.saturated,
            frozen: self.frozen.as_deref().map(FrozenPlan::of),
            observed: false,
        }
    }
}

impl SessionState {
    /// How many leading raw messages of a request (`hashes`) the last request had: 0 unless it
    /// starts with all of them.
    fn cached_raw(&self, hashes: &[u128]) -> usize {
        let (n, digest) = self.last_raw;
        if n > 0 && hashes.len() >= n && hashes_digest(&hashes[..n]) == digest { n } else { 0 }
    }

    /// Bytes this state keeps (charged to the memory budget): what it allocates.
    fn bytes(&self) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.bytes());
        let per_message = (self.seen.capacity() + self.counts.capacity()) * size_of::<(u128, u64)>();
        (size_of::<SessionState>() + frozen + per_message) as u64
    }
}

/// What the archive holds of a session that a process catching up on it lacks
/// ([`SessionCompactor::catch_up`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CaughtUp {
    /// The session's archived requests.
    pub requests: u64,
    /// The latest stored plan and the request it was stored with (0 and the empty plan: none is
    /// stored); `None`: the state holds it already.
    pub plan: Option<(u64, SessionPlan)>,
    /// The raw head of the last request compacted ([`BudgetReport::raw_head`]); `None`: none was.
    pub head: Option<RawHead>,
}

/// The stateful [`ConversationCompactor`]: epochs, stickiness and modes over the pure [`Engine`].
pub struct SessionCompactor {
    engine: Arc<dyn CompactEngine>,
    table: ModelTable,
    policy: EpochPolicy,
    counters: Vec<Arc<TokenCounter>>,
    /// Where each session's state is its part; the memory budget evicts the least recently used.
    budget: Arc<StateBudget>,
    /// Set (by [`SessionCompactor::with_wall_clock`]) only when `salience.tau_seconds` asks for
    /// recency on the wall clock; `None`: ages in turns.
    clock: Option<Clock>,
    /// With [`SessionCompactor::recording_plans`]: each session's state as it changed, until
    /// [`SessionCompactor::take_plan`] takes it (the pipeline, right after the request's compaction).
    plans: Option<Mutex<std::collections::HashMap<String, SessionPlan>>>,
}

impl std::fmt::Debug for SessionCompactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionCompactor").field("policy", &self.policy).finish_non_exhaustive()
    }
}

/// One request, resolved against the configuration.
struct Request<'a> {
    /// The neutral messages of the request.
    raw: &'a [&'a str],
    /// [`message_hashes`] of `raw`.
    hashes: &'a [u128],
    /// Tokens of each raw message.
    counts: &'a [u64],
    /// Tokens of the tools and the reply priming.
    fixed: u64,
    tools: Option<&'a str>,
    window: u64,
    reserve: u64,
    /// The most tokens the upstream accepts: the whole window less the answer length the request
    /// itself asks for ([`SessionCompactor::hard_limit`]).
    hard: u64,
    /// The raw message the upstream reads in place of everything before it, when there is one
    /// ([`WireBody::epoch_boundary`]).
    epoch_boundary: Option<usize>,
    /// The raw messages typed by the body's adapter ([`WireBody::typed`]).
    typed: Typed<'a>,
}

impl Request<'_> {
    fn usable(&self) -> u64 {
        self.window.saturating_sub(self.reserve)
    }
}

/// The result of one step of the state machine: the forwarded messages are `frozen`'s prefix followed
/// by the raw messages after those it covers (all of them without a frozen prefix).
struct Step {
    frozen: Option<Arc<Frozen>>,
    /// Tokens of the forwarded request (messages + tools), counted once by the step.
    tokens: u64,
    action: Action,
    history_changed: bool,
    engine_report: Option<Report>,
    /// The protected tail did not fit the model's window: the last turns the epoch protected.
    protected_turns: Option<u32>,
}

impl SessionCompactor {
    /// A compactor for `config` (mode, water marks, `models:`, encodings) over `engine`. An encoding's
    /// tables are loaded by its first count (see `budget::bpe`).
    pub fn new(config: &Config, engine: Arc<dyn CompactEngine>) -> Result<SessionCompactor, ModelTableError> {
        let table = ModelTable::from_config(config)?;
        let counters: Vec<Arc<TokenCounter>> = table
            .encodings()
            .into_iter()
            .map(|encoding| {
                Arc::new(TokenCounter::new(&CounterConfig {
                    encoding,
                    media: crate::tokens::MediaTokens {
                        image: config.budget.image_tokens,
                        audio: config.budget.audio_tokens,
                        document: config.budget.document_tokens,
                    },
                    cache_entries: config.budget.token_cache_entries,
                }))
            })
            .collect();
        let budget = Arc::new(StateBudget::new(config.memory.max_state_bytes));
        for counter in &counters {
            budget.reserve(counter.cache_bytes());
        }
        Ok(SessionCompactor {
            engine,
            table,
            policy: EpochPolicy::from_config(config),
            counters,
            budget,
            clock: None,
            plans: None,
        })
    }

    /// Charge sessions to `budget` (shared with the tracker and the archive); the token caches
    /// reserve their capacity there.
    pub fn with_budget(mut self, budget: Arc<StateBudget>) -> SessionCompactor {
        for counter in &self.counters {
            budget.reserve(counter.cache_bytes());
        }
        self.budget = budget;
        self
    }

    /// Keep each session's state as a [`SessionPlan`] whenever a request changes it, for
    /// [`SessionCompactor::take_plan`]: the proxy stores it in the archive, from which
    /// [`SessionCompactor::resume`] rebuilds the session after a restart or an eviction.
    pub fn recording_plans(mut self) -> SessionCompactor {
        self.plans = Some(Mutex::new(std::collections::HashMap::new()));
        self
    }

    /// The session's state as its last request left it, when that request changed it since the
    /// last plan taken; `None` otherwise (and without [`SessionCompactor::recording_plans`]).
    pub fn take_plan(&self, session: &str) -> Option<SessionPlan> {
        self.plans.as_ref()?.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(session)
    }

    /// Rebuild a session's state from a [`SessionPlan`] and the raw messages of its last request
    /// (their [`message_hashes`]: while the next request starts with them, the upstream holds them
    /// cached). The requests that follow are forwarded as they would have been had the state
    /// stayed in memory.
    pub fn resume(&self, session: &str, plan: SessionPlan, last_raw: &[u128]) {
        // A prefix without what became of each message it covers (stored by a pare that did not
        // keep it) cannot be written: the session's next epoch compacts afresh.
        let frozen = plan.frozen.and_then(|f| {
            let fates = f.plan.filter(|fates| fates.len() == f.raw_hashes.len())?;
            Some(Arc::new(Frozen::new(&f.raw_hashes, &f.prefix, f.prefix_seen, fates)))
        });
        let mut state = SessionState {
            epoch: plan.epoch,
            frozen,
            advanced_at_len: plan.advanced_at_len,
            saturated: plan.saturated,
            last_raw: (last_raw.len(), hashes_digest(last_raw)),
            ..SessionState::default()
        };
        state.planned = Some(state.plan_mark());
        let bytes = state.bytes();
        self.budget.put_part(Holder::Compactor, session, Mutex::new(state), bytes);
    }

    /// Whether this session's state is in memory (not new, not evicted).
    pub fn remembers(&self, session: &str) -> bool {
        self.budget.holds(Holder::Compactor, session)
    }

    /// How many requests of `session` the archive held when its state in memory was last known to
    /// match it; `None` when the session is not in memory or that is not known.
    pub fn archived(&self, session: &str) -> Option<u64> {
        let state = self.budget.peek_part::<Mutex<SessionState>>(Holder::Compactor, session)?;
        state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).archived
    }

    /// Say that the state of `session` in memory matches the archive holding `requests` of its
    /// requests (a session not in memory starts from the empty state, which is what a session
    /// whose archived requests never changed it is in); `plan_stored`: the last of them was
    /// stored with the state's plan ([`SessionCompactor::take_plan`]).
    pub fn set_archived(&self, session: &str, requests: u64, plan_stored: bool) {
        let state = self.session(session);
        let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.archived = Some(requests);
        if plan_stored {
            state.plan_seq = Some(requests);
        }
    }

    /// Whether the last catch-up of `session` found requests this process had not served (another
    /// process serves the session too); false when its state is not in memory.
    pub fn roams(&self, session: &str) -> bool {
        let Some(state) = self.budget.peek_part::<Mutex<SessionState>>(Holder::Compactor, session) else {
            return false;
        };
        state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).roams
    }

    /// The request number the stored plan the state of `session` holds was stored with (0: none
    /// stored), when known (`SessionState::plan_seq`).
    pub fn plan_seq(&self, session: &str) -> Option<u64> {
        let state = self.budget.peek_part::<Mutex<SessionState>>(Holder::Compactor, session)?;
        state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).plan_seq
    }

    /// Bring `session`'s state up to what the archive holds (`caught`), as the process that served
    /// its last requests holds it: the latest stored plan (unless [`SessionCompactor::plan_seq`]
    /// already is its request), and the raw head of the last request compacted. The counts and
    /// arrival times the state keeps of the messages it saw stay (the next request counts only the
    /// messages it lacks), so the request is compacted once, from the state it would have met on
    /// that process.
    pub fn catch_up(&self, session: &str, caught: CaughtUp) {
        let state = self.session(session);
        let mut guard = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let state = &mut *guard;
        if let Some((seq, plan)) = caught.plan {
            let frozen = plan.frozen.and_then(|f| {
                let fates = f.plan.filter(|fates| fates.len() == f.raw_hashes.len())?;
                Some(Arc::new(Frozen::new(&f.raw_hashes, &f.prefix, f.prefix_seen, fates)))
            });
            state.epoch = plan.epoch;
            state.frozen = frozen;
            state.frozen_changes += 1;
            state.advanced_at_len = plan.advanced_at_len;
            state.saturated = plan.saturated;
            state.plan_seq = Some(seq);
        }
        state.planned = Some(state.plan_mark());
        state.last_raw = caught.head.map_or((0, 0), |head| (head.messages as usize, head.digest));
        // A state that did not know the archive's count (not in memory) may lack any of them.
        state.roams = caught.requests > 0 && state.archived != Some(caught.requests);
        state.archived = Some(caught.requests);
        let bytes = state.bytes();
        drop(guard);
        self.budget.charge(Holder::Compactor, session, bytes);
    }

    /// Score recency on `clock` when the config sets `budget.salience.tau_seconds` (the proxy does
    /// this; replay and eval have no arrival times and stay with turns). Without `tau_seconds`, a
    /// no-op.
    pub fn with_wall_clock(mut self, config: &Config, clock: Clock) -> SessionCompactor {
        if config.budget.salience.tau_seconds.is_some() {
            self.clock = Some(clock);
        }
        self
    }

    pub fn policy(&self) -> &EpochPolicy {
        &self.policy
    }

    /// The token counter used for `model` (its encoding from `models:`, else `budget.encoding`).
    pub fn counter(&self, model: Option<&str>) -> &TokenCounter {
        self.counter_for(self.table.settings(model).encoding)
    }

    fn counter_for(&self, encoding: Encoding) -> &Arc<TokenCounter> {
        self.counters.iter().find(|c| c.encoding() == encoding).unwrap_or(&self.counters[0])
    }

    /// The window and answer reserve pare applies to `body` (`window` overrides config and default).
    pub fn window_and_reserve(&self, body: &dyn WireBody, window: Option<u64>) -> (u64, u64) {
        let settings = self.table.settings(body.model().as_deref());
        let window = window.or(settings.context_window).unwrap_or(self.table.default_window_for(body.wire()));
        (window, answer_reserve(body.output_limit(), settings.output_reserve, window))
    }

    /// The most tokens a request to a model with a `window`-token window may have: the whole window
    /// less the answer length the request asks for (`max_tokens` and its kin, capped at half the
    /// window as the answer reserve is), since an upstream refuses a prompt that leaves less than
    /// that; the whole window when it asks for none. No epoch forwards more, when what pare never
    /// compacts and the last turn fit it (the older protected turns yield first).
    pub fn hard_limit(body: &dyn WireBody, window: u64) -> u64 {
        window - answer_reserve(body.output_limit(), 0, window)
    }

    /// Sessions currently remembered.
    pub fn n_sessions(&self) -> usize {
        self.budget.count(Holder::Compactor)
    }

    /// Forget a session's state (its next request starts fresh).
    pub fn forget(&self, session: &str) {
        self.budget.release(Holder::Compactor, session);
    }

    /// `id`'s state, made empty when it has none.
    fn session(&self, id: &str) -> Arc<Mutex<SessionState>> {
        self.budget.part(Holder::Compactor, id, || Mutex::new(SessionState::default()))
    }

    /// What forwarding one request unchanged reports: its tokens counted (with `defer_counts`, left to
    /// the output's `late`), nothing compacted. Mode `off` forwards every request so; mode `observe`
    /// forwards so too, while [`SessionCompactor::compact_messages`] computes what `epoch` would
    /// have forwarded.
    pub fn count_unchanged(
        &self,
        body: &dyn WireBody,
        messages: &[&str],
        hashes: &[u128],
        window: Option<u64>,
        defer_counts: bool,
    ) -> CompactOutput {
        let (window, reserve) = self.window_and_reserve(body, window);
        let counter = self.counter_for(self.table.settings(body.model().as_deref()).encoding);
        let fixed = body.tools().map_or(0, |t| counter.tools(t)) + REPLY_PRIMING;
        let usable = window.saturating_sub(reserve);
        let tokens_estimated = body.wire() == Wire::Messages;
        let report = BudgetReport { mode: self.policy.mode, window, reserve, tokens_estimated, ..Default::default() };
        let known = counter.known_counts(hashes, &[]);
        let (counts, late) = counts_or_bounds(counter, messages, hashes, known, defer_counts, |_| true);
        let tokens_raw = counts.iter().sum::<u64>() + fixed;
        let summary = CompactionSummary {
            tokens_raw,
            tokens_forwarded: tokens_raw,
            epoch: 0,
            epoch_started: false,
            over_window: tokens_raw > usable,
            report: Some(report),
            ..Default::default()
        };
        let late = late.map(|known| LateCounts::new(counter, messages, hashes, &known, &counts, 0, usable).boxed());
        CompactOutput { body: None, spans: None, summary, late, lists: Arc::from([]) }
    }

    /// Compact one request of a session; the pure part of [`ConversationCompactor::compact`].
    pub fn compact_body(&self, session: &str, body: &dyn WireBody, window: Option<u64>) -> CompactOutput {
        let messages = body.messages();
        self.compact_messages(session, body, &messages, &message_hashes(&messages), window, false)
    }

    /// [`SessionCompactor::compact_body`] with the body's neutral messages already read and hashed
    /// (`hashes` is [`message_hashes`] of `messages`). With `defer_counts`, a request that surely
    /// appends (see `LateCounts`) is decided on upper bounds of its new messages' tokens, and the
    /// output's `late` counts them.
    pub fn compact_messages(
        &self,
        session: &str,
        body: &dyn WireBody,
        messages: &[&str],
        hashes: &[u128],
        window: Option<u64>,
        defer_counts: bool,
    ) -> CompactOutput {
        let (window, reserve) = self.window_and_reserve(body, window);
        let hard = Self::hard_limit(body, window);
        let tools = body.tools();
        let typed = |i: usize| body.typed(i);
        let typed: Typed<'_> = &typed;
        let epoch_boundary = body.epoch_boundary();
        let counter = self.counter_for(self.table.settings(body.model().as_deref()).encoding);
        let fixed = tools.map_or(0, |t| counter.tools(t)) + REPLY_PRIMING;
        let usable = window.saturating_sub(reserve);
        // Anthropic's tokenizer is not public: a Messages request's counts are the configured encoding's.
        let tokens_estimated = body.wire() == Wire::Messages;
        let base_report =
            BudgetReport { mode: self.policy.mode, window, reserve, tokens_estimated, ..Default::default() };

        if self.policy.mode == Mode::Off {
            return self.count_unchanged(body, messages, hashes, Some(window), defer_counts);
        }

        let state = self.session(session);
        let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // The session's last request counted the unchanged history already.
        let known = counter.known_counts(hashes, &state.counts);
        // The request with its messages' tokens: upper bounds while deciding whether it surely
        // appends, then the exact counts.
        let request =
            Request { raw: messages, hashes, counts: &[], fixed, tools, window, reserve, hard, epoch_boundary, typed };
        let (counts, late) = counts_or_bounds(counter, messages, hashes, known, defer_counts, |bounds| {
            self.surely_appends(&state, &Request { counts: bounds, ..request }, counter)
        });
        let tokens_raw = counts.iter().sum::<u64>() + fixed;
        let request = Request { counts: &counts, ..request };
        let epoch_before = state.epoch;
        let frozen_before = state.frozen.clone();
        let step = self.step(session, &mut state, &request, counter);
        let tools_hash = tools.map(|t| xxhash_rust::xxh3::xxh3_128(t.as_bytes()));
        let cached = CachedBefore::of(&state, frozen_before, tools_hash, hashes);
        let (prefill, uncached_from) = cached.estimate(&request, &step, counter, tokens_raw);
        state.last_tools = tools_hash;
        // What the next request takes as counted: the exact counts, up to the first one still late.
        let exact = late.as_ref().map_or(counts.len(), |known| known.iter().take_while(|c| c.is_some()).count());
        state.counts = hashes.iter().copied().zip(counts.iter().copied()).take(exact).collect();
        state.last_raw = (hashes.len(), hashes_digest(hashes));
        if let Some(plans) = &self.plans {
            let mark = state.plan_mark();
            if state.planned.as_ref() != Some(&mark) {
                state.planned = Some(mark);
                state.plan_seq = None;
                let plan = SessionPlan { observed: self.policy.mode == Mode::Observe, ..state.plan() };
                plans.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(session.to_owned(), plan);
            }
        }
        self.budget.charge(Holder::Compactor, session, state.bytes());
        let tokens_forwarded = step.tokens;
        let frozen_raw = step.frozen.as_ref().map_or(0, |f| f.raw_hashes.len());
        let unchanged = step.frozen.as_ref().is_none_or(|f| {
            f.prefix.len() == f.raw_hashes.len() && f.prefix.iter().zip(request.raw).all(|(f, r)| f == *r)
        });
        let report = BudgetReport {
            action: Some(step.action),
            history_changed: step.history_changed,
            engine: step.engine_report,
            protected_turns: step.protected_turns,
            raw_head: Some(RawHead { messages: hashes.len() as u64, digest: state.last_raw.1 }),
            ..base_report
        };
        let summary = CompactionSummary {
            tokens_raw,
            tokens_forwarded,
            epoch: state.epoch,
            epoch_started: state.epoch > epoch_before,
            over_window: tokens_forwarded > usable,
            report: Some(report),
            prefill: Some(prefill),
            observed: None,
        };
        drop(state);
        let late = late.map(|known| {
            LateCounts::new(counter, messages, hashes, &known, &counts, frozen_raw, usable)
                .with_prefill(uncached_from, hard)
        });
        let (body, spans) = if unchanged {
            (None, None)
        } else {
            let written = match &step.frozen {
                Some(f) => body.write(&Forward::of_plan(&f.plan, f.prefix.iter(), &f.reads, request.raw.len())),
                None => body.write(&Forward::unchanged(request.raw.len())),
            };
            match written {
                Ok((bytes, spans)) => (Some(bytes), Some(spans)),
                Err(err) => {
                    // Fail-open: the forwarded conversation has no valid form in this wire format.
                    let mut summary = summary;
                    summary.tokens_forwarded = summary.tokens_raw;
                    summary.over_window = tokens_raw > usable;
                    // Forwarded as sent: its prefill is the raw request's.
                    if let Some(prefill) = &mut summary.prefill {
                        prefill.forwarded = prefill.raw;
                    }
                    if let Some(report) = &mut summary.report {
                        report.write_failed = Some(err.to_string());
                    }
                    let late = late.map(|late| {
                        let uncached_from = late.uncached_from.map(|(raw, _)| (raw, raw));
                        LateCounts { tail_from: 0, uncached_from, ..late }.boxed()
                    });
                    return CompactOutput { body: None, spans: None, summary, late, lists: Arc::from([]) };
                }
            }
        };
        let lists = step.frozen.as_ref().map_or_else(|| Arc::from([]), |f| Arc::clone(&f.lists));
        CompactOutput { body, spans, summary, late: late.map(LateCounts::boxed), lists }
    }

    /// Whether `request`, its new messages' tokens given as upper bounds, appends to the session
    /// whatever their exact counts: no history change, no epoch, no eager advance — the one step
    /// whose forwarded bytes do not depend on the counts.
    fn surely_appends(&self, state: &SessionState, request: &Request<'_>, counter: &TokenCounter) -> bool {
        let frozen = state.frozen.as_ref();
        if frozen.is_some_and(|f| !request.hashes.starts_with(&f.raw_hashes)) {
            return false;
        }
        let (_, over) = self.over_trigger(state, frozen, request, counter);
        !over && !self.advances_eagerly(state, request)
    }

    /// The candidate's tokens (the frozen prefix, then the raw messages after it) and whether they
    /// pass the trigger: the high-water mark, or the usable window once saturated.
    fn over_trigger(
        &self,
        state: &SessionState,
        frozen: Option<&Arc<Frozen>>,
        request: &Request<'_>,
        counter: &TokenCounter,
    ) -> (u64, bool) {
        let frozen_raw = frozen.map_or(0, |f| f.raw_hashes.len());
        let candidate_tokens =
            frozen.map_or(0, |f| f.tokens(counter)) + request.counts[frozen_raw..].iter().sum::<u64>() + request.fixed;
        let usable = request.usable() as f64;
        let trigger = if state.saturated { usable } else { self.policy.high_water * usable };
        (candidate_tokens, candidate_tokens as f64 > trigger)
    }

    /// Whether an epoch that follows one that could not reach the high-water mark gains enough to
    /// be worth the upstream's cache: its result fits the usable window, or it is smaller than the
    /// request it would replace by at least what an ordinary epoch frees, `(high_water −
    /// low_water) × usable`. Otherwise the session appends: a session whose system prompt, user
    /// messages and protected tail alone fill the window then compacts as often, per token
    /// appended, as one that fits, instead of on every request (each such epoch rewrites the
    /// history after the task, and the upstream re-reads all of it).
    fn gains(&self, candidate_tokens: u64, forwarded_tokens: u64, usable: f64) -> bool {
        let span = (self.policy.high_water - self.policy.low_water).max(0.0) * usable;
        forwarded_tokens as f64 <= usable || candidate_tokens.saturating_sub(forwarded_tokens) as f64 >= span
    }

    /// Eager mode advances its frontier on a fresh session and every `polling` new turns.
    fn advances_eagerly(&self, state: &SessionState, request: &Request<'_>) -> bool {
        self.policy.mode == Mode::Eager
            && (state.frozen.is_none() && state.advanced_at_len == 0
                || new_turns(&request.raw[state.advanced_at_len.min(request.raw.len())..])
                    >= self.policy.polling as usize)
    }

    /// One transition of a session's state machine; the step says what is forwarded.
    fn step(&self, session: &str, state: &mut SessionState, request: &Request<'_>, counter: &TokenCounter) -> Step {
        let hashes = request.hashes;
        let history_changed = state.frozen.as_ref().is_some_and(|f| !hashes.starts_with(&f.raw_hashes));
        if history_changed {
            // The agent edited or dropped earlier messages: the frozen prefix no longer describes
            // this conversation. Start fresh (the epoch number keeps counting).
            state.frozen = None;
            state.frozen_changes += 1;
            state.saturated = false;
            state.advanced_at_len = 0;
        }
        // With a wall clock: when each raw message and each candidate message first arrived.
        let times = self.clock.as_ref().map(|clock| arrival_times(state, hashes, clock()));
        // The candidate is the frozen prefix followed by the raw messages after it; its tokens are the
        // prefix's (counted once per prefix) and the raw messages' (counted by the caller).
        let frozen = state.frozen.clone();
        let frozen_raw = frozen.as_ref().map_or(0, |f| f.raw_hashes.len());
        let (candidate_tokens, over) = self.over_trigger(state, frozen.as_ref(), request, counter);
        let usable = request.usable() as f64;
        let target = (self.policy.low_water * usable) as u64;
        let advance = over || self.advances_eagerly(state, request);
        if !advance {
            return Step {
                frozen,
                tokens: candidate_tokens,
                action: Action::Append,
                history_changed,
                engine_report: None,
                protected_turns: None,
            };
        }

        let candidate = match &frozen {
            Some(f) => forwarded(f.prefix.iter(), &request.raw[frozen_raw..]),
            None => request.raw.to_vec(),
        };
        let n_frozen = frozen.as_ref().map_or(0, |f| f.prefix.len());
        // The candidate typed: a frozen entry pare wrote as the engine gave it, one kept as sent as
        // the request's adapter types that raw message, the raw messages after the prefix likewise.
        let kept_raw = frozen.as_ref().map_or_else(Vec::new, |f| {
            let mut kept = vec![None; n_frozen];
            for (raw, fate) in f.plan.iter().enumerate() {
                if let Fate::Kept { at } = *fate {
                    kept[at] = Some(raw);
                }
            }
            kept
        });
        let candidate_typed = |c: usize| match &frozen {
            Some(f) if c < n_frozen => match f.reads.typed(c) {
                Some(message) => Some((Some(message.clone()), None)),
                None => kept_raw[c].and_then(|raw| (request.typed)(raw)),
            },
            _ => (request.typed)(frozen_raw + c - n_frozen),
        };
        let candidate_typed: Typed<'_> = &candidate_typed;
        let candidate_ages = times.as_ref().map(|t| t.ages(&t.candidate));
        // The boundary in the candidate: a raw message the frozen prefix covers is the entry its
        // fate names (kept as sent, like everything before it).
        let candidate_boundary = request.epoch_boundary.and_then(|raw| match &frozen {
            Some(f) if raw < frozen_raw => f.plan.get(raw).and_then(Fate::at),
            _ => Some(raw - frozen_raw + n_frozen),
        });
        // How deep the epoch goes: to the low-water mark, the history floor raising it no higher
        // than leaves room for the session's next requests (`EpochPolicy::epoch_floor`).
        let floor = self.policy.epoch_floor(usable as u64, turn_growth(request.raw, request.counts));
        let cached = n_frozen + state.cached_raw(hashes).saturating_sub(frozen_raw);
        // An epoch whose unavoidable part (system, user messages, the protected tail) leaves the
        // history less than its target keeps its markers' file and name lists while the request
        // stays within the usable window: they are most of what it keeps of old outputs.
        let lists_limit = (self.policy.mode != Mode::Eager).then_some(usable as u64);
        // The epoch with the engine's protected tail, or with `protect` last turns protected.
        let epoch_at = |protect: Option<u32>| -> Epoch {
            let depth = Depth { target, floor, protect, lists_limit };
            let attempt = match self.policy.mode {
                Mode::Epoch | Mode::Observe | Mode::Off => {
                    let head = Head { frozen: n_frozen, cached, epoch_boundary: candidate_boundary };
                    let ages = candidate_ages.clone();
                    self.lightest_fitting(request, (&candidate, candidate_typed), head, &depth, ages, counter)
                }
                Mode::Eager => {
                    let options = CompactOptions {
                        target_tokens: over.then_some(target),
                        history: self.policy.history_budget(usable as u64),
                        message_ages_secs: candidate_ages.clone(),
                        epoch_boundary: candidate_boundary,
                        protect_last_turns: protect,
                        ..Default::default()
                    };
                    self.attempt(request, (&candidate, candidate_typed), &options, counter)
                }
            };
            let (raw_boundary, prefix, typed, report, prefix_seen, mut lists, plan) = match attempt {
                Some(a) if a.boundary >= n_frozen => {
                    let seen = times.as_ref().map(|t| t.of_prefix(&a.plan, &t.candidate, a.prefix.len()));
                    let plan = raw_plan(frozen.as_deref(), &a.plan);
                    (frozen_raw + (a.boundary - n_frozen), a.prefix, a.typed, a.report, seen, a.lists, plan)
                }
                // The engine's boundary fell inside the frozen prefix: no raw index corresponds to it.
                // Compact the raw request instead (a fresh start for this session's prefix).
                _ => {
                    let options = CompactOptions {
                        target_tokens: over.then_some(target),
                        history: self.policy.history_budget(usable as u64),
                        history_floor: floor,
                        message_ages_secs: times.as_ref().map(|t| t.ages(&t.raw)),
                        epoch_boundary: request.epoch_boundary,
                        protect_last_turns: protect,
                        lists_limit,
                        ..Default::default()
                    };
                    let view = View { messages: request.raw, tools: request.tools, typed: Some(request.typed) };
                    let out = self.engine.compact(&view, &options, counter);
                    let seen = times.as_ref().map(|t| t.of_prefix(&out.plan, &t.raw, out.prefix.len()));
                    let mut plan = out.plan;
                    plan.truncate(request.raw.len());
                    (out.boundary.min(request.raw.len()), out.prefix, out.typed, out.report, seen, out.lists, plan)
                }
            };
            // The lists an earlier epoch derived go on while the prefix names them; a lightest cut
            // keeps only part of the engine's prefix: the lists its markers no longer name are left out.
            for earlier in frozen.iter().flat_map(|f| f.lists.iter()) {
                if !lists.contains(earlier) {
                    lists.push(earlier.clone());
                }
            }
            lists.retain(|list| {
                let id = crate::compact::markers::content_id(list);
                prefix.iter().any(|m| m.contains(id.as_str()))
            });
            let changed = forwarded(prefix.iter().map(String::as_str), &request.raw[raw_boundary..]) != candidate;
            let frozen = Arc::new(Frozen {
                lists: lists.into(),
                reads: WrittenReads::of(typed),
                ..Frozen::new(&hashes[..raw_boundary], &prefix, prefix_seen.unwrap_or_default(), plan)
            });
            let tokens = frozen.tokens(counter) + request.counts[raw_boundary..].iter().sum::<u64>() + request.fixed;
            Epoch { frozen, tokens, changed, report }
        };
        let mut epoch = epoch_at(None);
        if epoch.changed
            && over
            && state.saturated
            && candidate_tokens <= request.hard
            && !self.gains(candidate_tokens, epoch.tokens, usable)
        {
            // Not worth the cache (see `gains`), and appending stays within the model's window.
            return Step {
                frozen,
                tokens: candidate_tokens,
                action: Action::Append,
                history_changed,
                engine_report: None,
                protected_turns: None,
            };
        }
        // Over the model's window with the whole protected tail: its older turns yield, oldest
        // first, until the request is as deep as this session's epochs may leave it (the highest
        // target its history floor allows, room left for its next requests), else down to the last
        // turn alone. Yielding only as far as the window would put the next request over it again.
        let protected = self.engine.protected_turns();
        let mut yielded = None;
        if epoch.tokens > request.hard && protected > 1 {
            let ceiling = floor.map_or(target, |f| f.max_target.max(target));
            for protect in (1..protected).rev() {
                epoch = epoch_at(Some(protect));
                yielded = Some(protect);
                if epoch.tokens <= ceiling {
                    break;
                }
            }
        }
        let Epoch { frozen, tokens: forwarded_tokens, changed, report: engine_report } = epoch;
        if changed {
            state.epoch += 1;
        }
        state.frozen = Some(frozen.clone());
        state.frozen_changes += 1;
        state.advanced_at_len = request.raw.len();
        state.saturated = over && forwarded_tokens as f64 > self.policy.high_water * usable;
        let over_usable = state.saturated && forwarded_tokens as f64 > usable;
        if (yielded.is_some() || over_usable) && !state.warned_over_window {
            state.warned_over_window = true;
            tracing::warn!(
                session = %session,
                tokens = forwarded_tokens,
                usable = usable as u64,
                window = request.hard,
                protected_turns = protected,
                yielded_to = yielded,
                "the system prompt, the user messages and the protected tail \
                 (compaction.rules.protect_last_turns) do not fit the usable window: the session appends \
                 past it up to the model's window, and where a request would cross that, the tail's older \
                 turns yield, oldest first, the last turn forwarded whole; lower protect_last_turns or use \
                 a larger window"
            );
        }
        let action = match (self.policy.mode, over) {
            (Mode::Eager, false) => Action::Advance,
            _ => Action::Epoch,
        };
        Step {
            frozen: Some(frozen),
            tokens: forwarded_tokens,
            action,
            history_changed,
            engine_report: Some(engine_report),
            protected_turns: yielded,
        }
    }

    /// An epoch that compacts as little as it can. One engine run over the whole candidate, given
    /// the target: when the rules alone reach it, that run gives each message's compacted form, and
    /// pare keeps the compacted forms only for the shortest leading part that brings the request to
    /// `target`, forwarding the rest raw — so the recent tool outputs the model is likely to use next
    /// stay whole, and the next epoch finds this prefix already compacted (unchanged, cache kept).
    /// When the rules are not enough, the engine has already fitted the whole candidate (salience
    /// tiers, then elision); the epoch is a fit after the longest head of what the upstream holds
    /// cached that still reaches as far ([`SessionCompactor::fit_after_cached_head`]), else that
    /// whole fit.
    fn lightest_fitting(
        &self,
        request: &Request<'_>,
        (candidate, typed): (&[&str], Typed<'_>),
        head: Head,
        depth: &Depth,
        ages: Option<Vec<f64>>,
        counter: &TokenCounter,
    ) -> Option<Attempt> {
        let view = View { messages: candidate, tools: request.tools, typed: Some(typed) };
        let with_target = CompactOptions {
            target_tokens: Some(depth.target),
            history_floor: depth.floor,
            message_ages_secs: ages,
            epoch_boundary: head.epoch_boundary,
            protect_last_turns: depth.protect,
            lists_limit: depth.lists_limit,
            ..Default::default()
        };
        let mut attempt = None;
        self.engine.compact_heads(&view, &with_target, counter, &mut |run| {
            attempt = self.lightest_fitting_run(run, request, candidate, head, depth.target, counter);
        });
        attempt
    }

    /// [`SessionCompactor::lightest_fitting`] given the engine's `run` for each kept head.
    fn lightest_fitting_run(
        &self,
        run: &HeadRun<'_>,
        request: &Request<'_>,
        candidate: &[&str],
        head: Head,
        target: u64,
        counter: &TokenCounter,
    ) -> Option<Attempt> {
        let whole = run(0);
        // The target the engine applied (the history floor may have raised it).
        let applied = whole.report.tiers.as_ref().and_then(|t| t.target_tokens).unwrap_or(target);
        let boundary = whole.boundary.min(candidate.len());
        if whole.fitted {
            // Where the floor raised the target, the history is what the floor keeps for the next
            // step: it is not spent on keeping old turns for the cache.
            if applied <= target {
                let reached = forwarded_tokens(counter, &whole.prefix, &candidate[boundary..]) + request.fixed;
                let limit = applied.max(reached);
                if let Some(attempt) = self.fit_after_cached_head(run, request, candidate, head.cached, limit, counter)
                {
                    return Some(attempt);
                }
            }
            return Some(Attempt::of(whole, boundary));
        }
        let target = applied;
        let fixed = request.fixed;
        let prefix_tokens: Vec<u64> = whole.prefix.iter().map(|m| counter.message(m)).collect();
        let raw_tokens: Vec<u64> = candidate.iter().map(|m| counter.message(m)).collect();
        // Walk the cut points from the oldest: before an assistant or user message (no tool-call
        // group is split) and never inside the frozen prefix or an elided run. `n_out` counts the
        // compacted messages standing for raw messages before the cut.
        let n_frozen = head.frozen;
        let mut raw_after: u64 = raw_tokens[n_frozen..].iter().sum();
        let mut compacted_before: u64 = 0;
        let mut n_out = 0;
        let spans = prefix_spans(&whole.plan, whole.prefix.len());
        for cut in n_frozen..boundary {
            while n_out < spans.len() && spans[n_out].end <= cut {
                compacted_before += prefix_tokens[n_out];
                n_out += 1;
            }
            let splits_elision = n_out < spans.len() && spans[n_out].start < cut;
            let at_turn = cut > n_frozen && matches!(role_of(candidate[cut]).as_ref(), "assistant" | "user");
            if at_turn && !splits_elision && compacted_before + raw_after + fixed <= target {
                let prefix = whole.prefix[..n_out].to_vec();
                let typed = whole.typed[..n_out].to_vec();
                let mut messages: Vec<&str> = prefix.iter().map(String::as_str).collect();
                messages.extend_from_slice(&candidate[cut..]);
                if crate::compact::validate::check_messages(&messages).is_ok() {
                    let plan = whole.plan[..cut].to_vec();
                    return Some(Attempt {
                        boundary: cut,
                        prefix,
                        typed,
                        report: whole.report,
                        plan,
                        lists: whole.lists,
                    });
                }
            }
            raw_after -= raw_tokens[cut];
        }
        Some(Attempt::of(whole, boundary))
    }

    /// A fitted epoch that keeps the longest head of the candidate the upstream holds cached (the
    /// previous forwarded request's messages, `candidate[..n_cached]`) byte-identical and fits only
    /// what follows, when that still brings the request to `limit` (what the fit of the whole
    /// candidate reaches). `None` when no such head fits.
    ///
    /// A fit of the whole candidate gives the oldest turns the least room, so it rewrites the
    /// conversation from just after the task on, and the upstream re-reads everything after it.
    /// Each message of the head kept is one it does not re-read; the rest is fitted as tightly as
    /// needed. The cuts are turn starts (no tool-call group is split); keeping more of the head
    /// leaves less room for the rest, so the longest fitting cut is found by bisection.
    fn fit_after_cached_head(
        &self,
        run: &HeadRun<'_>,
        request: &Request<'_>,
        candidate: &[&str],
        n_cached: usize,
        limit: u64,
        counter: &TokenCounter,
    ) -> Option<Attempt> {
        let cuts: Vec<usize> = (1..=n_cached.min(candidate.len().saturating_sub(1)))
            .filter(|&cut| matches!(role_of(candidate[cut]).as_ref(), "assistant" | "user"))
            .collect();
        let fit_after = |keep_first: usize| -> Option<Attempt> {
            let out = run(keep_first);
            let boundary = out.boundary.min(candidate.len());
            if out.report.validation_failed.is_some() || boundary < keep_first {
                return None;
            }
            let tokens = forwarded_tokens(counter, &out.prefix, &candidate[boundary..]) + request.fixed;
            (tokens <= limit).then(|| Attempt::of(out, boundary))
        };
        let (mut lo, mut hi) = (0, cuts.len());
        let mut longest = None;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match fit_after(cuts[mid]) {
                Some(attempt) => {
                    longest = Some(attempt);
                    lo = mid + 1;
                }
                None => hi = mid,
            }
        }
        longest
    }

    /// The engine over the whole candidate.
    fn attempt(
        &self,
        request: &Request<'_>,
        (candidate, typed): (&[&str], Typed<'_>),
        options: &CompactOptions,
        counter: &TokenCounter,
    ) -> Option<Attempt> {
        let view = View { messages: candidate, tools: request.tools, typed: Some(typed) };
        let out = self.engine.compact(&view, options, counter);
        let boundary = out.boundary.min(candidate.len());
        Some(Attempt::of(out, boundary))
    }
}

/// What became of each raw message a new prefix covers, given what became of each message of the
/// epoch's candidate (the frozen prefix's entries, then the raw messages after those it covers): a
/// raw message behind a frozen entry follows that entry.
fn raw_plan(frozen: Option<&Frozen>, candidate: &[Fate]) -> Vec<Fate> {
    let (earlier, n_frozen): (&[Fate], usize) = match frozen {
        None => (&[], 0),
        Some(f) => (&f.plan, f.prefix.len()),
    };
    let mut plan = Vec::with_capacity(earlier.len() + candidate.len().saturating_sub(n_frozen));
    for fate in earlier {
        plan.push(match fate.at().and_then(|at| candidate.get(at)) {
            Some(next) => fate.then(*next),
            None => *fate,
        });
    }
    plan.extend_from_slice(candidate.get(n_frozen..).unwrap_or_default());
    plan
}

/// One hash standing for a list of message hashes.
fn hashes_digest(hashes: &[u128]) -> u128 {
    let mut digest = xxhash_rust::xxh3::Xxh3::new();
    for hash in hashes {
        digest.update(&hash.to_le_bytes());
    }
    digest.digest128()
}

/// Tokens of the messages `prefix ++ tail`.
fn forwarded_tokens(counter: &TokenCounter, prefix: &[String], tail: &[&str]) -> u64 {
    prefix.iter().map(|m| counter.message(m)).chain(tail.iter().map(|m| counter.message(m))).sum()
}

/// How much of an epoch's candidate the session's earlier requests fixed.
#[derive(Debug, Clone, Copy)]
struct Head {
    /// Leading messages that are the session's frozen prefix.
    frozen: usize,
    /// Leading messages the previous forwarded request had: the upstream holds them cached.
    cached: usize,
    /// The candidate message the upstream reads in place of everything before it, if any.
    epoch_boundary: Option<usize>,
}

/// How deep an epoch goes.
#[derive(Debug, Clone, Copy)]
struct Depth {
    /// The token target (`low_water` of the usable window).
    target: u64,
    /// The history floor ([`EpochPolicy::epoch_floor`]).
    floor: Option<HistoryFloor>,
    /// Last turns protected in place of the engine's `protect_last_turns` (`None`: the engine's).
    protect: Option<u32>,
    /// See [`CompactOptions::lists_limit`].
    lists_limit: Option<u64>,
}

/// An epoch's outcome: the new frozen prefix and the forwarded request's tokens.
struct Epoch {
    frozen: Arc<Frozen>,
    tokens: u64,
    /// The forwarded messages differ from the candidate's.
    changed: bool,
    report: Report,
}

/// Turns [`turn_growth`] averages over: the session's recent pace.
const GROWTH_TURNS: usize = 8;

/// The tokens a session adds per request: the mean of its last turns (an assistant message and
/// what follows it up to the next), read from the request itself, so that a session resumed from
/// its plan chooses the same depths. 0 before the first turn.
pub fn turn_growth(messages: &[&str], counts: &[u64]) -> u64 {
    let starts: Vec<usize> = (0..messages.len()).filter(|&i| role_of(messages[i]) == "assistant").collect();
    let n = starts.len().min(GROWTH_TURNS);
    match n {
        0 => 0,
        _ => counts[starts[starts.len() - n]..].iter().sum::<u64>() / n as u64,
    }
}

/// The engine's result in candidate space: forwarded = `prefix ++ candidate[boundary..]`.
struct Attempt {
    boundary: usize,
    prefix: Vec<String>,
    /// [`Compacted::typed`] of `prefix`.
    typed: Vec<Option<Box<Message>>>,
    report: Report,
    /// What became of each candidate message before `boundary`.
    plan: Vec<Fate>,
    /// [`Compacted::lists`] of the engine run.
    lists: Vec<String>,
}

impl Attempt {
    fn of(out: Compacted, boundary: usize) -> Attempt {
        let mut plan = out.plan;
        plan.truncate(boundary);
        Attempt { boundary, prefix: out.prefix, typed: out.typed, report: out.report, plan, lists: out.lists }
    }
}

/// Arrival times (clock milliseconds) of a request's raw messages and of its candidate messages.
struct Times {
    now: u64,
    raw: Vec<u64>,
    candidate: Vec<u64>,
}

impl Times {
    /// Each message's age in seconds.
    fn ages(&self, times: &[u64]) -> Vec<f64> {
        times.iter().map(|&t| self.now.saturating_sub(t) as f64 / 1000.0).collect()
    }

    /// When each message of a compacted prefix arrived (`plan` indexes into `times`): that of the
    /// message it stands for, or of the youngest of an elided run.
    fn of_prefix(&self, plan: &[Fate], times: &[u64], prefix_len: usize) -> Vec<u64> {
        let at = |idx: usize| times.get(idx).copied().unwrap_or(self.now);
        prefix_spans(plan, prefix_len).into_iter().map(|span| span.map(at).max().unwrap_or(self.now)).collect()
    }
}

/// Record when each raw message of this request first arrived (a message at the same index with
/// the same hash as in the last request keeps its time; anything else arrives `now`) and read the
/// candidate's times: the frozen prefix's, then the raw messages' after it.
fn arrival_times(state: &mut SessionState, hashes: &[u128], now: u64) -> Times {
    let seen: Vec<(u128, u64)> = hashes
        .iter()
        .enumerate()
        .map(|(idx, &hash)| {
            let earlier = state.seen.get(idx).filter(|(h, _)| *h == hash).map(|(_, t)| *t);
            (hash, earlier.unwrap_or(now))
        })
        .collect();
    state.seen = seen;
    let raw: Vec<u64> = state.seen.iter().map(|(_, t)| *t).collect();
    let candidate = match &state.frozen {
        Some(f) => {
            let mut times = f.prefix_seen.to_vec();
            times.resize(f.prefix.len(), now);
            times.extend_from_slice(&raw[f.raw_hashes.len()..]);
            times
        }
        None => raw.clone(),
    };
    Times { now, raw, candidate }
}

/// What the session's previous request left in an upstream's prefix cache, read from its state
/// after a step and before the request's counts replace the last request's: the uncached prefill
/// of a request raw and forwarded ([`super::prefill`]).
struct CachedBefore<'a> {
    /// The session's first request (nothing cached).
    first: bool,
    tools_unchanged: bool,
    /// Leading raw messages the request shares with the previous one.
    shared_raw: usize,
    /// The frozen prefix the previous request was forwarded with.
    frozen: Option<Arc<Frozen>>,
    /// The previous request's raw messages (hashes) as far as their counts are kept.
    previous_raw: &'a [(u128, u64)],
}

impl<'a> CachedBefore<'a> {
    fn of(state: &'a SessionState, frozen: Option<Arc<Frozen>>, tools: Option<u128>, hashes: &[u128]) -> Self {
        let first = state.last_raw.0 == 0 && state.counts.is_empty();
        // The counts kept may stop before the last request's end (late counts); its digest says
        // whether the request extends all of it.
        let counted = super::prefill::shared_prefix(state.counts.iter().map(|(h, _)| *h), hashes);
        CachedBefore {
            first,
            tools_unchanged: state.last_tools == tools,
            shared_raw: state.cached_raw(hashes).max(counted),
            frozen,
            previous_raw: &state.counts,
        }
    }

    /// The request's uncached prefill raw and forwarded (and whether the raw request is over its
    /// hard limit), and the raw message indices from which its messages count in each figure.
    fn estimate(
        &self,
        request: &Request<'_>,
        step: &Step,
        counter: &TokenCounter,
        tokens_raw: u64,
    ) -> (PrefillEstimate, (usize, usize)) {
        let raw_over_window = tokens_raw > request.hard;
        if self.first || !self.tools_unchanged {
            let prefill = PrefillEstimate { forwarded: step.tokens, raw: tokens_raw, raw_over_window };
            return (prefill, (0, 0));
        }
        let tools_tokens = request.fixed - REPLY_PRIMING;
        let shared = self.shared_raw;
        let raw = tokens_raw.saturating_sub(super::prefill::reused(true, tools_tokens, request.counts, shared));
        let frozen_raw = step.frozen.as_ref().map_or(0, |f| f.raw_hashes.len());
        let same_frozen = match (&self.frozen, &step.frozen) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        let (reused, forwarded_from) = if same_frozen {
            // An append: the prefix and the raw messages after it the previous request had.
            let from = shared.max(frozen_raw);
            let prefix = step.frozen.as_ref().map_or(0, |f| f.tokens(counter));
            (tools_tokens + prefix + request.counts[frozen_raw..from].iter().sum::<u64>(), from)
        } else {
            // A new prefix: compare the forwarded messages with those the previous request forwarded.
            fn prefix_of(f: Option<&Arc<Frozen>>) -> Vec<&str> {
                f.map(|f| f.prefix.iter().collect()).unwrap_or_default()
            }
            let (before, now) = (prefix_of(self.frozen.as_ref()), prefix_of(step.frozen.as_ref()));
            let before_raw = self.frozen.as_ref().map_or(0, |f| f.raw_hashes.len());
            let mut previous = message_hashes(&before);
            previous.extend(self.previous_raw.iter().skip(before_raw).map(|(h, _)| *h));
            let mut current = message_hashes(&now);
            let mut tokens = counter.message_counts(&now, &current, &[]);
            current.extend_from_slice(&request.hashes[frozen_raw..]);
            tokens.extend_from_slice(&request.counts[frozen_raw..]);
            let shared = super::prefill::shared_prefix(previous, &current);
            let from = frozen_raw + shared.saturating_sub(now.len());
            (super::prefill::reused(true, tools_tokens, &tokens, shared), from)
        };
        let prefill = PrefillEstimate { forwarded: step.tokens.saturating_sub(reused), raw, raw_over_window };
        (prefill, (shared, forwarded_from))
    }
}

/// The new messages of a request decided on upper bounds of their tokens
/// ([`TokenCounter::message_bound`]), counted after the decision. A request that surely appends
/// forwards the same bytes whatever its counts (the raw messages after the session's frozen prefix),
/// so only its summary waits for them: the pipeline counts them while the upstream works, and the
/// counts land in the cache the next request reads.
struct LateCounts {
    counter: Arc<TokenCounter>,
    /// Each message counted late: its hash, its text, the bound the summary holds for it, its index.
    texts: Vec<(u128, String, u64, usize)>,
    /// Messages from this index on are forwarded as they are: their counts are in `tokens_forwarded`.
    tail_from: usize,
    usable: u64,
    /// The summary's prefill estimate counts the raw messages from the first index on in its raw
    /// figure, from the second in its forwarded figure; `None`: no estimate.
    uncached_from: Option<(usize, usize)>,
    /// [`SessionCompactor::hard_limit`] of the request: the raw request over it does not fit.
    hard: u64,
}

impl LateCounts {
    fn new(
        counter: &Arc<TokenCounter>,
        messages: &[&str],
        hashes: &[u128],
        known: &[Option<u64>],
        bounds: &[u64],
        tail_from: usize,
        usable: u64,
    ) -> LateCounts {
        let texts = (0..messages.len())
            .filter(|&i| known[i].is_none())
            .map(|i| (hashes[i], messages[i].to_owned(), bounds[i], i))
            .collect();
        LateCounts { counter: Arc::clone(counter), texts, tail_from, usable, uncached_from: None, hard: u64::MAX }
    }

    /// The same, correcting the summary's prefill estimate too (see [`LateCounts::uncached_from`]).
    fn with_prefill(self, uncached_from: (usize, usize), hard: u64) -> LateCounts {
        LateCounts { uncached_from: Some(uncached_from), hard, ..self }
    }

    /// The summary with each bound replaced by the message's count.
    fn apply(self, mut summary: CompactionSummary) -> CompactionSummary {
        for (hash, text, bound, index) in &self.texts {
            let tokens = self.counter.message_hashed(*hash, text);
            summary.tokens_raw = summary.tokens_raw - bound + tokens;
            if *index >= self.tail_from {
                summary.tokens_forwarded = summary.tokens_forwarded - bound + tokens;
            }
            if let (Some((raw_from, forwarded_from)), Some(prefill)) = (self.uncached_from, &mut summary.prefill) {
                if *index >= raw_from {
                    prefill.raw = (prefill.raw + tokens).saturating_sub(*bound);
                }
                if *index >= forwarded_from.max(self.tail_from) {
                    prefill.forwarded = (prefill.forwarded + tokens).saturating_sub(*bound);
                }
            }
        }
        summary.over_window = summary.tokens_forwarded > self.usable;
        if let Some(prefill) = &mut summary.prefill {
            prefill.raw_over_window = summary.tokens_raw > self.hard;
        }
        summary
    }

    fn boxed(self) -> LateCount {
        Box::new(move |summary| self.apply(summary))
    }
}

/// Each message's tokens: from `known`, else counted now. With `defer`, when `decide` accepts the
/// messages not known yet at their upper bounds ([`TokenCounter::message_bound`]), those bounds
/// instead, and `known` back for [`LateCounts`] to count them later.
fn counts_or_bounds(
    counter: &TokenCounter,
    messages: &[&str],
    hashes: &[u128],
    known: Vec<Option<u64>>,
    defer: bool,
    decide: impl FnOnce(&[u64]) -> bool,
) -> (Vec<u64>, Option<Vec<Option<u64>>>) {
    if defer && known.contains(&None) {
        let bounds: Vec<u64> =
            known.iter().zip(messages).map(|(n, m)| n.unwrap_or_else(|| counter.message_bound(m))).collect();
        if decide(&bounds) {
            return (bounds, Some(known));
        }
    }
    (counter.fill_counts(messages, hashes, known), None)
}

/// A [`SessionCompactor`] that forwards every request unchanged, counting it
/// ([`SessionCompactor::count_unchanged`]): what the proxy forwards in mode `observe`.
pub struct Unchanged<'a>(pub &'a SessionCompactor);

impl ConversationCompactor for Unchanged<'_> {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(self.0.count_unchanged(input.body, input.messages, input.hashes, input.window, input.defer_counts))
    }
}

impl ConversationCompactor for SessionCompactor {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(self.compact_messages(
            input.session,
            input.body,
            input.messages,
            input.hashes,
            input.window,
            input.defer_counts,
        ))
    }
}

/// The forwarded messages `prefix ++ tail`, borrowed.
fn forwarded<'a>(prefix: impl Iterator<Item = &'a str>, tail: &[&'a str]) -> Vec<&'a str> {
    prefix.chain(tail.iter().copied()).collect()
}

/// Assistant messages among `messages` (a turn starts at each).
fn new_turns(messages: &[&str]) -> usize {
    messages.iter().filter(|m| role_of(m) == "assistant").count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_messages_come_back_as_they_went_in() {
        let messages = ["{\"role\":\"user\"}", "", "héllo → wörld", "{}"];
        let packed = Packed::new(&messages);
        assert_eq!(packed.len(), 4);
        assert_eq!(packed.iter().collect::<Vec<_>>(), messages);
        assert_eq!(packed.bytes(), messages.iter().map(|m| m.len()).sum::<usize>() + 4 * size_of::<usize>());
        assert_eq!(Packed::new::<&str>(&[]).iter().count(), 0);
    }

    #[test]
    fn a_session_is_charged_its_frozen_prefix_text_and_its_per_message_lists() {
        let prefix: Vec<String> =
            (0..50).map(|i| format!("{{\"role\":\"tool\",\"content\":\"{}\"}}", "x".repeat(i * 10))).collect();
        let text: usize = prefix.iter().map(String::len).sum();
        let hashes = message_hashes(&prefix);
        let state = SessionState {
            frozen: Some(Arc::new(Frozen::new(&hashes[..40], &prefix, vec![7; 50], vec![Fate::Kept { at: 0 }; 40]))),
            counts: hashes.iter().map(|&h| (h, 1)).collect(),
            ..SessionState::default()
        };
        // Per entry: its end, its arrival time, its count and the slot of its typed form.
        let slot = size_of::<std::sync::OnceLock<Option<Box<crate::neutral::Message>>>>();
        let per_message =
            40 * (16 + size_of::<Fate>()) + 50 * (size_of::<usize>() + 8 + slot) + 50 * size_of::<(u128, u64)>();
        let expected = size_of::<SessionState>() + size_of::<Frozen>() + text + per_message;
        assert_eq!(state.bytes(), expected as u64);
        // An entry a turn adapter read is charged its text again and the message it was read into.
        let frozen = state.frozen.as_ref().unwrap();
        frozen.reads.written(49, &prefix[49]).message().unwrap();
        let read = prefix[49].len() + size_of::<crate::neutral::Message>();
        assert_eq!(state.bytes(), (expected + read) as u64);
    }
}
