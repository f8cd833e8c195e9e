//! The metrics of MISSION.md (saved, peak, prefix reuse, uncached prefill, needle recall, validity)
//! computed over replayed sessions.
//!
//! A session `R1..Rn` is replayed through the same [`SessionCompactor`] path as the proxy, giving
//! `F1..Fn`; every figure is computed from those bytes, counted with the compactor's tokenizer:
//!
//! - **saved** `1 − ΣF/ΣR`; **peak** `max F` against the usable window (window − answer reserve), and
//!   `max F_k / usable_k`, the peak as a share of each request's own usable window: the figure that
//!   sums over sessions whose windows differ (models with windows of their own in `models:`, or
//!   requests asking for different answer lengths);
//!   a request *fits* when its first system message, user messages, protected tail and tools alone
//!   are within the usable window (pare touches none of those), and then `F` must be too;
//!   **over the model's window**: `F` over the whole window less the answer length the request asks
//!   for, the limit the upstream enforces, and among those the requests whose first system
//!   message, user messages, last turn and tools fit it (there must be none).
//! - **uncached prefill** `Σ (F_k − reused_k)`, reused being the tools (when unchanged) plus the
//!   longest common message prefix with the previous request, against the same sum over `R`.
//! - **needle recall**: identifiers (paths, IDs, names, numbers of 4+ digits) in the assistant's reply
//!   to request k (the message that follows in request k+1) that before appeared only in tool outputs;
//!   the share still present in `F_k`. Both sides are decoded text (the strings of each message, read
//!   through tool-call arguments and JSON-shaped results), never JSON bytes.
//! - **recoverable recall**: of the needles `F_k` lost, the share that a content id in `F_k` (a
//!   marker's `pare:` id) resolves to: the text it names, one of `R_k`'s, contains the needle, so a
//!   retrieval gets it back — directly, or through the id list an elision marker names (and the
//!   lists of earlier epochs' markers that list names: one retrieval per level).
//! - **why a needle was lost** (`lost_by`): for each lost needle, what became of the latest tool
//!   output that held it in the plan in force for `F_k` (the rules that rewrote it, `elision`, or
//!   the rules that dropped it; `strategy` for a peer's edit; `unplanned` when the compactor keeps no
//!   plans), and its way back: a retrieve id (as for recoverable recall), else the agent's own
//!   re-read (the call that produced the output stands in `F_k` with its longest argument: a path, a
//!   command), else none.
//! - **at most** `1 − Σfloor/ΣR`: what the invariants leave to save, the floor of a request being its
//!   first system message, user messages, protected tail and tools.
//! - **validity** (tool-call pairing, invariant 1), **preserved** (user messages and protected tail
//!   byte-identical), **deterministic** (a second replay gives the same bytes).

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use regex::Regex;
use serde::Serialize;
use serde_json::Value;

use std::sync::Arc;

use crate::budget::replay::{Replayed, replay_request, session_lines};
use crate::budget::{CompactEngine, SessionCompactor};
use crate::compact::markers::{content_id, content_ids_in, content_texts};
use crate::compact::report::RuleId;
use crate::compact::{CompactOptions, Fate};
use crate::neutral::{Message, View, role_of};
use crate::tokens::{CountTokens, REPLY_PRIMING, TokenCounter};
use crate::wire::{Wire, WireBody};
use corpus::{EvalError, Requests, SessionInput};
use strategy::Strategy;

pub mod corpus;
pub mod strategy;

/// Figures of one session, or sums over several.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Metrics {
    pub sessions: usize,
    pub requests: usize,
    /// Σ tokens(R_k).
    pub tokens_raw: u64,
    /// Σ tokens(F_k).
    pub tokens_forwarded: u64,
    /// Σ of what pare may not shrink in R_k: its first system message, user messages, protected
    /// tail and tools (the floor of F_k under the invariants).
    pub tokens_floor: u64,
    pub peak_raw: u64,
    pub peak_forwarded: u64,
    /// Smallest usable window (window − answer reserve) met.
    pub usable_window: u64,
    /// Largest usable window met: equal to `usable_window` when every request had the same.
    pub usable_window_max: u64,
    /// `max F_k / usable_k`: the peak as a share of each request's own usable window.
    pub peak_share: f64,
    /// Requests whose F exceeds the usable window.
    pub over_window: usize,
    /// Requests that fit (system + user + tail + tools within the window) whose F still exceeds it.
    pub over_window_fitting: usize,
    /// Requests whose F exceeds the model's whole window (less the answer length the request asks
    /// for: [`SessionCompactor::hard_limit`]), which the upstream refuses.
    pub over_model_window: usize,
    /// Those among them whose first system message, user messages, last turn and tools fit that
    /// window: pare may forward none of those (MISSION.md, invariant 8).
    pub over_model_window_fitting: usize,
    pub uncached_raw: u64,
    pub uncached_forwarded: u64,
    /// Needles (see module docs) and how many are still in F.
    pub needles: u64,
    pub needles_kept: u64,
    /// Needles F lost that a content id in F resolves to (the named text holds them).
    pub needles_recoverable: u64,
    /// Requests whose F satisfies invariant 1, and the same for R (for comparison).
    pub valid_forwarded: usize,
    pub valid_raw: usize,
    /// Requests whose user messages and protected tail are byte-identical in F.
    pub preserved: usize,
    /// Sessions whose second replay gave the same bytes.
    pub deterministic: usize,
    /// Epochs (prefix rewrites) over all sessions.
    pub epochs: u64,
    /// The lost needles by cause (see the module docs), each with its ways back.
    pub lost_by: BTreeMap<String, LostNeedles>,
}

/// Lost needles of one cause and how many of them have a way back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LostNeedles {
    pub lost: u64,
    /// A content id in the forwarded request names a text that holds the needle.
    pub retrieve: u64,
    /// No id does, but the call that produced the output stands in the forwarded request with its
    /// longest argument: the agent can run it again.
    pub reread: u64,
}

impl LostNeedles {
    fn add(&mut self, other: &LostNeedles) {
        self.lost += other.lost;
        self.retrieve += other.retrieve;
        self.reread += other.reread;
    }

    /// Lost needles with no way back.
    pub fn unrecoverable(&self) -> u64 {
        self.lost - self.retrieve - self.reread
    }
}

impl Metrics {
    pub fn add(&mut self, other: &Metrics) {
        self.sessions += other.sessions;
        self.requests += other.requests;
        self.tokens_raw += other.tokens_raw;
        self.tokens_forwarded += other.tokens_forwarded;
        self.tokens_floor += other.tokens_floor;
        self.peak_raw = self.peak_raw.max(other.peak_raw);
        self.peak_forwarded = self.peak_forwarded.max(other.peak_forwarded);
        self.usable_window = match (self.usable_window, other.usable_window) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        self.usable_window_max = self.usable_window_max.max(other.usable_window_max);
        self.peak_share = self.peak_share.max(other.peak_share);
        self.over_window += other.over_window;
        self.over_window_fitting += other.over_window_fitting;
        self.over_model_window += other.over_model_window;
        self.over_model_window_fitting += other.over_model_window_fitting;
        self.uncached_raw += other.uncached_raw;
        self.uncached_forwarded += other.uncached_forwarded;
        self.needles += other.needles;
        self.needles_kept += other.needles_kept;
        self.needles_recoverable += other.needles_recoverable;
        self.valid_forwarded += other.valid_forwarded;
        self.valid_raw += other.valid_raw;
        self.preserved += other.preserved;
        self.deterministic += other.deterministic;
        self.epochs += other.epochs;
        for (cause, lost) in &other.lost_by {
            self.lost_by.entry(cause.clone()).or_default().add(lost);
        }
    }

    /// `1 − ΣF/ΣR`.
    pub fn saved(&self) -> f64 {
        if self.tokens_raw == 0 { 0.0 } else { 1.0 - self.tokens_forwarded as f64 / self.tokens_raw as f64 }
    }

    /// The most any compaction may save under the invariants: `1 − Σfloor/ΣR`, the floor being
    /// each request's first system message, user messages, protected tail and tools.
    pub fn ceiling(&self) -> f64 {
        if self.tokens_raw == 0 { 0.0 } else { 1.0 - self.tokens_floor as f64 / self.tokens_raw as f64 }
    }

    /// Uncached prefill of F over that of R.
    pub fn prefill_ratio(&self) -> f64 {
        if self.uncached_raw == 0 { 1.0 } else { self.uncached_forwarded as f64 / self.uncached_raw as f64 }
    }

    /// Every request had the same usable window: `peak_forwarded` and `usable_window` compare.
    pub fn one_usable_window(&self) -> bool {
        self.usable_window == self.usable_window_max
    }

    /// Share of needles still present (1 when there are none).
    pub fn recall(&self) -> f64 {
        if self.needles == 0 { 1.0 } else { self.needles_kept as f64 / self.needles as f64 }
    }

    /// Share of the lost needles a content id in the same forwarded request resolves to (1 when
    /// none was lost).
    pub fn recoverable_recall(&self) -> f64 {
        let lost = self.needles - self.needles_kept;
        if lost == 0 { 1.0 } else { self.needles_recoverable as f64 / lost as f64 }
    }

    fn share(n: usize, of: usize) -> f64 {
        if of == 0 { 1.0 } else { n as f64 / of as f64 }
    }

    pub fn validity(&self) -> f64 {
        Metrics::share(self.valid_forwarded, self.requests)
    }

    pub fn preserved_share(&self) -> f64 {
        Metrics::share(self.preserved, self.requests)
    }

    pub fn deterministic_share(&self) -> f64 {
        Metrics::share(self.deterministic, self.sessions)
    }
}

/// One session's result.
#[derive(Debug, Clone, Serialize)]
pub struct SessionReport {
    /// The corpus source: the session file's parent directory name.
    pub source: String,
    pub id: String,
    #[serde(flatten)]
    pub metrics: Metrics,
}

/// A whole corpus: per session, per source, and in total.
#[derive(Debug, Clone, Serialize)]
pub struct CorpusReport {
    /// The window every request was replayed against (`--window`); `None`: each request's model's,
    /// from the configuration's `models:`, else `budget.default_context_window`.
    pub window: Option<u64>,
    pub mode: String,
    /// `pare`, or the peer strategy that produced the forwarded requests.
    pub strategy: String,
    /// The side of the split by task evaluated (`tune`, `holdout`), or `None` for every session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    pub sessions: Vec<SessionReport>,
    pub sources: BTreeMap<String, Metrics>,
    pub total: Metrics,
}

/// Which sessions an evaluation reads, and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvalInput {
    /// The wire format of the session files' request bodies (after `convert`).
    pub wire: Wire,
    /// The files hold chat requests: convert each session to requests of `wire`
    /// ([`crate::wire::convert::chat_session_to`]) before evaluating.
    pub convert_chat: bool,
}

/// Evaluate every session under `dir` at `window` (`None`: each request's model's window, see
/// [`CorpusReport::window`]).
pub fn evaluate_corpus(
    dir: &Path,
    compactor: &SessionCompactor,
    engine: &dyn CompactEngine,
    window: impl Into<Option<u64>>,
    input: EvalInput,
) -> Result<CorpusReport, EvalError> {
    evaluate_sessions(&corpus::from_dir(dir)?, Strategy::Pare, compactor, engine, window, input)
}

/// Evaluate `sessions` at `window` (`None`: each request's model's window, see
/// [`CorpusReport::window`]), forwarding what `strategy` sends.
pub fn evaluate_sessions(
    sessions: &[SessionInput],
    strategy: Strategy,
    compactor: &SessionCompactor,
    engine: &dyn CompactEngine,
    window: impl Into<Option<u64>>,
    input: EvalInput,
) -> Result<CorpusReport, EvalError> {
    let window = window.into();
    // Sessions are independent (each has its own state in the compactor, keyed by its id): evaluate
    // them on all cores; `collect` keeps the given order, so the report does not depend on the pool.
    let evaluate = |session: &SessionInput| -> Result<SessionReport, EvalError> {
        // A session file is read (and converted) here; an archive's bodies are used as they are.
        let text: Vec<u8>;
        let (key, requests): (String, Vec<&[u8]>) = match &session.requests {
            Requests::File(path) => {
                let read = std::fs::read(path).map_err(|source| EvalError::Io { path: path.clone(), source })?;
                text = match input.convert_chat {
                    true => {
                        let chat = String::from_utf8_lossy(&read);
                        crate::wire::convert::chat_session_to(input.wire, &chat).into_bytes()
                    }
                    false => read,
                };
                (path.display().to_string(), session_lines(&text))
            }
            Requests::Bodies(bodies) => {
                (format!("{}/{}", session.source, session.id), bodies.iter().map(Vec::as_slice).collect())
            }
        };
        let metrics = evaluate_session_with(strategy, compactor, engine, input.wire, &key, &requests, window);
        Ok(SessionReport { source: session.source.clone(), id: session.id.clone(), metrics })
    };
    let sessions: Vec<SessionReport> = sessions.par_iter().map(evaluate).collect::<Result<_, _>>()?;
    let mut sources: BTreeMap<String, Metrics> = BTreeMap::new();
    let mut total = Metrics::default();
    for s in &sessions {
        sources.entry(s.source.clone()).or_default().add(&s.metrics);
        total.add(&s.metrics);
    }
    let mode = format!("{:?}", compactor.policy().mode).to_lowercase();
    Ok(CorpusReport { window, mode, strategy: strategy.to_string(), split: None, sessions, sources, total })
}

/// Evaluate one session (its request bodies in order).
///
/// Every figure is computed on the requests' neutral messages (for chat, the messages themselves);
/// validity is the format's own pairing check of the forwarded body ([`WireBody::check`]).
pub fn evaluate_session(
    compactor: &SessionCompactor,
    engine: &dyn CompactEngine,
    wire: Wire,
    session: &str,
    requests: &[&[u8]],
    window: impl Into<Option<u64>>,
) -> Metrics {
    evaluate_session_with(Strategy::Pare, compactor, engine, wire, session, requests, window.into())
}

/// [`evaluate_session`] forwarding what `strategy` sends.
pub fn evaluate_session_with(
    strategy: Strategy,
    compactor: &SessionCompactor,
    engine: &dyn CompactEngine,
    wire: Wire,
    session: &str,
    requests: &[&[u8]],
    window: Option<u64>,
) -> Metrics {
    compactor.forget(session);
    let (first, fates) = replay_with_fates(strategy, compactor, wire, session, requests, window);
    let again_id = format!("{session}#again");
    compactor.forget(&again_id);
    let again = strategy::replay(strategy, compactor, wire, &again_id, requests, window);
    compactor.forget(session);
    compactor.forget(&again_id);
    compactor.take_plan(&again_id);
    let deterministic = first.iter().zip(&again).all(|(a, b)| a.forwarded == b.forwarded);

    let mut m =
        Metrics { sessions: 1, requests: requests.len(), deterministic: deterministic as usize, ..Metrics::default() };
    let needle_re = needle_regex();
    let mut previous: Option<(Parsed<'_>, Parsed<'_>)> = None;
    // The id lists the session's markers named so far, by id (what the archive holds).
    let mut lists: BTreeMap<String, &str> = BTreeMap::new();
    let parsed_raw: Vec<Option<Box<dyn WireBody + '_>>> =
        requests.iter().map(|r| crate::wire::parse(wire, r).ok()).collect();
    let raw_messages: Vec<Vec<&str>> =
        parsed_raw.iter().map(|p| p.as_ref().map(|b| b.messages()).unwrap_or_default()).collect();
    for (k, replayed) in first.iter().enumerate() {
        for list in replayed.lists.iter() {
            lists.entry(content_id(list)).or_insert(list);
        }
        let fwd_bytes = &replayed.forwarded;
        let (Some(raw), Ok(fwd)) = (&parsed_raw[k], crate::wire::parse(wire, fwd_bytes)) else {
            // Not a chat request: forwarded as is; it only counts as a request.
            m.valid_forwarded += 1;
            m.valid_raw += 1;
            m.preserved += 1;
            continue;
        };
        let counter = compactor.counter(raw.model().as_deref());
        let fwd_messages = fwd.messages();
        let raw_p = Parsed::new(&raw_messages[k], raw.tools(), counter);
        let fwd_p = Parsed::new(&fwd_messages, fwd.tools(), counter);
        let (window, reserve) = compactor.window_and_reserve(raw.as_ref(), window);
        let usable = window.saturating_sub(reserve);
        m.usable_window = if m.usable_window == 0 { usable } else { m.usable_window.min(usable) };
        m.usable_window_max = m.usable_window_max.max(usable);
        m.peak_share = m.peak_share.max(fwd_p.total as f64 / usable.max(1) as f64);
        m.tokens_raw += raw_p.total;
        m.tokens_forwarded += fwd_p.total;
        m.peak_raw = m.peak_raw.max(raw_p.total);
        m.peak_forwarded = m.peak_forwarded.max(fwd_p.total);
        if let Some(summary) = &replayed.summary {
            m.epochs = m.epochs.max(summary.epoch);
        }

        let typed = |i: usize| raw.typed(i);
        let view = View { messages: &raw_messages[k], tools: raw.tools(), typed: Some(&typed) };
        let boundary = engine.compact(&view, &CompactOptions::default(), counter).boundary.min(raw_messages[k].len());
        let floor = floor_tokens(&raw_p, boundary);
        m.tokens_floor += floor;
        if fwd_p.total > usable {
            m.over_window += 1;
            if floor <= usable {
                m.over_window_fitting += 1;
            }
        }
        let hard = SessionCompactor::hard_limit(raw.as_ref(), window);
        if fwd_p.total > hard {
            m.over_model_window += 1;
            let last_turn = raw_p.roles.iter().rposition(|r| r == "assistant").unwrap_or(0);
            if floor_tokens(&raw_p, last_turn) <= hard {
                m.over_model_window_fitting += 1;
            }
        }
        match &previous {
            Some((prev_raw, prev_fwd)) => {
                m.uncached_raw += raw_p.total - reused(prev_raw, &raw_p);
                m.uncached_forwarded += fwd_p.total - reused(prev_fwd, &fwd_p);
            }
            None => {
                m.uncached_raw += raw_p.total;
                m.uncached_forwarded += fwd_p.total;
            }
        }
        m.valid_forwarded += fwd.check().is_ok() as usize;
        m.valid_raw += raw.check().is_ok() as usize;
        // A tail that did not fit the model's window kept the turns the epoch protected.
        let yielded = replayed.summary.as_ref().and_then(|s| s.report.as_ref()).and_then(|r| r.protected_turns);
        let kept_from = yielded.map_or(boundary, |turns| nth_last_turn(&raw_p.roles, turns).max(boundary));
        m.preserved += preserves_user_and_tail(&raw_p.messages, &fwd_p.messages, kept_from) as usize;

        if let Some(next) = raw_messages.get(k + 1).filter(|_| parsed_raw[k + 1].is_some()) {
            let raw_view = View { messages: &raw_messages[k], tools: raw.tools(), typed: Some(&typed) };
            let (needles, lost) = next_step_needles(&needle_re, &raw_view, next, &fwd_p.messages, &lists);
            m.needles += needles.found;
            m.needles_kept += needles.kept;
            m.needles_recoverable += needles.recoverable;
            if !lost.is_empty() {
                let plan = match strategy {
                    Strategy::Pare => Plan::Pare(fates[k].as_deref()),
                    _ => Plan::Strategy,
                };
                for (cause, way) in why_lost(&raw_view, &fwd_p.messages, plan, &lost) {
                    m.lost_by.entry(cause).or_default().add(&way);
                }
            }
        }
        // The previous request's bodies are re-parsed views over `requests` and `first`.
        previous = Some((raw_p.detach(), fwd_p.detach()));
    }
    m
}

/// What became of each raw message a frozen prefix covers (empty: no prefix), shared by the
/// requests under one plan; `None`: not known.
type Fates = Option<Arc<[Fate]>>;

/// `strategy`'s replay of `requests`, with pare's plan in force after each request: what became of
/// each raw message its frozen prefix covers (empty: none; `None`: the compactor keeps no plans,
/// or a peer's strategy forwarded the request).
fn replay_with_fates(
    strategy: Strategy,
    compactor: &SessionCompactor,
    wire: Wire,
    session: &str,
    requests: &[&[u8]],
    window: Option<u64>,
) -> (Vec<Replayed>, Vec<Fates>) {
    if strategy != Strategy::Pare {
        return (strategy::replay(strategy, compactor, wire, session, requests, window), vec![None; requests.len()]);
    }
    let mut in_force: Fates = None;
    let mut fates = Vec::with_capacity(requests.len());
    let replayed = requests
        .iter()
        .map(|raw| {
            let replayed = replay_request(compactor, wire, session, raw, window);
            // A recording compactor has a plan after a session's first request and whenever one
            // changes it; without one there is none, ever.
            if let Some(plan) = compactor.take_plan(session) {
                in_force = match plan.frozen {
                    None => Some(Arc::from([])),
                    Some(frozen) => frozen.plan.map(Arc::from),
                };
            }
            fates.push(in_force.clone());
            replayed
        })
        .collect();
    (replayed, fates)
}

/// What forwarded a request, for [`why_lost`].
#[derive(Clone, Copy)]
enum Plan<'a> {
    /// pare, with the fates of the raw messages its frozen prefix covers (`None`: not recorded).
    Pare(Option<&'a [Fate]>),
    /// A peer's strategy.
    Strategy,
}

/// Why each needle of `lost` (with whether a content id in `fwd` resolves to it) is missing from
/// `fwd`, and its way back: see the module docs. The holder is the latest tool output of `raw` that
/// held the needle.
fn why_lost<M: AsRef<str>>(
    raw: &View<'_>,
    fwd: &[M],
    plan: Plan<'_>,
    lost: &[(String, bool)],
) -> Vec<(String, LostNeedles)> {
    let messages: Vec<Option<Message>> = raw.messages.iter().map(|m| Message::from_raw(m).ok()).collect();
    let outputs: Vec<(usize, String)> = raw
        .messages
        .iter()
        .enumerate()
        .filter(|(_, m)| role_of(m) == "tool")
        .map(|(i, m)| {
            let mut text = String::new();
            push_decoded(m, &mut text);
            (i, text)
        })
        .collect();
    let mut forwarded = String::new();
    for m in fwd {
        push_decoded(m.as_ref(), &mut forwarded);
    }
    lost.iter()
        .map(|(needle, recoverable)| {
            let holder = outputs.iter().rev().find(|(_, text)| text.contains(needle.as_str())).map(|(i, _)| *i);
            let cause = match (plan, holder) {
                (Plan::Strategy, _) => "strategy".to_owned(),
                (Plan::Pare(None), _) | (_, None) => "unplanned".to_owned(),
                (Plan::Pare(Some(fates)), Some(i)) => match fates.get(i) {
                    None | Some(Fate::Kept { .. }) => "kept".to_owned(),
                    Some(Fate::Rewritten { rules, .. }) if rules.is_empty() => "rewritten".to_owned(),
                    Some(Fate::Rewritten { rules, .. }) => rules.iter().map(RuleId::name).collect::<Vec<_>>().join("+"),
                    Some(Fate::Elided { .. }) => "elision".to_owned(),
                    Some(Fate::Dropped { rules }) => format!("dropped: {}", rules.names()),
                },
            };
            let reread = !recoverable
                && holder.is_some_and(|i| {
                    let id = messages[i].as_ref().and_then(|m| m.tool_call_id.as_deref());
                    let call = messages[..i]
                        .iter()
                        .rev()
                        .flatten()
                        .flat_map(|m| m.tool_calls.iter().flatten())
                        .find(|c| id.is_some_and(|id| c.id == id));
                    call.and_then(|c| c.function.as_ref()).is_some_and(|f| {
                        let mut arguments = String::new();
                        push_strings(&f.arguments, &mut arguments);
                        arguments.lines().max_by_key(|a| a.len()).is_some_and(|a| a.len() >= 3 && forwarded.contains(a))
                    })
                });
            let way = LostNeedles { lost: 1, retrieve: *recoverable as u64, reread: reread as u64 };
            (cause, way)
        })
        .collect()
}

/// A request's messages with their token counts.
struct Parsed<'a> {
    messages: Vec<std::borrow::Cow<'a, str>>,
    /// [`crate::neutral::message_hashes`] of `messages`.
    hashes: Vec<u128>,
    message_tokens: Vec<u64>,
    roles: Vec<String>,
    tools: Option<String>,
    tools_tokens: u64,
    total: u64,
}

impl<'a> Parsed<'a> {
    fn new(body_messages: &[&'a str], tools: Option<&str>, counter: &TokenCounter) -> Parsed<'a> {
        let messages: Vec<std::borrow::Cow<'a, str>> =
            body_messages.iter().map(|m| std::borrow::Cow::Borrowed(*m)).collect();
        let message_tokens: Vec<u64> = messages.iter().map(|m| counter.message(m)).collect();
        let hashes = crate::neutral::message_hashes(&messages);
        let roles = messages.iter().map(|m| role_of(m).into_owned()).collect();
        let tools = tools.map(str::to_owned);
        let tools_tokens = tools.as_deref().map_or(0, |t| counter.tools(t));
        let total = message_tokens.iter().sum::<u64>() + tools_tokens + REPLY_PRIMING;
        Parsed { messages, hashes, message_tokens, roles, tools, tools_tokens, total }
    }

    fn detach(self) -> Parsed<'static> {
        Parsed {
            messages: self.messages.into_iter().map(|m| std::borrow::Cow::Owned(m.into_owned())).collect(),
            hashes: self.hashes,
            message_tokens: self.message_tokens,
            roles: self.roles,
            tools: self.tools,
            tools_tokens: self.tools_tokens,
            total: self.total,
        }
    }
}

/// Tokens a prompt cache can reuse from `previous` ([`crate::budget::prefill`]).
fn reused(previous: &Parsed<'_>, current: &Parsed<'_>) -> u64 {
    let shared = crate::budget::prefill::shared_prefix(previous.hashes.iter().copied(), &current.hashes);
    crate::budget::prefill::reused(
        previous.tools == current.tools,
        current.tools_tokens,
        &current.message_tokens,
        shared,
    )
}

/// What pare may not shrink: the first system message, user messages, the protected tail and tools.
fn floor_tokens(raw: &Parsed<'_>, boundary: usize) -> u64 {
    let first_system = raw.roles.iter().position(|r| r == "system" || r == "developer");
    let kept: u64 = (0..raw.messages.len())
        .filter(|i| *i >= boundary || Some(*i) == first_system || raw.roles[*i] == "user")
        .map(|i| raw.message_tokens[i])
        .sum();
    kept + raw.tools_tokens + REPLY_PRIMING
}

/// Where the last `turns` turns start (the `turns`-th last assistant message; 0 with fewer).
fn nth_last_turn(roles: &[String], turns: u32) -> usize {
    let mut starts = roles.iter().enumerate().rev().filter(|(_, r)| *r == "assistant").map(|(i, _)| i);
    starts.nth(turns.saturating_sub(1) as usize).unwrap_or(0)
}

/// User messages of `raw` appear, in order and byte-identical, in `fwd`; and `fwd` ends with
/// `raw[boundary..]`.
fn preserves_user_and_tail<A: AsRef<str>, B: AsRef<str>>(raw: &[A], fwd: &[B], boundary: usize) -> bool {
    let tail = &raw[boundary.min(raw.len())..];
    if tail.len() > fwd.len() || !tail.iter().zip(&fwd[fwd.len() - tail.len()..]).all(|(a, b)| a.as_ref() == b.as_ref())
    {
        return false;
    }
    let mut forwarded = fwd.iter();
    raw.iter().filter(|m| role_of(m.as_ref()) == "user").all(|user| forwarded.any(|f| f.as_ref() == user.as_ref()))
}

fn needle_regex() -> Regex {
    Regex::new(r"[A-Za-z0-9_][A-Za-z0-9_./\-]*[A-Za-z0-9_]").expect("static regex")
}

/// Identifier-like tokens of a text: paths, IDs (letters and digits), snake/camel-case names, numbers
/// of 4+ digits. Plain words are not needles.
pub fn identifiers(re: &Regex, text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in re.find_iter(text) {
        let token = m.as_str().trim_end_matches(['.', '-', '/']);
        if token.len() < 4 || out.iter().any(|t| t == token) {
            continue;
        }
        let has_alpha = token.chars().any(|c| c.is_ascii_alphabetic());
        let has_digit = token.chars().any(|c| c.is_ascii_digit());
        let is_number = token.chars().all(|c| c.is_ascii_digit());
        let is_path = has_alpha && (token.contains('/') || has_file_extension(token));
        let is_id = has_alpha && has_digit && !token.contains('.');
        let is_name = has_alpha
            && (token.contains('_') && token.chars().any(|c| c.is_ascii_lowercase())
                || token.as_bytes().windows(2).any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase()));
        if is_number || is_path || is_id || is_name {
            out.push(token.to_owned());
        }
    }
    out
}

fn has_file_extension(token: &str) -> bool {
    match token.rsplit_once('.') {
        Some((stem, ext)) => {
            !stem.is_empty()
                && (1..=5).contains(&ext.len())
                && ext.chars().all(|c| c.is_ascii_alphanumeric())
                && ext.chars().any(|c| c.is_ascii_lowercase())
        }
        None => false,
    }
}

/// The needles of one request.
#[derive(Debug, Default, PartialEq, Eq)]
struct Needles {
    found: u64,
    /// Still in the forwarded request.
    kept: u64,
    /// Lost, but in a text a content id of the forwarded request names.
    recoverable: u64,
}

/// Needles of request `raw` (identifiers of the assistant reply found in `next` that appeared before
/// only in tool outputs), how many of them `fwd` still contains, and how many of the others a content
/// id in `fwd` resolves to, directly or through the id lists among `lists` (by id).
/// The lost needles come second, each with whether an id resolves to it.
fn next_step_needles<M: AsRef<str>>(
    re: &Regex,
    raw: &View<'_>,
    next: &[&str],
    fwd: &[M],
    lists: &BTreeMap<String, &str>,
) -> (Needles, Vec<(String, bool)>) {
    let n = raw.messages.len();
    let extends = next.len() > n && raw.messages.iter().zip(next).all(|(a, b)| a == b);
    if !extends {
        return Default::default();
    }
    let Ok(reply) = Message::from_raw(next[n]) else {
        return Default::default();
    };
    if reply.role != "assistant" {
        return Default::default();
    }
    let mut reply_text = reply.text();
    for call in reply.tool_calls.iter().flatten() {
        if let Some(f) = &call.function {
            // Arguments are JSON text on the wire: read the strings inside, not their escapes.
            push_strings(&f.arguments, &mut reply_text);
        }
    }
    // Compare decoded text, never JSON bytes: in `"line\nNow"` the bytes hold a spurious `nNow`.
    let (mut tool_text, mut other_text) = (String::new(), String::new());
    for m in raw.messages {
        let text = *m;
        let out = if role_of(text) == "tool" { &mut tool_text } else { &mut other_text };
        push_decoded(text, out);
    }
    if let Some(tools) = raw.tools {
        push_decoded(tools, &mut other_text);
    }
    let mut forwarded = String::new();
    for m in fwd {
        push_decoded(m.as_ref(), &mut forwarded);
    }
    let mut out = Needles::default();
    let mut lost: Vec<String> = Vec::new();
    for id in identifiers(re, &reply_text) {
        if !tool_text.contains(&id) || other_text.contains(&id) {
            continue;
        }
        out.found += 1;
        if forwarded.contains(&id) {
            out.kept += 1;
        } else {
            lost.push(id);
        }
    }
    if lost.is_empty() {
        return (out, Vec::new());
    }
    let named = named_texts(raw, fwd, lists);
    let lost: Vec<(String, bool)> = lost
        .into_iter()
        .map(|needle| {
            let recoverable = named.iter().any(|text| text.contains(needle.as_str()));
            (needle, recoverable)
        })
        .collect();
    out.recoverable = lost.iter().filter(|(_, recoverable)| *recoverable).count() as u64;
    (out, lost)
}

/// The texts of `raw` that a content id in `fwd` names (what `/_pare/retrieve/{id}` gives back),
/// directly or through an id list among `lists` that an id names, at any depth (an epoch's list
/// names the list of the earlier marker it swallowed).
fn named_texts<M: AsRef<str>>(raw: &View<'_>, fwd: &[M], lists: &BTreeMap<String, &str>) -> Vec<String> {
    let mut ids: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    let mut todo: Vec<&str> = fwd.iter().flat_map(|m| content_ids_in(m.as_ref())).collect();
    while let Some(hex) = todo.pop() {
        if !ids.insert(hex) {
            continue;
        }
        if let Some(list) = lists.get(&format!("pare:{hex}")) {
            todo.extend(content_ids_in(list));
        }
    }
    if ids.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for m in raw.messages {
        let Ok(message) = Message::from_raw(m) else { continue };
        for text in content_texts(&message) {
            let id = content_id(&text);
            if ids.contains(&id["pare:".len()..]) {
                out.push(text);
            }
        }
    }
    out
}

/// The strings of a JSON text (see [`push_strings`]); a text that is not JSON is taken as it is.
fn push_decoded(json: &str, out: &mut String) {
    match serde_json::from_str::<Value>(json) {
        Ok(value) => push_strings(&value, out),
        Err(_) => {
            out.push_str(json);
            out.push('\n');
        }
    }
}

/// Every string (and number) inside a JSON value, newline-separated. A string that is itself a JSON
/// object or array (tool-call arguments, Hermes-style results) is read through to its strings.
fn push_strings(value: &Value, out: &mut String) {
    match value {
        Value::String(s) => {
            let nested = s
                .trim_start()
                .starts_with(['{', '['])
                .then(|| serde_json::from_str::<Value>(s).ok())
                .flatten()
                .filter(|v| v.is_object() || v.is_array());
            match nested {
                Some(inner) => push_strings(&inner, out),
                None => {
                    out.push_str(s);
                    out.push('\n');
                }
            }
        }
        Value::Number(n) => {
            out.push_str(&n.to_string());
            out.push('\n');
        }
        Value::Array(items) => items.iter().for_each(|v| push_strings(v, out)),
        Value::Object(map) => map.values().for_each(|v| push_strings(v, out)),
        Value::Bool(_) | Value::Null => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step whose next reply names `load_user_8841`, which only the tool output holds.
    const OUTPUT: &str = "def load_user_8841(user_id):\n    return UserCache.get(user_id)\n";
    const CALL: &str = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{\"command\":\"cat a.py\"}"}}]}"#;
    const USER: &str = r#"{"role":"user","content":"fix it"}"#;
    const REPLY: &str = r#"{"role":"assistant","content":"I will edit load_user_8841 now."}"#;

    fn tool_result() -> String {
        serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": OUTPUT}).to_string()
    }

    /// A needle lost to a marker is recoverable when the marker's id names the output that held it,
    /// and only then.
    #[test]
    fn lost_needles_are_recoverable_through_the_ids_that_name_them() {
        let (output, call, user) = (OUTPUT, CALL, USER);
        let result = tool_result();
        let raw = [user, call, result.as_str()];
        let next = [user, call, result.as_str(), REPLY];
        let view = View::of_texts(&raw, None);
        let marker = |suffix: &str| {
            serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": format!("[tool: bash → ok{suffix}]")})
                .to_string()
        };
        let re = needle_regex();
        let none = BTreeMap::new();
        let kept = next_step_needles(&re, &view, &next, &raw, &none).0;
        assert_eq!(kept, Needles { found: 1, kept: 1, recoverable: 0 });
        let named = [user.to_owned(), call.to_owned(), marker(&format!("; {}", content_id(output)))];
        assert_eq!(
            next_step_needles(&re, &view, &next, &named, &none).0,
            Needles { found: 1, kept: 0, recoverable: 1 }
        );
        let unnamed = [user.to_owned(), call.to_owned(), marker("")];
        assert_eq!(
            next_step_needles(&re, &view, &next, &unnamed, &none).0,
            Needles { found: 1, kept: 0, recoverable: 0 }
        );
        let elsewhere = [user.to_owned(), call.to_owned(), marker("; pare:0123456789ab")];
        assert_eq!(
            next_step_needles(&re, &view, &next, &elsewhere, &none).0,
            Needles { found: 1, kept: 0, recoverable: 0 }
        );
    }

    /// A needle lost to an elision marker that names the id list of its outputs is recoverable
    /// through the list, and through the list of an earlier marker that list names; a list the
    /// session never produced resolves nothing.
    #[test]
    fn lost_needles_are_recoverable_through_the_id_lists_markers_name() {
        use crate::compact::markers::{LIST_ENTRY, id_entry, id_list_text};
        let (output, call, user) = (OUTPUT, CALL, USER);
        let result = tool_result();
        let raw = [user, call, result.as_str()];
        let next = [user, call, result.as_str(), REPLY];
        let view = View::of_texts(&raw, None);
        let re = needle_regex();
        let inner =
            id_list_text(&[id_entry(&content_id(output), "bash(\"cat a.py\")"), id_entry(&content_id("other"), "")]);
        let outer = id_list_text(&[id_entry(&content_id(&inner), &format!("{LIST_ENTRY} (4 messages)"))]);
        let marker = |id: &str| {
            [user.to_owned(), serde_json::json!({"role": "assistant", "content": format!("[pare: 2 earlier messages elided — bash ×1; ids listed in {id}]")}).to_string()]
        };
        let lists: BTreeMap<String, &str> =
            [(content_id(&inner), inner.as_str()), (content_id(&outer), outer.as_str())].into();
        let recovered = Needles { found: 1, kept: 0, recoverable: 1 };
        assert_eq!(next_step_needles(&re, &view, &next, &marker(&content_id(&inner)), &lists).0, recovered);
        assert_eq!(next_step_needles(&re, &view, &next, &marker(&content_id(&outer)), &lists).0, recovered);
        let unknown: BTreeMap<String, &str> = BTreeMap::new();
        let lost = Needles { found: 1, kept: 0, recoverable: 0 };
        assert_eq!(next_step_needles(&re, &view, &next, &marker(&content_id(&outer)), &unknown).0, lost);
    }

    /// A lost needle is blamed on what became of the output that held it, and its way back is a
    /// retrieve id, else the call that can be run again, else none.
    #[test]
    fn a_lost_needle_names_its_cause_and_its_way_back() {
        let result = tool_result();
        let raw = [USER, CALL, result.as_str()];
        let view = View::of_texts(&raw, None);
        let mut truncate = crate::compact::report::RuleSet::default();
        truncate.insert(RuleId::Truncate);
        truncate.insert(RuleId::TierHeavy);
        let fates = [Fate::Kept { at: 0 }, Fate::Kept { at: 1 }, Fate::Rewritten { at: 2, rules: truncate }];
        let marker =
            |content: &str| serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": content}).to_string();
        let lost = [("load_user_8841".to_owned(), false)];
        let way = |lost: u64, retrieve: u64, reread: u64| LostNeedles { lost, retrieve, reread };

        let call_kept = [USER.to_owned(), CALL.to_owned(), marker("[tool: bash → ok]")];
        let why = why_lost(&view, &call_kept, Plan::Pare(Some(&fates)), &lost);
        assert_eq!(why, vec![("truncate+tier_heavy".to_owned(), way(1, 0, 1))]);

        let by_id = [("load_user_8841".to_owned(), true)];
        assert_eq!(why_lost(&view, &call_kept, Plan::Pare(Some(&fates)), &by_id)[0].1, way(1, 1, 0));

        let call_gone = [USER.to_owned(), marker("[pare: 2 earlier messages elided]")];
        let elided = [Fate::Kept { at: 0 }, Fate::Elided { at: 1 }, Fate::Elided { at: 1 }];
        let why = why_lost(&view, &call_gone, Plan::Pare(Some(&elided)), &lost);
        assert_eq!(why, vec![("elision".to_owned(), way(1, 0, 0))]);
        assert_eq!(why_lost(&view, &call_gone, Plan::Pare(None), &lost)[0].0, "unplanned");
        assert_eq!(why_lost(&view, &call_gone, Plan::Strategy, &lost)[0].0, "strategy");
    }

    #[test]
    fn identifiers_keep_paths_ids_names_and_long_numbers() {
        let re = needle_regex();
        let found = identifiers(
            &re,
            "Open src/core/loop.py and config.yaml, reservation ZFA04Y, call read_file, getUserId, 12345, 123, the word Hello.",
        );
        assert_eq!(found, vec!["src/core/loop.py", "config.yaml", "ZFA04Y", "read_file", "getUserId", "12345"]);
    }

    #[test]
    fn user_and_tail_preservation() {
        let raw = [
            "{\"role\":\"user\",\"content\":\"a\"}",
            "{\"role\":\"tool\",\"content\":\"long\"}",
            "{\"role\":\"assistant\",\"content\":\"t\"}",
        ];
        let good = [
            "{\"role\":\"user\",\"content\":\"a\"}",
            "{\"role\":\"tool\",\"content\":\"[short]\"}",
            "{\"role\":\"assistant\",\"content\":\"t\"}",
        ];
        assert!(preserves_user_and_tail(&raw, &good, 2));
        assert!(!preserves_user_and_tail(&raw, &good, 1), "the tool message is in the tail");
        let lost_user = ["{\"role\":\"assistant\",\"content\":\"t\"}"];
        assert!(!preserves_user_and_tail(&raw, &lost_user, 2));
    }
}
