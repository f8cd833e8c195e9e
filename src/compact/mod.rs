//! The compaction engine: a pure, deterministic, always-valid rewrite of a request's conversation,
//! read in pare's neutral form ([`crate::neutral`]): it knows no wire format.
//!
//! `request + policy (+ a target) → forwarded messages + report`. No I/O, no clock, no randomness;
//! it cannot fail on user data: whatever it does not understand passes through unchanged.
//!
//! The seam used by [`crate::budget`] (epochs) and `pare compact`:
//! [`Engine::compact`] returns the forwarded form of the messages *before* `boundary`; the messages
//! from `boundary` on (the protected tail) are forwarded byte-identical. That split is what lets the
//! epoch machinery keep a compacted prefix sticky and append new raw messages after it.
//!
//! # Code map
//!
//! - [`conversation`]: messages parsed once, the protected tail, tool-call groups, calls.
//! - [`outcome`]: a tool result's shape and success. [`markers`]: templates and facts.
//! - [`rules`]: one module per rule, run in priority order. [`outline`]: structural maps.
//! - [`edited`]: the files the conversation edits, the latest read of each and the lines edits touch.
//! - [`salience`]: scores, tiers and elision when a token target is given; `spans`: what elision
//!   weighs a run with (marker summaries that combine, runs, range sums).
//! - [`edits`]: what rules changed and how it is serialized. [`validate`]: invariant 1.
//! - [`report`]: what each rule saved.

pub mod conversation;
pub mod edited;
pub mod edits;
pub mod in_play;
pub mod markers;
pub mod outcome;
pub mod outline;
pub mod provenance;
pub mod relevance;
pub mod report;
pub mod rules;
pub mod salience;
mod spans;
pub mod validate;

use regex::Regex;

use crate::config::{Config, SalienceConfig, TierBudgets};
use crate::neutral::{Message, View};
use crate::tokens::CountTokens;

use crate::config::pack::{self, Pack, PackError, RulesSpec};
use conversation::Conversation;
use edits::Edits;
use outcome::SuccessPolicy;
use report::{Report, RuleId, RuleSet, RuleStats};
use rules::custom::CompiledCustom;
use validate::Skeleton;

/// Why an engine could not be built from a configuration.
pub type EngineConfigError = PackError;

/// Options of one compaction.
#[derive(Debug, Clone, Default)]
pub struct CompactOptions {
    /// Token target for the whole forwarded request (messages + tools). `None`: rules only.
    pub target_tokens: Option<u64>,
    /// A budget for the history alone, whatever the window (eager mode): see [`HistoryBudget`].
    pub history: Option<HistoryBudget>,
    /// The least history the target leaves (epoch mode): see [`HistoryFloor`].
    pub history_floor: Option<HistoryFloor>,
    /// Age in seconds of each input message (since pare first received it). With
    /// `budget.salience.tau_seconds` set, salience's recency is `exp(−age/tau_seconds)` of a group's
    /// youngest message instead of its age in turns. `None` (or a length that does not match the
    /// messages): turns.
    pub message_ages_secs: Option<Vec<f64>>,
    /// Messages before this index are forwarded as their original bytes: no rule, tier or elision
    /// touches them (a caller's cache-stable head, see `budget::compactor`). 0: none. The engine
    /// keeps at least everything up to [`CompactOptions::epoch_boundary`].
    pub keep_first: usize,
    /// The message the upstream reads in place of everything before it (a server-side compaction:
    /// a Responses `compaction` item, an Anthropic `compaction` block), when the request has one:
    /// it and everything before it are forwarded as they are (rewriting what the upstream drops
    /// saves nothing and costs the cache), and so are the tool results answering it.
    pub epoch_boundary: Option<usize>,
    /// How many last turns are protected in this compaction, in place of the policy's
    /// `protect_last_turns` (`None`: the policy's). The session compactor lowers it when the
    /// protected tail alone does not fit the model's window: the older protected turns yield.
    pub protect_last_turns: Option<u32>,
    /// The most tokens the forwarded request may reach with its elision markers' file and name
    /// lists. A request the whole history's elision leaves over its target still keeps those lists
    /// (most of what it keeps of old outputs, and cheap per identifier) while it stays within this;
    /// only above it do the markers go terse. `None`: the target.
    pub lists_limit: Option<u64>,
    /// Keep all the work on the calling thread. By default a conversation of
    /// [`conversation::PARALLEL_BYTES`] or more spreads its per-message work over the rayon pool
    /// (same output either way).
    pub single_thread: bool,
}

/// A token budget for the *history*: the messages before the protected tail that salience tiers and
/// elision may compress — every message there except the first system message, user messages and
/// groups a rule keeps whole. When the history after the rules weighs more than `high` tokens,
/// tiers and elision bring it down to `low` (or to the request's `target_tokens`, whichever asks for
/// less). It does not depend on the window, the tools or the tail: it bounds what old turns cost on
/// every request, as observation masking keeps only the last turns' outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryBudget {
    pub high: u64,
    pub low: u64,
}

/// The least *history* (what [`HistoryBudget`] counts) a token target leaves: when the rest of the
/// request (first system message, user messages, kept groups, protected tail, tools) leaves less than
/// `tokens` of `target_tokens` to the history, the target rises to that rest plus `tokens`, but never
/// above `max_target`. What the next step needs from old turns is a number of tokens (a file view,
/// a command's output), not a share of the window, so a small window keeps as much as a large one
/// can afford.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryFloor {
    pub tokens: u64,
    pub max_target: u64,
}

/// What [`Engine::compact`] produces.
#[derive(Debug, Clone)]
pub struct Compacted {
    /// Index of the first raw message of the protected tail; raw messages from here on are forwarded
    /// unchanged.
    pub boundary: usize,
    /// The forwarded form of raw messages `0..boundary`, each a complete JSON message (an elided run is
    /// one marker message, so `prefix.len()` may be smaller than `boundary`).
    pub prefix: Vec<String>,
    /// What each rule did.
    pub report: Report,
    /// A target was given and the rules alone did not reach it, so salience tiers and elision ran:
    /// the prefix is fitted as a whole. `false` means every edit in the prefix is a rule's, made
    /// message by message, so a caller may keep the compacted form of a leading part only (the
    /// epoch's lightest cut).
    pub fitted: bool,
    /// The texts the prefix's markers name that the engine derived rather than read (the id lists
    /// of elision markers, [`markers::id_list_text`]): the archive stores them with the request, so
    /// that their ids resolve like those of the hidden outputs.
    pub lists: Vec<String>,
    /// What became of each message before `boundary`.
    pub plan: Vec<Fate>,
    /// Each prefix entry pare wrote (a rewrite, a marker) typed, as the engine's check of it read
    /// it; `None` for an entry kept as sent. Whoever writes the forwarded body or compacts the prefix
    /// again takes these instead of reading the texts.
    pub typed: Vec<Option<Box<Message>>>,
}

/// What became of one message before the boundary: the engine's plan for it. The forwarded
/// prefix is written from the plan (each entry stands for the messages whose fate names it, in
/// order), and the archive stores the plan with the state it leaves (`archive::plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Forwarded as its original bytes, as prefix entry `at`.
    Kept { at: usize },
    /// Rewritten by `rules` into prefix entry `at`.
    Rewritten { at: usize, rules: RuleSet },
    /// Hidden behind the elision marker that is prefix entry `at`, with every other message whose
    /// fate names the same entry.
    Elided { at: usize },
    /// Left out by `rules`.
    Dropped { rules: RuleSet },
}

impl Fate {
    /// The prefix entry that stands for the message (`None`: left out).
    pub fn at(&self) -> Option<usize> {
        match *self {
            Fate::Kept { at } | Fate::Rewritten { at, .. } | Fate::Elided { at } => Some(at),
            Fate::Dropped { .. } => None,
        }
    }

    /// The same fate standing at prefix entry `at`.
    pub fn moved_to(self, at: usize) -> Fate {
        match self {
            Fate::Kept { .. } => Fate::Kept { at },
            Fate::Rewritten { rules, .. } => Fate::Rewritten { at, rules },
            Fate::Elided { .. } => Fate::Elided { at },
            dropped @ Fate::Dropped { .. } => dropped,
        }
    }

    /// The fate of a message that had this one in a compaction whose entry for it a later
    /// compaction (an epoch over the earlier prefix) gave fate `next`: rewrites add up their rules,
    /// an elided message stays elided wherever its marker goes.
    pub fn then(self, next: Fate) -> Fate {
        match (self, next) {
            (Fate::Dropped { .. }, _) => self,
            (_, Fate::Kept { at }) => self.moved_to(at),
            (Fate::Kept { .. }, Fate::Rewritten { .. }) | (_, Fate::Elided { .. }) => next,
            (Fate::Rewritten { rules: before, .. }, Fate::Rewritten { at, rules }) => {
                Fate::Rewritten { at, rules: before.union(rules) }
            }
            (Fate::Elided { .. }, Fate::Rewritten { at, .. }) => Fate::Elided { at },
            (Fate::Rewritten { rules: before, .. }, Fate::Dropped { rules }) => {
                Fate::Dropped { rules: before.union(rules) }
            }
            (_, Fate::Dropped { .. }) => next,
        }
    }
}

/// For each of the `n_prefix` entries a plan writes, the messages it stands for (`start..end`,
/// empty for an entry no fate names).
pub fn prefix_spans(plan: &[Fate], n_prefix: usize) -> Vec<std::ops::Range<usize>> {
    let mut spans = vec![0..0; n_prefix];
    for (idx, fate) in plan.iter().enumerate() {
        if let Some(span) = fate.at().and_then(|at| spans.get_mut(at)) {
            if span.start == span.end {
                *span = idx..idx + 1;
            } else {
                span.end = idx + 1;
            }
        }
    }
    spans
}

/// The compiled rule policy: the pack's rules with their regexes compiled once.
#[derive(Debug)]
pub struct Policy {
    pub name: String,
    pub spec: RulesSpec,
    pub success: SuccessPolicy,
    pub custom: Vec<CompiledCustom>,
    pub collapse_except: Vec<Regex>,
}

impl Policy {
    pub fn new(name: &str, spec: RulesSpec) -> Policy {
        Policy {
            name: name.to_owned(),
            success: SuccessPolicy::new(&spec.success),
            custom: spec.custom.iter().filter(|r| r.enabled).filter_map(CompiledCustom::compile).collect(),
            collapse_except: spec
                .collapse_succeeded
                .except_tools
                .iter()
                .filter_map(|p| Regex::new(&format!("^(?:{p})$")).ok())
                .collect(),
            spec,
        }
    }
}

/// The compiled policy (rule pack + overrides, regexes compiled once) and the salience settings.
#[derive(Debug)]
pub struct Engine {
    pub policy: Policy,
    pub salience: SalienceConfig,
    pub tiers: TierBudgets,
}

impl Engine {
    /// The engine with the built-in default pack.
    pub fn default_pack() -> Engine {
        let pack = pack::load_pack("default", pack::BUILTIN_PACKS[0].1, None).expect("the built-in pack is valid");
        Engine::from_pack(pack, SalienceConfig::default(), TierBudgets::default())
    }

    /// The engine of a configuration: `compaction.pack` (a built-in name or a path) with
    /// `compaction.rules` deep-merged onto its `rules:`, and `budget.salience` / `budget.tiers`.
    pub fn from_config(config: &Config) -> Result<Engine, EngineConfigError> {
        let pack = Pack::of_config(config)?;
        Ok(Engine::from_pack(pack, config.budget.salience.clone(), config.budget.tiers.clone()))
    }

    pub fn from_pack(pack: Pack, salience: SalienceConfig, tiers: TierBudgets) -> Engine {
        let name = if pack.name.is_empty() { "custom".to_owned() } else { pack.name.clone() };
        Engine { policy: Policy::new(&name, pack.rules), salience, tiers }
    }

    /// Compact a request. Never fails: anything unexpected forwards the original messages.
    pub fn compact(&self, view: &View<'_>, opts: &CompactOptions, counter: &dyn CountTokens) -> Compacted {
        self.prepare(view, opts, counter).compact(opts.keep_first)
    }

    /// The part of a compaction that does not depend on [`CompactOptions::keep_first`]: the
    /// conversation analysed and the rules applied, once, for any number of runs that differ only in
    /// the head they keep ([`Prepared::compact`]). `opts.keep_first` is not read.
    pub fn prepare<'p>(
        &'p self,
        view: &View<'p>,
        opts: &'p CompactOptions,
        counter: &'p dyn CountTokens,
    ) -> Prepared<'p> {
        let policy = &self.policy;
        let mut conv = Conversation::analyse(
            view,
            opts.protect_last_turns.unwrap_or(policy.spec.protect_last_turns),
            &policy.spec.key_arguments,
            &policy.success,
            !opts.single_thread,
        );
        conv.retrieve_tool = markers::retrieve_tool(view.tools);
        conv.epoch_head = conv.epoch_head_after(opts.epoch_boundary);
        let input_skeletons: Vec<Option<Skeleton>> = (conv.msgs.iter().zip(conv.raw))
            .map(|(m, raw)| match m {
                Some(m) => Some(skeleton_of(m)),
                None => crate::neutral::is_opaque(raw).then(Skeleton::opaque),
            })
            .collect();
        let input_invalid = validate::check(&input_skeletons).err().map(|violation| violation.to_string());
        let mut edits = Edits::new(&conv);
        let mut rendered = Vec::new();
        if input_invalid.is_none() {
            rules::apply(policy, &conv, &mut edits);
            rendered = finish_rules(&conv, &mut edits, counter);
        }
        Prepared {
            engine: self,
            tools: view.tools,
            opts,
            counter,
            conv,
            input_skeletons,
            input_invalid,
            edits,
            rendered,
            memo: salience::Memo::default(),
        }
    }
}

/// A request analysed and its rules applied with no head kept ([`Engine::prepare`]). A rule's edit of
/// a message depends only on that message and the conversation, never on another message's edits
/// or on a kept head: the edits with a head kept are these with the head's reverted.
pub struct Prepared<'p> {
    engine: &'p Engine,
    tools: Option<&'p str>,
    opts: &'p CompactOptions,
    counter: &'p dyn CountTokens,
    conv: Conversation<'p>,
    input_skeletons: Vec<Option<Skeleton>>,
    /// Invariant 1 broken in the input: every run forwards it unchanged.
    input_invalid: Option<String>,
    edits: Edits,
    /// The forwarded form of each message the rules changed (`None`: unchanged).
    rendered: Vec<Option<String>>,
    /// What each run's tiers and elision share with the others.
    memo: salience::Memo,
}

impl Prepared<'_> {
    /// The compaction with [`CompactOptions::keep_first`] set to `keep_first`, the other options
    /// those given to [`Engine::prepare`].
    pub fn compact(&self, keep_first: usize) -> Compacted {
        let (engine, conv, opts, counter) = (self.engine, &self.conv, self.opts, self.counter);
        let mut report = Report {
            pack: engine.policy.name.clone(),
            messages_in: conv.msgs.len(),
            boundary: conv.boundary,
            ..Report::default()
        };
        if let Some(violation) = &self.input_invalid {
            report.input_invalid = Some(violation.clone());
            return unchanged(conv, report);
        }
        let input_skeletons = &self.input_skeletons;

        let mut edits = self.edits.clone();
        let mut rendered = self.rendered.clone();
        let keep_first = keep_first.max(conv.epoch_head).min(conv.boundary);
        for idx in 0..keep_first {
            edits.revert(idx);
        }
        rendered[..keep_first].fill(None);
        edits.kept[..keep_first].fill(true);

        let mut elided = salience::Elided::default();
        let mut fitted = false;
        if opts.target_tokens.is_some() || opts.history.is_some() {
            let tools = self.tools.map(|t| counter.tools(t)).unwrap_or(0);
            let ages = opts.message_ages_secs.as_deref().filter(|ages| ages.len() == conv.msgs.len());
            let budget = salience::Budget {
                target: opts.target_tokens,
                history: opts.history,
                floor: opts.history_floor,
                ages,
                lists_limit: opts.lists_limit,
            };
            let fit = salience::fit(engine, conv, &mut edits, &mut rendered, counter, tools, budget, &self.memo);
            fitted = fit.report.target_tokens.is_some_and(|target| fit.report.tokens_after_rules > target);
            report.tiers = Some(fit.report);
            elided = fit.elided;
        }

        // Assemble the prefix and check invariant 1 on the whole forwarded array. Each message pare
        // wrote is read back, a check of what it wrote and its typed form: independent per message.
        let edited: Vec<usize> =
            (0..conv.boundary).filter(|&i| rendered[i].is_some() && !elided.messages.contains(&i)).collect();
        let mut edited_reads: Vec<Option<Box<Message>>> = vec![None; conv.boundary];
        for (idx, read) in edited.iter().zip(conv.map_each(&edited, |&i| rendered[i].as_deref().and_then(read_back))) {
            edited_reads[*idx] = read;
        }
        let mut prefix = Vec::with_capacity(conv.boundary);
        let mut typed = Vec::with_capacity(conv.boundary);
        let mut plan = Vec::with_capacity(conv.boundary);
        let mut skeletons = Vec::with_capacity(conv.msgs.len());
        let mut idx = 0;
        while idx < conv.boundary {
            let at = prefix.len();
            if let Some((end, marker)) = elided.runs.get(&idx) {
                let read = read_back(marker);
                skeletons.push(read.as_deref().map(skeleton_of));
                typed.push(read);
                prefix.push(marker.clone());
                plan.extend((idx..*end).map(|_| Fate::Elided { at }));
                idx = *end;
                continue;
            }
            let rules = || edits.savings[idx].iter().map(|(rule, _)| *rule).collect::<RuleSet>();
            if edits.dropped[idx] {
                plan.push(Fate::Dropped { rules: rules() });
            } else {
                match rendered[idx].take() {
                    Some(text) => {
                        let read = edited_reads[idx].take();
                        skeletons.push(read.as_deref().map(skeleton_of));
                        typed.push(read);
                        prefix.push(text);
                        plan.push(Fate::Rewritten { at, rules: rules() });
                    }
                    None => {
                        skeletons.push(input_skeletons[idx].clone());
                        typed.push(None);
                        prefix.push(conv.raw[idx].to_owned());
                        plan.push(Fate::Kept { at });
                    }
                }
            }
            idx += 1;
        }
        skeletons.extend(input_skeletons[conv.boundary..].iter().cloned());
        if let Err(violation) = validate::check(&skeletons) {
            report.validation_failed = Some(violation.to_string());
            report.rules.clear();
            report.tiers = None;
            return unchanged(conv, report);
        }

        fill_report(conv, &edits, &elided, &mut report, prefix.len());
        Compacted { boundary: conv.boundary, prefix, report, fitted, lists: elided.lists, plan, typed }
    }
}

/// A message pare wrote, read back: what the pairing check sees of it and its typed form (`None`:
/// it reads as no message, which the check refuses).
fn read_back(text: &str) -> Option<Box<Message>> {
    Message::from_raw(text).ok().map(Box::new)
}

/// The original messages, forwarded unchanged.
fn unchanged(conv: &Conversation<'_>, mut report: Report) -> Compacted {
    report.boundary = conv.msgs.len();
    report.messages_out = conv.msgs.len();
    Compacted {
        boundary: conv.msgs.len(),
        prefix: conv.raw.iter().map(|m| (*m).to_owned()).collect(),
        report,
        fitted: false,
        lists: Vec::new(),
        plan: (0..conv.msgs.len()).map(|at| Fate::Kept { at }).collect(),
        typed: vec![None; conv.msgs.len()],
    }
}

fn skeleton_of(m: &Message) -> Skeleton {
    Skeleton {
        role: m.role.clone(),
        tool_calls: m.tool_calls.iter().flatten().map(|c| c.id.clone()).collect(),
        tool_call_id: m.tool_call_id.clone(),
    }
}

/// Render every changed message; revert any edit that does not save tokens (invariant 4), and
/// share each message's token saving among the rules that changed it.
fn finish_rules(conv: &Conversation<'_>, edits: &mut Edits, counter: &dyn CountTokens) -> Vec<Option<String>> {
    let changed: Vec<usize> = (0..conv.boundary).filter(|&i| !edits.dropped[i] && edits.changed(i)).collect();
    // Rendering and counting are independent per message: a pure function of the edits so far.
    let outcomes = {
        let edits = &*edits;
        conv.map_each(&changed, |&idx| {
            let text = edits.render(conv, idx);
            let raw = conv.raw[idx];
            if text == raw {
                return None;
            }
            let (before, after) = (counter.message(raw), counter.message(&text));
            (after < before).then(|| (before - after, text))
        })
    };
    let mut rendered: Vec<Option<String>> = vec![None; conv.boundary];
    for idx in (0..conv.boundary).filter(|&i| edits.dropped[i]) {
        edits.tokens_saved[idx] = counter.message(conv.raw[idx]) as i64;
    }
    for (idx, outcome) in changed.into_iter().zip(outcomes) {
        match outcome {
            Some((saved, text)) => {
                edits.tokens_saved[idx] = saved as i64;
                rendered[idx] = Some(text);
            }
            None => edits.revert(idx),
        }
    }
    rendered
}

/// Token saving of one message, shared among its rules by the characters each removed.
fn share(savings: &[(RuleId, i64)], tokens: i64) -> Vec<(RuleId, i64, i64)> {
    let positive: i64 = savings.iter().map(|(_, c)| (*c).max(0)).sum();
    let mut out: Vec<(RuleId, i64, i64)> = Vec::new();
    let mut given = 0;
    for (n, (rule, chars)) in savings.iter().enumerate() {
        let t = if n + 1 == savings.len() {
            tokens - given
        } else if positive > 0 {
            tokens * (*chars).max(0) / positive
        } else {
            0
        };
        given += t;
        match out.iter_mut().find(|(r, _, _)| r == rule) {
            Some(slot) => {
                slot.1 += chars;
                slot.2 += t;
            }
            None => out.push((*rule, *chars, t)),
        }
    }
    out
}

fn fill_report(
    conv: &Conversation<'_>,
    edits: &Edits,
    elided: &salience::Elided,
    report: &mut Report,
    prefix_len: usize,
) {
    let mut per_rule: std::collections::BTreeMap<RuleId, RuleStats> = Default::default();
    for idx in 0..conv.boundary {
        if edits.savings[idx].is_empty() || elided.messages.contains(&idx) {
            continue;
        }
        let tokens = edits.tokens_saved[idx];
        if edits.dropped[idx] {
            report.messages_dropped += 1;
        } else {
            report.messages_changed += 1;
        }
        for (rule, chars, t) in share(&edits.savings[idx], tokens) {
            let s = per_rule.entry(rule).or_default();
            s.messages += 1;
            s.chars_saved += chars;
            s.tokens_saved += t;
        }
    }
    if !elided.runs.is_empty() {
        let s = per_rule.entry(RuleId::Elision).or_default();
        s.messages = elided.messages.len() as u64;
        s.chars_saved = elided.chars_saved;
        s.tokens_saved = elided.tokens_saved;
        report.messages_dropped += elided.messages.len() as u64;
    }
    for (rule, stats) in per_rule {
        report.chars_saved += stats.chars_saved;
        report.tokens_saved += stats.tokens_saved;
        report.rules.insert(rule, stats);
    }
    report.messages_out = prefix_len + (conv.msgs.len() - conv.boundary);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::{QuarterCounter, request_tokens};
    use crate::wire::ChatBody;

    /// An OpenHands session's request and the default engine protecting its last two turns.
    fn openhands() -> (ChatBody<'static>, Engine) {
        let body = include_bytes!("../../tests/fixtures/compact/openhands_django_11066.json");
        let mut engine = Engine::default_pack();
        engine.policy.spec.protect_last_turns = 2;
        (ChatBody::parse(body).unwrap(), engine)
    }

    /// What a run with `keep_first` computes from scratch: the rules applied with the head kept
    /// (they never touch it), its edits reverted, nothing shared with another run.
    fn alone<'p>(engine: &'p Engine, view: &View<'p>, opts: &'p CompactOptions, keep_first: usize) -> Prepared<'p> {
        let mut prepared = engine.prepare(view, opts, &QuarterCounter);
        let conv = &prepared.conv;
        let mut edits = Edits::new(conv);
        let keep_first = keep_first.min(conv.boundary);
        edits.kept[..keep_first].fill(true);
        rules::apply(&engine.policy, conv, &mut edits);
        for idx in 0..keep_first {
            edits.revert(idx);
        }
        prepared.rendered = finish_rules(conv, &mut edits, &QuarterCounter);
        prepared.edits = edits;
        prepared
    }

    #[test]
    fn runs_of_one_prepared_compaction_are_the_runs_made_alone() {
        let (parsed, engine) = openhands();
        let view = parsed.view();
        let rules_only = engine.compact(&view, &CompactOptions::default(), &QuarterCounter);
        let mut forwarded = rules_only.prefix.clone();
        forwarded.extend(view.messages[rules_only.boundary..].iter().map(|m| (*m).to_owned()));
        let tokens = request_tokens(&QuarterCounter, &forwarded, view.tools);
        // Turn starts, in the order a bisection might ask for them, so that runs reuse what others
        // memoized.
        let mut cuts: Vec<usize> = (0..rules_only.boundary)
            .filter(|&i| matches!(crate::neutral::role_of(view.messages[i]).as_ref(), "assistant" | "user"))
            .collect();
        cuts.sort_by_key(|&cut| (cut * 7) % 11);
        let mut outputs = Vec::new();
        for share in [30, 50, 70, 85] {
            let opts = CompactOptions { target_tokens: Some(tokens * share / 100), ..Default::default() };
            let shared = engine.prepare(&view, &opts, &QuarterCounter);
            for &keep_first in &cuts {
                let out = shared.compact(keep_first);
                let expected = alone(&engine, &view, &opts, keep_first).compact(keep_first);
                let case = format!("target {share} %, keep_first {keep_first}");
                assert_eq!(out.prefix, expected.prefix, "{case}");
                assert_eq!(out.plan, expected.plan, "{case}");
                assert_eq!(out.report, expected.report, "{case}");
                assert_eq!((out.boundary, out.fitted), (expected.boundary, expected.fitted), "{case}");
                assert_eq!(out.prefix[..keep_first], view.messages[..keep_first], "{case}");
                outputs.push(out);
            }
        }
        // The runs differ: rules changed the head of some, tiers and elision fitted the rest.
        assert!(outputs.iter().any(|o| o.report.rules.values().any(|r| r.messages > 0)));
        assert!(outputs.iter().any(|o| o.report.tiers.as_ref().is_some_and(|t| t.elided_groups > 0)));
        let distinct: std::collections::BTreeSet<&Vec<String>> = outputs.iter().map(|o| &o.prefix).collect();
        assert!(distinct.len() > 2, "{} distinct outputs", distinct.len());
    }

    /// A server-side compaction (a Responses `compaction` item, an Anthropic `compaction` block),
    /// given as [`CompactOptions::epoch_boundary`], is a hard epoch boundary: it and everything
    /// before it are forwarded as they are, by the rules and by tiers and elision; what follows is
    /// compacted.
    #[test]
    fn nothing_up_to_an_epoch_boundary_is_rewritten() {
        let (parsed, engine) = openhands();
        let plain = parsed.view();
        let rules_only = engine.compact(&plain, &CompactOptions::default(), &QuarterCounter);
        // An assistant turn halfway through the history becomes the boundary; its results go with it.
        let role = |i: usize| crate::neutral::role_of(plain.messages[i]).into_owned();
        let at = (rules_only.boundary / 2..rules_only.boundary)
            .find(|&i| role(i) == "assistant")
            .expect("an assistant turn in the history");
        let head = (at + 1..plain.messages.len()).find(|&i| role(i) != "tool").unwrap();
        let refs = plain.messages;
        let tokens = request_tokens(&QuarterCounter, refs, plain.tools);
        for opts in
            [CompactOptions::default(), CompactOptions { target_tokens: Some(tokens * 30 / 100), ..Default::default() }]
        {
            let without = engine.compact(&plain, &opts, &QuarterCounter);
            let kept =
                |prefix: &[String], messages: &[&str]| prefix.get(..head).is_some_and(|p| p == &messages[..head]);
            assert!(!kept(&without.prefix, refs), "the history before it is compactable");
            let bounded = CompactOptions { epoch_boundary: Some(at), ..opts.clone() };
            let out = engine.compact(&plain, &bounded, &QuarterCounter);
            assert!(kept(&out.prefix, refs), "target {:?}", opts.target_tokens);
            assert_ne!(out.prefix[head..], refs[head..out.boundary], "what follows is compacted");
        }
    }

    /// The engine reads an entry as its maker typed it, not its text, and hands over typed every
    /// entry it wrote: compacting the forwarded request with those gives what its texts give.
    #[test]
    fn entries_are_typed_by_their_maker_both_ways() {
        let (parsed, engine) = openhands();
        let plain = parsed.view();
        let tokens = request_tokens(&QuarterCounter, plain.messages, plain.tools);
        let opts = CompactOptions { target_tokens: Some(tokens * 40 / 100), ..Default::default() };
        let out = engine.compact(&plain, &opts, &QuarterCounter);
        // Typed by the engine: each entry it wrote, as its text reads; none it kept.
        for ((text, typed), fate) in out.prefix.iter().zip(&out.typed).zip(0..) {
            let kept = out.plan.contains(&Fate::Kept { at: fate });
            assert_eq!(typed.is_none(), kept, "{text}");
            if let Some(typed) = typed {
                assert_eq!(Some(&**typed), Message::from_raw(text).ok().as_ref());
            }
        }
        assert!(out.typed.iter().any(Option::is_some), "the engine wrote entries");
        // The forwarded request, its written entries given typed, compacts as its texts read.
        let mut forwarded: Vec<&str> = out.prefix.iter().map(String::as_str).collect();
        forwarded.extend_from_slice(&plain.messages[out.boundary..]);
        let given = |i: usize| out.typed.get(i)?.as_ref().map(|m| (Some((**m).clone()), None));
        let typed = View { messages: &forwarded, tools: plain.tools, typed: Some(&given) };
        let by_text = engine.compact(&View::of_texts(&forwarded, plain.tools), &opts, &QuarterCounter);
        assert_eq!(engine.compact(&typed, &opts, &QuarterCounter).prefix, by_text.prefix);
        // What the maker types is what the engine reads: the first tool result given with an
        // error in place of its output is compacted as a failure would be, its text unread.
        let at = (0..out.boundary).find(|&i| crate::neutral::role_of(plain.messages[i]) == "tool").unwrap();
        let mut failed = Message::from_raw(plain.messages[at]).unwrap();
        failed.content = Some(crate::neutral::Content::Text("Traceback (most recent call last):\nError".repeat(200)));
        let given = |i: usize| (i == at).then(|| (Some(failed.clone()), None));
        let view = View { messages: plain.messages, tools: plain.tools, typed: Some(&given) };
        let rules_only = CompactOptions::default();
        let rewritten = engine.compact(&view, &rules_only, &QuarterCounter);
        let read = engine.compact(&plain, &rules_only, &QuarterCounter);
        assert_ne!(rewritten.prefix, read.prefix, "the typed form is what the rules read");
    }

    /// An opaque entry (wire parts an adapter does not read) between the turns of a history is
    /// valid input: it is forwarded as it is, in its place, by the rules and by tiers and elision,
    /// while the history around it is compacted.
    #[test]
    fn an_opaque_entry_is_kept_in_place() {
        let (parsed, engine) = openhands();
        let mut messages: Vec<&str> = parsed.view().messages.to_vec();
        let turns: Vec<usize> =
            (2..messages.len() / 2).filter(|&i| crate::neutral::role_of(messages[i]) == "assistant").collect();
        let opaque = crate::neutral::opaque(&[r#"{"type":"reasoning","id":"rs_1","encrypted_content":"gAAAA"}"#]);
        let at = turns[turns.len() / 2];
        messages.insert(at, &opaque);
        let view = View::of_texts(&messages, parsed.view().tools);
        let tokens = request_tokens(&QuarterCounter, &messages, view.tools);
        for opts in
            [CompactOptions::default(), CompactOptions { target_tokens: Some(tokens * 30 / 100), ..Default::default() }]
        {
            let out = engine.compact(&view, &opts, &QuarterCounter);
            assert_eq!(out.report.input_invalid, None);
            assert_eq!(out.report.validation_failed, None);
            assert!(out.report.messages_changed > 0 || out.report.messages_dropped > 0, "the history is compacted");
            let fate = out.plan[at];
            let kept = fate.at().map(|i| out.prefix[i].as_str());
            assert_eq!(kept, Some(opaque.as_str()), "target {:?}: {fate:?}", opts.target_tokens);
        }
    }
}
