//! Converters between Chat Completions and the Gemini API.
//!
//! [`to_chat`]: a Gemini conversation as chat messages, for `pare export sft|dpo`, which write one
//! format whatever the wire the agent spoke. It is the adapter's neutral view with each content
//! made text:
//!
//! - `systemInstruction` → one `system` message (its text parts joined);
//! - a user turn's `functionResponse` parts → one `tool` message each, paired with their call as
//!   the adapter pairs them, before the turn's text; its text parts → one `user` message;
//! - a model turn's text parts → `content`, its `functionCall` parts → `tool_calls` with
//!   `arguments` the JSON text of `args`;
//! - left out: `thought: true` parts (the model's private reasoning) and every `thoughtSignature`,
//!   `inlineData` and `fileData` (export rows are text), `executableCode` and
//!   `codeExecutionResult` (the server ran them: there is no call for the agent to answer), and
//!   turns of another role.

use serde_json::{Map, Value, json};

use super::GeminiBody;
use crate::wire::WireBody;

/// The Gemini request Gemini CLI would have sent for the chat request `chat` (an object with
/// `messages`), for tests and evaluation (`pare eval --wire gemini` on a chat corpus):
///
/// - the first system message becomes `systemInstruction` (`{"parts": [{"text": …}]}`); later
///   system messages become user text;
/// - an assistant message becomes a model turn: its `reasoning_content` a `thought: true` text
///   part, its text a `text` part, each tool call a `functionCall` part (`name`, `args`: the
///   arguments' object, or `{"arguments": …}` when they are not one); the turn's first call carries
///   a `thoughtSignature` derived from the turn (opaque to pare as the real one is);
/// - tool messages become `functionResponse` parts (`name` of their call, `response:
///   {"output": text}`) and user messages `text` parts, gathered into one user turn until the next
///   assistant message (Gemini CLI alternates roles); calls and responses carry no `id`, as the
///   Gemini API sends them, so the adapter pairs them by name and order;
/// - chat tools become one `{"functionDeclarations": […]}` tool; `max_tokens` (else
///   `max_completion_tokens`) and `temperature` go to `generationConfig`. `model` and `stream` are
///   in a Gemini request's path and are left out.
///
/// `None` when `chat` has no `messages` array.
pub fn chat_to_gemini(chat: &Value) -> Option<Value> {
    let messages = chat.get("messages")?.as_array()?;
    let mut out = Map::new();
    let mut turns: Vec<(&str, Vec<Value>)> = Vec::new();
    let push = |role: &'static str, part: Value, turns: &mut Vec<(&str, Vec<Value>)>| match turns.last_mut() {
        Some((last, parts)) if *last == role => parts.push(part),
        _ => turns.push((role, vec![part])),
    };
    let mut call_names: Map<String, Value> = Map::new();
    for (idx, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let text = crate::wire::chat_text(m.get("content"));
        match role {
            "system" if idx == 0 => {
                out.insert("systemInstruction".to_owned(), json!({"parts": [{"text": text}]}));
            }
            "tool" => {
                let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
                let name = call_names.get(id).cloned().unwrap_or_else(|| json!("tool"));
                push("user", json!({"functionResponse": {"name": name, "response": {"output": text}}}), &mut turns);
            }
            "assistant" => {
                let start = turns.len();
                let mut signature = Some(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(m.to_string().as_bytes())));
                if let Some(reasoning) = m.get("reasoning_content").and_then(Value::as_str).filter(|r| !r.is_empty()) {
                    push("model", json!({"text": reasoning, "thought": true}), &mut turns);
                }
                if !text.is_empty() {
                    push("model", json!({"text": text}), &mut turns);
                }
                for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let function = call.get("function").cloned().unwrap_or(Value::Null);
                    let name = function.get("name").cloned().unwrap_or_else(|| json!("tool"));
                    if let Some(id) = call.get("id").and_then(Value::as_str) {
                        call_names.insert(id.to_owned(), name.clone());
                    }
                    let args = match function.get("arguments") {
                        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                            Ok(object @ Value::Object(_)) => object,
                            _ => json!({"arguments": s}),
                        },
                        Some(object @ Value::Object(_)) => object.clone(),
                        Some(other) => json!({"arguments": other}),
                        None => json!({}),
                    };
                    let mut part = json!({"functionCall": {"name": name, "args": args}});
                    if let Some(signature) = signature.take() {
                        part["thoughtSignature"] = json!(signature);
                    }
                    push("model", part, &mut turns);
                }
                if turns.len() == start && turns.last().is_none_or(|(r, _)| *r != "model") {
                    push("model", json!({"text": "(empty)"}), &mut turns);
                }
            }
            _ => push("user", json!({"text": text}), &mut turns),
        }
    }
    let turns: Vec<Value> = turns.into_iter().map(|(role, parts)| json!({"role": role, "parts": parts})).collect();
    out.insert("contents".to_owned(), Value::Array(turns));
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        let declarations: Vec<Value> = tools
            .iter()
            .filter_map(|t| t.get("function"))
            .map(|f| {
                let mut declaration = Map::new();
                declaration.insert("name".to_owned(), f.get("name").cloned().unwrap_or(Value::Null));
                if let Some(description) = f.get("description") {
                    declaration.insert("description".to_owned(), description.clone());
                }
                if let Some(parameters) = f.get("parameters") {
                    declaration.insert("parameters".to_owned(), parameters.clone());
                }
                Value::Object(declaration)
            })
            .collect();
        out.insert("tools".to_owned(), json!([{"functionDeclarations": declarations}]));
    }
    let mut config = Map::new();
    if let Some(limit) = chat.get("max_tokens").or_else(|| chat.get("max_completion_tokens")) {
        config.insert("maxOutputTokens".to_owned(), limit.clone());
    }
    if let Some(temperature) = chat.get("temperature") {
        config.insert("temperature".to_owned(), temperature.clone());
    }
    if !config.is_empty() {
        out.insert("generationConfig".to_owned(), Value::Object(config));
    }
    Some(Value::Object(out))
}

/// A neutral message of the adapter as a plain chat message (text content); `None` for an opaque
/// entry (an array, no role).
fn plain(message: Value) -> Option<Value> {
    let role = message.get("role").and_then(Value::as_str)?.to_owned();
    let text = crate::wire::chat_text(message.get("content"));
    let calls = message.get("tool_calls").filter(|c| c.as_array().is_some_and(|a| !a.is_empty()));
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    if role == "tool" {
        out.insert("tool_call_id".into(), message.get("tool_call_id").cloned().unwrap_or(json!("")));
    }
    let no_text = text.is_empty() && calls.is_some();
    out.insert("content".into(), if no_text { Value::Null } else { Value::String(text) });
    if let Some(calls) = calls {
        out.insert("tool_calls".into(), calls.clone());
    }
    Some(Value::Object(out))
}

/// The conversation of a Gemini request body, as chat messages (see the module docs).
pub fn to_chat(raw: &[u8]) -> Vec<Value> {
    let Ok(body) = GeminiBody::parse(raw) else { return Vec::new() };
    body.messages().iter().filter_map(|m| serde_json::from_str::<Value>(m).ok()).filter_map(plain).collect()
}

/// A model answer (a candidate's `content`: `{"role": "model", "parts": […]}`) as a chat message.
pub fn answer_to_chat(content: &Value) -> Option<Value> {
    super::neutral_answer(content).and_then(plain)
}

/// Gemini tool definitions (`[{"functionDeclarations": […]}, {"googleSearch": {}}, …]`) as chat
/// tools; tools other than function declarations (search, code execution) are left out.
pub fn tools_to_chat(tools: &Value) -> Value {
    let tools = tools.as_array().map(Vec::as_slice).unwrap_or_default();
    let chat: Vec<Value> = tools
        .iter()
        .filter_map(|t| t.get("functionDeclarations").or_else(|| t.get("function_declarations")))
        .filter_map(Value::as_array)
        .flatten()
        .map(|declaration| {
            let mut function = Map::new();
            function.insert("name".into(), declaration.get("name").cloned().unwrap_or(Value::Null));
            if let Some(description) = declaration.get("description") {
                function.insert("description".into(), description.clone());
            }
            let parameters = declaration
                .get("parameters")
                .or_else(|| declaration.get("parametersJsonSchema"))
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            function.insert("parameters".into(), parameters);
            json!({"type": "function", "function": Value::Object(function)})
        })
        .collect();
    Value::Array(chat)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_session_becomes_a_gemini_cli_request_and_back() {
        let chat = crate::wire::convert::sample_chat_session();
        let g = chat_to_gemini(&chat).unwrap();
        assert_eq!(g["systemInstruction"], json!({"parts": [{"text": "be brief"}]}));
        assert_eq!(g["generationConfig"], json!({"maxOutputTokens": 100}));
        assert!(g.get("model").is_none() && g.get("stream").is_none(), "the path says these");
        assert_eq!(
            g["tools"],
            json!([{"functionDeclarations": [{"name": "ls", "description": "list", "parameters": {"type": "object"}}]}])
        );
        let roles: Vec<&str> = g["contents"].as_array().unwrap().iter().map(|t| t["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "model", "user", "model"]);
        let call_turn = &g["contents"][1]["parts"];
        assert_eq!(call_turn[0], json!({"text": "think", "thought": true}));
        assert_eq!(call_turn[1]["functionCall"], json!({"name": "ls", "args": {"path": "."}}));
        assert_eq!(call_turn[1]["thoughtSignature"].as_str().unwrap().len(), 16);
        assert!(call_turn[2].get("thoughtSignature").is_none(), "only the first call is signed");
        assert_eq!(call_turn[2]["functionCall"]["args"], json!({"arguments": "not json"}));
        let results = &g["contents"][2]["parts"];
        assert_eq!(results[0], json!({"functionResponse": {"name": "ls", "response": {"output": "a.rs"}}}));
        assert_eq!(results[1]["functionResponse"]["name"], "sh");
        assert_eq!(results[2], json!({"text": "and now?"}));
        assert_eq!(tools_to_chat(&g["tools"]), chat["tools"]);
        assert_eq!(tools_to_chat(&json!([{"googleSearch": {}}])), json!([]));
        // Back to chat: the same conversation, thought left out, calls paired by name and order.
        let back = to_chat(g.to_string().as_bytes());
        assert_eq!(back.len(), 7);
        assert_eq!(back[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(back[2]["content"], Value::Null);
        assert_eq!(back[2]["tool_calls"][1]["function"]["arguments"], "{\"arguments\":\"not json\"}");
        assert_eq!(back[3], json!({"role": "tool", "tool_call_id": "call_0", "content": "a.rs"}));
        assert_eq!(back[4]["tool_call_id"], "call_1");
        assert_eq!(back[6], json!({"role": "assistant", "content": "a.rs"}));
        assert!(chat_to_gemini(&json!({"input": []})).is_none());
    }

    #[test]
    fn an_answer_becomes_a_chat_message_without_its_thoughts() {
        let content = json!({"role": "model", "parts": [
            {"text": "private", "thought": true},
            {"text": "Done."},
            {"functionCall": {"name": "run", "args": {"cmd": "ls"}}, "thoughtSignature": "c2ln"},
        ]});
        assert_eq!(
            answer_to_chat(&content),
            Some(json!({"role": "assistant", "content": "Done.", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"ls\"}"}}
            ]}))
        );
        assert_eq!(answer_to_chat(&json!({"role": "user", "parts": []})), None);
    }
}
