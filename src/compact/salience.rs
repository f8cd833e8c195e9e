//! Salience tiers and elision, used when a token target is given (or a history budget sets one) and
//! the rules alone leave the request over it (the hyle design).
//!
//! Each group outside the protected tail (a tool-call group, a lone assistant message, a later
//! system message) gets `S = w_r·R + w_e·E + w_k·K + w_f·F`: `R = exp(−age/τ)` with the age in turns
//! (assistant messages after it; no clock, so the result is deterministic) — or, opted into with
//! `salience.tau_seconds`, in seconds since pare received the group's youngest message (the caller
//! passes the ages: the engine reads no clock), `E` = an error in its
//! results, `K` = overlap of its words with the task (first and latest user message), `F` = it
//! mentions a file the protected tail touches or holds the latest full read of a file the
//! conversation edits. Such a read is as recent as the latest call that names its file (what the
//! agent's next edit quotes is in it); a full read that a later full read of the same path before
//! the protected tail supersedes scores [`SUPERSEDED_READ_FACTOR`] of its `S`; a group whose
//! output keeps lines for relevance (`super::relevance`) adds [`RELEVANT_BONUS`]. In descending `S`
//! (the more recent first on ties), groups fill the Focus / Recent / Summary / Background shares of
//! the budget left after everything that is never compressed, each at that tier's size: as is /
//! light (tool outputs truncated) / heavy (results become markers with their facts, assistant text
//! cut) / facts only. A group that fits no tier, and then the lowest-salience groups while the
//! request is still over target, are elided: each run of elided groups becomes one assistant message
//! (valid between complete groups) listing what went. Never the first system message, a user
//! message, a kept message or the tail.

use std::cell::{OnceCell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::conversation::{Conversation, GroupKind, is_system, path_argument};
use super::edited::FileEdits;
use super::edits::{Edits, TextEdit};
use super::markers::{
    ElisionSummary, LIST_ENTRY, NAMES_PER_ELISION, NAMES_PER_ELISION_AT_FLOOR, content_ids_in, derived_id_list,
    files_suffix, group_digits, id_entry, ids_suffix, is_compacted, mentioned_files, names_suffix, parse_elision,
    placeholders, render,
};
use super::report::{RuleId, TierReport};
use super::rules::truncate_lines;
use super::spans::{Fenwick, MAX_FILES, MarkerSummary, Runs, Seen, Texts};
use super::{Engine, HistoryBudget, HistoryFloor};
use crate::tokens::{CountTokens, REPLY_PRIMING};

/// Groups elided by [`fit`]: each run of elided groups is replaced by one marker message.
#[derive(Debug, Default)]
pub struct Elided {
    /// Run start (raw index) → (end, exclusive; the marker message's JSON).
    pub runs: BTreeMap<usize, (usize, String)>,
    /// Every raw message index elided.
    pub messages: BTreeSet<usize>,
    /// The id lists ([`super::markers::id_list_text`]) the runs' markers name, in run order: texts the engine
    /// derived, which the archive stores so that the markers' list ids resolve.
    pub lists: Vec<String>,
    pub chars_saved: i64,
    pub tokens_saved: i64,
}

/// What [`fit`] did.
pub struct Fit {
    pub report: TierReport,
    pub elided: Elided,
}

/// The four tiers, most salient first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    Focus,
    Recent,
    Summary,
    Background,
}

const TIERS: [Tier; 4] = [Tier::Focus, Tier::Recent, Tier::Summary, Tier::Background];

/// A group the tiers may compress or elide.
struct Unit {
    start: usize,
    end: usize,
    score: f64,
    /// Per tier, the text edit of each message (`None`: unchanged) and the group's tokens, made the
    /// first time the tier is asked for: most groups are only ever weighed at one or two tiers, and a
    /// form costs a rendering and a tokenization per message.
    forms: [OnceCell<Form>; 4],
}

type Form = (Vec<Option<TextEdit>>, u64);

/// What making a form reads besides the edits.
struct Forms<'e, 'c, 'a> {
    engine: &'e Engine,
    conv: &'c Conversation<'a>,
    counter: &'e dyn CountTokens,
}

impl Unit {
    /// The group at `tier`, as the edits were before any tier changed this group: a unit's forms
    /// read only its own messages, and [`apply_tier`] makes the one form a later step may still
    /// apply (facts only) before it changes them.
    fn form<'u>(&'u self, tier: Tier, forms: &Forms<'_, '_, '_>, edits: &Edits, tokens: &[u64]) -> &'u Form {
        self.forms[tier as usize].get_or_init(|| {
            let mut texts = Vec::with_capacity(self.end - self.start);
            let mut size = 0;
            for (idx, &now) in tokens.iter().enumerate().take(self.end).skip(self.start) {
                if edits.dropped[idx] {
                    texts.push(None);
                    continue;
                }
                let form = form(forms.engine, forms.conv, edits, idx, tier);
                size += match &form {
                    Some(edit) => forms.counter.message(&edits.render_as(forms.conv, idx, Some(edit))).min(now),
                    None => now,
                };
                texts.push(form);
            }
            (texts, size)
        })
    }
}

/// The least share of the target that salience tiers divide among the groups (see [`fit`]).
/// Measured on the tuning half of the shared and long corpora (`pare eval --split tune`, coding
/// sessions): epoch 16k needle recall 0.835 without it, 0.843 at 0.3, 0.850 at 0.5, 0.851 at 0.8 and
/// above; savings, prefill, eager 16k and 32k and epoch 32k unchanged (within 0.1 point).
pub const MIN_TIER_SHARE: f64 = 0.5;

/// What [`fit`] brings the request under: a target for the whole request, a budget for its history,
/// or both (the lower of the two targets they give wins).
#[derive(Debug, Clone, Copy, Default)]
pub struct Budget<'a> {
    pub target: Option<u64>,
    pub history: Option<HistoryBudget>,
    /// Raises `target` so that it leaves the history at least this much.
    pub floor: Option<HistoryFloor>,
    /// Age in seconds of each message, for recency on the wall clock (`salience.tau_seconds`).
    pub ages: Option<&'a [f64]>,
    /// See [`super::CompactOptions::lists_limit`].
    pub lists_limit: Option<u64>,
}

/// What the fits of one prepared compaction share ([`super::Prepared`]), each made the first time a
/// fit asks: a group's salience and an elided run's marker with its tokens. Both read only the
/// conversation, the options and the rules' edits of the messages they cover, which are the same
/// in every fit (a fit's kept head is never scored nor elided): a bisection over kept heads scores
/// each group once and renders each marker once.
#[derive(Debug, Default)]
pub struct Memo {
    /// Salience by the group's first message.
    scores: RefCell<HashMap<usize, f64>>,
    /// Each marker and its tokens.
    markers: RefCell<HashMap<MarkerKey, (String, u64)>>,
    /// The tokens of each marker an elision step weighed (rendered from its run's summary; the
    /// text is made again only for the runs that stay elided).
    marker_tokens: RefCell<HashMap<MarkerKey, u64>>,
}

/// An elided run's marker is made from its `start` and `end`, whether it is terse, and how many names
/// it lists.
type MarkerKey = (usize, usize, bool, usize);

/// Bring the request under its [`Budget`] with tiers, then elision. `rendered` holds the forwarded
/// form of each changed message before the boundary and is updated in place. `memo` holds what
/// earlier fits with the same conversation, options and rules' edits found.
#[allow(clippy::too_many_arguments)]
pub fn fit(
    engine: &Engine,
    conv: &Conversation<'_>,
    edits: &mut Edits,
    rendered: &mut [Option<String>],
    counter: &dyn CountTokens,
    tools_tokens: u64,
    budget: Budget<'_>,
    memo: &Memo,
) -> Fit {
    let current = |edits: &Edits, rendered: &[Option<String>], idx: usize| -> u64 {
        if edits.dropped[idx] { 0 } else { counter.message(rendered[idx].as_deref().unwrap_or(conv.raw[idx])) }
    };
    let tail: u64 = conv.raw[conv.boundary..].iter().map(|m| counter.message(m)).sum();
    let mut tokens: Vec<u64> = (0..conv.boundary).map(|i| current(edits, rendered, i)).collect();
    let fixed_extra = tail + tools_tokens + REPLY_PRIMING;
    let after_rules = tokens.iter().sum::<u64>() + fixed_extra;
    let history_weight =
        (budget.history.is_some() || budget.floor.is_some()).then(|| history_tokens(conv, edits, &tokens));
    let history = budget.history.zip(history_weight);
    // The history floor raises the window's target: everything but the history stays as the rules
    // left it, and the history keeps at least `floor.tokens` (within `floor.max_target`).
    let window_target = match (budget.target, budget.floor.zip(history_weight)) {
        (Some(target), Some((floor, weight))) => {
            Some(target.max((after_rules - weight + floor.tokens).min(floor.max_target)))
        }
        (target, _) => target,
    };
    // The history budget, when the history is over its high mark, as a target for the whole request:
    // everything else stays as the rules left it, the history goes down to `low`.
    let history_target = history.filter(|(h, weight)| *weight > h.high).map(|(h, weight)| after_rules - weight + h.low);
    let target = match (window_target, history_target) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    // The floor raised the target applied: the window leaves the history so little that its elision
    // markers are most of what the request keeps of old outputs, so they list more names.
    let at_floor = window_target > budget.target && target == window_target;
    let mut report = TierReport {
        target_tokens: target,
        tokens_after_rules: after_rules,
        history_tokens_after_rules: history.map(|(_, weight)| weight),
        ..TierReport::default()
    };
    let mut elided = Elided::default();
    let Some(target) = target.filter(|&t| after_rules > t) else {
        return Fit { report, elided };
    };

    // Markers keep their lists while the request with them stays within this.
    let lists_limit = budget.lists_limit.map_or(target, |limit| limit.max(target));
    let names_per_elision = if at_floor { NAMES_PER_ELISION_AT_FLOOR } else { NAMES_PER_ELISION };
    let facts = MarkerFacts::new(engine, conv, edits, names_per_elision);
    let units = units(engine, conv, edits, &facts, budget.ages, memo);
    let forms = Forms { engine, conv, counter };
    let scored: u64 = units.iter().map(|u| u.form(Tier::Focus, &forms, edits, &tokens).1).sum();
    // Tiers share what the target leaves after the untouched part, and never less than
    // MIN_TIER_SHARE of the target: when the task and the tail leave almost nothing, every group would
    // otherwise be cut to its facts; this way the most salient keep their form and elision removes
    // the least salient whole.
    let budget = (target.saturating_sub(after_rules - scored) as f64).max(MIN_TIER_SHARE * target as f64);
    // Descending salience; on ties the more recent group first.
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by(|&a, &b| units[b].score.total_cmp(&units[a].score).then(units[b].start.cmp(&units[a].start)));

    let shares = &engine.tiers;
    let mut remaining = [shares.focus, shares.recent, shares.summary, shares.background].map(|s| s.max(0.0) * budget);
    let mut tier_of: Vec<Option<Tier>> = vec![None; units.len()];
    let mut t = 0;
    for &u in &order {
        while t < TIERS.len() && units[u].form(TIERS[t], &forms, edits, &tokens).1 as f64 > remaining[t] {
            if t + 1 < TIERS.len() {
                remaining[t + 1] += remaining[t];
            }
            t += 1;
        }
        if t < TIERS.len() {
            remaining[t] -= units[u].form(TIERS[t], &forms, edits, &tokens).1 as f64;
            tier_of[u] = Some(TIERS[t]);
        }
    }

    // Compress each group at its tier (a group that fits no tier is compressed to facts first, and
    // elided below).
    let mut final_tier: Vec<Tier> = tier_of.iter().map(|t| t.unwrap_or(Tier::Background)).collect();
    for (u, unit) in units.iter().enumerate() {
        apply_tier(&forms, edits, rendered, &mut tokens, unit, final_tier[u]);
    }

    // Elide: first the groups that fit no tier, then the least salient, while over target.
    let mut total = tokens.iter().sum::<u64>() + fixed_extra;
    let mut candidates: Vec<usize> = order.iter().rev().copied().filter(|&u| tier_of[u].is_none()).collect();
    candidates.extend(order.iter().rev().copied().filter(|&u| tier_of[u].is_some()));
    let mut gone: BTreeSet<usize> = BTreeSet::new(); // unit indices
    let summaries = UnitSummaries::new(&facts, conv, edits, &units);
    let ctx =
        ElideContext { engine, facts: &facts, summaries: &summaries, conv, counter, memo, fixed_extra, terse: false };
    let mut went_terse = false;
    ctx.elide_in_order(edits, &units, &candidates, &mut gone, &tokens, &mut total, |total, u| {
        total <= target && tier_of[u].is_some()
    });
    if total > target {
        // Still over: everything left goes to facts only, then elision runs to a fixpoint, so that
        // compacting the output again finds nothing more to do (idempotence).
        for (u, unit) in units.iter().enumerate() {
            if !gone.contains(&u) && final_tier[u] != Tier::Background {
                final_tier[u] = Tier::Background;
                apply_tier(&forms, edits, rendered, &mut tokens, unit, Tier::Background);
            }
        }
        ctx.elide_to_fixpoint(edits, &units, &candidates, &mut gone, &tokens, &mut total);
        if total > lists_limit {
            // Still over (and over the lists' limit): the markers go terse (no file or name lists) in the end, so weigh the
            // remaining steps with terse markers — a run that pays only without its lists must
            // still be elided (also when no run paid with them: compacting the output again would
            // find it), or a request that could fit stays over.
            let terse_ctx = ElideContext { terse: true, ..ctx };
            terse_ctx.elide_to_fixpoint(edits, &units, &candidates, &mut gone, &tokens, &mut total);
            went_terse = !gone.is_empty();
        }
    }
    for (u, tier) in final_tier.iter().enumerate() {
        if gone.contains(&u) {
            continue;
        }
        match tier {
            Tier::Focus => report.focus += 1,
            Tier::Recent => report.recent += 1,
            Tier::Summary => report.summary += 1,
            Tier::Background => report.background += 1,
        }
    }
    // Still over the lists' limit after eliding all it could: the markers drop their file and name
    // lists, so that what cannot be elided (system, users, tail, tools) plus the markers fits
    // whenever it can.
    let terse = went_terse || total > lists_limit && !gone.is_empty();
    let final_ctx = ElideContext { terse, ..ctx };
    let spans = run_spans(edits, &units, &gone);
    if terse {
        total = final_ctx.elided_total(edits, &tokens, &spans);
    }
    let runs: BTreeMap<usize, (usize, String)> =
        spans.into_iter().map(|(start, end)| (start, (end, final_ctx.marker(edits, start, end).0))).collect();
    elided.lists = runs
        .iter()
        .filter_map(|(&start, &(end, _))| derived_id_list(&run_ids(&facts, conv, edits, start, end)))
        .collect();
    for (start, (end, marker)) in &runs {
        let mut raw_tokens = 0i64;
        let mut raw_chars = 0i64;
        for idx in *start..*end {
            if !edits.dropped[idx] {
                elided.messages.insert(idx);
                raw_tokens += counter.message(conv.raw[idx]) as i64;
                raw_chars += conv.raw[idx].len() as i64;
            }
        }
        elided.tokens_saved += raw_tokens - counter.message(marker) as i64;
        elided.chars_saved += raw_chars - marker.len() as i64;
    }
    report.elided_groups = gone.len() as u64;
    report.elided_messages = elided.messages.len() as u64;
    report.over_target = total > target;
    elided.runs = runs;
    Fit { report, elided }
}

/// Tokens of the history as the rules left it: the groups before the boundary that tiers and elision
/// may touch (tool calls, assistant messages, system messages after the first), less any group a rule
/// keeps whole. What [`HistoryBudget`] bounds.
fn history_tokens(conv: &Conversation<'_>, edits: &Edits, tokens: &[u64]) -> u64 {
    conv.groups
        .iter()
        .filter(|g| {
            history_kind(conv, g.kind, g.start) && !(g.start..g.end).any(|i| edits.kept[i] && !edits.dropped[i])
        })
        .map(|g| tokens[g.start..g.end].iter().sum::<u64>())
        .sum()
}

/// A group of a kind tiers and elision may compress: tool calls, assistant text, a later system message.
fn history_kind(conv: &Conversation<'_>, kind: GroupKind, start: usize) -> bool {
    match kind {
        GroupKind::ToolCalls | GroupKind::Assistant => true,
        GroupKind::System => conv.first_system != Some(start),
        GroupKind::User | GroupKind::Other => false,
    }
}

/// Per message, what an elision marker says of it (tool name and files of a tool result; what an
/// earlier elision marker stood for), computed once per [`fit`]: markers are re-rendered at every
/// elision step, and a message's facts never change.
struct MarkerFacts {
    tool_results: Vec<Option<(String, Vec<String>)>>,
    /// Per tool result, the identifiers the elision marker may list (`{names}`: those its collapse
    /// marker lists, or would list); empty when the template does not ask for them.
    names: Vec<Vec<String>>,
    earlier_elisions: Vec<Option<ElisionSummary>>,
    /// Per message, the id-list entries an elision marker has for it (`{retrieve}`, see
    /// [`id_entry`]): a tool result's own id with its call, or for a result that is already a
    /// marker (an earlier compaction) the ids that marker shows; for an earlier elision marker the
    /// ids it shows, or its list id; empty for other messages or when the template does not ask.
    ids: Vec<Vec<String>>,
    /// How many names an elision marker lists: [`NAMES_PER_ELISION`], or
    /// [`NAMES_PER_ELISION_AT_FLOOR`] when the history floor raised the target.
    names_per_elision: usize,
}

impl MarkerFacts {
    fn new(engine: &Engine, conv: &Conversation<'_>, edits: &Edits, names_per_elision: usize) -> MarkerFacts {
        let tool_results = (0..conv.boundary)
            .map(|idx| match &conv.msgs[idx] {
                Some(m) if m.role == "tool" => {
                    let facts = conv.facts(idx);
                    Some((facts.tool.clone(), facts.files.clone()))
                }
                _ => None,
            })
            .collect();
        let wants_names = placeholders(&engine.policy.spec.tiers.elision_template).contains(&"names");
        let indices: Vec<usize> = (0..conv.boundary).collect();
        let names = conv.map_each(&indices, |&idx| {
            if !wants_names || conv.outcomes[idx].is_none() {
                return Vec::new();
            }
            // A result already compacted reads as its marker: the tool's name is not a name of it.
            let tool = &conv.facts(idx).tool;
            conv.names(idx).iter().filter(|n| *n != tool).cloned().collect()
        });
        let earlier_elisions: Vec<Option<ElisionSummary>> =
            (0..conv.boundary).map(|idx| earlier_elision(conv, edits, idx)).collect();
        let wants_ids = placeholders(&engine.policy.spec.tiers.elision_template).contains(&"retrieve");
        let ids = conv.map_each(&indices, |&idx| {
            if !wants_ids {
                return Vec::new();
            }
            if let Some(earlier) = &earlier_elisions[idx] {
                return match earlier.listed {
                    true => earlier
                        .ids
                        .iter()
                        .map(|id| id_entry(id, &format!("{LIST_ENTRY} ({} messages)", group_digits(earlier.messages))))
                        .collect(),
                    false => earlier.ids.clone(),
                };
            }
            match &conv.outcomes[idx] {
                Some(_) if edits.compacted[idx] => {
                    let text = conv.msgs[idx].as_ref().map(|m| m.text()).unwrap_or_default();
                    let call = conv.facts(idx).call();
                    let mut ids: Vec<String> = Vec::new();
                    for hex in content_ids_in(&text) {
                        let entry = id_entry(&format!("pare:{hex}"), &call);
                        if !ids.contains(&entry) {
                            ids.push(entry);
                        }
                    }
                    ids
                }
                Some(_) => vec![id_entry(conv.content_id(idx), &conv.facts(idx).call())],
                None => Vec::new(),
            }
        });
        MarkerFacts { tool_results, names, earlier_elisions, ids, names_per_elision }
    }
}

/// Each unit's [`MarkerSummary`] (what an elision marker says of it) and the texts they refer to,
/// made once per [`fit`].
struct UnitSummaries<'f> {
    texts: Texts<'f>,
    units: Vec<MarkerSummary>,
}

impl<'f> UnitSummaries<'f> {
    fn new(facts: &'f MarkerFacts, conv: &Conversation<'_>, edits: &Edits, units: &[Unit]) -> UnitSummaries<'f> {
        let mut texts = Texts::default();
        let mut seen = Seen::default();
        let cap = facts.names_per_elision;
        let units = units
            .iter()
            .map(|unit| {
                let mut summary: Option<MarkerSummary> = None;
                for idx in unit.start..unit.end {
                    let Some(one) = message_summary(facts, conv, edits, idx, &mut texts, &mut seen) else { continue };
                    summary = Some(match summary {
                        Some(before) => before.then(&one, cap, &mut seen),
                        None => one,
                    });
                }
                summary.unwrap_or_default()
            })
            .collect();
        UnitSummaries { texts, units }
    }
}

/// What an elision marker says of message `idx` alone (`None`: nothing, a dropped message or one
/// that is not a chat message), as [`elision_marker`] reads it.
fn message_summary<'f>(
    facts: &'f MarkerFacts,
    conv: &Conversation<'_>,
    edits: &Edits,
    idx: usize,
    texts: &mut Texts<'f>,
    seen: &mut Seen,
) -> Option<MarkerSummary> {
    let m = conv.msgs[idx].as_ref()?;
    if edits.dropped[idx] {
        return None;
    }
    let mut summary = MarkerSummary::default();
    let add_tool =
        |summary: &mut MarkerSummary, id: u32, k: usize| match summary.tools.binary_search_by_key(&id, |t| t.0) {
            Ok(at) => summary.tools[at].1 += k,
            Err(at) => summary.tools.insert(at, (id, k)),
        };
    let (files, names): (&'f [String], &'f [String]) = match &facts.earlier_elisions[idx] {
        Some(earlier) => {
            summary.n = earlier.messages;
            summary.notes = earlier.notes;
            for (tool, k) in &earlier.tools {
                add_tool(&mut summary, texts.id(tool), *k);
            }
            (&earlier.files, &earlier.names)
        }
        None => {
            summary.n = 1;
            let mut files: &'f [String] = &[];
            if let Some(Some((tool, mentioned))) = facts.tool_results.get(idx) {
                add_tool(&mut summary, texts.id(tool), 1);
                files = mentioned;
            } else if m.role == "assistant" && m.tool_calls.as_ref().is_none_or(|t| t.is_empty()) {
                summary.notes = 1;
            } else if is_system(&m.role) {
                add_tool(&mut summary, texts.id("system"), 1);
            }
            (files, &facts.names[idx])
        }
    };
    summary.ids = facts.ids[idx].iter().map(|entry| texts.id(entry)).collect();
    for file in files {
        if summary.files.len() >= MAX_FILES {
            break;
        }
        let id = texts.id(file);
        if !summary.files.contains(&id) {
            summary.files.push(id);
        }
    }
    seen.clear();
    for name in names {
        if summary.names.len() >= facts.names_per_elision {
            break;
        }
        let id = texts.id(name);
        if seen.insert(id) {
            summary.names.push(id);
        }
    }
    Some(summary)
}

/// What elision needs besides the state it changes.
struct ElideContext<'e, 'c, 'a> {
    engine: &'e Engine,
    facts: &'e MarkerFacts,
    summaries: &'e UnitSummaries<'e>,
    conv: &'c Conversation<'a>,
    counter: &'e dyn CountTokens,
    memo: &'e Memo,
    fixed_extra: u64,
    /// Weigh steps with terse markers (no file or name lists).
    terse: bool,
}

impl ElideContext<'_, '_, '_> {
    /// The marker of the elided run `start..end` and its tokens (see [`Memo`]).
    fn marker(&self, edits: &Edits, start: usize, end: usize) -> (String, u64) {
        let key = (start, end, self.terse, self.facts.names_per_elision);
        if let Some(found) = self.memo.markers.borrow().get(&key) {
            return found.clone();
        }
        let marker = elision_marker(self.engine, self.facts, self.conv, edits, start, end, self.terse);
        let tokens = self.counter.message(&marker);
        self.memo.markers.borrow_mut().insert(key, (marker.clone(), tokens));
        (marker, tokens)
    }

    /// Tokens of the request with the runs `spans` (in order) elided.
    fn elided_total(&self, edits: &Edits, tokens: &[u64], spans: &[(usize, usize)]) -> u64 {
        let mut total = self.fixed_extra;
        let mut idx = 0;
        for &(start, end) in spans {
            total += (idx..start).filter(|&i| !edits.dropped[i]).map(|i| tokens[i]).sum::<u64>();
            total += self.marker_tokens(edits, start, end);
            idx = end;
        }
        total + (idx..self.conv.boundary).filter(|&i| !edits.dropped[i]).map(|i| tokens[i]).sum::<u64>()
    }

    /// The tokens of [`ElideContext::marker`], without copying the marker.
    fn marker_tokens(&self, edits: &Edits, start: usize, end: usize) -> u64 {
        let key = (start, end, self.terse, self.facts.names_per_elision);
        if let Some(tokens) = self.memo.marker_tokens.borrow().get(&key) {
            return *tokens;
        }
        if let Some((_, tokens)) = self.memo.markers.borrow().get(&key) {
            return *tokens;
        }
        self.marker(edits, start, end).1
    }

    /// The tokens of the marker of `start..end`, given the run's summary: rendered from the
    /// summary, without reading the run's messages (see [`Memo::marker_tokens`]).
    fn marker_tokens_of(&self, start: usize, end: usize, summary: &MarkerSummary) -> u64 {
        let key = (start, end, self.terse, self.facts.names_per_elision);
        if let Some(tokens) = self.memo.marker_tokens.borrow().get(&key) {
            return *tokens;
        }
        if let Some((_, tokens)) = self.memo.markers.borrow().get(&key) {
            return *tokens;
        }
        let tokens = self.counter.message(&summary_marker(
            self.engine,
            &self.summaries.texts,
            summary,
            self.conv.retrieve_tool.as_deref(),
            self.terse,
        ));
        self.memo.marker_tokens.borrow_mut().insert(key, tokens);
        tokens
    }

    /// Weigh what is elided so far with this context's markers, then elide whatever still pays, to a
    /// fixpoint (no stop before).
    fn elide_to_fixpoint(
        &self,
        edits: &Edits,
        units: &[Unit],
        candidates: &[usize],
        gone: &mut BTreeSet<usize>,
        tokens: &[u64],
        total: &mut u64,
    ) {
        *total = self.elided_total(edits, tokens, &run_spans(edits, units, gone));
        for _ in 0..=units.len() {
            let left: Vec<usize> = candidates.iter().copied().filter(|u| !gone.contains(u)).collect();
            if !self.elide_in_order(edits, units, &left, gone, tokens, total, |_, _| false) {
                break;
            }
        }
    }

    /// Elide `candidates` in order while that lowers the total (run markers included), until `stop`
    /// says enough. A group smaller than the marker that would replace it does not pay on its own, so
    /// candidates that do not pay are held back, and a candidate is committed together with the held
    /// back ones of *its own run* as soon as that run lowers the total (a run of small groups shares one
    /// marker). Held-back groups elsewhere never ride along: a run that does not pay would otherwise
    /// hide one that does, and compacting the output again would find it (idempotence).
    /// Returns whether anything was elided.
    ///
    /// Each step weighs only what changes: the run the candidate joins (among the groups elided or
    /// held back, found in a union of runs that keeps each run's [`MarkerSummary`]), the tokens of
    /// its groups still there and the markers of the elided runs it swallows (sums over ranges of a
    /// Fenwick tree), and its new marker (rendered from the summary). A step costs the logarithm of
    /// the conversation and the length of one marker; re-reading the run and totalling the request
    /// at each step would make it linear, and a long conversation's fit quadratic.
    #[allow(clippy::too_many_arguments)]
    fn elide_in_order(
        &self,
        edits: &Edits,
        units: &[Unit],
        candidates: &[usize],
        gone: &mut BTreeSet<usize>,
        tokens: &[u64],
        total: &mut u64,
        stop: impl Fn(u64, usize) -> bool,
    ) -> bool {
        #[cfg(test)]
        if tests::REFERENCE.with(std::cell::Cell::get) {
            return self.reference_elide_in_order(edits, units, candidates, gone, tokens, total, stop);
        }
        let n_units = units.len();
        let cap = self.facts.names_per_elision;
        let summaries = &self.summaries.units;
        // Two groups one after the other make one run when only dropped messages lie between them.
        let joins: Vec<bool> = (0..n_units)
            .map(|w| w + 1 < n_units && (units[w].end..units[w + 1].start).all(|i| edits.dropped[i]))
            .collect();
        let unit_tokens: Vec<u64> = units
            .iter()
            .map(|unit| (unit.start..unit.end).filter(|&i| !edits.dropped[i]).map(|i| tokens[i]).sum())
            .collect();
        // The tokens of each group still there; the runs of groups elided or held back; the elided
        // runs (first group → last group, marker tokens) with their markers' tokens at their first
        // group.
        let mut there = Fenwick::new(n_units);
        let mut runs = Runs::new(n_units);
        let mut elided: BTreeMap<usize, (usize, u64)> = BTreeMap::new();
        let mut markers = Fenwick::new(n_units);
        let mut seen = Seen::default();
        for (w, &n) in unit_tokens.iter().enumerate() {
            if !gone.contains(&w) {
                there.add(w, n);
            }
        }
        let mut run_first = None;
        for &w in gone.iter() {
            let (_, _, summary) = runs.would_join(w, &joins, &summaries[w], cap, &mut seen);
            runs.join(w, &joins, summary);
            let first = *run_first.get_or_insert(w);
            if !(joins[w] && gone.contains(&(w + 1))) {
                let marker = self.marker_tokens(edits, units[first].start, units[w].end);
                elided.insert(first, (w, marker));
                markers.add(first, marker);
                run_first = None;
            }
        }
        let mut pending: BTreeSet<usize> = BTreeSet::new();
        let mut changed = false;
        for &u in candidates {
            if stop(*total, u) {
                break;
            }
            // The run `u` would join, counting the held-back groups.
            let (first, last, summary) = runs.would_join(u, &joins, &summaries[u], cap, &mut seen);
            let marker = self.marker_tokens_of(units[first].start, units[last].end, &summary);
            runs.join(u, &joins, summary);
            let removed = there.range(first, last) + markers.range(first, last);
            let new_total = (*total + marker).saturating_sub(removed);
            if new_total < *total {
                *total = new_total;
                let joined: Vec<usize> = pending.range(first..=last).copied().collect();
                for w in joined.into_iter().chain([u]) {
                    pending.remove(&w);
                    gone.insert(w);
                    there.sub(w, unit_tokens[w]);
                }
                let swallowed: Vec<(usize, u64)> =
                    elided.range(first..=last).map(|(&start, &(_, marker))| (start, marker)).collect();
                for (start, marker) in swallowed {
                    elided.remove(&start);
                    markers.sub(start, marker);
                }
                elided.insert(first, (last, marker));
                markers.add(first, marker);
                changed = true;
            } else {
                pending.insert(u);
            }
        }
        changed
    }
}

/// Rewrite a unit's messages to their form at `tier`, where that saves tokens.
fn apply_tier(
    forms: &Forms<'_, '_, '_>,
    edits: &mut Edits,
    rendered: &mut [Option<String>],
    tokens: &mut [u64],
    unit: &Unit,
    tier: Tier,
) {
    let (conv, counter) = (forms.conv, forms.counter);
    let rule = match tier {
        Tier::Focus => return,
        Tier::Recent => RuleId::TierLight,
        Tier::Summary => RuleId::TierHeavy,
        Tier::Background => RuleId::TierFacts,
    };
    // A group still over target later goes to facts only: that form is made from the edits as they
    // are before this tier changes them, as every other form of the group was.
    unit.form(Tier::Background, forms, edits, tokens);
    for (k, form) in unit.form(tier, forms, edits, tokens).0.iter().enumerate() {
        let idx = unit.start + k;
        let Some(form) = form else { continue };
        let text = edits.render_as(conv, idx, Some(form));
        if counter.message(&text) >= tokens[idx] {
            continue;
        }
        edits.set_text(conv, idx, rule, form.text.clone(), form.embed);
        edits.claimed[idx] = true;
        let text = edits.render(conv, idx);
        tokens[idx] = counter.message(&text);
        edits.tokens_saved[idx] = counter.message(conv.raw[idx]) as i64 - tokens[idx] as i64;
        rendered[idx] = Some(text);
    }
}

/// Maximal runs `start..end` of elided units (dropped messages between them do not break a run).
fn run_spans(edits: &Edits, units: &[Unit], gone: &BTreeSet<usize>) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = gone.iter().map(|&u| (units[u].start, units[u].end)).collect();
    spans.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (start, end) in spans {
        if let Some(last) = merged.last_mut()
            && (last.1..start).all(|i| edits.dropped[i])
        {
            last.1 = end;
            continue;
        }
        merged.push((start, end));
    }
    merged
}

/// `{"role":"assistant","content":"[pare: 12 earlier messages elided — read_file ×5, terminal ×7; files: …]"}`.
fn elision_marker(
    engine: &Engine,
    marker_facts: &MarkerFacts,
    conv: &Conversation<'_>,
    edits: &Edits,
    start: usize,
    end: usize,
    terse: bool,
) -> String {
    let mut n = 0;
    let mut tools: BTreeMap<String, usize> = BTreeMap::new();
    let mut files: Vec<String> = Vec::new();
    let mut notes = 0;
    for idx in start..end {
        let Some(m) = &conv.msgs[idx] else { continue };
        if edits.dropped[idx] {
            continue;
        }
        // An earlier elision marker: what it stood for joins this one.
        if let Some(earlier) = &marker_facts.earlier_elisions[idx] {
            n += earlier.messages;
            for (tool, k) in &earlier.tools {
                *tools.entry(tool.clone()).or_default() += k;
            }
            notes += earlier.notes;
            for f in &earlier.files {
                if files.len() < MAX_FILES && !files.contains(f) {
                    files.push(f.clone());
                }
            }
            continue;
        }
        n += 1;
        if let Some(Some((tool, mentioned))) = marker_facts.tool_results.get(idx) {
            *tools.entry(tool.clone()).or_default() += 1;
            for f in mentioned {
                if files.len() < MAX_FILES && !files.contains(f) {
                    files.push(f.clone());
                }
            }
        } else if m.role == "assistant" && m.tool_calls.as_ref().is_none_or(|t| t.is_empty()) {
            notes += 1;
        } else if is_system(&m.role) {
            *tools.entry("system".into()).or_default() += 1;
        }
    }
    // Names: the most recent results' first (the next step is likelier to reuse them), then what an
    // earlier elision marker listed; at most `names_per_elision`, none twice.
    let mut names: Vec<&str> = Vec::new();
    for idx in (start..end).rev() {
        if edits.dropped[idx] || conv.msgs[idx].is_none() {
            continue;
        }
        let listed = match &marker_facts.earlier_elisions[idx] {
            Some(earlier) => &earlier.names,
            None => &marker_facts.names[idx],
        };
        for n in listed {
            if names.len() >= marker_facts.names_per_elision {
                break;
            }
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let ids = run_ids(marker_facts, conv, edits, start, end);
    let tools: Vec<(&str, usize)> = tools.iter().map(|(tool, k)| (tool.as_str(), *k)).collect();
    let lists = Lists { files: &files, names: &names, ids: &ids, retrieve_tool: conv.retrieve_tool.as_deref() };
    elision_text(engine, n, &tools, notes, &lists, terse)
}

/// The id-list entries of the run `start..end` (see [`MarkerFacts::ids`]): the most recent outputs'
/// first, then what an earlier elision marker named, none twice.
fn run_ids<'f>(
    facts: &'f MarkerFacts,
    conv: &Conversation<'_>,
    edits: &Edits,
    start: usize,
    end: usize,
) -> Vec<&'f str> {
    let mut ids: Vec<&str> = Vec::new();
    let mut seen: rustc_hash::FxHashSet<&str> = rustc_hash::FxHashSet::default();
    for idx in (start..end).rev() {
        if edits.dropped[idx] || conv.msgs[idx].is_none() {
            continue;
        }
        for entry in &facts.ids[idx] {
            if seen.insert(entry) {
                ids.push(entry);
            }
        }
    }
    ids
}

/// The lists an elision marker shows.
struct Lists<'l> {
    files: &'l [String],
    names: &'l [&'l str],
    ids: &'l [&'l str],
    retrieve_tool: Option<&'l str>,
}

/// [`elision_marker`] of a run given its [`MarkerSummary`] (the same bytes, see
/// `summary_markers_are_the_markers_of_their_runs`).
fn summary_marker(
    engine: &Engine,
    texts: &Texts<'_>,
    summary: &MarkerSummary,
    retrieve_tool: Option<&str>,
    terse: bool,
) -> String {
    let mut tools: Vec<(&str, usize)> = summary.tools.iter().map(|&(id, k)| (texts.text(id), k)).collect();
    tools.sort_unstable();
    let files: Vec<String> = summary.files.iter().map(|&id| texts.text(id).to_owned()).collect();
    let names: Vec<&str> = summary.names.iter().map(|&id| texts.text(id)).collect();
    let ids: Vec<&str> = summary.ids.iter().map(|&id| texts.text(id)).collect();
    let lists = Lists { files: &files, names: &names, ids: &ids, retrieve_tool };
    elision_text(engine, summary.n, &tools, summary.notes, &lists, terse)
}

/// The elision marker message: `n` messages, per tool (in name order) its results, assistant
/// notes, files and names (left out when `terse`).
fn elision_text(
    engine: &Engine,
    n: usize,
    tools: &[(&str, usize)],
    notes: usize,
    lists: &Lists<'_>,
    terse: bool,
) -> String {
    let Lists { files, names, ids, retrieve_tool } = *lists;
    let mut what: Vec<String> = tools.iter().map(|(t, k)| format!("{t} ×{k}")).collect();
    if notes > 0 {
        what.push(format!("assistant notes ×{notes}"));
    }
    let text = render(&engine.policy.spec.tiers.elision_template, &|name| match name {
        "n" => Some(group_digits(n)),
        "tools" => Some(what.join(", ")),
        "files" => Some(if terse { String::new() } else { files_suffix(files) }),
        "names" => Some(if terse { String::new() } else { names_suffix(names) }),
        // Kept in a terse marker: the ids are what gets the run back.
        "retrieve" => Some(ids_suffix(ids, retrieve_tool)),
        _ => None,
    });
    serde_json::json!({"role": "assistant", "content": text}).to_string()
}

/// What message `idx` summarises when it is an elision marker of an earlier compaction.
fn earlier_elision(conv: &Conversation<'_>, edits: &Edits, idx: usize) -> Option<ElisionSummary> {
    let m = conv.msgs[idx].as_ref()?;
    if m.role != "assistant" || !edits.compacted[idx] || m.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
        return None;
    }
    parse_elision(&m.text())
}

/// The groups tiers may touch, scored (their forms are made on demand, see [`Unit::form`]; their
/// scores once per [`Memo`]).
fn units(
    engine: &Engine,
    conv: &Conversation<'_>,
    edits: &Edits,
    marker_facts: &MarkerFacts,
    ages: Option<&[f64]>,
    memo: &Memo,
) -> Vec<Unit> {
    // What scoring reads besides the group, made when the first group is scored.
    let scoring = OnceCell::new();
    let mut out = Vec::new();
    for g in &conv.groups {
        let elidable_kind = history_kind(conv, g.kind, g.start);
        let live: Vec<usize> = (g.start..g.end).filter(|&i| !edits.dropped[i]).collect();
        if !elidable_kind || live.is_empty() || live.iter().any(|&i| edits.kept[i]) {
            continue;
        }
        // pare's own notes stay, except an elision marker in the default form: eliding it again merges
        // what it lists into the new marker, so successive epochs leave one marker, not a pile.
        let earlier_elision = g.kind == GroupKind::Assistant && marker_facts.earlier_elisions[g.start].is_some();
        if g.kind == GroupKind::Assistant && edits.compacted[g.start] && !earlier_elision {
            continue;
        }
        // An earlier elision marker is already history's least salient form: first to go.
        let score = if earlier_elision {
            -1.0
        } else {
            let known = memo.scores.borrow().get(&g.start).copied();
            known.unwrap_or_else(|| {
                let relevant = (g.start..g.end).any(|i| edits.relevant[i]);
                let score =
                    scoring.get_or_init(|| Scoring::new(conv)).score(engine, conv, g.start, g.end, ages, relevant);
                memo.scores.borrow_mut().insert(g.start, score);
                score
            })
        };
        out.push(Unit { start: g.start, end: g.end, score, forms: Default::default() });
    }
    out
}

/// What a group's salience reads besides the group: the task's words, the files the protected tail
/// works on, and the turn count from each message on.
struct Scoring {
    task: Vec<String>,
    tail_files: Vec<String>,
    assistants_from: Vec<usize>,
    file_edits: FileEdits,
}

/// What a group adds to its salience when relevance kept lines of one of its outputs under their
/// marker (`compact::relevance`: they name what the conversation works on now). Measured on the
/// tuning half (`pare eval --split tune`, epoch 16k, with 48 kept lines per output): needle recall
/// of the long mini-swe-agent sessions 0.927 at 0, 0.938 at 0.05, 0.939 at 0.15; the long OpenHands
/// sessions 0.417 at 0, 0.513 at 0.05 to 0.15; savings within 0.1 point.
pub const RELEVANT_BONUS: f64 = 0.15;

/// A full read of a file that a later full read shows again scores this share of its salience: the
/// later read says what the file holds now.
pub const SUPERSEDED_READ_FACTOR: f64 = 0.5;

impl Scoring {
    fn new(conv: &Conversation<'_>) -> Scoring {
        let mut assistants_from = vec![0usize; conv.msgs.len() + 1];
        for idx in (0..conv.msgs.len()).rev() {
            let is_assistant = conv.msgs[idx].as_ref().is_some_and(|m| m.role == "assistant");
            assistants_from[idx] = assistants_from[idx + 1] + usize::from(is_assistant);
        }
        Scoring {
            task: task_words(conv),
            tail_files: tail_files(conv),
            assistants_from,
            file_edits: FileEdits::new(conv),
        }
    }

    /// `S = w_r·R + w_e·E + w_k·K + w_f·F` of the group `start..end`.
    fn score(
        &self,
        engine: &Engine,
        conv: &Conversation<'_>,
        start: usize,
        end: usize,
        ages: Option<&[f64]>,
        relevant: bool,
    ) -> f64 {
        let sal = &engine.salience;
        let task = &self.task;
        let recency = match (sal.tau_seconds, ages) {
            // On the wall clock: the age of the group's youngest message (a result arrives after its call).
            (Some(tau), Some(ages)) => {
                let age = ages[start..end].iter().copied().fold(f64::INFINITY, f64::min).max(0.0);
                (-age / tau.max(1e-9)).exp()
            }
            _ => {
                // The latest read of a file the agent edits is as recent as the agent's latest work
                // on that file: what it keeps is what the next edit quotes.
                let from = (start..end)
                    .filter_map(|i| self.file_edits.last_touch_of_latest_read(i))
                    .max()
                    .map_or(start, |touch| touch.max(start));
                let age = self.assistants_from[from].saturating_sub(1) as f64;
                (-age / sal.tau_turns.max(1e-9)).exp()
            }
        };
        let error = (start..end)
            .any(|i| conv.outcomes[i].as_ref().is_some_and(|o| !o.status.is_ok() || o.first_error.is_some()));
        let overlap = task_overlap(conv, start, end, task);
        let keywords = if task.is_empty() { 0.0 } else { (overlap as f64 / task.len().min(10) as f64).min(1.0) };
        let files = group_files(conv, start, end);
        let edited = (start..end).any(|i| self.file_edits.is_latest_read_of_edited(i));
        let focused = edited || files.iter().any(|f| self.tail_files.iter().any(|t| same_file(f, t)));
        let score = sal.w_recency * recency
            + sal.w_error * f64::from(u8::from(error))
            + sal.w_keywords * keywords
            + sal.w_files * f64::from(u8::from(focused))
            + if relevant { RELEVANT_BONUS } else { 0.0 };
        // Superseded within the history: a read in the protected tail is what the agent works on
        // now, and `F` already ranks the history's reads of the files it touches.
        let superseded = !edited && (start..end).any(|i| self.file_edits.is_superseded_before(i, conv.boundary));
        if superseded { score * SUPERSEDED_READ_FACTOR } else { score }
    }
}

/// The text of message `idx` at `tier`, or `None` when it stays as it is.
fn form(engine: &Engine, conv: &Conversation<'_>, edits: &Edits, idx: usize, tier: Tier) -> Option<TextEdit> {
    let spec = &engine.policy.spec.tiers;
    if tier == Tier::Focus || edits.compacted[idx] || edits.kept[idx] {
        return None;
    }
    // A read the rules left whole for the tiers: its structural map below Focus.
    if let Some(map) = &edits.deferred_map[idx] {
        return Some(TextEdit { text: map.clone(), embed: false });
    }
    let m = conv.msgs[idx].as_ref()?;
    let current = edits.current_text(conv, idx);
    let candidate = if conv.outcomes[idx].is_some() {
        match tier {
            Tier::Focus => return None,
            Tier::Recent => {
                if edits.claimed[idx] || current.chars().count() <= spec.light_max_chars || is_compacted(&current) {
                    return None;
                }
                let truncate = conv.fill_retrieve(idx, &engine.policy.spec.truncate.template);
                let short = truncate_lines(&current, spec.light_head, spec.light_tail, &truncate)
                    .unwrap_or_else(|| current.clone());
                let cap = spec.light_max_chars * 4;
                let hard_cap = conv.fill_retrieve(idx, &engine.policy.spec.hard_cap.template);
                let short = super::rules::cap_chars(&short, cap, &hard_cap).unwrap_or(short);
                TextEdit { text: short, embed: true }
            }
            Tier::Summary => TextEdit { text: conv.render_marker(idx, &spec.heavy_template), embed: false },
            Tier::Background => TextEdit { text: conv.render_marker(idx, &spec.facts_template), embed: false },
        }
    } else if m.role == "assistant" {
        if current.trim().is_empty() || is_compacted(&current) {
            return None;
        }
        let chars = current.chars().count();
        match tier {
            Tier::Focus | Tier::Recent => return None,
            Tier::Summary => {
                if chars <= spec.heavy_text_chars {
                    return None;
                }
                let head: String = current.chars().take(spec.heavy_text_chars).collect();
                let cut = chars - spec.heavy_text_chars;
                TextEdit {
                    text: format!(
                        "{}…\n[pare: {} more chars of this note omitted]",
                        head.trim_end(),
                        group_digits(cut)
                    ),
                    embed: false,
                }
            }
            Tier::Background => TextEdit {
                text: render(&spec.facts_text_template, &|name| match name {
                    "chars" => Some(group_digits(chars)),
                    "lines" => Some(group_digits(current.lines().count())),
                    "retrieve" => Some(conv.retrieve(idx)),
                    _ => None,
                }),
                embed: false,
            },
        }
    } else {
        return None;
    };
    (candidate.text != current).then_some(candidate)
}

const STOP_WORDS: &[&str] = &[
    "this",
    "that",
    "with",
    "from",
    "have",
    "will",
    "would",
    "should",
    "could",
    "there",
    "their",
    "them",
    "then",
    "than",
    "what",
    "when",
    "where",
    "which",
    "while",
    "your",
    "about",
    "into",
    "some",
    "such",
    "also",
    "only",
    "like",
    "just",
    "make",
    "sure",
    "need",
    "please",
    "following",
    "file",
    "files",
    "code",
    "none",
    "true",
    "false",
    "self",
    "return",
    "def",
    "class",
    "import",
];

/// Words of 4+ characters (identifiers included), lowercased, without common English filler.
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| w.chars().count() >= 4)
        .map(str::to_lowercase)
        .filter(|w| !STOP_WORDS.contains(&w.as_str()))
}

/// The task: the first and the latest user message (the first 8 KiB of each).
fn task_words(conv: &Conversation<'_>) -> Vec<String> {
    let users: Vec<&crate::neutral::Message> = conv.msgs.iter().flatten().filter(|m| m.role == "user").collect();
    let mut set = BTreeSet::new();
    for m in [users.first(), users.last()].into_iter().flatten() {
        let text = m.text();
        set.extend(words(super::markers::prefix_at_char_boundary(&text, 8 * 1024)));
    }
    set.into_iter().collect()
}

/// How many of the task's words (sorted, as [`task_words`] gives them) a group contains, among the
/// [`words`] of its assistant text, its calls' arguments and the start of its results. Each word of
/// the group is lowercased into one reused buffer and looked up, rather than collected: groups are
/// many and large, the task is a few dozen words.
fn task_overlap(conv: &Conversation<'_>, start: usize, end: usize, task: &[String]) -> usize {
    if task.is_empty() {
        return 0;
    }
    let mut found = vec![false; task.len()];
    let mut lower = String::new();
    let mut look_up = |text: &str| {
        for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if word.len() < 4 || word.chars().count() < 4 {
                continue;
            }
            // `str::to_lowercase` for non-ASCII words: it is what `words` does (final sigma included).
            let word = if word.is_ascii() {
                lower.clear();
                lower.extend(word.bytes().map(|b| char::from(b.to_ascii_lowercase())));
                lower.as_str()
            } else {
                lower = word.to_lowercase();
                lower.as_str()
            };
            if let Ok(i) = task.binary_search_by(|t| t.as_str().cmp(word)) {
                found[i] = true;
            }
        }
    };
    for idx in start..end {
        let Some(m) = &conv.msgs[idx] else { continue };
        match &conv.outcomes[idx] {
            Some(o) => look_up(super::markers::prefix_at_char_boundary(&o.text, 8 * 1024)),
            None => look_up(super::markers::prefix_at_char_boundary(&m.text(), 8 * 1024)),
        }
        for call in conv.calls_of_message(idx).iter() {
            look_up(&call.arguments);
        }
    }
    found.iter().filter(|&&f| f).count()
}

/// Files a group touches: its calls' path arguments and the paths its messages mention.
fn group_files(conv: &Conversation<'_>, start: usize, end: usize) -> Vec<String> {
    let mut out = Vec::new();
    for idx in start..end {
        if conv.outcomes[idx].is_some() {
            out.extend(conv.facts(idx).files.iter().cloned());
        } else if let Some(m) = &conv.msgs[idx] {
            out.extend(mentioned_files(&m.text(), 8));
            for call in conv.calls_of_message(idx).iter() {
                out.extend(path_argument(&call.arguments));
                out.extend(mentioned_files(&call.arguments, 4));
            }
        }
    }
    out
}

/// Files the protected tail works on: its calls' paths and the paths its calls and notes mention.
fn tail_files(conv: &Conversation<'_>) -> Vec<String> {
    let mut out = Vec::new();
    for idx in conv.boundary..conv.msgs.len() {
        let Some(m) = &conv.msgs[idx] else { continue };
        if m.role == "assistant" {
            out.extend(mentioned_files(&m.text(), 8));
            for call in conv.calls_of_message(idx).iter() {
                out.extend(path_argument(&call.arguments));
                out.extend(mentioned_files(&call.arguments, 4));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// `src/a.py` and `/repo/src/a.py` name the same file.
fn same_file(a: &str, b: &str) -> bool {
    let (long, short) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    long == short || (long.ends_with(short) && long.as_bytes()[long.len() - short.len() - 1] == b'/')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::QuarterCounter;
    use crate::wire::ChatBody;

    thread_local! {
        /// Elide with [`ElideContext::reference_elide_in_order`] (the test of the fast one).
        pub(super) static REFERENCE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    impl ElideContext<'_, '_, '_> {
        /// [`ElideContext::elide_in_order`] as its doc states it, step by step: each step finds the
        /// run from every group elided or held back and totals the whole request again (quadratic).
        #[allow(clippy::too_many_arguments)]
        pub(super) fn reference_elide_in_order(
            &self,
            edits: &Edits,
            units: &[Unit],
            candidates: &[usize],
            gone: &mut BTreeSet<usize>,
            tokens: &[u64],
            total: &mut u64,
            stop: impl Fn(u64, usize) -> bool,
        ) -> bool {
            let mut pending: BTreeSet<usize> = BTreeSet::new();
            let mut changed = false;
            for &u in candidates {
                if stop(*total, u) {
                    break;
                }
                let mut all = gone.clone();
                all.extend(pending.iter().copied());
                all.insert(u);
                let (run_start, run_end) = run_spans(edits, units, &all)
                    .into_iter()
                    .find(|&(start, end)| (start..end).contains(&units[u].start))
                    .expect("every elided unit lies in a run");
                let joined: Vec<usize> = pending
                    .iter()
                    .copied()
                    .filter(|&p| units[p].start >= run_start && units[p].start < run_end)
                    .collect();
                let mut trial = gone.clone();
                trial.extend(joined.iter().copied());
                trial.insert(u);
                let new_total = self.elided_total(edits, tokens, &run_spans(edits, units, &trial));
                if new_total < *total {
                    *total = new_total;
                    *gone = trial;
                    for p in joined {
                        pending.remove(&p);
                    }
                    changed = true;
                } else {
                    pending.insert(u);
                }
            }
            changed
        }
    }

    /// The request `body` compacted with `protect_last_turns` and a target of `share` % of its
    /// tokens, elided by the fast steps or the reference ones.
    fn compact_at(body: &[u8], protect_last_turns: u32, share: u64, reference: bool) -> (Vec<String>, String) {
        let parsed = ChatBody::parse(body).unwrap();
        let view = parsed.view();
        let mut engine = Engine::default_pack();
        engine.policy.spec.protect_last_turns = protect_last_turns;
        let tokens = crate::tokens::request_tokens(&QuarterCounter, view.messages, view.tools);
        let options = super::super::CompactOptions { target_tokens: Some(tokens * share / 100), ..Default::default() };
        REFERENCE.with(|r| r.set(reference));
        let out = engine.compact(&view, &options, &QuarterCounter);
        REFERENCE.with(|r| r.set(false));
        (out.prefix, serde_json::to_string(&out.report).unwrap())
    }

    /// A long agent session: many small tool steps (some results repeated, so that the rules drop
    /// or fold some), a few notes and later system messages, an earlier elision marker, files and
    /// names in the outputs.
    fn long_session(n_steps: usize) -> Vec<u8> {
        use serde_json::json;
        let mut messages = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Fix the parser in src/parser.rs and run the tests."}),
            json!({"role": "assistant", "content": "[pare: 12 earlier messages elided — terminal ×6, read_file ×2, assistant notes ×1; files: a.py, b/c.rs; names: load_user, HAT170]"}),
        ];
        for k in 0..n_steps {
            match k % 9 {
                4 => messages.push(json!({"role": "assistant", "content": format!("Step {k}: the failure in src/mod_{}.rs is next. {}", k % 5, "word ".repeat(k % 40))})),
                7 => messages.push(json!({"role": "system", "content": format!("reminder {k}")})),
                _ => {
                    let id = format!("call_{k}");
                    let (tool, args, output) = if k % 3 == 0 {
                        ("read_file", json!({"path": format!("src/mod_{}.rs", k % 7)}).to_string(), format!("fn item_{k}() {{}}\n{}", "let x = 1;\n".repeat(k % 13)))
                    } else {
                        ("terminal", json!({"command": format!("pytest tests/test_{}.py", k % 4)}).to_string(), format!("{} passed, ticket T{:05} in src/mod_{}.rs\n{}", k % 11, k * 37, k % 6, "ok\n".repeat(k % 17)))
                    };
                    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": tool, "arguments": args}}]}));
                    messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                }
            }
        }
        json!({"model": "m", "messages": messages}).to_string().into_bytes()
    }

    /// Regression: elision's steps read each candidate's whole run and totalled
    /// the whole request again, so fitting a conversation that far exceeds its target was quadratic
    /// (10,000 messages took over a second a request). The fast steps choose what the stated steps
    /// choose: the same forwarded messages and report, on real agent requests and long sessions, at
    /// targets from tight to loose.
    #[test]
    fn fast_elision_steps_choose_what_the_stated_steps_choose() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compact");
        let mut bodies: Vec<(String, Vec<u8>)> = Vec::new();
        for name in [
            "hermes_chat",
            "mini_swe_agent_sqlfluff",
            "openhands_django_11066",
            "swe_agent_function_calling",
            "tau_bench_airline",
        ] {
            bodies.push((name.into(), std::fs::read(dir.join(format!("{name}.json"))).unwrap()));
        }
        for n in [40, 150, 400] {
            bodies.push((format!("long session {n}"), long_session(n)));
        }
        let mut elided = 0;
        for (name, body) in &bodies {
            for protect in [1, 2, 5] {
                for share in [5, 15, 30, 50, 70, 90] {
                    let fast = compact_at(body, protect, share, false);
                    let reference = compact_at(body, protect, share, true);
                    assert_eq!(fast, reference, "{name}, protect {protect}, target {share} %");
                    elided += usize::from(fast.1.contains("\"elision\""));
                }
            }
        }
        assert!(elided > 40, "only {elided} cases elided");
    }

    /// A marker rendered from a run's summary is the marker read from the run's messages.
    #[test]
    fn summary_markers_are_the_markers_of_their_runs() {
        let body = long_session(120);
        let parsed = ChatBody::parse(&body).unwrap();
        let view = parsed.view();
        let engine = Engine::default_pack();
        let options = super::super::CompactOptions::default();
        let prepared = engine.prepare(&view, &options, &QuarterCounter);
        let (conv, edits) = (&prepared.conv, &prepared.edits);
        let memo = Memo::default();
        for names_per_elision in [3, NAMES_PER_ELISION] {
            let facts = MarkerFacts::new(&engine, conv, edits, names_per_elision);
            let units = units(&engine, conv, edits, &facts, None, &memo);
            let summaries = UnitSummaries::new(&facts, conv, edits, &units);
            assert!(units.len() > 50);
            let mut seen = Seen::default();
            for first in (0..units.len()).step_by(7) {
                let mut summary = summaries.units[first].clone();
                for last in first..units.len().min(first + 40) {
                    if last > first {
                        // A run goes on only over dropped messages.
                        if !(units[last - 1].end..units[last].start).all(|i| edits.dropped[i]) {
                            break;
                        }
                        summary = summary.then(&summaries.units[last], names_per_elision, &mut seen);
                    }
                    let (start, end) = (units[first].start, units[last].end);
                    for terse in [false, true] {
                        assert_eq!(
                            summary_marker(&engine, &summaries.texts, &summary, conv.retrieve_tool.as_deref(), terse),
                            elision_marker(&engine, &facts, conv, edits, start, end, terse),
                            "units {first}..={last}"
                        );
                    }
                }
            }
        }
    }

    /// Scores of each group before the boundary of `messages` (one protected turn), by first message.
    fn scores(messages: &[serde_json::Value]) -> BTreeMap<usize, f64> {
        use super::super::outcome::SuccessPolicy;
        use super::super::pack::{RulesSpec, SuccessSpec};
        let raw: Vec<String> = messages.iter().map(|m| m.to_string()).collect();
        let refs: Vec<&str> = raw.iter().map(String::as_str).collect();
        let policy = SuccessPolicy::new(&SuccessSpec::default());
        let conv = Conversation::analyse(
            &crate::neutral::View::of_texts(&refs, None),
            1,
            &RulesSpec::default().key_arguments,
            &policy,
            false,
        );
        let engine = Engine::default_pack();
        let scoring = Scoring::new(&conv);
        conv.groups
            .iter()
            .filter(|g| g.kind == GroupKind::ToolCalls)
            .map(|g| (g.start, scoring.score(&engine, &conv, g.start, g.end, None, false)))
            .collect()
    }

    fn step(id: &str, tool: &str, args: serde_json::Value, output: &str) -> [serde_json::Value; 2] {
        use serde_json::json;
        [
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function",
                "function": {"name": tool, "arguments": args.to_string()}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": output}),
        ]
    }

    /// Of two full views of one path, the older scores half what it would alone; the latest view of a
    /// file the agent edits scores as recent as the latest call that names the file, above a log that
    /// came after the view.
    #[test]
    fn the_latest_view_of_an_edited_file_wins_over_older_views_and_logs() {
        use serde_json::json;
        let view = |id: &str| step(id, "str_replace_editor", json!({"command": "view", "path": "/w/a.py"}), "1\tx = 1");
        let log = |id: &str| step(id, "execute_bash", json!({"command": "make test"}), "all passed");
        let head = [json!({"role": "system", "content": "agent"}), json!({"role": "user", "content": "go"})];
        let tail = step("t", "execute_bash", json!({"command": "ls"}), "ok");
        let session = |steps: Vec<[serde_json::Value; 2]>| -> Vec<serde_json::Value> {
            head.iter().cloned().chain(steps.into_iter().flatten()).chain(tail.iter().cloned()).collect()
        };
        // The older view (at 2) alone, then followed by a second full view of the same path.
        let alone = scores(&session(vec![view("v1"), log("l1"), log("l2")]));
        let superseded = scores(&session(vec![view("v1"), log("l1"), view("v2")]));
        assert!((superseded[&2] - alone[&2] * SUPERSEDED_READ_FACTOR).abs() < 1e-9, "{superseded:?} {alone:?}");

        // View, log, then an edit of the viewed file: the view outranks the log after it.
        let edit = step(
            "e1",
            "str_replace_editor",
            json!({"command": "str_replace", "path": "/w/a.py", "old_str": "x = 1", "new_str": "x = 2"}),
            "edited",
        );
        let edited = scores(&session(vec![view("v1"), log("l1"), edit.clone()]));
        assert!(edited[&2] > edited[&4], "{edited:?}");
        // Without the edit, the log (more recent) outranks the view.
        let unedited = scores(&session(vec![view("v1"), log("l1"), log("l2")]));
        assert!(unedited[&2] < unedited[&4], "{unedited:?}");
    }

    #[test]
    fn same_file_matches_path_suffixes_only_at_a_slash() {
        assert!(same_file("/repo/src/a.py", "src/a.py"));
        assert!(same_file("a.py", "a.py"));
        assert!(!same_file("/repo/src/ba.py", "a.py"));
    }

    #[test]
    fn words_skip_filler_and_short_tokens() {
        let w: Vec<String> =
            words("Please fix the separability_matrix for nested CompoundModels in file x.py").collect();
        assert_eq!(w, vec!["separability_matrix", "nested", "compoundmodels"]);
    }
}
