//! The upstream's answer: assembling the assistant message from an SSE stream or a JSON body, and the
//! [`ResponseSink`] the pipeline hands to the proxy (it records the answer in the archive and tells the
//! session tracker, so the agent's next request finds its session).
//!
//! The sink reads a streamed answer's events as they pass ([`sse::Parser`]) and knows the answer is
//! whole once the dialect's final event went by (chat `[DONE]`, Responses `response.completed` /
//! `.incomplete` / `.failed`, Messages `message_stop` / `error`): it registers the answer then, and
//! the proxy records the exchange complete even when the client closes before the body's last chunk.
//! The body kept for the archive is bounded per answer ([`MAX_BODY`]) and across all answers in
//! flight ([`HeldAnswers`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Map, Value, json};

use super::sse::{self, Event};
use super::{Archive, ResponseRecord, Ticket, keep_headers, now_ms};
use crate::exchange::Usage;
use crate::exchange::{ResponseSink, StreamEnd};
use crate::session::SessionTracker;
use crate::wire::Wire;

/// Most response bytes kept per exchange; a longer body is stored up to here and marked partial.
pub const MAX_BODY: usize = 64 * 1024 * 1024;

/// What the answer says, assembled: `{"message": {...}, "finish_reason", "usage", "model"}`.
pub fn assemble(body: &[u8], stream: bool) -> Option<Value> {
    if stream || sse::looks_like_sse(body) { assemble_sse(body) } else { assemble_json(body) }
}

fn assemble_json(body: &[u8]) -> Option<Value> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    // The parts are moved out of the parsed answer, never copied.
    let take = |value: &mut Value, key: &str| value.get_mut(key).map(Value::take);
    let choice = v.get_mut("choices")?.get_mut(0)?;
    let message = take(choice, "message")?;
    let finish_reason = take(choice, "finish_reason").unwrap_or(Value::Null);
    Some(json!({
        "message": message,
        "finish_reason": finish_reason,
        "usage": take(&mut v, "usage").unwrap_or(Value::Null),
        "model": take(&mut v, "model").unwrap_or(Value::Null),
    }))
}

#[derive(Default)]
struct Assembly {
    content: Option<String>,
    reasoning: Option<String>,
    /// By the `index` the stream gives each call (the upstream's choice: only those it sent are held).
    tool_calls: BTreeMap<u64, Map<String, Value>>,
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
        let next = self.tool_calls.last_key_value().map_or(0, |(&last, _)| last.saturating_add(1));
        let idx = call.get("index").and_then(Value::as_u64).unwrap_or(next);
        let entry = self.tool_calls.entry(idx).or_default();
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
                .into_values()
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
    let mut assembly = Assembly::default();
    sse::each_event(body, |event| {
        if !event.data.is_empty()
            && !is_final(event)
            && let Ok(v) = serde_json::from_str::<Value>(&event.data)
        {
            assembly.event(&v);
        }
    });
    assembly.finish()
}

/// Whether `event` ends a Chat Completions stream: its data is `[DONE]` (never a `[DONE]` inside
/// some content, which is JSON-quoted in a chunk's data).
pub fn is_final(event: &Event) -> bool {
    event.data.trim() == "[DONE]"
}

/// The answer of format `wire` assembled from its body: a stream when `stream` or when it reads as
/// one, else a JSON body.
pub fn assemble_answer(wire: Wire, body: &[u8], stream: bool) -> Option<Value> {
    match wire {
        Wire::Chat => assemble(body, stream),
        Wire::Responses => super::responses_sse::assemble(body, stream),
        Wire::Messages => super::messages_sse::assemble(body, stream),
        Wire::Gemini => super::gemini_sse::assemble(body, stream),
    }
}

/// The test for the event that ends a stream of format `wire`.
pub fn final_event_of(wire: Wire) -> fn(&Event) -> bool {
    match wire {
        Wire::Chat => is_final,
        Wire::Responses => super::responses_sse::is_final,
        Wire::Messages => super::messages_sse::is_final,
        Wire::Gemini => super::gemini_sse::is_final,
    }
}

/// The neutral messages an answer of format `wire`, as [`assemble_answer`] gives it, stands for:
/// the assistant message for chat, one per output item for Responses, the turn's for Messages and
/// Gemini. What the session tracker keys the agent's next request against; `None` when the answer
/// holds no message.
pub fn answer_messages(wire: Wire, assembled: &Value) -> Option<Vec<Value>> {
    match wire {
        Wire::Chat => assembled.get("message").map(|m| vec![m.clone()]),
        Wire::Responses => assembled.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()).cloned(),
        Wire::Messages => assembled.get("message").and_then(crate::wire::messages::neutral_answer).map(|m| vec![m]),
        Wire::Gemini => assembled.get("message").and_then(crate::wire::gemini::neutral_answer).map(|m| vec![m]),
    }
}

/// Why an archived answer's body was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// The answer alone reached [`MAX_BODY`].
    AnswerCap,
    /// The answers held for the archive by every exchange in flight reached
    /// `archive.max_held_answer_bytes`.
    HeldCap,
}

impl Truncation {
    /// Why, in words: what the archive's `end_reason` says after "body truncated".
    pub fn reason(self) -> String {
        match self {
            Truncation::AnswerCap => format!("the answer reached {MAX_BODY} bytes, one answer's cap"),
            Truncation::HeldCap => "the answers held for the archive reached archive.max_held_answer_bytes".to_owned(),
        }
    }
}

/// The bytes of answers held in memory for the archive, shared by every exchange in flight under one
/// cap. An answer takes room chunk by chunk as it streams and gives it back when it is handed to the
/// archive's writer (whose queue bounds it from there). A chunk that does not fit is still streamed
/// to the client unchanged: only the archived copy stops there, marked truncated
/// ([`Truncation::HeldCap`]) and counted. The cap counts the bytes kept: a body's spare capacity and
/// the answer assembled from it when it ends take memory besides (the peak can reach about twice
/// the cap).
#[derive(Debug)]
pub struct HeldAnswers {
    max: usize,
    held: AtomicUsize,
    n_answer_cap: AtomicU64,
    n_held_cap: AtomicU64,
}

impl HeldAnswers {
    pub fn new(max_bytes: u64) -> HeldAnswers {
        HeldAnswers {
            max: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            held: AtomicUsize::new(0),
            n_answer_cap: AtomicU64::new(0),
            n_held_cap: AtomicU64::new(0),
        }
    }

    /// Room for up to `want` bytes: what is left of the cap, at most `want`.
    fn take(&self, want: usize) -> usize {
        let mut granted = 0;
        let _ = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            granted = want.min(self.max.saturating_sub(held));
            Some(held + granted)
        });
        granted
    }

    fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn count(&self, why: Truncation) {
        let counter = match why {
            Truncation::AnswerCap => &self.n_answer_cap,
            Truncation::HeldCap => &self.n_held_cap,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Acquire) as u64
    }

    /// The cap (`archive.max_held_answer_bytes`).
    pub fn max_bytes(&self) -> u64 {
        self.max as u64
    }

    /// Answers archived truncated since start, for `why`.
    pub fn n_truncated(&self, why: Truncation) -> u64 {
        match why {
            Truncation::AnswerCap => self.n_answer_cap.load(Ordering::Relaxed),
            Truncation::HeldCap => self.n_held_cap.load(Ordering::Relaxed),
        }
    }
}

/// One answer's room in [`HeldAnswers`], given back when it is dropped.
struct Held {
    answers: Arc<HeldAnswers>,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.answers.give_back(self.bytes);
    }
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
    /// The body's room in the answers held for the archive.
    held: Held,
    /// Set when the body stopped being kept (nothing is appended after a gap).
    truncated: Option<Truncation>,
    /// Reads the stream's events as they pass, to see its final event.
    events: sse::Parser,
    /// The stream's final event passed: the answer is whole, whatever happens to the connection after.
    final_seen: bool,
    /// `Some(key_ext)` once the answer was registered with the tracker.
    registered: Option<Option<u64>>,
    /// The assembled answer, kept when it was assembled early (at the final event).
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
        answers: Arc<HeldAnswers>,
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
            held: Held { answers, bytes: 0 },
            truncated: None,
            events: sse::Parser::new(),
            final_seen: false,
            registered: None,
            assembled: None,
            wire,
        }
    }

    fn assemble(&self) -> Option<Value> {
        assemble_answer(self.wire, &self.body, self.stream)
    }

    /// Assemble the answer and tell the tracker (once), as soon as it is complete.
    fn register(&mut self) {
        if self.registered.is_some() {
            return;
        }
        self.assembled = self.assemble();
        let ok = self.status.is_none_or(|s| (200..300).contains(&s));
        let messages = self.assembled.as_ref().filter(|_| ok).and_then(|a| answer_messages(self.wire, a));
        let key = match messages {
            Some(m) => self.tracker.answered_with(&self.session, self.key_req, &m),
            None => {
                self.tracker.unanswered(&self.session, self.key_req);
                None
            }
        };
        self.registered = Some(key);
    }

    /// Keep `bytes` for the archive, as far as both caps allow; past them the body stops for good.
    fn keep(&mut self, bytes: &[u8]) {
        if self.truncated.is_some() {
            return;
        }
        let want = bytes.len().min(MAX_BODY.saturating_sub(self.body.len()));
        let granted = self.held.answers.take(want);
        self.held.bytes += granted;
        self.body.extend_from_slice(&bytes[..granted]);
        if granted < bytes.len() {
            let why = if granted < want { Truncation::HeldCap } else { Truncation::AnswerCap };
            self.held.answers.count(why);
            tracing::warn!(session = %self.session, kept = self.body.len(), reason = %why.reason(),
                "answer archived truncated; the client's stream goes on unchanged");
            self.truncated = Some(why);
        }
    }

    /// Read the stream's events in `bytes` until its final one.
    fn watch_for_the_end(&mut self, bytes: &[u8]) {
        let final_event = final_event_of(self.wire);
        let mut seen = false;
        self.events.feed(bytes, &mut |event| seen |= final_event(event));
        self.final_seen = seen;
    }
}

impl ResponseSink for ArchiveSink {
    fn head(&mut self, status: u16, headers: &HeaderMap) {
        self.status = Some(status);
        self.headers = keep_headers(headers, &[], &[]);
        if let Some(ct) = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
            self.stream = ct.to_ascii_lowercase().contains("text/event-stream");
        }
    }

    fn chunk(&mut self, bytes: &Bytes) {
        self.keep(bytes);
        if !self.stream || self.final_seen {
            return;
        }
        self.watch_for_the_end(bytes);
        if self.final_seen && self.truncated.is_none() {
            self.register();
        }
    }

    fn answer_complete(&self) -> bool {
        self.final_seen
    }

    fn finish(self: Box<Self>, end: StreamEnd) {
        self.finish_reporting(end);
    }

    fn finish_reporting(mut self: Box<Self>, end: StreamEnd) -> Option<Usage> {
        if end == StreamEnd::Complete && self.truncated.is_none() {
            self.register();
        } else if self.registered.is_none() {
            self.tracker.unanswered(&self.session, self.key_req);
            self.assembled = self.assemble();
        }
        let key_ext = self.registered.flatten();
        let usage = self.assembled.as_ref().and_then(|answer| Usage::of_answer(self.wire, answer));
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
        usage
    }
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

    /// The indices of a stream are the upstream's: however large, the answer holds only the parts it
    /// sent (a huge index was a vector grown to it: pare aborted, out of memory).
    #[test]
    fn a_huge_stream_index_holds_only_what_was_sent() {
        let huge = u64::MAX;
        let chat = format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": huge, "id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{}"}}]}}]})
        );
        let answer = assemble_answer(Wire::Chat, chat.as_bytes(), true).unwrap();
        assert_eq!(
            answer["message"]["tool_calls"].as_array().map(|c| (c.len(), c[0]["id"].clone())),
            Some((1, json!("c1")))
        );

        let event = |data: Value| format!("event: {}\ndata: {data}\n\n", data["type"].as_str().unwrap());
        let responses = [
            event(json!({"type": "response.created", "response": {"id": "r", "output": []}})),
            event(json!({"type": "response.output_item.added", "output_index": huge,
                "item": {"type": "message", "role": "assistant", "content": []}})),
            event(json!({"type": "response.output_text.delta", "output_index": huge, "content_index": huge, "delta": "lost"})),
            event(json!({"type": "response.output_text.delta", "output_index": huge, "content_index": 0, "delta": "hi"})),
        ]
        .concat();
        let answer = assemble_answer(Wire::Responses, responses.as_bytes(), true).unwrap();
        assert_eq!(answer["response"]["output"].as_array().map(Vec::len), Some(1));
        assert_eq!(answer["response"]["output"][0]["content"], json!([{"type": "output_text", "text": "hi"}]));

        let messages = [
            event(json!({"type": "message_start", "message": {"id": "m", "role": "assistant", "content": []}})),
            event(json!({"type": "content_block_start", "index": huge, "content_block": {"type": "text", "text": ""}})),
            event(json!({"type": "content_block_delta", "index": huge, "delta": {"type": "text_delta", "text": "hi"}})),
            event(json!({"type": "message_stop"})),
        ]
        .concat();
        let answer = assemble_answer(Wire::Messages, messages.as_bytes(), true).unwrap();
        assert_eq!(answer["message"]["content"], json!([{"type": "text", "text": "hi"}]));
    }

    #[test]
    fn a_stream_cut_short_still_assembles_what_arrived() {
        let sse = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: {\"choi";
        let a = assemble_sse(sse.as_bytes()).unwrap();
        assert_eq!(a["message"]["content"], "Hel");
        assert_eq!(a["finish_reason"], Value::Null);
    }

    /// A sink for a streamed chat answer, without an archive.
    fn sink(answers: &Arc<HeldAnswers>) -> Box<ArchiveSink> {
        let tracker = Arc::new(SessionTracker::new(&crate::config::ArchiveConfig::default()));
        let mut sink =
            Box::new(ArchiveSink::new(None, tracker, "s".into(), None, true, Wire::Chat, Arc::clone(answers)));
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
        sink.head(200, &headers);
        sink
    }

    fn content(text: &str) -> Bytes {
        let chunk = json!({"choices": [{"index": 0, "delta": {"content": text}}]});
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// Regression: `[DONE]` inside streamed content ended the archived answer
    /// there (a byte search over the chunk); the end is the event whose data is `[DONE]`.
    #[test]
    fn done_inside_streamed_content_does_not_end_the_answer() {
        let answers = Arc::new(HeldAnswers::new(1 << 20));
        let mut sink = sink(&answers);
        let talk = "A stream ends with `data: [DONE]\n\n`; [DONE] alone is not JSON.";
        for chunk in [content(talk), content(" More after it."), Bytes::from_static(b"data: [DO")] {
            sink.chunk(&chunk);
            assert!(!sink.answer_complete(), "not the end yet");
        }
        sink.chunk(&Bytes::from_static(b"NE]\r\n\r\n"));
        assert!(sink.answer_complete(), "the [DONE] event, split across chunks, is the end");
        assert_eq!(sink.registered, Some(None), "registered at the final event");
        let assembled = sink.assembled.clone().unwrap();
        assert_eq!(assembled["message"]["content"], format!("{talk} More after it."));
    }

    /// Answers in flight together hold at most the cap; the one that does not fit keeps what it got,
    /// stops for good (nothing after a gap), is marked and counted; finished answers give room back.
    #[test]
    fn answers_in_flight_share_one_cap() {
        let answers = Arc::new(HeldAnswers::new(1000));
        let (mut first, mut second) = (sink(&answers), sink(&answers));
        first.chunk(&Bytes::from(vec![b' '; 600]));
        second.chunk(&Bytes::from(vec![b' '; 300]));
        second.chunk(&Bytes::from(vec![b' '; 300]));
        assert_eq!((first.body.len(), second.body.len()), (600, 400));
        assert_eq!(second.truncated, Some(Truncation::HeldCap));
        assert_eq!(answers.held_bytes(), 1000);
        first.finish(StreamEnd::Complete);
        assert_eq!(answers.held_bytes(), 400, "a finished answer gives its room back");
        second.chunk(&Bytes::from(vec![b' '; 10]));
        assert_eq!(second.body.len(), 400, "a truncated body takes nothing after its gap");
        assert_eq!((answers.n_truncated(Truncation::HeldCap), answers.n_truncated(Truncation::AnswerCap)), (1, 0));
        second.finish(StreamEnd::Complete);
        assert_eq!(answers.held_bytes(), 0);
    }

    /// A truncated answer is not registered at its final event: the tracker would key the cut copy.
    #[test]
    fn a_truncated_answer_still_sees_its_end_but_is_not_registered() {
        let answers = Arc::new(HeldAnswers::new(10));
        let mut sink = sink(&answers);
        sink.chunk(&content("hello"));
        sink.chunk(&Bytes::from_static(b"data: [DONE]\n\n"));
        assert!(sink.answer_complete());
        assert_eq!(sink.truncated, Some(Truncation::HeldCap));
        assert_eq!(sink.registered, None);
    }

    #[test]
    fn json_body_gives_the_message() {
        let body = br#"{"id":"x","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"total_tokens":3}}"#;
        let a = assemble(body, false).unwrap();
        assert_eq!(a["message"]["content"], "hi");
        assert_eq!(a["finish_reason"], "stop");
        assert!(assemble(b"{\"error\":{\"message\":\"bad\"}}", false).is_none());
    }

    /// The assembled answer, key for key and in order, as archived; a part the answer lacks is null
    /// and an answer without a message is none.
    #[test]
    fn json_body_assembles_its_parts_in_order() {
        let body = br#"{"usage":{"total_tokens":3},"choices":[{"finish_reason":"tool_calls","index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}}],"model":"m"}"#;
        let a = assemble(body, false).unwrap();
        assert_eq!(
            a.to_string(),
            r#"{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls","usage":{"total_tokens":3},"model":"m"}"#
        );
        let bare = assemble(br#"{"choices":[{"message":{"role":"assistant","content":"x"}}]}"#, false).unwrap();
        assert_eq!(
            bare.to_string(),
            r#"{"message":{"role":"assistant","content":"x"},"finish_reason":null,"usage":null,"model":null}"#
        );
        assert!(assemble(br#"{"choices":[{"finish_reason":"stop"}]}"#, false).is_none());
        assert!(assemble(br#"{"choices":{"0":{"message":{}}}}"#, false).is_none());
    }
}
