//! The upstream's answer: assembling the assistant message from an SSE stream or a JSON body, and the
//! [`ResponseSink`] the pipeline hands to the proxy (it records the answer in the archive and tells the
//! session tracker, so the agent's next request finds its session).

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Map, Value, json};

use super::{Archive, ResponseRecord, Ticket, keep_headers, now_ms};
use crate::exchange::{ResponseSink, StreamEnd};
use crate::session::SessionTracker;
use crate::wire::Wire;

/// Most response bytes kept per exchange; a longer body is stored up to here and marked partial.
pub const MAX_BODY: usize = 64 * 1024 * 1024;

/// What the answer says, assembled: `{"message": {...}, "finish_reason", "usage", "model"}`.
pub fn assemble(body: &[u8], stream: bool) -> Option<Value> {
    if stream || looks_like_sse(body) { assemble_sse(body) } else { assemble_json(body) }
}

pub(super) fn looks_like_sse(body: &[u8]) -> bool {
    let start = body.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(0);
    body[start..].starts_with(b"data:") || body[start..].starts_with(b"event:") || body[start..].starts_with(b":")
}

fn assemble_json(body: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let choice = v.get("choices")?.get(0)?;
    let message = choice.get("message")?.clone();
    Some(json!({
        "message": message,
        "finish_reason": choice.get("finish_reason").cloned().unwrap_or(Value::Null),
        "usage": v.get("usage").cloned().unwrap_or(Value::Null),
        "model": v.get("model").cloned().unwrap_or(Value::Null),
    }))
}

#[derive(Default)]
struct Assembly {
    content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Vec<Map<String, Value>>,
    finish_reason: Value,
    usage: Value,
    model: Value,
    saw_choice: bool,
}

fn append(slot: &mut Option<String>, piece: Option<&Value>) {
    if let Some(Value::String(s)) = piece {
        slot.get_or_insert_with(String::new).push_str(s);
    }
}

impl Assembly {
    fn event(&mut self, data: &Value) {
        if let Some(model) = data.get("model").filter(|m| !m.is_null()) {
            self.model = model.clone();
        }
        if let Some(usage) = data.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage.clone();
        }
        let Some(choices) = data.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            self.saw_choice = true;
            if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
                self.finish_reason = reason.clone();
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            append(&mut self.content, delta.get("content"));
            append(&mut self.reasoning, delta.get("reasoning_content"));
            append(&mut self.reasoning, delta.get("reasoning"));
            for call in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                self.tool_call(call);
            }
        }
    }

    fn tool_call(&mut self, call: &Value) {
        let idx = call.get("index").and_then(Value::as_u64).map(|i| i as usize).unwrap_or(self.tool_calls.len());
        while self.tool_calls.len() <= idx {
            self.tool_calls.push(Map::new());
        }
        let entry = &mut self.tool_calls[idx];
        for key in ["id", "type"] {
            if let Some(v) = call.get(key).filter(|v| v.as_str().is_some_and(|s| !s.is_empty())) {
                entry.insert(key.to_string(), v.clone());
            }
        }
        if let Some(function) = call.get("function") {
            let slot = entry.entry("function").or_insert_with(|| json!({})).as_object_mut().expect("an object");
            for key in ["name", "arguments"] {
                if let Some(Value::String(piece)) = function.get(key) {
                    let current = slot.entry(key).or_insert_with(|| Value::String(String::new()));
                    if let Value::String(s) = current {
                        s.push_str(piece);
                    }
                }
            }
        }
    }

    fn finish(self) -> Option<Value> {
        if !self.saw_choice {
            return None;
        }
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert("content".into(), self.content.map(Value::String).unwrap_or(Value::Null));
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .into_iter()
                .map(|mut c| {
                    c.entry("type").or_insert_with(|| json!("function"));
                    Value::Object(c)
                })
                .collect();
            message.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(reasoning) = self.reasoning {
            message.insert("reasoning_content".into(), Value::String(reasoning));
        }
        Some(json!({
            "message": Value::Object(message),
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "model": self.model,
        }))
    }
}

/// Assemble the assistant message from the raw bytes of an SSE stream (complete or cut short).
pub fn assemble_sse(body: &[u8]) -> Option<Value> {
    let text = String::from_utf8_lossy(body);
    let mut assembly = Assembly::default();
    let mut data = String::new();
    let flush = |data: &mut String, assembly: &mut Assembly| {
        if !data.is_empty() && data.trim() != "[DONE]" {
            if let Ok(v) = serde_json::from_str::<Value>(data) {
                assembly.event(&v);
            }
        }
        data.clear();
    };
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            flush(&mut data, &mut assembly);
        } else if let Some(rest) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(rest.strip_prefix(' ').unwrap_or(rest));
        }
    }
    flush(&mut data, &mut assembly);
    assembly.finish()
}

/// Records one exchange's answer as it streams through the proxy.
pub struct ArchiveSink {
    archive: Option<(Arc<Archive>, Ticket)>,
    tracker: Arc<SessionTracker>,
    session: String,
    key_req: Option<u64>,
    stream: bool,
    status: Option<u16>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    truncated: bool,
    /// `Some(key_ext)` once the answer was registered with the tracker.
    registered: Option<Option<u64>>,
    /// The assembled answer, kept when it was assembled early (at `[DONE]`).
    assembled: Option<Value>,
    /// The request's format, which says how to read the answer.
    wire: Wire,
}

impl ArchiveSink {
    pub fn new(
        archive: Option<(Arc<Archive>, Ticket)>,
        tracker: Arc<SessionTracker>,
        session: String,
        key_req: Option<u64>,
        request_stream: bool,
        wire: Wire,
    ) -> ArchiveSink {
        ArchiveSink {
            archive,
            tracker,
            session,
            key_req,
            stream: request_stream,
            status: None,
            headers: Vec::new(),
            body: Vec::new(),
            truncated: false,
            registered: None,
            assembled: None,
            wire,
        }
    }

    fn assemble(&self) -> Option<Value> {
        match self.wire {
            Wire::Chat => assemble(&self.body, self.stream),
            Wire::Responses => super::responses_sse::assemble(&self.body, self.stream),
            Wire::Messages => super::messages_sse::assemble(&self.body, self.stream),
        }
    }

    /// Assemble the answer and tell the tracker (once), as soon as it is complete.
    fn register(&mut self) {
        if self.registered.is_some() {
            return;
        }
        self.assembled = self.assemble();
        let ok = self.status.is_none_or(|s| (200..300).contains(&s));
        // The answer's neutral messages: one for chat, the output items' for Responses.
        let messages: Option<Vec<Value>> = self.assembled.as_ref().filter(|_| ok).and_then(|a| match self.wire {
            Wire::Chat => a.get("message").map(|m| vec![m.clone()]),
            Wire::Responses => a.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()).cloned(),
            Wire::Messages => a.get("message").and_then(crate::wire::messages::neutral_answer).map(|m| vec![m]),
        });
        let key = match messages {
            Some(m) => self.tracker.answered_with(&self.session, self.key_req, &m),
            None => {
                self.tracker.unanswered(&self.session, self.key_req);
                None
            }
        };
        self.registered = Some(key);
    }
}

impl ResponseSink for ArchiveSink {
    fn head(&mut self, status: u16, headers: &HeaderMap) {
        self.status = Some(status);
        self.headers = keep_headers(headers, &[]);
        if let Some(ct) = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
            self.stream = ct.to_ascii_lowercase().contains("text/event-stream");
        }
    }

    fn chunk(&mut self, bytes: &Bytes) {
        let room = MAX_BODY.saturating_sub(self.body.len());
        if bytes.len() > room {
            self.truncated = true;
        }
        self.body.extend_from_slice(&bytes[..bytes.len().min(room)]);
        let done = match self.wire {
            Wire::Chat => memchr_done(bytes),
            Wire::Messages => super::messages_sse::saw_stop(bytes),
            Wire::Responses => super::responses_sse::saw_end(&self.body),
        };
        if self.stream && self.registered.is_none() && done {
            self.register();
        }
    }

    fn finish(mut self: Box<Self>, end: StreamEnd) {
        if end == StreamEnd::Complete && !self.truncated {
            self.register();
        } else if self.registered.is_none() {
            self.tracker.unanswered(&self.session, self.key_req);
            self.assembled = self.assemble();
        }
        let key_ext = self.registered.flatten();
        if let Some((archive, ticket)) = self.archive.take() {
            let record = ResponseRecord {
                at_ms: now_ms(),
                status: self.status,
                headers: std::mem::take(&mut self.headers),
                stream: self.stream,
                end,
                body: std::mem::take(&mut self.body),
                truncated: self.truncated,
                assembled: self.assembled.take(),
                key_ext,
            };
            archive.record_response(ticket, record);
        }
    }
}

fn memchr_done(bytes: &[u8]) -> bool {
    bytes.windows(6).any(|w| w == b"[DONE]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_stream_assembles_content_tool_calls_reasoning_and_usage() {
        let sse = concat!(
            "data: {\"id\":\"x\",\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"reasoning_content\":\"think \"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"hard\",\"content\":\"Let me \"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"look.\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":\"{\\\"pa\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"th\\\": \\\"a\\\"}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":5}}\n\n",
            "data: [DONE]\n\n",
        );
        let a = assemble(sse.as_bytes(), true).unwrap();
        assert_eq!(a["message"]["content"], "Let me look.");
        assert_eq!(a["message"]["reasoning_content"], "think hard");
        assert_eq!(a["message"]["tool_calls"][0]["id"], "call_1");
        assert_eq!(a["message"]["tool_calls"][0]["function"]["name"], "read_file");
        assert_eq!(a["message"]["tool_calls"][0]["function"]["arguments"], "{\"path\": \"a\"}");
        assert_eq!(a["finish_reason"], "tool_calls");
        assert_eq!(a["usage"]["completion_tokens"], 5);
        assert_eq!(a["model"], "m1");
    }

    #[test]
    fn a_stream_cut_short_still_assembles_what_arrived() {
        let sse = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: {\"choi";
        let a = assemble_sse(sse.as_bytes()).unwrap();
        assert_eq!(a["message"]["content"], "Hel");
        assert_eq!(a["finish_reason"], Value::Null);
    }

    #[test]
    fn json_body_gives_the_message() {
        let body = br#"{"id":"x","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"total_tokens":3}}"#;
        let a = assemble(body, false).unwrap();
        assert_eq!(a["message"]["content"], "hi");
        assert_eq!(a["finish_reason"], "stop");
        assert!(assemble(b"{\"error\":{\"message\":\"bad\"}}", false).is_none());
    }
}
