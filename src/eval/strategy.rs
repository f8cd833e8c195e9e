//! The peers' deterministic context strategies, so that `pare eval --strategy` measures pare against
//! them on the same sessions with the same metrics:
//!
//! - `mask:N` — SWE-agent's `LastNObservations`: every environment observation but the first (the
//!   task) and the last `N` becomes `Old environment output: (L lines omitted)`. Observations are the
//!   tool results; an agent that has none (a text-mode agent, whose environment answers as the user)
//!   has its user messages after the first as observations, as SWE-agent's text mode does.
//! - `clear:K@F` — Anthropic's `clear_tool_uses` context editing: when the request exceeds `F` of the
//!   usable window, every tool result but the last `K` becomes `[cleared]` (tool calls are kept).
//! - `truncate` — Codex's truncation of function outputs: an output over 10 KiB or 256 lines keeps
//!   its first 128 and last 128 lines within 10 KiB around `[... omitted M of T lines ...]`, behind a
//!   `Total output lines: T` header.
//!
//! Each runs statelessly on every request, as the peer does on the history it sends: the raw request
//! in, the edited request out. Tool-call pairing is never changed: only a result's content is.

use std::fmt;
use std::str::FromStr;

use serde_json::Value;

use crate::budget::SessionCompactor;
use crate::budget::replay::{Replayed, replay_session};
use crate::neutral::role_of;
use crate::wire::{ChatBody, Wire};

/// Which strategy produces the forwarded requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strategy {
    /// pare itself, through the proxy's compactor.
    Pare,
    /// SWE-agent `LastNObservations` keeping the last `keep` observations.
    Mask { keep: usize },
    /// Anthropic `clear_tool_uses`: keep the last `keep` tool results once the request is over
    /// `trigger` × the usable window.
    Clear { keep: usize, trigger: f64 },
    /// Codex-style head and tail of every tool output over 10 KiB or 256 lines.
    Truncate,
}

impl FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Strategy, String> {
        let bad = || format!("unknown strategy `{s}` (pare, mask:N, clear:K@F with 0 < F ≤ 1, truncate)");
        match s.split_once(':') {
            None if s == "pare" => Ok(Strategy::Pare),
            None if s == "truncate" => Ok(Strategy::Truncate),
            Some(("mask", n)) => n.parse().ok().filter(|n| *n > 0).map(|keep| Strategy::Mask { keep }).ok_or_else(bad),
            Some(("clear", spec)) => {
                let (k, f) = spec.split_once('@').ok_or_else(bad)?;
                let keep = k.parse().map_err(|_| bad())?;
                let trigger: f64 = f.parse().map_err(|_| bad())?;
                (trigger > 0.0 && trigger <= 1.0).then_some(Strategy::Clear { keep, trigger }).ok_or_else(bad)
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Pare => write!(f, "pare"),
            Strategy::Mask { keep } => write!(f, "mask:{keep}"),
            Strategy::Clear { keep, trigger } => write!(f, "clear:{keep}@{trigger}"),
            Strategy::Truncate => write!(f, "truncate"),
        }
    }
}

/// SWE-agent's placeholder for an elided observation.
pub fn mask_placeholder(lines: usize) -> String {
    format!("Old environment output: ({lines} lines omitted)")
}

/// Anthropic's (and LangChain's mirror of it) placeholder for a cleared tool result.
pub const CLEARED: &str = "[cleared]";

/// Codex's limits for a function output sent to the model.
const TRUNCATE_BYTES: usize = 10 * 1024;
const TRUNCATE_LINES: usize = 256;

/// Replay one session with `strategy`: pare's goes through the compactor exactly as the proxy does;
/// a peer's edits each raw request on its own. The peers read Chat Completions requests: on another
/// wire format their requests are forwarded unchanged (`pare eval` refuses the combination).
/// `window`: every request's context window; `None`: its model's, from the configuration.
pub fn replay(
    strategy: Strategy,
    compactor: &SessionCompactor,
    wire: Wire,
    session: &str,
    requests: &[&[u8]],
    window: Option<u64>,
) -> Vec<Replayed> {
    if strategy == Strategy::Pare {
        return replay_session(compactor, wire, session, requests, window);
    }
    requests
        .iter()
        .map(|raw| {
            let forwarded = ChatBody::parse(raw).ok().filter(|_| wire == Wire::Chat).and_then(|body| {
                let (window, reserve) = compactor.window_and_reserve(&body, window);
                let usable = window.saturating_sub(reserve);
                let counter = compactor.counter(body.split.model().as_deref());
                let tools = body.split.field("tools").map(|t| t.get());
                let tokens = || counter.count_request(body.messages(), tools);
                apply(strategy, &body, usable, tokens)
            });
            Replayed {
                forwarded: forwarded.unwrap_or_else(|| raw.to_vec()),
                summary: None,
                skipped: None,
                lists: Default::default(),
            }
        })
        .collect()
}

/// The request `strategy` sends for `body`, or `None` when it sends it unchanged. `tokens` counts the
/// raw request (only `clear` asks).
pub fn apply(strategy: Strategy, body: &ChatBody<'_>, usable: u64, tokens: impl FnOnce() -> u64) -> Option<Vec<u8>> {
    let roles: Vec<_> = body.messages().iter().map(|m| role_of(m)).collect();
    let tool_results: Vec<usize> = (0..roles.len()).filter(|&i| roles[i] == "tool").collect();
    let mut edit: Vec<(usize, String)> = Vec::new();
    match strategy {
        Strategy::Pare => return None,
        Strategy::Mask { keep } => {
            let observations: Vec<usize> = if tool_results.is_empty() {
                (0..roles.len()).filter(|&i| roles[i] == "user").collect()
            } else {
                // The task (the first user message) is SWE-agent's first observation, never elided.
                let task = roles.iter().position(|r| r == "user");
                task.into_iter().chain(tool_results.iter().copied()).collect()
            };
            let last_removed = observations.len().saturating_sub(keep);
            for &i in observations.get(1..last_removed).unwrap_or_default() {
                edit.push((i, mask_placeholder(line_count(&content_text(body.messages()[i])))));
            }
        }
        Strategy::Clear { keep, trigger } => {
            if (tokens() as f64) <= trigger * usable as f64 {
                return None;
            }
            let last_cleared = tool_results.len().saturating_sub(keep);
            edit.extend(tool_results[..last_cleared].iter().map(|&i| (i, CLEARED.to_owned())));
        }
        Strategy::Truncate => {
            for &i in &tool_results {
                let text = content_text(body.messages()[i]);
                if let Some(short) = head_and_tail(&text) {
                    edit.push((i, short));
                }
            }
        }
    }
    let mut messages: Vec<String> = body.messages().iter().map(|m| (*m).to_owned()).collect();
    let mut changed = false;
    for (i, text) in edit {
        if let Some(replaced) = with_content(&messages[i], text) {
            changed |= replaced != messages[i];
            messages[i] = replaced;
        }
    }
    changed.then(|| body.to_vec_with_messages(&messages))
}

/// The text of a message's content: the string, or its text parts joined by newlines.
fn content_text(raw: &str) -> String {
    crate::neutral::Message::from_raw(raw).map(|m| m.text()).unwrap_or_default()
}

/// Python's `len(text.splitlines())`, which SWE-agent counts.
fn line_count(text: &str) -> usize {
    text.lines().count()
}

/// `raw` with its content replaced by the string `text`; every other key keeps its place.
fn with_content(raw: &str, text: String) -> Option<String> {
    let mut value: Value = serde_json::from_str(raw).ok()?;
    *value.as_object_mut()?.get_mut("content")? = Value::String(text);
    serde_json::to_string(&value).ok()
}

/// Codex's head and tail of an output over its limits, or `None` within them.
fn head_and_tail(text: &str) -> Option<String> {
    let total = line_count(text);
    if text.len() <= TRUNCATE_BYTES && total <= TRUNCATE_LINES {
        return None;
    }
    let segments: Vec<&str> = text.split_inclusive('\n').collect();
    let head_take = (TRUNCATE_LINES / 2).min(segments.len());
    let tail_take = (TRUNCATE_LINES / 2).min(segments.len() - head_take);
    let omitted = segments.len() - head_take - tail_take;
    let head: String = segments[..head_take].concat();
    let tail: String = segments[segments.len() - tail_take..].concat();
    let marker = if omitted > 0 {
        format!("\n[... omitted {omitted} of {total} lines ...]\n\n")
    } else {
        format!("\n[... output truncated to fit {TRUNCATE_BYTES} bytes ...]\n\n")
    };
    let mut out = String::from(prefix_within(&head, TRUNCATE_BYTES / 2));
    out.push_str(&marker);
    out.push_str(suffix_within(&tail, TRUNCATE_BYTES.saturating_sub(out.len())));
    Some(format!("Total output lines: {total}\n\n{out}"))
}

/// The longest prefix of `s` of at most `max` bytes ending on a char boundary.
fn prefix_within(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The longest suffix of `s` of at most `max` bytes starting on a char boundary.
fn suffix_within(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireBody;
    use serde_json::json;

    fn call(id: &str) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})
    }

    fn result(id: &str, text: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": text})
    }

    /// A session of `n` calls, each answered by a 3-line result.
    fn body(n: usize) -> Vec<u8> {
        let mut messages = vec![json!({"role": "system", "content": "s"}), json!({"role": "user", "content": "task"})];
        for k in 0..n {
            messages.push(call(&format!("c{k}")));
            messages.push(result(&format!("c{k}"), &format!("out {k}\nline\nline")));
        }
        json!({"model": "m", "messages": messages, "x": 1}).to_string().into_bytes()
    }

    fn contents(bytes: &[u8]) -> Vec<Value> {
        let v: Value = serde_json::from_slice(bytes).unwrap();
        v["messages"].as_array().unwrap().iter().map(|m| m["content"].clone()).collect()
    }

    fn run(strategy: Strategy, raw: &[u8], usable: u64, tokens: u64) -> Option<Vec<u8>> {
        apply(strategy, &ChatBody::parse(raw).unwrap(), usable, || tokens)
    }

    fn valid(bytes: &[u8]) -> bool {
        ChatBody::parse(bytes).unwrap().check().is_ok()
    }

    #[test]
    fn strategies_parse_and_print_back() {
        for s in ["pare", "mask:5", "clear:3@0.9", "truncate"] {
            assert_eq!(s.parse::<Strategy>().unwrap().to_string(), s);
        }
        for bad in ["mask:0", "mask", "clear:3", "clear:3@1.5", "clear:x@0.5", "cut"] {
            assert!(bad.parse::<Strategy>().is_err(), "{bad}");
        }
    }

    #[test]
    fn mask_keeps_the_task_and_the_last_n_observations() {
        let raw = body(8);
        let out = run(Strategy::Mask { keep: 5 }, &raw, 0, 0).unwrap();
        assert!(valid(&out));
        let results: Vec<Value> = contents(&out).into_iter().skip(2).skip(1).step_by(2).collect();
        let masked = json!(mask_placeholder(3));
        assert_eq!(results.iter().filter(|c| **c == masked).count(), 3, "8 results − 5 kept");
        assert!(results[..3].iter().all(|c| *c == masked));
        assert!(results[3..].iter().all(|c| c.as_str().unwrap().starts_with("out ")));
        assert_eq!(contents(&out)[1], json!("task"));
        assert_eq!(run(Strategy::Mask { keep: 8 }, &raw, 0, 0), None, "nothing older than the last 8");
        // The other keys keep their bytes.
        assert!(String::from_utf8(out).unwrap().ends_with(",\"x\":1}"));
    }

    #[test]
    fn mask_without_tool_results_elides_the_user_observations_after_the_task() {
        let messages: Vec<Value> = (0..4)
            .flat_map(|k| {
                [
                    json!({"role": "user", "content": format!("obs {k}\nmore")}),
                    json!({"role": "assistant", "content": "cmd"}),
                ]
            })
            .collect();
        let raw = json!({"messages": messages}).to_string().into_bytes();
        let out = contents(&run(Strategy::Mask { keep: 2 }, &raw, 0, 0).unwrap());
        assert_eq!(out[0], json!("obs 0\nmore"));
        assert_eq!(out[2], json!(mask_placeholder(2)));
        assert_eq!(out[4], json!("obs 2\nmore"));
    }

    #[test]
    fn clear_triggers_above_its_share_and_keeps_the_last_k() {
        let raw = body(6);
        assert_eq!(run(Strategy::Clear { keep: 3, trigger: 0.5 }, &raw, 1000, 500), None, "at the trigger");
        let out = run(Strategy::Clear { keep: 3, trigger: 0.5 }, &raw, 1000, 501).unwrap();
        assert!(valid(&out));
        let all = contents(&out);
        let results: Vec<&Value> = all.iter().skip(3).step_by(2).collect();
        assert_eq!(results.iter().filter(|c| ***c == json!(CLEARED)).count(), 3);
        assert!(results[3..].iter().all(|c| c.as_str().unwrap().starts_with("out ")));
        // The calls stay.
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["messages"][2]["tool_calls"][0]["id"], "c0");
    }

    #[test]
    fn truncate_keeps_head_and_tail_of_long_outputs_only() {
        let long: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        let messages = vec![call("a"), result("a", &long), call("b"), result("b", "short")];
        let raw = json!({"messages": messages}).to_string().into_bytes();
        let out = run(Strategy::Truncate, &raw, 0, 0).unwrap();
        assert!(valid(&out));
        let all = contents(&out);
        let text = all[1].as_str().unwrap();
        assert!(text.starts_with("Total output lines: 1000\n\nline 0\n"));
        assert!(text.contains("\n[... omitted 744 of 1000 lines ...]\n\n"));
        assert!(text.ends_with("line 999\n"));
        assert!(text.len() <= TRUNCATE_BYTES + 40);
        assert_eq!(all[3], json!("short"));
        let small = json!({"messages": [call("a"), result("a", "ok")]}).to_string().into_bytes();
        assert_eq!(run(Strategy::Truncate, &small, 0, 0), None);
    }
}
