//! An Anthropic Messages conversation as Chat Completions messages, for `pare export sft|dpo`, which
//! write one format whatever the wire the agent spoke.
//!
//! - `system` (a string or text blocks) → one `system` message;
//! - a user turn's `tool_result` blocks → one `tool` message each, in order, before the turn's other
//!   text (the API puts results first in the turn); its text blocks → one `user` message;
//! - an assistant turn's text blocks → `content`, its `tool_use` blocks → `tool_calls` with
//!   `arguments` the JSON text of `input`;
//! - left out: `thinking` and `redacted_thinking` (their text is the model's private reasoning, and
//!   chat formats have no place for a signature), images and documents (export rows are text),
//!   server-side tool blocks (`server_tool_use`, `web_search_tool_result`, …: the server ran them,
//!   there is no call for the agent to answer), `is_error` and `cache_control`.

use serde_json::{Map, Value, json};

/// The conversation of a Messages request body (its `system` and `messages`), followed by `answer`
/// (the assistant message the API returned) when there is one, as chat messages.
pub fn to_chat(body: &Value, answer: Option<&Value>) -> Vec<Value> {
    let mut out = Vec::new();
    if let Some(system) = body.get("system") {
        let text = text_of(system);
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    let turns = body.get("messages").and_then(Value::as_array).into_iter().flatten();
    for turn in turns.chain(answer) {
        match turn.get("role").and_then(Value::as_str) {
            Some("assistant") => out.push(assistant(turn.get("content"))),
            _ => user(turn.get("content"), &mut out),
        }
    }
    out
}

/// The text of a content value: a string as is, text blocks joined with newlines, other blocks left out.
pub fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => {
            let texts: Vec<&str> = blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect();
            texts.join("\n")
        }
        _ => String::new(),
    }
}

fn blocks(content: Option<&Value>) -> &[Value] {
    content.and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default()
}

fn user(content: Option<&Value>, out: &mut Vec<Value>) {
    for block in blocks(content).iter().filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result")) {
        out.push(json!({
            "role": "tool",
            "tool_call_id": block.get("tool_use_id").and_then(Value::as_str).unwrap_or(""),
            "content": block.get("content").map(text_of).unwrap_or_default(),
        }));
    }
    let text = content.map(text_of).unwrap_or_default();
    let only_results = !blocks(content).is_empty() && text.is_empty();
    if !only_results {
        out.push(json!({"role": "user", "content": text}));
    }
}

fn assistant(content: Option<&Value>) -> Value {
    let calls: Vec<Value> = blocks(content)
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .map(|b| {
            json!({
                "id": b.get("id").and_then(Value::as_str).unwrap_or(""),
                "type": "function",
                "function": {
                    "name": b.get("name").and_then(Value::as_str).unwrap_or(""),
                    "arguments": b.get("input").unwrap_or(&json!({})).to_string(),
                },
            })
        })
        .collect();
    let text = content.map(text_of).unwrap_or_default();
    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    let no_text = text.is_empty() && !calls.is_empty();
    message.insert("content".into(), if no_text { Value::Null } else { Value::String(text) });
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claude_code_conversation_becomes_chat_messages() {
        let body = json!({
            "model": "claude-sonnet-4-5",
            "system": [
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be brief."},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Fix the build."}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look first.", "signature": "EqQB"},
                    {"type": "text", "text": "Reading both."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.rs"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "cargo build"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "fn main() {}"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true, "content": [{"type": "text", "text": "error[E0425]"}, {"type": "text", "text": "1 error"}]},
                    {"type": "text", "text": "<system-reminder>todo list empty</system-reminder>", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                ]},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwK"}, {"type": "tool_use", "id": "toolu_3", "name": "Edit", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "content": "ok"}]},
            ],
        });
        let answer = json!({"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]});
        assert_eq!(
            to_chat(&body, Some(&answer)),
            vec![
                json!({"role": "system", "content": "You are Claude Code.\nBe brief."}),
                json!({"role": "user", "content": "Fix the build."}),
                json!({"role": "assistant", "content": "Reading both.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "Read", "arguments": "{\"file_path\":\"a.rs\"}"}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\":\"cargo build\"}"}},
                ]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "fn main() {}"}),
                json!({"role": "tool", "tool_call_id": "toolu_2", "content": "error[E0425]\n1 error"}),
                json!({"role": "user", "content": "<system-reminder>todo list empty</system-reminder>"}),
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "toolu_3", "type": "function", "function": {"name": "Edit", "arguments": "{}"}},
                ]}),
                json!({"role": "tool", "tool_call_id": "toolu_3", "content": "ok"}),
                json!({"role": "assistant", "content": "Fixed."}),
            ]
        );
    }

    #[test]
    fn string_contents_and_a_string_system_pass_as_text() {
        let body = json!({"system": "Be terse.", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": []},
        ]});
        assert_eq!(
            to_chat(&body, None),
            vec![
                json!({"role": "system", "content": "Be terse."}),
                json!({"role": "user", "content": "hi"}),
                json!({"role": "assistant", "content": "hello"}),
                json!({"role": "user", "content": ""}),
            ]
        );
        assert_eq!(to_chat(&json!({"messages": "not a list"}), None), Vec::<Value>::new());
    }
}
