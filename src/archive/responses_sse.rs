//! The answer to a Responses API request, assembled for the archive: from a JSON body (the response
//! object) or from its SSE stream. `response.completed` (or `response.incomplete` / `response.failed`)
//! carries the whole response and is used as it is; a stream cut before it is assembled from what
//! arrived — `response.created` for the envelope, `response.output_item.added` / `.done` for the
//! items, `response.output_text.delta` and `response.function_call_arguments.delta` for their text.
//!
//! The assembled value is `{"response": {...}, "message": {...}, "messages": [...], "usage", "model"}`:
//! `messages` are the output items read into pare's neutral form (what the session tracker keys and
//! export writes), `message` the last assistant one.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::sse::{self, Event};
use crate::wire::responses::ResponsesBody;

/// The response object of a JSON body or an SSE stream, with its output read as neutral messages.
pub fn assemble(body: &[u8], stream: bool) -> Option<Value> {
    let response = if stream || sse::looks_like_sse(body) {
        assemble_sse(body)?
    } else {
        let v: Value = serde_json::from_slice(body).ok()?;
        v.get("output")?;
        v
    };
    Some(with_messages(response))
}

/// The neutral messages of the response's `output` items, beside it.
fn with_messages(response: Value) -> Value {
    let output = response.get("output").cloned().unwrap_or_else(|| json!([]));
    let request = json!({ "input": output }).to_string();
    let messages: Vec<Value> =
        ResponsesBody::parse(request.as_bytes()).map(|body| body.neutral_values()).unwrap_or_default();
    let message = messages.iter().rev().find(|m| m.get("role").and_then(Value::as_str) == Some("assistant")).cloned();
    json!({
        "message": message,
        "messages": messages,
        "usage": response.get("usage").cloned().unwrap_or(Value::Null),
        "model": response.get("model").cloned().unwrap_or(Value::Null),
        "status": response.get("status").cloned().unwrap_or(Value::Null),
        "response": response,
    })
}

/// Whether `event` ends a Responses stream: `response.completed`, `.incomplete` or `.failed` (its
/// `event` name, else its data's `type`), after which a client may send its next request.
pub fn is_final(event: &Event) -> bool {
    matches!(event.type_name().as_deref(), Some("response.completed" | "response.incomplete" | "response.failed"))
}

/// The response of an SSE stream: the final event's when it arrived, else what the events built.
fn assemble_sse(body: &[u8]) -> Option<Value> {
    let mut envelope: Option<Value> = None;
    // By `output_index` (the upstream's choice: only the items it sent are held).
    let mut items: BTreeMap<u64, Value> = BTreeMap::new();
    let mut last: Option<Value> = None;
    sse::each_event(body, |event| {
        if last.is_some() {
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(&event.data) else { return };
        let kind = event.get("type").and_then(Value::as_str).unwrap_or("");
        let index = event.get("output_index").and_then(Value::as_u64);
        match kind {
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(response) = event.get("response").filter(|r| r.get("output").is_some()) {
                    last = Some(response.clone());
                }
            }
            "response.created" | "response.in_progress" => envelope = event.get("response").cloned(),
            "response.output_item.added" | "response.output_item.done" => {
                if let (Some(i), Some(item)) = (index, event.get("item")) {
                    items.insert(i, item.clone());
                }
            }
            "response.output_text.delta" => {
                if let (Some(i), Some(delta)) = (index, event.get("delta").and_then(Value::as_str)) {
                    let content_index = event.get("content_index").and_then(Value::as_u64).unwrap_or(0) as usize;
                    append_text(items.entry(i).or_default(), content_index, delta);
                }
            }
            "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                if let (Some(i), Some(delta)) = (index, event.get("delta").and_then(Value::as_str)) {
                    let key = if kind.contains("custom") { "input" } else { "arguments" };
                    append_field(items.entry(i).or_default(), key, delta);
                }
            }
            _ => {}
        }
    });
    if last.is_some() {
        return last;
    }
    if envelope.is_none() && items.is_empty() {
        return None;
    }
    let mut response = envelope.unwrap_or_else(|| json!({}));
    let map = response.as_object_mut()?;
    map.insert("output".into(), Value::Array(items.into_values().filter(|i| !i.is_null()).collect()));
    map.insert("status".into(), json!("incomplete"));
    Some(response)
}

/// Append `delta` to the `text` of content part `content_index` of an output message item: a part
/// there, or the next one (a delta for a part further on, which no stream sends, is left out).
fn append_text(item: &mut Value, content_index: usize, delta: &str) {
    if item.is_null() {
        *item = json!({"type": "message", "role": "assistant", "content": []});
    }
    let Some(content) = item.as_object_mut().map(|m| m.entry("content").or_insert_with(|| json!([]))) else { return };
    let Some(parts) = content.as_array_mut() else { return };
    if content_index == parts.len() {
        parts.push(json!({"type": "output_text", "text": ""}));
    }
    let Some(part) = parts.get_mut(content_index) else { return };
    append_field(part, "text", delta);
}

fn append_field(item: &mut Value, key: &str, delta: &str) {
    let Some(map) = item.as_object_mut() else { return };
    match map.entry(key).or_insert_with(|| Value::String(String::new())) {
        Value::String(s) => s.push_str(delta),
        other => *other = Value::String(delta.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    /// One SSE frame of a Responses stream.
    fn event(kind: &str, fields: Map<String, Value>) -> String {
        let mut map = fields;
        map.insert("type".into(), json!(kind));
        format!("event: {kind}\ndata: {}\n\n", Value::Object(map))
    }

    fn fields(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    /// The events a Responses server streams for a reasoning item, a text answer and a function call.
    fn stream(with_completed: bool) -> String {
        let call = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell", "arguments": "", "status": "in_progress"});
        let mut s = String::new();
        s += &event(
            "response.created",
            fields(
                json!({"sequence_number": 0, "response": {"id": "resp_1", "object": "response", "status": "in_progress", "model": "gpt-5", "output": []}}),
            ),
        );
        s += &event(
            "response.output_item.added",
            fields(json!({"output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": []}})),
        );
        s += &event(
            "response.output_item.done",
            fields(
                json!({"output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}}),
            ),
        );
        s += &event(
            "response.output_item.added",
            fields(
                json!({"output_index": 1, "item": {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}}),
            ),
        );
        s += &event(
            "response.content_part.added",
            fields(json!({"output_index": 1, "content_index": 0, "part": {"type": "output_text", "text": ""}})),
        );
        s += &event(
            "response.output_text.delta",
            fields(json!({"output_index": 1, "content_index": 0, "delta": "Let me "})),
        );
        s += &event(
            "response.output_text.delta",
            fields(json!({"output_index": 1, "content_index": 0, "delta": "look."})),
        );
        s += &event("response.output_item.added", fields(json!({"output_index": 2, "item": call})));
        s += &event(
            "response.function_call_arguments.delta",
            fields(json!({"output_index": 2, "item_id": "fc_1", "delta": "{\"command\":"})),
        );
        s += &event(
            "response.function_call_arguments.delta",
            fields(json!({"output_index": 2, "item_id": "fc_1", "delta": "[\"ls\"]}"})),
        );
        if with_completed {
            s += &event(
                "response.completed",
                fields(
                    json!({"response": {"id": "resp_1", "status": "completed", "model": "gpt-5", "usage": {"input_tokens": 10, "output_tokens": 5},
                    "output": [
                        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                        {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
                        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell", "arguments": "{\"command\":[\"ls\"]}", "status": "completed"}
                    ]}}),
                ),
            );
        }
        s
    }

    #[test]
    fn a_completed_stream_gives_the_final_response_and_its_neutral_turn() {
        let a = assemble(stream(true).as_bytes(), true).unwrap();
        assert_eq!(a["response"]["status"], "completed");
        assert_eq!(a["usage"]["output_tokens"], 5);
        assert_eq!(a["messages"].as_array().unwrap().len(), 1, "reasoning, text and call are one turn");
        assert_eq!(a["message"]["content"][0]["text"], "Let me look.");
        assert_eq!(a["message"]["tool_calls"][0]["id"], "call_1");
        assert_eq!(a["message"]["tool_calls"][0]["function"]["arguments"], "{\"command\":[\"ls\"]}");
    }

    #[test]
    fn a_cut_stream_is_assembled_from_its_deltas() {
        let a = assemble(stream(false).as_bytes(), true).unwrap();
        assert_eq!(a["status"], "incomplete");
        assert_eq!(a["response"]["id"], "resp_1");
        let output = a["response"]["output"].as_array().unwrap();
        assert_eq!(output[0]["encrypted_content"], "gAAA");
        assert_eq!(output[1]["content"][0]["text"], "Let me look.");
        assert_eq!(output[2]["arguments"], "{\"command\":[\"ls\"]}");
        assert_eq!(a["message"]["tool_calls"][0]["function"]["name"], "shell");
    }

    /// The end is the final event, by its name or its data's type; never a final event's name
    /// quoted in some text, nor an earlier event.
    #[test]
    fn the_end_is_the_final_event() {
        let mut n_final = 0;
        sse::each_event(stream(true).as_bytes(), |e| n_final += usize::from(is_final(e)));
        assert_eq!(n_final, 1);
        sse::each_event(stream(false).as_bytes(), |e| assert!(!is_final(e), "{e:?}"));
        let quoted = event("response.output_text.delta", fields(json!({"delta": "\"response.completed\""})));
        sse::each_event(quoted.as_bytes(), |e| assert!(!is_final(e), "{e:?}"));
        for kind in ["response.completed", "response.incomplete", "response.failed"] {
            let unnamed = format!("data: {}\n\n", json!({"type": kind, "response": {}}));
            sse::each_event(unnamed.as_bytes(), |e| assert!(is_final(e), "{e:?}"));
        }
    }

    /// A data field spread over several lines is one event (a server may break its JSON anywhere
    /// a newline is whitespace).
    #[test]
    fn a_multi_line_data_field_is_one_event() {
        let split = stream(true).replace(",\"", ",\ndata: \"");
        assert_ne!(split, stream(true));
        assert_eq!(assemble(split.as_bytes(), true), assemble(stream(true).as_bytes(), true));
    }

    #[test]
    fn a_json_body_is_the_response() {
        let body = json!({"id": "resp_2", "status": "completed", "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}]});
        let a = assemble(body.to_string().as_bytes(), false).unwrap();
        assert_eq!(a["message"], json!({"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}));
        assert!(assemble(b"{\"error\":{}}", false).is_none());
        assert!(assemble(b"data: nothing\n\n", true).is_none());
    }
}
