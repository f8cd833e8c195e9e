//! Training data from the **raw** sessions (never the compacted view): SFT conversations (OpenAI
//! fine-tuning chat format or ShareGPT) and DPO preference pairs in TRL's conversational format.
//!
//! # How DPO pairs are mined
//!
//! - **branch**: two or more exchanges of a session sent the same messages (same normalized message
//!   keys, see [`crate::session`]) and got different complete answers; exactly one of those answers was
//!   continued (a later request of the session starts with "those messages + that answer"). The
//!   continued answer is `chosen`, each abandoned one `rejected`. When several answers were continued,
//!   or none, the group is skipped: the archive does not say which was preferred.
//! - **retry**: in the session's final transcript, an assistant message with a single tool call whose
//!   result reads as an error, followed — before any new user message — by an assistant call of the
//!   same tool whose result reads as a success. `prompt` is the transcript before the failed call,
//!   `rejected` the failed call, `chosen` the successful one. Limits: the successful call was written
//!   after seeing the error, so the pair approximates "what the model should have done"; error
//!   detection is a heuristic over the tool output (JSON `exit_code`/`returncode` ≠ 0, a non-empty
//!   `error`, `success: false`, `status: "error"`; text such as `Traceback`, `Error:`, `exit code 1`,
//!   `command not found`, `No such file or directory`); branches abandoned before the final transcript
//!   are not searched for retries.
//!
//! Responses API exchanges are exported in the same formats, converted to chat messages: `instructions`
//! is the system message, `developer` messages become `system` ones, function, custom and local shell
//! calls become `tool_calls`, their outputs tool messages; `reasoning` items (encrypted) and opaque
//! items (`compaction`, web search calls…) are dropped.
//!
//! Messages are exported with `role`, `content` (text parts joined into a string, so every row has the
//! same shape), `tool_calls` (`arguments` as a JSON string), `tool_call_id` and `name`; reasoning fields
//! and unknown keys are left out.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use regex::Regex;
use serde_json::{Map, Value, json};

use super::ArchiveError;
use super::query::{ArchiveReader, SessionFilter};
use super::read::BodyKind;
use crate::session::{chain_key, content_text, message_key_value, prefix_keys};
use crate::wire::responses::ResponsesBody;
use crate::wire::{Wire, WireBody};
use crate::wire::{gemini, messages};

/// One exchange as export sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExchangeData {
    pub seq: i64,
    /// The raw request's messages (empty when the body was not a chat request).
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    /// The assistant message, when a complete successful answer was recorded.
    pub answer: Option<Value>,
}

/// A session's exchanges in order.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionData {
    pub id: String,
    pub exchanges: Vec<ExchangeData>,
}

/// SFT output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftFormat {
    /// `{"messages": [...], "tools": [...]}`.
    OpenAi,
    /// `{"conversations": [{"from": "system|human|gpt|tool", "value": ...}], "tools": "[...]"}` (Hermes
    /// trajectories; `tools`, the request's tool schemas as a JSON string, only when it had any).
    ShareGpt,
}

/// How a DPO pair was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mined {
    Branch,
    Retry,
}

/// One preference pair with its provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoPair {
    pub prompt: Vec<Value>,
    pub chosen: Vec<Value>,
    pub rejected: Vec<Value>,
    pub session: String,
    /// The request the rejected answer was given to.
    pub request: Option<i64>,
    /// The request the chosen answer was given to.
    pub chosen_request: Option<i64>,
    pub mined: Mined,
    /// For retries: the tool that failed and then succeeded.
    pub tool: Option<String>,
}

impl DpoPair {
    pub fn to_json(&self) -> Value {
        json!({
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            "provenance": {
                "session": self.session,
                "request": self.request,
                "chosen_request": self.chosen_request,
                "mined": self.mined,
                "tool": self.tool,
            },
        })
    }
}

/// What an export wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportStats {
    pub sessions: usize,
    pub rows: usize,
    /// A DPO export: why sessions gave no pair.
    pub dpo: DpoTally,
}

/// Why a DPO export's sessions gave no pairs, counted while mining (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpoTally {
    /// Sessions without an answered request (nothing to compare).
    pub unanswered: usize,
    /// Sessions where no request was sent again and answered differently (no branch).
    pub no_branch: usize,
    /// Branches skipped because none, or more than one, of their answers was continued.
    pub ambiguous_branches: usize,
    /// Sessions whose final transcript has no failed tool call retried with success (no retry).
    pub no_retry: usize,
}

impl DpoTally {
    /// The reasons in words, each with its count: "3 session(s) without an answered request, …".
    pub fn reasons(&self) -> String {
        let mut reasons = Vec::new();
        for (n, what) in [
            (self.unanswered, "session(s) without an answered request"),
            (self.no_branch, "session(s) where no request was sent again and answered differently (branch)"),
            (self.ambiguous_branches, "branch(es) where none or several of the answers were continued"),
            (self.no_retry, "session(s) with no failed tool call retried successfully (retry)"),
        ] {
            if n > 0 {
                reasons.push(format!("{n} {what}"));
            }
        }
        reasons.join(", ")
    }
}

/// Load the sessions matching `filter` with their raw messages and answers.
pub fn load_sessions(reader: &ArchiveReader, filter: &SessionFilter) -> Result<Vec<SessionData>, ArchiveError> {
    let mut out = Vec::new();
    for info in reader.sessions(filter)? {
        let mut exchanges = Vec::new();
        for ex in reader.exchanges(&info.id)? {
            let raw = reader.body(&info.id, ex.seq, BodyKind::Raw)?;
            let (messages, tools) = match Wire::of_path(&ex.path) {
                Some(Wire::Responses) => responses_as_chat(&raw),
                Some(Wire::Messages) => messages_as_chat(&raw),
                Some(Wire::Gemini) => gemini_as_chat(&raw),
                _ => {
                    let body: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
                    let messages = body.get("messages").and_then(Value::as_array).cloned().unwrap_or_default();
                    (messages, body.get("tools").cloned())
                }
            };
            let tools = tools.filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
            let answer = reader.response(&info.id, ex.seq)?.and_then(|r| {
                let ok = !r.partial && r.status.is_none_or(|s| (200..300).contains(&s));
                let message = ok.then(|| r.assembled.and_then(|a| a.get("message").cloned())).flatten();
                match Wire::of_path(&ex.path) {
                    Some(Wire::Messages) => message.map(|m| messages::convert::answer_to_chat(&m)),
                    Some(Wire::Gemini) => message.and_then(|m| gemini::convert::answer_to_chat(&m)),
                    _ => message,
                }
            });
            exchanges.push(ExchangeData { seq: ex.seq, messages, tools, answer });
        }
        out.push(SessionData { id: info.id, exchanges });
    }
    Ok(out)
}

/// A Messages request as chat messages and chat tools (see [`messages::convert::to_chat`]).
fn messages_as_chat(raw: &[u8]) -> (Vec<Value>, Option<Value>) {
    let body: Value = serde_json::from_slice(raw).unwrap_or(Value::Null);
    let tools = body.get("tools").map(messages::convert::tools_to_chat);
    (messages::convert::to_chat(&body, None), tools)
}

/// A Gemini request as chat messages and chat tools (see [`gemini::convert::to_chat`]).
fn gemini_as_chat(raw: &[u8]) -> (Vec<Value>, Option<Value>) {
    let tools =
        serde_json::from_slice::<Value>(raw).ok().and_then(|b| b.get("tools").map(gemini::convert::tools_to_chat));
    (gemini::convert::to_chat(raw), tools)
}

/// A Responses request as chat messages and chat tools: its neutral messages (instructions as the
/// system message, message items, calls as assistant `tool_calls`, outputs as tool messages), with
/// `developer` messages as `system` ones; reasoning and opaque items are left out, and so are
/// tools other than functions.
fn responses_as_chat(raw: &[u8]) -> (Vec<Value>, Option<Value>) {
    let Ok(body) = ResponsesBody::parse(raw) else {
        return (Vec::new(), None);
    };
    let messages = body
        .messages()
        .iter()
        .filter_map(|m| serde_json::from_str::<Value>(m).ok())
        .filter(Value::is_object)
        .map(|mut m| {
            if m["role"] == "developer" {
                m["role"] = json!("system");
            }
            m
        })
        .collect();
    let tools = body.tools().and_then(|t| serde_json::from_str::<Vec<Value>>(t).ok()).map(|tools| {
        let functions = tools.into_iter().filter(|t| t.get("type").and_then(Value::as_str) == Some("function"));
        Value::Array(
            functions
                .map(|t| {
                    let mut function = t.as_object().cloned().unwrap_or_default();
                    function.remove("type");
                    function.remove("strict");
                    json!({"type": "function", "function": function})
                })
                .collect(),
        )
    });
    (messages, tools)
}

/// A message reduced to the keys training formats use (see the module docs).
pub fn clean_message(m: &Value) -> Value {
    let mut out = Map::new();
    let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
    out.insert("role".into(), json!(role));
    let content = match m.get("content") {
        None | Some(Value::Null) => Value::Null,
        other => Value::String(content_text(other)),
    };
    out.insert("content".into(), content);
    if let Some(Value::Array(calls)) = m.get("tool_calls")
        && !calls.is_empty()
    {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let f = c.get("function").cloned().unwrap_or(Value::Null);
                let arguments = match f.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    None | Some(Value::Null) => "{}".into(),
                    Some(other) => other.to_string(),
                };
                json!({
                    "id": c.get("id").and_then(Value::as_str).unwrap_or(""),
                    "type": "function",
                    "function": {"name": f.get("name").and_then(Value::as_str).unwrap_or(""), "arguments": arguments},
                })
            })
            .collect();
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
        out.insert("tool_call_id".into(), json!(id));
    }
    if let Some(name) = m.get("name").and_then(Value::as_str) {
        out.insert("name".into(), json!(name));
    }
    Value::Object(out)
}

/// The session's final conversation: the last request that got a complete answer, plus that answer.
pub fn final_conversation(session: &SessionData) -> Option<(Vec<Value>, Option<Value>)> {
    let last = session.exchanges.iter().rev().find(|e| e.answer.is_some() && !e.messages.is_empty())?;
    let mut messages: Vec<Value> = last.messages.iter().map(clean_message).collect();
    messages.push(clean_message(last.answer.as_ref().expect("found with an answer")));
    Some((messages, last.tools.clone()))
}

/// One SFT row for a session, or `None` when it has no answered chat request.
pub fn sft_row(session: &SessionData, format: SftFormat) -> Option<Value> {
    let (messages, tools) = final_conversation(session)?;
    Some(match format {
        SftFormat::OpenAi => {
            let mut row = json!({"messages": messages});
            if let Some(tools) = tools {
                row["tools"] = tools;
            }
            row
        }
        // The tool schemas as a JSON string, as ShareGPT tool-calling datasets carry them
        // (LLaMA-Factory's `tools` column, NousResearch's hermes-function-calling).
        SftFormat::ShareGpt => {
            let mut row = json!({"conversations": sharegpt(&messages)});
            if let Some(tools) = tools {
                row["tools"] = Value::String(tools.to_string());
            }
            row
        }
    })
}

fn sharegpt(messages: &[Value]) -> Vec<Value> {
    let mut names: HashMap<String, String> = HashMap::new();
    messages
        .iter()
        .map(|m| {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
            let text = m.get("content").and_then(Value::as_str).unwrap_or("").to_string();
            match role {
                "system" | "developer" => json!({"from": "system", "value": text}),
                "assistant" => {
                    let mut value = text;
                    for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                        let name = call["function"]["name"].as_str().unwrap_or("").to_string();
                        let raw_args = call["function"]["arguments"].as_str().unwrap_or("{}");
                        let args: Value = serde_json::from_str(raw_args).unwrap_or_else(|_| json!(raw_args));
                        if let Some(id) = call.get("id").and_then(Value::as_str) {
                            names.insert(id.to_string(), name.clone());
                        }
                        if !value.is_empty() {
                            value.push('\n');
                        }
                        value.push_str(&format!(
                            "<tool_call>\n{}\n</tool_call>",
                            json!({"name": name, "arguments": args})
                        ));
                    }
                    json!({"from": "gpt", "value": value})
                }
                "tool" => {
                    let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
                    let name = m
                        .get("name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .or_else(|| names.get(id).cloned())
                        .unwrap_or_default();
                    let body = json!({"tool_call_id": id, "name": name, "content": text});
                    json!({"from": "tool", "value": format!("<tool_response>\n{body}\n</tool_response>")})
                }
                _ => json!({"from": "human", "value": text}),
            }
        })
        .collect()
}

/// Whether a tool output reads as a failure (see the module docs for the heuristic).
pub fn tool_output_failed(output: &str) -> bool {
    let trimmed = output.trim();
    if let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(trimmed) {
        for key in ["exit_code", "returncode", "exitCode", "return_code"] {
            if let Some(code) = obj.get(key).and_then(Value::as_i64) {
                return code != 0;
            }
        }
        match obj.get("error") {
            Some(Value::String(s)) if !s.trim().is_empty() => return true,
            Some(Value::Bool(true)) | Some(Value::Object(_)) => return true,
            _ => {}
        }
        if obj.get("success") == Some(&Value::Bool(false)) {
            return true;
        }
        if let Some(status) = obj.get("status").and_then(Value::as_str) {
            return matches!(status.to_ascii_lowercase().as_str(), "error" | "failed" | "failure");
        }
        return false;
    }
    static PATTERNS: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = PATTERNS.get_or_init(|| {
        Regex::new(
            r"(?mi)^\s*(error|fatal|exception)\b[:!]?|Traceback \(most recent call last\)|command not found|No such file or directory|(exit[ _]?code|returncode)\W{0,3}[1-9]|<returncode>\s*[1-9]",
        )
        .expect("a valid pattern")
    });
    re.is_match(trimmed)
}

/// Mine DPO pairs from one session (branches first, then retries, each in transcript order).
pub fn mine_pairs(session: &SessionData) -> Vec<DpoPair> {
    mine_pairs_tallied(session, &mut DpoTally::default())
}

/// [`mine_pairs`], counting in `tally` why the session gave no pair of each kind.
pub fn mine_pairs_tallied(session: &SessionData, tally: &mut DpoTally) -> Vec<DpoPair> {
    if session.exchanges.iter().all(|e| e.answer.is_none()) {
        tally.unanswered += 1;
        return Vec::new();
    }
    let mut pairs = mine_branches(session, tally);
    let retries = mine_retries(session);
    tally.no_retry += retries.is_empty() as usize;
    pairs.extend(retries);
    pairs
}

fn mine_branches(session: &SessionData, tally: &mut DpoTally) -> Vec<DpoPair> {
    let prefixes: Vec<Vec<u64>> = session
        .exchanges
        .iter()
        .map(|e| prefix_keys(&e.messages.iter().map(message_key_value).collect::<Vec<_>>()))
        .collect();
    // Every prefix key any request starts with: an answer is "continued" when a request extends it.
    let mut continued_keys: HashMap<u64, i64> = HashMap::new();
    for (e, keys) in session.exchanges.iter().zip(&prefixes) {
        for k in keys {
            continued_keys.entry(*k).or_insert(e.seq);
        }
    }
    let mut groups: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
    let mut first_of: HashMap<u64, i64> = HashMap::new();
    for (idx, (e, keys)) in session.exchanges.iter().zip(&prefixes).enumerate() {
        let (Some(key), Some(_)) = (keys.last(), &e.answer) else { continue };
        let first = *first_of.entry(*key).or_insert(e.seq);
        groups.entry(first).or_default().push(idx);
    }
    let mut pairs = Vec::new();
    let mut branched = false;
    for members in groups.values().filter(|m| m.len() >= 2) {
        // Distinct answers of the group, in order of first appearance: (ext key, exchange index).
        let mut answers: Vec<(u64, usize)> = Vec::new();
        for &idx in members {
            let e = &session.exchanges[idx];
            let key_req = *prefixes[idx].last().expect("grouped by it");
            let ext = chain_key(key_req, message_key_value(e.answer.as_ref().expect("grouped with an answer")));
            if !answers.iter().any(|(k, _)| *k == ext) {
                answers.push((ext, idx));
            }
        }
        if answers.len() < 2 {
            continue;
        }
        branched = true;
        let (kept, abandoned): (Vec<_>, Vec<_>) = answers.iter().partition(|(k, _)| continued_keys.contains_key(k));
        let [(_, chosen_idx)] = kept.as_slice() else {
            tally.ambiguous_branches += 1;
            continue;
        };
        let chosen = &session.exchanges[*chosen_idx];
        for (_, idx) in abandoned {
            let rejected = &session.exchanges[idx];
            pairs.push(DpoPair {
                prompt: chosen.messages.iter().map(clean_message).collect(),
                chosen: vec![clean_message(chosen.answer.as_ref().expect("answered"))],
                rejected: vec![clean_message(rejected.answer.as_ref().expect("answered"))],
                session: session.id.clone(),
                request: Some(rejected.seq),
                chosen_request: Some(chosen.seq),
                mined: Mined::Branch,
                tool: None,
            });
        }
    }
    tally.no_branch += !branched as usize;
    pairs
}

fn mine_retries(session: &SessionData) -> Vec<DpoPair> {
    let Some(last) = session.exchanges.iter().rev().find(|e| !e.messages.is_empty()) else { return Vec::new() };
    let mut transcript = last.messages.clone();
    if let Some(answer) = &last.answer {
        transcript.push(answer.clone());
    }
    let results: HashMap<&str, (usize, bool)> = transcript
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("role").and_then(Value::as_str) == Some("tool"))
        .filter_map(|(i, m)| {
            let id = m.get("tool_call_id").and_then(Value::as_str)?;
            Some((id, (i, tool_output_failed(&content_text(m.get("content"))))))
        })
        .collect();
    let calls_of = |m: &Value| -> Vec<(String, String)> {
        m.get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|c| {
                (
                    c.get("id").and_then(Value::as_str).unwrap_or("").to_string(),
                    c["function"]["name"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    };
    // Request seq whose answer was transcript message `i` (request k holds every message before it).
    let request_for = |i: usize| -> Option<i64> {
        let keys = prefix_keys(&transcript[..i].iter().map(message_key_value).collect::<Vec<_>>());
        let target = keys.last().copied();
        session
            .exchanges
            .iter()
            .find(|e| {
                e.messages.len() == i
                    && prefix_keys(&e.messages.iter().map(message_key_value).collect::<Vec<_>>()).last().copied()
                        == target
            })
            .map(|e| e.seq)
    };
    let mut pairs = Vec::new();
    for (i, m) in transcript.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) != Some("assistant") {
            continue;
        }
        let calls = calls_of(m);
        let [(id, tool)] = calls.as_slice() else { continue };
        let Some(&(_, true)) = results.get(id.as_str()) else { continue };
        // The next call of the same tool before any user message; a success makes a pair.
        for (j, later) in transcript.iter().enumerate().skip(i + 1) {
            let role = later.get("role").and_then(Value::as_str);
            if role == Some("user") {
                break;
            }
            if role != Some("assistant") {
                continue;
            }
            let Some((later_id, _)) = calls_of(later).into_iter().find(|(_, name)| name == tool) else { continue };
            if let Some(&(_, false)) = results.get(later_id.as_str()) {
                pairs.push(DpoPair {
                    prompt: transcript[..i].iter().map(clean_message).collect(),
                    chosen: vec![clean_message(later)],
                    rejected: vec![clean_message(m)],
                    session: session.id.clone(),
                    request: request_for(i),
                    chosen_request: request_for(j),
                    mined: Mined::Retry,
                    tool: Some(tool.clone()),
                });
            }
            break;
        }
    }
    pairs
}

/// Write one SFT row per session to `out` (JSON Lines).
pub fn export_sft(
    reader: &ArchiveReader,
    filter: &SessionFilter,
    format: SftFormat,
    out: &mut impl Write,
) -> Result<ExportStats, ExportError> {
    let mut stats = ExportStats::default();
    for session in load_sessions(reader, filter)? {
        stats.sessions += 1;
        if let Some(row) = sft_row(&session, format) {
            writeln!(out, "{row}")?;
            stats.rows += 1;
        }
    }
    Ok(stats)
}

/// Write every mined DPO pair to `out` (JSON Lines).
pub fn export_dpo(
    reader: &ArchiveReader,
    filter: &SessionFilter,
    out: &mut impl Write,
) -> Result<ExportStats, ExportError> {
    let mut stats = ExportStats::default();
    for session in load_sessions(reader, filter)? {
        stats.sessions += 1;
        for pair in mine_pairs_tallied(&session, &mut stats.dpo) {
            writeln!(out, "{}", pair.to_json())?;
            stats.rows += 1;
        }
    }
    Ok(stats)
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error("cannot write the export: {0}")]
    Write(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_failures_are_read_from_json_and_text() {
        assert!(tool_output_failed(r#"{"output": "", "exit_code": 1, "error": null}"#));
        assert!(!tool_output_failed(r#"{"output": "ok", "exit_code": 0, "error": null}"#));
        assert!(tool_output_failed(r#"{"error": "file not found"}"#));
        assert!(!tool_output_failed(r#"{"content": "x", "error": null}"#));
        assert!(tool_output_failed("Traceback (most recent call last):\n  File \"x\""));
        assert!(tool_output_failed("bash: foo: command not found"));
        assert!(tool_output_failed("<returncode>2</returncode>\n<output>...</output>"));
        assert!(tool_output_failed("[Command finished with exit code 1]"));
        assert!(!tool_output_failed("[Command finished with exit code 0]"));
        assert!(!tool_output_failed("def error_handler():\n    pass"));
    }

    #[test]
    fn clean_message_flattens_parts_and_keeps_tool_fields() {
        let m = json!({"role": "tool", "tool_call_id": "c", "name": "bash", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "cache_control": {}});
        assert_eq!(clean_message(&m), json!({"role": "tool", "content": "a\nb", "tool_call_id": "c", "name": "bash"}));
        let a = json!({"role": "assistant", "content": null, "reasoning_content": "hmm", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]});
        assert_eq!(
            clean_message(&a),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
        );
    }
}
