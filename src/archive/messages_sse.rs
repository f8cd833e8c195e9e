//! The answer of an Anthropic Messages exchange, assembled for the archive: an SSE stream
//! (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`,
//! `ping`, `error`) or a JSON body becomes the message as the non-streaming API returns it
//! (`{"id", "type": "message", "role", "model", "content": [...], "stop_reason", "usage", …}`),
//! wrapped like the chat answer: `{"message", "finish_reason", "usage", "model"}`.
//!
//! The assembly follows the `anthropic` SDK's stream accumulator: text, thinking and partial tool
//! input are appended per block index, a `signature_delta` sets the thinking block's signature, a
//! `citations_delta` appends to the block's citations, `message_delta` sets the stop reason and
//! merges its usage. A stream cut short gives what arrived: a tool input whose JSON did not arrive
//! whole keeps the value its block started with. An `error` event is kept under `"error"`.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::sse::{self, Event};

/// What a Messages answer says, assembled; `None` when the body is neither a message nor a stream of one.
pub fn assemble(body: &[u8], stream: bool) -> Option<Value> {
    if stream || sse::looks_like_sse(body) { assemble_sse(body) } else { assemble_json(body) }
}

fn assemble_json(body: &[u8]) -> Option<Value> {
    let message: Value = serde_json::from_slice(body).ok()?;
    if message.get("type").and_then(Value::as_str) != Some("message") {
        return None;
    }
    Some(envelope(message, None))
}

/// The archive's envelope around a Messages answer (the same keys as a chat answer's).
fn envelope(message: Value, error: Option<Value>) -> Value {
    let mut out = json!({
        "finish_reason": message.get("stop_reason").cloned().unwrap_or(Value::Null),
        "usage": message.get("usage").cloned().unwrap_or(Value::Null),
        "model": message.get("model").cloned().unwrap_or(Value::Null),
        "message": message,
    });
    if let Some(error) = error {
        out["error"] = error;
    }
    out
}

/// One content block being assembled.
struct Block {
    fields: Map<String, Value>,
    /// The `partial_json` pieces of a tool input so far.
    input_json: String,
}

#[derive(Default)]
struct Assembly {
    message: Option<Map<String, Value>>,
    /// Blocks by their stream index (the upstream's choice: only the blocks it sent are held).
    blocks: BTreeMap<usize, Block>,
    error: Option<Value>,
}

fn append_str(fields: &mut Map<String, Value>, key: &str, piece: &str) {
    match fields.get_mut(key) {
        Some(Value::String(s)) => s.push_str(piece),
        _ => {
            fields.insert(key.to_owned(), Value::String(piece.to_owned()));
        }
    }
}

impl Assembly {
    fn event(&mut self, data: &Value) {
        match data.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                if let Some(Value::Object(message)) = data.get("message") {
                    self.message = Some(message.clone());
                }
            }
            "content_block_start" => {
                let (Some(idx), Some(Value::Object(block))) = (index_of(data), data.get("content_block")) else {
                    return;
                };
                self.blocks.insert(idx, Block { fields: block.clone(), input_json: String::new() });
            }
            "content_block_delta" => {
                let Some(block) = index_of(data).and_then(|idx| self.blocks.get_mut(&idx)) else {
                    return;
                };
                let Some(delta) = data.get("delta") else { return };
                let text = |key: &str| delta.get(key).and_then(Value::as_str);
                match delta.get("type").and_then(Value::as_str).unwrap_or("") {
                    "text_delta" => append_str(&mut block.fields, "text", text("text").unwrap_or("")),
                    "thinking_delta" => append_str(&mut block.fields, "thinking", text("thinking").unwrap_or("")),
                    "signature_delta" => {
                        block.fields.insert("signature".into(), json!(text("signature").unwrap_or("")));
                    }
                    "input_json_delta" => block.input_json.push_str(text("partial_json").unwrap_or("")),
                    "citations_delta" => {
                        if let Some(citation) = delta.get("citation") {
                            match block.fields.get_mut("citations") {
                                Some(Value::Array(list)) => list.push(citation.clone()),
                                _ => {
                                    block.fields.insert("citations".into(), json!([citation]));
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                let Some(message) = self.message.as_mut() else { return };
                if let Some(Value::Object(delta)) = data.get("delta") {
                    for (key, value) in delta {
                        message.insert(key.clone(), value.clone());
                    }
                }
                if let Some(Value::Object(usage)) = data.get("usage") {
                    let slot = message.entry("usage").or_insert_with(|| json!({}));
                    if !slot.is_object() {
                        *slot = json!({});
                    }
                    let slot = slot.as_object_mut().expect("made an object");
                    for (key, value) in usage.iter().filter(|(_, v)| !v.is_null()) {
                        slot.insert(key.clone(), value.clone());
                    }
                }
            }
            "error" => self.error = Some(data.get("error").cloned().unwrap_or(Value::Null)),
            // `content_block_stop`, `message_stop`, `ping` and unknown events add nothing: a tool input
            // is read when the message is finished, so a stream cut before its block stopped keeps it too.
            _ => {}
        }
    }

    fn finish(self) -> Option<Value> {
        let Some(mut message) = self.message else {
            return self.error.map(|error| json!({"message": Value::Null, "finish_reason": Value::Null, "usage": Value::Null, "model": Value::Null, "error": error}));
        };
        let content: Vec<Value> = self
            .blocks
            .into_values()
            .map(|mut block| {
                if !block.input_json.is_empty()
                    && let Ok(input) = serde_json::from_str::<Value>(&block.input_json)
                {
                    block.fields.insert("input".into(), input);
                }
                Value::Object(block.fields)
            })
            .collect();
        message.insert("content".into(), Value::Array(content));
        Some(envelope(Value::Object(message), self.error))
    }
}

fn index_of(data: &Value) -> Option<usize> {
    data.get("index").and_then(Value::as_u64).and_then(|i| usize::try_from(i).ok())
}

/// Assemble the message from the raw bytes of a Messages SSE stream (complete or cut short).
pub fn assemble_sse(body: &[u8]) -> Option<Value> {
    let mut assembly = Assembly::default();
    sse::each_event(body, |event| {
        if let Ok(v) = serde_json::from_str::<Value>(&event.data) {
            assembly.event(&v);
        }
    });
    assembly.finish()
}

/// Whether `event` ends a Messages stream: `message_stop`, or an `error` (the API closes the stream
/// after one), by its `event` name, else its data's `type`.
pub fn is_final(event: &Event) -> bool {
    matches!(event.type_name().as_deref(), Some("message_stop" | "error"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames as the Messages API sends them: `event:` then `data:`, a blank line after each.
    fn sse(events: &[Value]) -> String {
        events.iter().map(|e| format!("event: {}\ndata: {}\n\n", e["type"].as_str().unwrap(), e)).collect()
    }

    fn start(id: &str) -> Value {
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": "claude-sonnet-4-5", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 472, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2048, "output_tokens": 2}}})
    }

    fn delta(index: usize, delta: Value) -> Value {
        json!({"type": "content_block_delta", "index": index, "delta": delta})
    }

    #[test]
    fn text_thinking_and_a_tool_call_assemble_as_the_api_returns_them() {
        let events = [
            start("msg_01"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            delta(0, json!({"type": "thinking_delta", "thinking": "The user wants "})),
            delta(0, json!({"type": "thinking_delta", "thinking": "the file."})),
            delta(0, json!({"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"})),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            delta(1, json!({"type": "text_delta", "text": "Let me "})),
            delta(1, json!({"type": "text_delta", "text": "read it."})),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": {}}}),
            delta(2, json!({"type": "input_json_delta", "partial_json": ""})),
            delta(2, json!({"type": "input_json_delta", "partial_json": "{\"file_path\": \"/src/ma"})),
            delta(2, json!({"type": "input_json_delta", "partial_json": "in.rs\", \"limit\": 20}"})),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 89, "input_tokens": null}}),
            json!({"type": "message_stop"}),
        ];
        let a = assemble(sse(&events).as_bytes(), true).unwrap();
        assert_eq!(
            a["message"],
            json!({"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                "content": [
                    {"type": "thinking", "thinking": "The user wants the file.", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"},
                    {"type": "text", "text": "Let me read it."},
                    {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": {"file_path": "/src/main.rs", "limit": 20}},
                ],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 472, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2048, "output_tokens": 89}})
        );
        assert_eq!(a["finish_reason"], "tool_use");
        assert_eq!(a["usage"]["output_tokens"], 89);
        assert_eq!(a["model"], "claude-sonnet-4-5");
        assert!(a.get("error").is_none());
    }

    #[test]
    fn a_tool_call_without_input_deltas_keeps_its_empty_input_and_redacted_thinking_passes_whole() {
        let events = [
            start("msg_02"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_02", "name": "LS", "input": {}}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 12}}),
            json!({"type": "message_stop"}),
        ];
        let a = assemble_sse(sse(&events).as_bytes()).unwrap();
        assert_eq!(a["message"]["content"][0], json!({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}));
        assert_eq!(a["message"]["content"][1]["input"], json!({}));
    }

    #[test]
    fn citations_and_server_tool_input_accumulate() {
        let events = [
            start("msg_03"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}}),
            delta(0, json!({"type": "input_json_delta", "partial_json": "{\"query\": \"rust\"}"})),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": "", "citations": null}}),
            delta(
                1,
                json!({"type": "citations_delta", "citation": {"type": "web_search_result_location", "url": "https://a"}}),
            ),
            delta(
                1,
                json!({"type": "citations_delta", "citation": {"type": "web_search_result_location", "url": "https://b"}}),
            ),
            delta(1, json!({"type": "text_delta", "text": "Rust is"})),
        ];
        let a = assemble_sse(sse(&events).as_bytes()).unwrap();
        assert_eq!(a["message"]["content"][0]["input"], json!({"query": "rust"}));
        assert_eq!(a["message"]["content"][1]["citations"][1]["url"], "https://b");
        assert_eq!(a["message"]["content"][1]["text"], "Rust is");
    }

    #[test]
    fn a_stream_cut_short_keeps_what_arrived() {
        let mut body = sse(&[
            start("msg_04"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            delta(0, json!({"type": "text_delta", "text": "Hel"})),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_04", "name": "Bash", "input": {}}}),
            delta(1, json!({"type": "input_json_delta", "partial_json": "{\"command\": \"ca"})),
        ]);
        body.push_str("event: content_block_delta\ndata: {\"type\": \"content_blo");
        sse::each_event(body.as_bytes(), |e| assert!(!is_final(e), "{e:?}"));
        let a = assemble_sse(body.as_bytes()).unwrap();
        assert_eq!(a["message"]["content"][0]["text"], "Hel");
        assert_eq!(a["message"]["content"][1]["input"], json!({}), "an input cut mid-JSON keeps its start");
        assert_eq!(a["finish_reason"], Value::Null);
    }

    #[test]
    fn an_error_event_is_kept_with_or_without_a_message() {
        let overloaded = json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
        let a = assemble_sse(sse(std::slice::from_ref(&overloaded)).as_bytes()).unwrap();
        assert_eq!(a["message"], Value::Null);
        assert_eq!(a["error"]["type"], "overloaded_error");
        let b = assemble_sse(sse(&[start("msg_05"), overloaded]).as_bytes()).unwrap();
        assert_eq!(b["message"]["id"], "msg_05");
        assert_eq!(b["error"]["message"], "Overloaded");
        assert!(assemble_sse(b"event: ping\ndata: {\"type\": \"ping\"}\n\n").is_none());
    }

    #[test]
    fn a_json_body_is_the_message_and_an_error_body_is_not() {
        let body = br#"{"id":"msg_06","type":"message","role":"assistant","model":"claude-haiku-4-5","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}"#;
        let a = assemble(body, false).unwrap();
        assert_eq!(a["message"]["content"][0]["text"], "hi");
        assert_eq!(a["finish_reason"], "end_turn");
        assert_eq!(a["usage"]["input_tokens"], 9);
        let error = br#"{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}"#;
        assert!(assemble(error, false).is_none());
        let mut n_final = 0;
        let stop = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\ndata: {\"type\":\"message_stop\"}\n\n";
        sse::each_event(stop.as_bytes(), |e| n_final += usize::from(is_final(e)));
        assert_eq!(n_final, 2, "named, and unnamed with its type in the data");
        let quoted = sse(&[delta(0, json!({"type": "text_delta", "text": "\"message_stop\" ends it"}))]);
        sse::each_event(quoted.as_bytes(), |e| assert!(!is_final(e), "{e:?}"));
    }
}
