//! The answer of a Gemini exchange, assembled for the archive. `generateContent` answers with one
//! `GenerateContentResponse`; `streamGenerateContent` with a stream of them, as server-sent events
//! (`?alt=sse`: one response per `data:`) or as a JSON array written element by element. Either
//! becomes the answer wrapped like the chat answer: `{"message", "finish_reason", "usage",
//! "model"}`, with `message` the first candidate's `content` (`{"role": "model", "parts": […]}`),
//! `usage` the `usageMetadata` as the API reports it (the last one of a stream: it is cumulative;
//! `cachedContentTokenCount` and `thoughtsTokenCount` included), `model` the `modelVersion`, and
//! `response_id` and `prompt_feedback` when the API sends them.
//!
//! The parts of a stream are joined as Gemini CLI joins them for its history: a text part
//! continues the part before it when both are text of the same kind (thought or not); a
//! `thoughtSignature` that arrives on a piece is kept on the joined part; every other part
//! (`functionCall`, `inlineData`, …) stays whole and in order. A stream cut short gives what
//! arrived. An `error` object (the API ends a stream with one) is kept under `"error"`.

use serde_json::{Map, Value, json};

use super::sse::{self, Event};

/// What a Gemini answer says, assembled; `None` when the body is neither a response nor a stream of them.
pub fn assemble(body: &[u8], stream: bool) -> Option<Value> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(body.len());
    let mut assembly = Assembly::default();
    if stream || sse::looks_like_sse(body) {
        sse::each_event(body, |event| {
            if let Ok(v) = serde_json::from_str::<Value>(&event.data) {
                assembly.response(&v);
            }
        });
    } else if body.get(start) == Some(&b'[') {
        for v in array_elements(&body[start + 1..]) {
            assembly.response(&v);
        }
    } else {
        assembly.response(&serde_json::from_slice::<Value>(body).ok()?);
    }
    assembly.finish()
}

/// The elements of a JSON array stream after its `[`, as far as they arrived whole.
fn array_elements(mut rest: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let skip = rest.iter().position(|b| !b.is_ascii_whitespace() && *b != b',').unwrap_or(rest.len());
        rest = &rest[skip..];
        if rest.is_empty() || rest[0] == b']' {
            return out;
        }
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => {
                out.push(v);
                rest = &rest[values.byte_offset()..];
            }
            _ => return out,
        }
    }
}

/// Whether `event` ends a Gemini SSE stream: a response whose candidate has its `finishReason`
/// and that reports the usage (the API sends both in its last chunk), or an `error`.
pub fn is_final(event: &Event) -> bool {
    let Ok(data) = serde_json::from_str::<Value>(&event.data) else { return false };
    if data.get("error").is_some() {
        return true;
    }
    let finished = data
        .get("candidates")
        .and_then(Value::as_array)
        .is_some_and(|c| c.iter().any(|c| c.get("finishReason").is_some_and(|r| !r.is_null())));
    let blocked = data.get("promptFeedback").and_then(|f| f.get("blockReason")).is_some_and(|r| !r.is_null());
    (finished || blocked) && data.get("usageMetadata").is_some()
}

#[derive(Default)]
struct Assembly {
    /// The first candidate's content: its role, and its parts so far.
    role: Option<Value>,
    parts: Vec<Map<String, Value>>,
    seen: bool,
    finish_reason: Option<Value>,
    usage: Option<Value>,
    model: Option<Value>,
    response_id: Option<Value>,
    prompt_feedback: Option<Value>,
    error: Option<Value>,
}

/// A part that a streamed text piece may continue: text, thought or not as `thought` says, and
/// nothing else (no call, no data).
fn continues(part: &Map<String, Value>, thought: bool) -> bool {
    part.get("text").is_some_and(Value::is_string)
        && part.get("thought").and_then(Value::as_bool).unwrap_or(false) == thought
        && part.keys().all(|k| matches!(k.as_str(), "text" | "thought" | "thoughtSignature"))
}

impl Assembly {
    fn response(&mut self, data: &Value) {
        if let Some(error) = data.get("error") {
            self.error = Some(error.clone());
            return;
        }
        let Some(object) = data.as_object() else { return };
        self.seen = true;
        for (key, slot) in [
            ("usageMetadata", &mut self.usage),
            ("modelVersion", &mut self.model),
            ("responseId", &mut self.response_id),
            ("promptFeedback", &mut self.prompt_feedback),
        ] {
            if let Some(value) = object.get(key).filter(|v| !v.is_null()) {
                *slot = Some(value.clone());
            }
        }
        let Some(candidate) = data.get("candidates").and_then(Value::as_array).and_then(|c| c.first()) else {
            return;
        };
        if let Some(reason) = candidate.get("finishReason").filter(|r| !r.is_null()) {
            self.finish_reason = Some(reason.clone());
        }
        let Some(content) = candidate.get("content") else { return };
        if let Some(role) = content.get("role") {
            self.role = Some(role.clone());
        }
        for part in content.get("parts").and_then(Value::as_array).into_iter().flatten() {
            let Some(part) = part.as_object() else { continue };
            let thought = part.get("thought").and_then(Value::as_bool).unwrap_or(false);
            let piece = continues(part, thought).then(|| part.get("text").and_then(Value::as_str)).flatten();
            match (piece, self.parts.last_mut()) {
                (Some(text), Some(last)) if continues(last, thought) => {
                    if let Some(Value::String(s)) = last.get_mut("text") {
                        s.push_str(text);
                    }
                    if let Some(signature) = part.get("thoughtSignature") {
                        last.insert("thoughtSignature".into(), signature.clone());
                    }
                }
                _ => self.parts.push(part.clone()),
            }
        }
    }

    fn finish(self) -> Option<Value> {
        if !self.seen && self.error.is_none() {
            return None;
        }
        let message = match (self.seen, self.role, self.parts.is_empty()) {
            (false, _, _) | (true, None, true) => Value::Null,
            (true, role, _) => json!({
                "role": role.unwrap_or_else(|| json!("model")),
                "parts": self.parts.into_iter().map(Value::Object).collect::<Vec<_>>(),
            }),
        };
        let mut out = json!({
            "message": message,
            "finish_reason": self.finish_reason.unwrap_or(Value::Null),
            "usage": self.usage.unwrap_or(Value::Null),
            "model": self.model.unwrap_or(Value::Null),
        });
        for (key, value) in
            [("response_id", self.response_id), ("prompt_feedback", self.prompt_feedback), ("error", self.error)]
        {
            if let Some(value) = value {
                out[key] = value;
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Responses as the Gemini API streams them: text in pieces, a thought, a signed call, the
    /// usage (with cached tokens) and the finish reason in the last chunk.
    fn chunks() -> Vec<Value> {
        vec![
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Let me ", "thought": true}]}, "index": 0}], "modelVersion": "gemini-2.5-pro", "responseId": "r1"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "look.", "thought": true}]}, "index": 0}], "modelVersion": "gemini-2.5-pro", "responseId": "r1"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Listing "}]}, "index": 0}], "usageMetadata": {"promptTokenCount": 10}, "modelVersion": "gemini-2.5-pro", "responseId": "r1"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "files.", "thoughtSignature": "c2ln"}, {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}, "thoughtSignature": "Q2lR"}]}, "index": 0}], "modelVersion": "gemini-2.5-pro", "responseId": "r1"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": ""}]}, "finishReason": "STOP", "index": 0}], "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 7, "totalTokenCount": 30, "cachedContentTokenCount": 4, "thoughtsTokenCount": 13}, "modelVersion": "gemini-2.5-pro", "responseId": "r1"}),
        ]
    }

    fn expected() -> Value {
        json!({
            "message": {"role": "model", "parts": [
                {"text": "Let me look.", "thought": true},
                {"text": "Listing files.", "thoughtSignature": "c2ln"},
                {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}, "thoughtSignature": "Q2lR"},
                {"text": ""},
            ]},
            "finish_reason": "STOP",
            "usage": {"promptTokenCount": 10, "candidatesTokenCount": 7, "totalTokenCount": 30, "cachedContentTokenCount": 4, "thoughtsTokenCount": 13},
            "model": "gemini-2.5-pro",
            "response_id": "r1",
        })
    }

    #[test]
    fn an_sse_stream_and_a_json_array_stream_assemble_alike() {
        let sse: String = chunks().iter().map(|c| format!("data: {c}\r\n\r\n")).collect();
        assert_eq!(assemble(sse.as_bytes(), true), Some(expected()));
        // The JSON array stream as the API writes it: `[`, elements separated by `,` and line ends.
        let array = format!("[{}]", chunks().iter().map(Value::to_string).collect::<Vec<_>>().join("\n,\r\n"));
        assert_eq!(assemble(array.as_bytes(), false), Some(expected()));
        let last = sse.rsplit("data: ").next().unwrap();
        assert!(is_final(&Event { event: String::new(), data: last.trim().to_owned() }));
        let first = Event { event: String::new(), data: chunks()[0].to_string() };
        assert!(!is_final(&first));
    }

    #[test]
    fn a_whole_response_and_a_cut_stream_keep_what_arrived() {
        let whole = json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Hi."}]}, "finishReason": "STOP"}], "usageMetadata": {"promptTokenCount": 3, "cachedContentTokenCount": 1}, "modelVersion": "gemini-2.5-flash"});
        let a = assemble(whole.to_string().as_bytes(), false).unwrap();
        assert_eq!(a["message"], json!({"role": "model", "parts": [{"text": "Hi."}]}));
        assert_eq!(a["usage"]["cachedContentTokenCount"], 1);
        let array: String = format!("[{},\n{}", chunks()[2], &chunks()[3].to_string()[..40]);
        let cut = assemble(array.as_bytes(), false).unwrap();
        assert_eq!(cut["message"]["parts"], json!([{"text": "Listing "}]));
        assert_eq!(cut["finish_reason"], Value::Null);
        let error =
            assemble(br#"data: {"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}}"#, true);
        assert_eq!(error.unwrap()["error"]["status"], "RESOURCE_EXHAUSTED");
        assert_eq!(assemble(b"not json", false), None);
    }
}
