//! `pare compact [--config FILE] [--window TOKENS] [--stats] [--diff] [FILE|-]`: one request body in,
//! the body pare would forward out (stdout). `--stats` prints per rule what it saved, `--diff` prints
//! each changed message before → after (both to stderr).
//!
//! Tokens are counted with tiktoken (the encoding of the request's model from `models:`, else
//! `budget.encoding`). With `--window`, the engine also applies salience tiers and elision down to
//! the low-water mark of the usable window (window minus the answer's reserve), raised by the history
//! floor (`budget.history_floor`), as an epoch would.
//! When the config's `compaction.mode` is `eager`, what an eager advance does applies instead: the
//! history budget (`budget.eager_history`, shares of the usable window: `--window`'s, else the
//! model's) always, and `eager_low_water` for `--window`.
//! A request no rule changes is written back as read (as the proxy forwards it); a body that is not a
//! request of the `--wire` format is written back unchanged and the exit status is 1.

use std::borrow::Cow;
use std::io::{Read, Write};
use std::process::ExitCode;

use anyhow::Context;
use serde_json::Value;

use crate::budget::EpochPolicy;
use crate::budget::window::{ModelTable, answer_reserve};
use crate::compact::markers::{group_digits, group_signed, shorten};
use crate::compact::provenance::{Step, steps};
use crate::compact::report::RuleSet;
use crate::compact::{CompactOptions, Compacted, Engine};
use crate::config::Config;
use crate::neutral::{Message, View};
use crate::tokens::{CounterConfig, TokenCounter, request_tokens};
use crate::wire::{Forward, WrittenReads};

pub fn run(args: super::CompactArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    let engine = Engine::from_config(&config)?;
    let input = read_input(&args.input)?;
    let body = match crate::wire::parse_at(args.wire, &args.path, &input) {
        Ok(body) => body,
        Err(err) => {
            std::io::stdout().write_all(&input).context("cannot write to stdout")?;
            eprintln!("pare: {}: not compacted: {err}", args.input);
            return Ok(ExitCode::from(1));
        }
    };
    let models = ModelTable::from_config(&config)?;
    let settings = models.settings(body.model().as_deref());
    let counter = TokenCounter::new(&CounterConfig { encoding: settings.encoding, ..CounterConfig::default() });
    // The mode's low-water mark and, in eager mode, its history budget — as the proxy resolves them.
    let policy = EpochPolicy::from_config(&config);
    let window = args.window.or(settings.context_window).unwrap_or(config.budget.default_context_window);
    let usable = window.saturating_sub(answer_reserve(body.output_limit(), settings.output_reserve, window));
    let target_tokens = args.window.map(|_| (usable as f64 * policy.low_water) as u64);
    let options = CompactOptions {
        target_tokens,
        epoch_boundary: body.epoch_boundary(),
        history: policy.history_budget(usable),
        history_floor: policy.history_floor(usable),
        ..Default::default()
    };
    let raw_messages = body.messages();
    let tools = body.tools();
    let typed = |i: usize| body.typed(i);
    let view = View { messages: &raw_messages, tools, typed: Some(&typed) };
    let mut out = engine.compact(&view, &options, &counter);
    let mut messages: Vec<&str> = out.prefix.iter().map(String::as_str).collect();
    messages.extend_from_slice(&raw_messages[out.boundary..]);
    // A request no rule changed is written back as read, as the proxy forwards it (a re-serialized
    // body would differ in the whitespace between its top-level values).
    let unchanged = messages.len() == raw_messages.len() && messages.iter().zip(&raw_messages).all(|(m, r)| m == r);
    let forwarded: Cow<'_, [u8]> = if unchanged {
        Cow::Borrowed(&input)
    } else {
        let reads = WrittenReads::of(std::mem::take(&mut out.typed));
        match body.write(&Forward::of_plan(
            &out.plan,
            out.prefix.iter().map(String::as_str),
            &reads,
            raw_messages.len(),
        )) {
            Ok((bytes, _)) => Cow::Owned(bytes),
            Err(err) => {
                eprintln!("pare: {}: forwarded unchanged: {err}", args.input);
                Cow::Borrowed(&input)
            }
        }
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&forwarded).context("cannot write to stdout")?;
    if !forwarded.ends_with(b"\n") {
        stdout.write_all(b"\n").context("cannot write to stdout")?;
    }

    if args.stats {
        let before = request_tokens(&counter, &raw_messages, tools);
        let after = request_tokens(&counter, &messages, tools);
        let encoding = settings.encoding.name();
        eprint!("{}", stats_table(&out, before, after, encoding, target_tokens));
    }
    if args.diff {
        eprint!("{}", diff(&raw_messages, &out));
    }
    Ok(ExitCode::SUCCESS)
}

fn read_input(path: &str) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    if path == "-" {
        std::io::stdin().read_to_end(&mut bytes).context("cannot read stdin")?;
    } else {
        bytes = std::fs::read(path).with_context(|| format!("cannot read {path}"))?;
    }
    Ok(bytes)
}

/// The `--stats` table.
pub fn stats_table(out: &Compacted, before: u64, after: u64, encoding: &str, target: Option<u64>) -> String {
    let r = &out.report;
    let pct = if before > 0 { 100.0 * (before as f64 - after as f64) / before as f64 } else { 0.0 };
    let mut s = format!(
        "pack {} · messages {} → {} (tail from #{}) · tokens {} → {} (−{pct:.1} %, {encoding})\n",
        r.pack,
        r.messages_in,
        r.messages_out,
        out.boundary,
        group_digits(before as usize),
        group_digits(after as usize),
    );
    let tiers = r.tiers.as_ref();
    // The target tiers and elision aimed at: the window's (raised by the history floor), or the
    // history budget's when lower.
    if let Some(target) = tiers.and_then(|t| t.target_tokens).or(target) {
        s.push_str(&format!("target {} tokens", group_digits(target as usize)));
        if let Some(t) = tiers {
            s.push_str(&format!(
                " · tiers focus {} recent {} summary {} background {} · elided {} groups{}",
                t.focus,
                t.recent,
                t.summary,
                t.background,
                t.elided_groups,
                if t.over_target { " · still over target" } else { "" }
            ));
        }
        s.push('\n');
    }
    if let Some(history) = tiers.and_then(|t| t.history_tokens_after_rules) {
        s.push_str(&format!(
            "history {} tokens after the rules (eager's history budget)\n",
            group_digits(history as usize)
        ));
    }
    for (key, why) in [("input_invalid", &r.input_invalid), ("validation_failed", &r.validation_failed)] {
        if let Some(why) = why {
            s.push_str(&format!("{key}: {why} (forwarded unchanged)\n"));
        }
    }
    s.push_str(&format!("{:<24}{:>10}{:>14}{:>14}\n", "rule", "messages", "chars saved", "tokens saved"));
    for (rule, v) in &r.rules {
        s.push_str(&format!(
            "{:<24}{:>10}{:>14}{:>14}\n",
            rule.name(),
            v.messages,
            group_signed(v.chars_saved),
            group_signed(v.tokens_saved)
        ));
    }
    s
}

/// What `--diff` shows of a message: its text, then each tool call as `→ name(arguments)`, and the
/// size of its reasoning, on one line.
fn shown(raw: &str) -> String {
    let Ok(m) = Message::from_raw(raw) else {
        return raw.replace('\n', "⏎");
    };
    let mut parts: Vec<String> = Vec::new();
    let text = m.text();
    if !text.is_empty() {
        parts.push(text);
    }
    for call in m.tool_calls.iter().flatten() {
        if let Some(f) = &call.function {
            let arguments = match &f.arguments {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            parts.push(format!("→ {}({arguments})", f.name));
        }
    }
    for reasoning in [&m.reasoning_content, &m.reasoning].into_iter().flatten() {
        let chars = reasoning.as_str().map_or_else(|| reasoning.to_string().chars().count(), |r| r.chars().count());
        parts.push(format!("[reasoning: {chars} chars]"));
    }
    parts.join(" ").replace('\n', "⏎")
}

/// Width of a `--diff` line.
const PREVIEW_CHARS: usize = 240;

fn preview(raw: &str) -> String {
    shorten(&shown(raw), PREVIEW_CHARS)
}

/// Width of a one-line mention of a message (a new message, one that an elision hid).
const MENTION_CHARS: usize = 120;

/// `#N role: text…` on one line.
pub(crate) fn mention(idx: usize, raw: &str) -> String {
    format!("#{idx} {}: {}", role(raw), shorten(&shown(raw), MENTION_CHARS))
}

/// `--diff` lines for a changed message: when the change lies beyond the first line's width (an
/// argument elided after its head lines, a result truncated), both sides start a little before the
/// first character that differs, so that the change is what is shown.
fn previews(before: &str, after: &str) -> (String, String) {
    let (before, after) = (shown(before), shown(after));
    let common = before.chars().zip(after.chars()).take_while(|(a, b)| a == b).count();
    let start = common.saturating_sub(PREVIEW_CHARS / 4);
    let window = |s: &str| {
        if start == 0 || common < PREVIEW_CHARS * 3 / 4 {
            return shorten(s, PREVIEW_CHARS);
        }
        let rest: String = s.chars().skip(start).collect();
        format!("…{}", shorten(&rest, PREVIEW_CHARS))
    };
    (window(&before), window(&after))
}

fn role(raw: &str) -> String {
    Message::from_raw(raw).ok().map(|m| m.role).unwrap_or_else(|| "?".into())
}

/// The `--diff` listing: each changed, dropped or elided message, before → after.
pub fn diff(raw_messages: &[&str], out: &Compacted) -> String {
    let forwarded: Vec<&str> = out.prefix.iter().map(String::as_str).collect();
    let steps = steps(&out.plan, out.boundary, out.prefix.len());
    steps.into_iter().filter_map(|step| change(step, raw_messages, &forwarded)).collect()
}

/// One change as `pare compact --diff` and `pare sessions show --diff` show it: the message number
/// (from 0) and role, the rules that made it, then the original, shortened, next to what replaced
/// it. `raw` and `forwarded` are the two message lists `step` refers to; a message forwarded as
/// sent is no change.
pub(crate) fn change(step: Step, raw: &[&str], forwarded: &[&str]) -> Option<String> {
    let named = |rules: RuleSet| if rules.is_empty() { "rewritten".to_owned() } else { rules.names() };
    match step {
        Step::Kept { .. } => None,
        Step::Edited { raw: idx, fwd, rules } => {
            let (before, entry) = (raw[idx], forwarded[fwd]);
            let (minus, plus) = previews(before, entry);
            Some(format!(
                "#{idx} {} · {} ({} → {} bytes)\n  - {minus}\n  + {plus}\n",
                role(before),
                named(rules),
                group_digits(before.len()),
                group_digits(entry.len())
            ))
        }
        Step::Elided { start, end, fwd } => {
            let hidden: String = (start..end).map(|idx| format!("  - {}\n", mention(idx, raw[idx]))).collect();
            Some(format!(
                "#{start}..#{} elided ({} messages) · elision\n{hidden}  + {}\n",
                end - 1,
                end - start,
                preview(forwarded[fwd])
            ))
        }
        Step::Dropped { raw: idx, rules } => {
            Some(format!("#{idx} {} dropped · {}\n  - {}\n", role(raw[idx]), named(rules), preview(raw[idx])))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_start_near_a_change_beyond_the_first_line() {
        let head: String = (1..=30).map(|i| format!("line {i} of the output\n")).collect();
        let before = serde_json::json!({"role": "tool", "content": format!("{head}tail A\ntail B\n")}).to_string();
        let after =
            serde_json::json!({"role": "tool", "content": format!("{head}[...truncated 2 lines...]")}).to_string();
        let (minus, plus) = previews(&before, &after);
        assert!(minus.starts_with('…') && plus.starts_with('…'), "{minus} / {plus}");
        assert!(minus.contains("tail A") && plus.contains("[...truncated 2 lines...]"), "{minus} / {plus}");
        assert!(!plus.contains("line 1 of"), "{plus}");

        // A change within the first line's width: both sides from the start.
        let short_before = serde_json::json!({"role": "tool", "content": "status: ok, 3 files"}).to_string();
        let short_after = serde_json::json!({"role": "tool", "content": "[tool: ls → ok]"}).to_string();
        assert_eq!(previews(&short_before, &short_after), ("status: ok, 3 files".into(), "[tool: ls → ok]".into()));
    }

    #[test]
    fn shown_lists_calls_and_reasoning() {
        let m = r#"{"role":"assistant","content":null,"reasoning_content":"thinking","tool_calls":[{"id":"a","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.py\"}"}}]}"#;
        assert_eq!(shown(m), r#"→ read_file({"path":"a.py"}) [reasoning: 8 chars]"#);
    }
}
