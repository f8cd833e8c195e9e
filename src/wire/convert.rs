//! Converters between wire formats, for tests and evaluation: a Chat Completions session becomes the
//! session an agent speaking another format would have sent (Responses as Codex CLI sends it,
//! Anthropic Messages, Gemini: `pare eval --convert --wire responses` on a chat corpus). The ways
//! back to chat messages, for export, are in each format's own module (`messages::convert`,
//! `gemini::convert`) and in the archive's export (Responses).

use serde_json::{Map, Value, json};

use super::Wire;

/// A session file of chat requests (one a line) as the session an agent speaking `wire` would have
/// sent, one request a line: Responses ([`chat_to_responses`], also for `chat`), Messages
/// ([`super::messages::convert::chat_to_messages`]) or Gemini
/// ([`super::gemini::convert::chat_to_gemini`]). Lines that are not chat requests are left out.
pub fn chat_session_to(wire: Wire, chat: &str) -> String {
    let convert: fn(&Value) -> Option<Value> = match wire {
        Wire::Messages => super::messages::convert::chat_to_messages,
        Wire::Gemini => super::gemini::convert::chat_to_gemini,
        Wire::Chat | Wire::Responses => chat_to_responses,
    };
    let mut out = String::new();
    for line in chat.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(converted) = serde_json::from_str::<Value>(line).ok().as_ref().and_then(convert) {
            out.push_str(&converted.to_string());
            out.push('\n');
        }
    }
    out
}

/// The Responses request an agent would have sent for the chat request `chat` (a JSON object with
/// `messages`): the first system message becomes `instructions`, other messages become `message`
/// items with `input_text`/`output_text` parts, an assistant's `reasoning_content` a `reasoning` item
/// (its text as `encrypted_content`, opaque to pare as the real one is), its tool calls
/// `function_call` items, tool messages `function_call_output` items. Chat tools become Responses
/// function tools; `max_tokens` becomes `max_output_tokens`; `model`, `stream`, `temperature` are
/// kept. `None` when `chat` has no `messages` array.
pub fn chat_to_responses(chat: &Value) -> Option<Value> {
    let messages = chat.get("messages")?.as_array()?;
    let mut out = Map::new();
    for key in ["model", "stream", "temperature"] {
        if let Some(v) = chat.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    let mut items = Vec::new();
    let mut instructions = None;
    for (idx, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let text = super::chat_text(m.get("content"));
        match role {
            "system" if idx == 0 => instructions = Some(text),
            "tool" => items.push(json!({
                "type": "function_call_output",
                "call_id": m.get("tool_call_id").cloned().unwrap_or(Value::Null),
                "output": text,
            })),
            "assistant" => {
                if let Some(reasoning) = m.get("reasoning_content").and_then(Value::as_str).filter(|r| !r.is_empty()) {
                    items.push(json!({
                        "type": "reasoning",
                        "id": format!("rs_{idx}"),
                        "summary": [],
                        "encrypted_content": reasoning,
                    }));
                }
                if !text.is_empty() {
                    items.push(json!({
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }));
                }
                for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let function = call.get("function").cloned().unwrap_or(Value::Null);
                    let arguments = match function.get("arguments") {
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                        None => "{}".to_owned(),
                    };
                    items.push(json!({
                        "type": "function_call",
                        "call_id": call.get("id").cloned().unwrap_or(Value::Null),
                        "name": function.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": arguments,
                    }));
                }
            }
            _ => items.push(json!({
                "type": "message",
                "role": role,
                "content": [{"type": "input_text", "text": text}],
            })),
        }
    }
    if let Some(instructions) = instructions {
        out.insert("instructions".to_owned(), Value::String(instructions));
    }
    out.insert("input".to_owned(), Value::Array(items));
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| match t.get("function") {
                Some(Value::Object(f)) => {
                    let mut tool = Map::new();
                    tool.insert("type".to_owned(), json!("function"));
                    tool.extend(f.clone());
                    Value::Object(tool)
                }
                _ => t.clone(),
            })
            .collect();
        out.insert("tools".to_owned(), Value::Array(tools));
    }
    if let Some(max) = chat.get("max_tokens").or_else(|| chat.get("max_completion_tokens")) {
        out.insert("max_output_tokens".to_owned(), max.clone());
    }
    Some(Value::Object(out))
}

/// A short chat session with parallel tool calls (one with arguments that are not JSON), a result
/// in parts, reasoning and a tool definition: what the converters' tests turn into each format.
#[cfg(test)]
pub(crate) fn sample_chat_session() -> Value {
    json!({
        "model": "m", "max_tokens": 100, "stream": true,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "", "reasoning_content": "think",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}},
                            {"id": "c2", "type": "function", "function": {"name": "sh", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.rs"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "and now?"},
            {"role": "assistant", "content": "a.rs"}
        ],
        "tools": [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {"type": "object"}}}]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_session_becomes_responses_items() {
        let chat = json!({
            "model": "m", "max_tokens": 100,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", "reasoning_content": "think",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.rs"},
                {"role": "assistant", "content": "a.rs"}
            ],
            "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
        });
        let r = chat_to_responses(&chat).unwrap();
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(r["max_output_tokens"], 100);
        assert_eq!(r["tools"][0], json!({"type": "function", "name": "ls", "parameters": {}}));
        let types: Vec<&str> = r["input"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["message", "reasoning", "function_call", "function_call_output", "message"]);
        assert_eq!(r["input"][2]["call_id"], "c1");
        assert_eq!(r["input"][4]["content"][0]["type"], "output_text");
        assert!(chat_to_responses(&json!({"input": []})).is_none());
    }
}
