//! The gateway's compress call (`POST /v1/compress`, `proxy::retrieve::gateway_compress`): the rule
//! pack's compaction of a guardrail's chat messages, one forwarded message per message.

use serde_json::{Value, json};

/// What a gateway compress call answers.
pub struct GatewayCompacted {
    /// The forwarded chat body (archived).
    pub forwarded: Vec<u8>,
    pub messages: Vec<Value>,
    pub tokens_before: u64,
    pub tokens_after: u64,
    /// The hex digits of each content id the messages name, in order of first appearance.
    pub ids: Vec<String>,
}

/// The engine and token counter of the gateway's compress calls: the configured rule pack with the
/// rule that drops consecutive assistant messages off. Built on the first call, then shared (the
/// pack's parse and its regexes cost milliseconds; a call on a small body, a fraction of one).
pub struct GatewayEngine {
    engine: crate::compact::Engine,
    counter: crate::tokens::TokenCounter,
}

impl GatewayEngine {
    pub fn new(config: &crate::config::Config) -> Result<GatewayEngine, String> {
        let mut engine = crate::compact::Engine::from_config(config).map_err(|e| e.to_string())?;
        engine.policy.spec.consecutive_assistant.enabled = false;
        let counter = crate::tokens::TokenCounter::new(&crate::tokens::CounterConfig {
            cache_entries: 1024,
            ..Default::default()
        });
        Ok(GatewayEngine { engine, counter })
    }

    /// The rules' compaction of chat body `raw`, one forwarded message per message.
    ///
    /// The guardrail sends only the messages it lets a compressor touch: tool results often arrive
    /// without the assistant message that called them, which no chat request may hold. Each such
    /// result is read as the answer to a call of its own (an assistant message inserted before it,
    /// naming the result's `name` or `tool`), and the inserted messages are left out of the answer.
    pub fn compact_keeping_positions(&self, raw: &[u8]) -> Result<GatewayCompacted, String> {
        let (engine, counter) = (&self.engine, &self.counter);
        let body = crate::wire::ChatBody::parse(raw).map_err(|e| e.to_string())?;
        let view = body.view();
        let (messages, inserted) = with_calls_for_orphan_results(view.messages);
        let refs: Vec<&str> = messages.iter().map(String::as_str).collect();
        let read = crate::neutral::View::of_texts(&refs, view.tools);
        let out = engine.compact(&read, &crate::compact::CompactOptions::default(), counter);
        let mut all: Vec<String> = out.prefix;
        all.extend(refs[out.boundary.min(refs.len())..].iter().map(|m| (*m).to_owned()));
        let mut forwarded: Vec<String> = if all.len() == refs.len() {
            all.into_iter().enumerate().filter(|(idx, _)| !inserted.contains(idx)).map(|(_, m)| m).collect()
        } else {
            Vec::new()
        };
        if forwarded.len() != view.messages.len() {
            // A rule dropped a message (a custom rule): the guardrail needs the count kept.
            forwarded = view.messages.iter().map(|m| (*m).to_owned()).collect();
        }
        let mut ids: Vec<String> = Vec::new();
        for message in &forwarded {
            for id in crate::compact::markers::content_ids_in(message) {
                if !ids.iter().any(|known| known == id) {
                    ids.push(id.to_owned());
                }
            }
        }
        let messages = forwarded.iter().map(|m| serde_json::from_str(m).unwrap_or(Value::Null)).collect();
        Ok(GatewayCompacted {
            tokens_before: counter.count_request(view.messages, None),
            tokens_after: counter.count_request(&forwarded, None),
            forwarded: body.to_vec_with_messages(&forwarded),
            messages,
            ids,
        })
    }
}

/// `messages` with an assistant message calling each tool result that no earlier assistant message
/// called, and the indices of the inserted messages.
fn with_calls_for_orphan_results(messages: &[&str]) -> (Vec<String>, Vec<usize>) {
    let mut out: Vec<String> = Vec::with_capacity(messages.len());
    let mut inserted = Vec::new();
    let mut called: Vec<String> = Vec::new();
    for raw in messages {
        let parsed: Option<Value> = serde_json::from_str(raw).ok();
        let role = parsed.as_ref().and_then(|m| m.get("role")).and_then(Value::as_str).unwrap_or_default();
        match role {
            "assistant" => {
                called = parsed
                    .as_ref()
                    .and_then(|m| m.get("tool_calls"))
                    .and_then(Value::as_array)
                    .map(|calls| calls.iter().filter_map(|c| c.get("id")?.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
            }
            "tool" => {
                let id = parsed.as_ref().and_then(|m| m.get("tool_call_id")).and_then(Value::as_str);
                if let Some(id) = id.filter(|id| !called.iter().any(|c| c == id)) {
                    let name = parsed.as_ref().and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("tool");
                    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
                        "function": {"name": name, "arguments": "{}"}}]});
                    inserted.push(out.len());
                    out.push(call.to_string());
                    called = vec![id.to_owned()];
                }
            }
            _ => called.clear(),
        }
        out.push((*raw).to_owned());
    }
    (out, inserted)
}
