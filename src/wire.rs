//! The Chat Completions request as pare reads it.
//!
//! Only what the rules read is typed; everything else is carried as raw JSON so that it passes through
//! byte for byte. A request is parsed once: its top-level keys keep their order and raw bytes, and each
//! message is kept as its original bytes ([`RawValue`]) until a rule needs to look inside it.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A chat-completions request body, parsed shallowly.
#[derive(Debug)]
pub struct ChatBody<'a> {
    /// Top-level keys in their original order, each with its original bytes.
    pub fields: Vec<(String, &'a RawValue)>,
    /// Index into `fields` of the `messages` key.
    pub messages_idx: usize,
    /// The `messages` array, one raw value per message, in order.
    pub messages: Vec<&'a RawValue>,
}

/// Why a body is not a chat request pare can compact (it is then forwarded unchanged).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("body is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("body has no `messages` array")]
    NoMessages,
}

impl<'a> ChatBody<'a> {
    /// Parse the top level and split `messages` into raw messages. Does not look inside messages.
    pub fn parse(bytes: &'a [u8]) -> Result<ChatBody<'a>, WireError> {
        let top: indexmap::IndexMap<String, &'a RawValue> = serde_json::from_slice(bytes)?;
        let fields: Vec<(String, &'a RawValue)> = top.into_iter().collect();
        let messages_idx = fields.iter().position(|(k, _)| k == "messages").ok_or(WireError::NoMessages)?;
        let messages: Vec<&'a RawValue> =
            serde_json::from_str(fields[messages_idx].1.get()).map_err(|_| WireError::NoMessages)?;
        Ok(ChatBody { fields, messages_idx, messages })
    }

    /// The raw value of a top-level key.
    pub fn field(&self, key: &str) -> Option<&'a RawValue> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The request's `model`, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.field("model").and_then(|v| serde_json::from_str::<String>(v.get()).ok())
    }

    /// Serialize the body with `messages` replaced; every other key keeps its position and bytes.
    pub fn to_vec_with_messages<M: AsRef<str>>(&self, messages: &[M]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.fields.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum());
        out.push(b'{');
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key).expect("writing a string to a Vec cannot fail");
            out.push(b':');
            if i == self.messages_idx {
                out.push(b'[');
                for (j, m) in messages.iter().enumerate() {
                    if j > 0 {
                        out.push(b',');
                    }
                    out.extend_from_slice(m.as_ref().as_bytes());
                }
                out.push(b']');
            } else {
                out.extend_from_slice(value.get().as_bytes());
            }
        }
        out.push(b'}');
        out
    }
}

/// A message's `content`: a string, an array of parts, or null/absent.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
    /// Anything else (a number, an object…) is carried unchanged.
    Other(Value),
}

/// One part of an array `content`. `text` is typed; every other key (`type`, `image_url`,
/// `cache_control`…) is carried in `extra`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ContentPart {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One chat message. Typed fields are those the rules read; all others are in `extra`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Message {
    #[serde(default)]
    pub role: String,
    #[serde(default, deserialize_with = "deserialize_present", skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `content: null` must survive a round trip as `null`, distinct from an absent key.
fn deserialize_present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Content>, D::Error> {
    let v = Value::deserialize(d)?;
    Ok(Some(match v {
        Value::String(s) => Content::Text(s),
        // Read the parts from the borrowed value: a failed attempt must not cost a copy of the text.
        Value::Array(_) => match Vec::<ContentPart>::deserialize(&v) {
            Ok(parts) => Content::Parts(parts),
            Err(_) => Content::Other(v),
        },
        other => Content::Other(other),
    }))
}

/// One entry of an assistant's `tool_calls`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ToolCall {
    #[serde(default)]
    pub id: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<FunctionCall>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The `function` of a tool call; `arguments` is a JSON-encoded string on the wire.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct FunctionCall {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub arguments: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Message {
    /// Parse one raw message. Fails only when the message is not a JSON object of this shape.
    pub fn from_raw(raw: &RawValue) -> serde_json::Result<Message> {
        serde_json::from_str(raw.get())
    }

    /// The text of the content: the string, or the `text` parts joined by newlines.
    pub fn text(&self) -> String {
        match &self.content {
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(parts)) => {
                parts.iter().filter_map(|p| p.text.as_deref()).collect::<Vec<_>>().join("\n")
            }
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untouched_top_level_keeps_order_and_bytes() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.50,"x":{"b":1,"a":2}}"#;
        let parsed = ChatBody::parse(body).unwrap();
        let msgs: Vec<&str> = parsed.messages.iter().map(|m| m.get()).collect();
        assert_eq!(parsed.to_vec_with_messages(&msgs), body.to_vec());
    }

    #[test]
    fn message_round_trip_keeps_unknown_keys_and_null_content() {
        let raw = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}","z":1},"w":2}],"zz":{"k":[1,2]}}"#;
        let m: Message = serde_json::from_str(raw).unwrap();
        assert_eq!(serde_json::to_string(&m).unwrap(), raw);
    }

    #[test]
    fn content_parts_keep_extra_keys() {
        let raw = r#"{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"image_url","image_url":{"url":"data:x"}}]}"#;
        let m: Message = serde_json::from_str(raw).unwrap();
        assert_eq!(serde_json::to_string(&m).unwrap(), raw);
        assert_eq!(m.text(), "a");
    }

    #[test]
    fn body_without_messages_is_refused() {
        assert!(matches!(ChatBody::parse(br#"{"model":"m"}"#), Err(WireError::NoMessages)));
        assert!(matches!(ChatBody::parse(b"{nope"), Err(WireError::Json(_))));
    }

    #[test]
    fn tool_call_round_trip_keeps_extras_at_every_level() {
        let raw =
            r#"{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}","strict":true},"index":0}"#;
        let call: ToolCall = serde_json::from_str(raw).unwrap();
        assert_eq!(call.extra.get("index"), Some(&serde_json::json!(0)));
        assert_eq!(call.function.as_ref().unwrap().extra.get("strict"), Some(&serde_json::json!(true)));
        assert_eq!(serde_json::to_string(&call).unwrap(), raw);
        // Some clients send `arguments` as an object: it is carried as-is.
        let raw = r#"{"id":"c2","function":{"name":"g","arguments":{"x":[1,2]}}}"#;
        let call: ToolCall = serde_json::from_str(raw).unwrap();
        assert_eq!(serde_json::to_string(&call).unwrap(), raw);
    }

    #[test]
    fn content_part_round_trip() {
        for raw in [
            r#"{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}"#,
            r#"{"type":"image_url","image_url":{"url":"data:x","detail":"low"}}"#,
            r#"{"type":"thinking","thinking":"hmm","signature":"s"}"#,
        ] {
            let part: ContentPart = serde_json::from_str(raw).unwrap();
            assert_eq!(serde_json::to_string(&part).unwrap(), raw);
        }
    }

    #[test]
    fn message_with_reasoning_and_odd_content_round_trips() {
        for raw in [
            r#"{"role":"assistant","content":"x","reasoning_content":"why","reasoning":{"effort":"low"}}"#,
            r#"{"role":"tool","content":42,"tool_call_id":"c","name":"f"}"#,
            r#"{"role":"user"}"#,
        ] {
            let m: Message = serde_json::from_str(raw).unwrap();
            assert_eq!(serde_json::to_string(&m).unwrap(), raw);
        }
    }
}
