//! Converters between Chat Completions and the Anthropic Messages API.
//!
//! [`to_chat`]: a Messages conversation as chat messages, for `pare export sft|dpo`, which write one
//! format whatever the wire the agent spoke:
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

/// The Messages request Claude Code would have sent for the chat request `chat` (an object with
/// `messages`), for tests and evaluation (`pare eval --wire messages` on a chat corpus):
///
/// - the first system message becomes `system`, one text block marked `cache_control`; later system
///   messages become user text (where Claude Code puts its reminders);
/// - an assistant message becomes an assistant turn: its `reasoning_content` a `thinking` block with
///   a signature (derived from the text: opaque to pare as the real one is), its text a `text`
///   block, each tool call a `tool_use` block whose `input` is the arguments' object (arguments that
///   are not a JSON object are wrapped as `{"arguments": …}`);
/// - tool messages become `tool_result` blocks and user messages `text` blocks, gathered into one
///   user turn until the next assistant message (the API alternates roles);
/// - the last block of the last user turn carries `cache_control`: with the system's, Claude Code's
///   breakpoints;
/// - chat tools become `{name, description, input_schema}`; `model`, `stream`, `temperature`,
///   `max_tokens` (else `max_completion_tokens`) are kept. A chat request without a limit gives a
///   Messages request without `max_tokens`, which the API would refuse: pare then reserves
///   `budget.output_reserve` for the answer, as for the chat request, so that both are compacted
///   against the same usable window.
///
/// `None` when `chat` has no `messages` array.
pub fn chat_to_messages(chat: &Value) -> Option<Value> {
    let messages = chat.get("messages")?.as_array()?;
    let mut out = Map::new();
    for key in ["model", "stream", "temperature"] {
        if let Some(v) = chat.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    if let Some(max_tokens) = chat.get("max_tokens").or_else(|| chat.get("max_completion_tokens")) {
        out.insert("max_tokens".to_owned(), max_tokens.clone());
    }
    let ephemeral = json!({"type": "ephemeral"});
    let mut turns: Vec<(&str, Vec<Value>)> = Vec::new();
    let push = |role: &'static str, block: Value, turns: &mut Vec<(&str, Vec<Value>)>| match turns.last_mut() {
        Some((last, blocks)) if *last == role => blocks.push(block),
        _ => turns.push((role, vec![block])),
    };
    for (idx, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let text = crate::wire::chat_text(m.get("content"));
        match role {
            "system" if idx == 0 => {
                out.insert("system".to_owned(), json!([{"type": "text", "text": text, "cache_control": ephemeral}]));
            }
            "tool" => {
                let id = m.get("tool_call_id").cloned().unwrap_or(Value::Null);
                push("user", json!({"type": "tool_result", "tool_use_id": id, "content": text}), &mut turns);
            }
            "assistant" => {
                let start = turns.len();
                if let Some(reasoning) = m.get("reasoning_content").and_then(Value::as_str).filter(|r| !r.is_empty()) {
                    let signature = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(reasoning.as_bytes()));
                    push(
                        "assistant",
                        json!({"type": "thinking", "thinking": reasoning, "signature": signature}),
                        &mut turns,
                    );
                }
                if !text.is_empty() {
                    push("assistant", json!({"type": "text", "text": text}), &mut turns);
                }
                for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let function = call.get("function").cloned().unwrap_or(Value::Null);
                    let input = match function.get("arguments") {
                        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                            Ok(object @ Value::Object(_)) => object,
                            _ => json!({"arguments": s}),
                        },
                        Some(object @ Value::Object(_)) => object.clone(),
                        Some(other) => json!({"arguments": other}),
                        None => json!({}),
                    };
                    let block = json!({
                        "type": "tool_use",
                        "id": call.get("id").cloned().unwrap_or(Value::Null),
                        "name": function.get("name").cloned().unwrap_or(Value::Null),
                        "input": input,
                    });
                    push("assistant", block, &mut turns);
                }
                if turns.len() == start && turns.last().is_none_or(|(r, _)| *r != "assistant") {
                    push("assistant", json!({"type": "text", "text": "(empty)"}), &mut turns);
                }
            }
            _ => push("user", json!({"type": "text", "text": text}), &mut turns),
        }
    }
    if let Some((_, blocks)) = turns.iter_mut().rev().find(|(role, _)| *role == "user")
        && let Some(Value::Object(last)) = blocks.last_mut()
    {
        last.insert("cache_control".to_owned(), ephemeral);
    }
    let turns: Vec<Value> = turns.into_iter().map(|(role, blocks)| json!({"role": role, "content": blocks})).collect();
    out.insert("messages".to_owned(), Value::Array(turns));
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .filter_map(|t| t.get("function"))
            .map(|f| {
                let mut tool = Map::new();
                tool.insert("name".to_owned(), f.get("name").cloned().unwrap_or(Value::Null));
                if let Some(description) = f.get("description") {
                    tool.insert("description".to_owned(), description.clone());
                }
                let schema = f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}));
                tool.insert("input_schema".to_owned(), schema);
                Value::Object(tool)
            })
            .collect();
        out.insert("tools".to_owned(), Value::Array(tools));
    }
    Some(Value::Object(out))
}

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

/// The assistant message the API returned (`{"role": "assistant", "content": [...]}`) as a chat message.
pub fn answer_to_chat(message: &Value) -> Value {
    assistant(message.get("content"))
}

/// Messages tool definitions (`{name, description, input_schema}`) as chat tools; server tools
/// (`{type: "web_search_…", …}`, no `input_schema`) are left out.
pub fn tools_to_chat(tools: &Value) -> Value {
    let tools = tools.as_array().map(Vec::as_slice).unwrap_or_default();
    let chat: Vec<Value> = tools
        .iter()
        .filter(|t| t.get("input_schema").is_some())
        .map(|t| {
            let mut function = Map::new();
            function.insert("name".into(), t.get("name").cloned().unwrap_or(Value::Null));
            if let Some(description) = t.get("description") {
                function.insert("description".into(), description.clone());
            }
            function.insert("parameters".into(), t["input_schema"].clone());
            json!({"type": "function", "function": Value::Object(function)})
        })
        .collect();
    Value::Array(chat)
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
        assert_eq!(answer_to_chat(&answer), json!({"role": "assistant", "content": "Fixed."}));
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
    fn a_chat_session_becomes_a_claude_code_request() {
        let chat = crate::wire::convert::sample_chat_session();
        let m = chat_to_messages(&chat).unwrap();
        assert_eq!(m["system"], json!([{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]));
        assert_eq!(m["max_tokens"], 100);
        assert_eq!(m["stream"], true);
        assert_eq!(m["tools"], json!([{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]));
        let roles: Vec<&str> = m["messages"].as_array().unwrap().iter().map(|t| t["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
        let call_turn = &m["messages"][1]["content"];
        assert_eq!(call_turn[0]["type"], "thinking");
        assert_eq!(call_turn[0]["signature"].as_str().unwrap().len(), 16);
        assert_eq!(call_turn[1], json!({"type": "tool_use", "id": "c1", "name": "ls", "input": {"path": "."}}));
        assert_eq!(call_turn[2]["input"], json!({"arguments": "not json"}));
        let results = &m["messages"][2]["content"];
        assert_eq!(results[0], json!({"type": "tool_result", "tool_use_id": "c1", "content": "a.rs"}));
        assert_eq!(results[1]["content"], "ok");
        assert_eq!(results[2], json!({"type": "text", "text": "and now?", "cache_control": {"type": "ephemeral"}}));
        assert_eq!(tools_to_chat(&m["tools"]), chat["tools"]);
        assert_eq!(tools_to_chat(&json!([{"type": "web_search_20250305", "name": "web_search"}])), json!([]));
        // Back to chat: the same conversation, thinking left out.
        let back = to_chat(&m, None);
        assert_eq!(back.len(), 7);
        assert_eq!(back[2]["tool_calls"][1]["function"]["arguments"], "{\"arguments\":\"not json\"}");
        assert!(chat_to_messages(&json!({"input": []})).is_none());
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
