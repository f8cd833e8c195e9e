//! The Chat Completions request as pare reads it.
//!
//! Only what the rules read is typed; everything else is carried as raw JSON so that it passes through
//! byte for byte. A request is parsed once: its top-level keys keep their order and raw bytes, and each
//! message is kept as its original bytes until a rule needs to look inside it.

mod read;
mod scan;
#[cfg(test)]
mod testing;

pub use read::{MemberValue, Want, object_members, raw_members};
pub use scan::push_json_string;

/// A JSON object's members as (key, raw value text), in order.
pub type Members<'a> = Vec<(&'a str, &'a str)>;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A chat-completions request body, parsed shallowly.
#[derive(Debug)]
pub struct ChatBody<'a> {
    /// Top-level keys other than `messages`, in their original order, each with its original bytes.
    pub fields: Vec<(String, &'a RawValue)>,
    /// Position of the `messages` key among the top-level keys: it comes before `fields[messages_idx]`
    /// (after the last field when `messages_idx == fields.len()`).
    pub messages_idx: usize,
    /// The `messages` array as it is in the body, brackets and whitespace inside included (the
    /// archive stores the bytes between messages).
    pub messages_raw: &'a str,
    /// The `messages` array, one message per entry as its original JSON text (checked to be valid
    /// JSON, not necessarily an object), in order.
    pub messages: Vec<&'a str>,
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
    /// Parse the top level and split `messages` into raw messages, checking that the whole body is
    /// valid JSON but building no value inside a message. A repeated key keeps its first position and
    /// its last value (as a JSON object map does); a `messages` that is not an array is refused.
    ///
    /// A body is read by the fast scan of [`scan`] when it can; whatever the scan declines (invalid
    /// JSON included) is parsed by serde_json, which also words the error.
    pub fn parse(bytes: &'a [u8]) -> Result<ChatBody<'a>, WireError> {
        if let Some(body) = Self::from_scan(bytes) {
            return Ok(body);
        }
        // The array's elements are read in a second pass over its bytes: this path is for bodies the
        // scan declines, which are rare and small.
        let top: TopLevel<'a> = serde_json::from_slice(bytes)?;
        let (messages_idx, messages_raw, messages) = top.messages().ok_or(WireError::NoMessages)?;
        let messages = messages.into_iter().map(RawValue::get).collect();
        Ok(ChatBody {
            fields: top.fields.into_iter().collect(),
            messages_idx,
            messages_raw: messages_raw.get(),
            messages,
        })
    }

    /// The fast path: the scan's split, with the (few, small) top-level values handed to serde_json
    /// as raw values.
    fn from_scan(bytes: &'a [u8]) -> Option<ChatBody<'a>> {
        let split = scan::split(bytes)?;
        let fields = split
            .fields
            .into_iter()
            .map(|(key, value)| Some((key.to_owned(), serde_json::from_str::<&'a RawValue>(value).ok()?)))
            .collect::<Option<Vec<_>>>()?;
        Some(ChatBody {
            fields,
            messages_idx: split.messages_idx,
            messages_raw: split.messages_raw,
            messages: split.messages,
        })
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
        self.to_vec_and_spans(messages).0
    }

    /// [`ChatBody::to_vec_with_messages`], and where in the bytes written each value lies (what a
    /// parse of them would find, without the parse).
    pub fn to_vec_and_spans<M: AsRef<str>>(&self, messages: &[M]) -> (Vec<u8>, Spans) {
        let fields_len: usize = self.fields.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum();
        let messages_len: usize = messages.iter().map(|m| m.as_ref().len() + 1).sum();
        let mut out = Vec::with_capacity(fields_len + messages_len + 16);
        let mut spans = Spans {
            fields: Vec::with_capacity(self.fields.len()),
            messages_array: (0, 0),
            messages: Vec::with_capacity(messages.len()),
        };
        out.push(b'{');
        let write_messages = |out: &mut Vec<u8>, spans: &mut Spans| {
            out.extend_from_slice(b"\"messages\":");
            let array_start = out.len();
            out.push(b'[');
            for (j, m) in messages.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                let start = out.len();
                out.extend_from_slice(m.as_ref().as_bytes());
                spans.messages.push((start, out.len()));
            }
            out.push(b']');
            spans.messages_array = (array_start, out.len());
        };
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if i == self.messages_idx {
                write_messages(&mut out, &mut spans);
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key).expect("writing a string to a Vec cannot fail");
            out.push(b':');
            let start = out.len();
            out.extend_from_slice(value.get().as_bytes());
            spans.fields.push((start, out.len()));
        }
        if self.messages_idx >= self.fields.len() {
            if !self.fields.is_empty() {
                out.push(b',');
            }
            write_messages(&mut out, &mut spans);
        }
        out.push(b'}');
        (out, spans)
    }

    /// Where this body's values lie in `body`, the bytes it was parsed from (`None` for other bytes).
    pub fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        let span = |inner: &str| {
            let start = (inner.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            (start + inner.len() <= body.len()).then_some((start, start + inner.len()))
        };
        Some(Spans {
            fields: self.fields.iter().map(|(_, v)| span(v.get())).collect::<Option<_>>()?,
            messages_array: span(self.messages_raw)?,
            messages: self.messages.iter().map(|m| span(m)).collect::<Option<_>>()?,
        })
    }
}

/// Where a body's values lie, as byte ranges (start, end) into it: each top-level value other than
/// `messages` (in [`ChatBody::fields`] order), the `messages` array, and each message. What the
/// archive splits a body along ([`crate::archive::body::split_along`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spans {
    pub fields: Vec<(usize, usize)>,
    pub messages_array: (usize, usize),
    pub messages: Vec<(usize, usize)>,
}

/// The top level as serde_json reads it for [`ChatBody::parse`]: every key kept raw, `messages` apart.
struct TopLevel<'a> {
    fields: indexmap::IndexMap<String, &'a RawValue>,
    /// Position of the first `messages` key among the keys, and its last value.
    messages: Option<(usize, &'a RawValue)>,
}

impl<'a> TopLevel<'a> {
    /// The elements of `messages`, when it is an array.
    fn messages(&self) -> Option<(usize, &'a RawValue, Vec<&'a RawValue>)> {
        let (idx, raw) = self.messages?;
        if !raw.get().starts_with('[') {
            return None;
        }
        Some((idx, raw, serde_json::from_str(raw.get()).ok()?))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for TopLevel<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TopVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for TopVisitor<'a> {
            type Value = TopLevel<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<TopLevel<'a>, A::Error> {
                let mut top = TopLevel { fields: indexmap::IndexMap::new(), messages: None };
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    let value = map.next_value::<&'a RawValue>()?;
                    if key == "messages" {
                        let position = top.messages.map_or(top.fields.len(), |(p, _)| p);
                        top.messages = Some((position, value));
                    } else {
                        top.fields.insert(key.into_owned(), value);
                    }
                }
                Ok(top)
            }
        }
        d.deserialize_map(TopVisitor(std::marker::PhantomData))
    }
}

/// The `role` of a raw message ("" when it has none or is not an object); reads only that key.
pub fn role_of(raw: &str) -> std::borrow::Cow<'_, str> {
    #[derive(Deserialize)]
    struct Role<'a> {
        #[serde(borrow, default)]
        role: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_str::<Role<'_>>(raw).ok().and_then(|r| r.role).unwrap_or_default()
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
    ///
    /// The common shapes are read by the fast typed read of `wire::read`, which gives what serde_json's
    /// derived read gives; whatever it declines is read by serde_json.
    pub fn from_raw(raw: &str) -> serde_json::Result<Message> {
        Message::read(raw).0
    }

    /// [`Message::from_raw`], and the message's members as (key, raw value) in order when the fast
    /// read gave them (whoever rewrites the message then need not find them again).
    pub fn read(raw: &str) -> (serde_json::Result<Message>, Option<Members<'_>>) {
        match read::message(raw) {
            Some((message, members)) => (Ok(message), Some(members)),
            None => (serde_json::from_str(raw), None),
        }
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
        let msgs = parsed.messages.clone();
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

    /// The one-pass parse must agree with a JSON object map: a repeated key keeps its first position
    /// and its last value, `messages` included.
    #[test]
    fn repeated_keys_keep_first_position_and_last_value() {
        let body = br#"{"a":1,"messages":[{"role":"user"}],"b":2,"a":3,"messages":[{"role":"tool"},7]}"#;
        let parsed = ChatBody::parse(body).unwrap();
        let msgs = parsed.messages.clone();
        assert_eq!(msgs, vec![r#"{"role":"tool"}"#, "7"]);
        assert_eq!(
            String::from_utf8(parsed.to_vec_with_messages(&msgs)).unwrap(),
            r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#
        );
        // The same reading as a generic JSON map gives.
        let map: indexmap::IndexMap<String, Value> = serde_json::from_slice(body).unwrap();
        assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#);
        // A later non-array `messages` wins and is refused; a later array makes an earlier odd one valid.
        assert!(matches!(ChatBody::parse(br#"{"messages":[],"messages":{"x":[1]}}"#), Err(WireError::NoMessages)));
        let parsed = ChatBody::parse(br#"{"messages":"x","m":null,"messages":[]}"#).unwrap();
        assert_eq!(parsed.to_vec_with_messages::<&str>(&[]), br#"{"messages":[],"m":null}"#.to_vec());
    }

    #[test]
    fn messages_first_last_or_alone_serialize_in_place() {
        for body in [
            r#"{"messages":[{"role":"user","content":"hi"}],"model":"m"}"#,
            r#"{"model":"m","stream":true,"messages":[]}"#,
            r#"{"messages":[1,2,3]}"#,
            r#"{"model":"m","messages":[{"role":"user"}],"tools":[{"type":"function"}],"n":1}"#,
        ] {
            let parsed = ChatBody::parse(body.as_bytes()).unwrap();
            let msgs = parsed.messages.clone();
            assert_eq!(String::from_utf8(parsed.to_vec_with_messages(&msgs)).unwrap(), body);
            assert_eq!(parsed.field("messages").map(|v| v.get()), None);
            // Where the writing put each value is where a parse of what it wrote finds it, also with
            // other messages than the parsed ones.
            for msgs in [msgs.clone(), vec![r#"{"role":"user","content":"new"}"#, "7"], Vec::new()] {
                let (bytes, spans) = parsed.to_vec_and_spans(&msgs);
                assert_eq!(bytes, parsed.to_vec_with_messages(&msgs));
                assert_eq!(ChatBody::parse(&bytes).unwrap().spans_in(&bytes), Some(spans), "{body}");
            }
            assert_eq!(parsed.spans_in(b"other bytes"), None);
        }
    }

    #[test]
    fn role_is_read_alone_and_defaults_to_empty() {
        assert_eq!(role_of(r#"{"content":"x","role":"tool","tool_call_id":"c"}"#), "tool");
        assert_eq!(role_of(r#"{"role":"us\u0065r"}"#), "user");
        assert_eq!(role_of(r#"{"content":"no role"}"#), "");
        assert_eq!(role_of("[1,2]"), "");
    }

    #[test]
    fn body_without_messages_is_refused() {
        assert!(matches!(ChatBody::parse(br#"{"model":"m"}"#), Err(WireError::NoMessages)));
        assert!(matches!(ChatBody::parse(b"{nope"), Err(WireError::Json(_))));
        assert!(matches!(ChatBody::parse(br#"{"messages":[1,]}"#), Err(WireError::Json(_))));
        assert!(matches!(ChatBody::parse(b"[1]"), Err(WireError::Json(_))));
        for not_array in [r#"null"#, r#"3"#, r#"-1.5"#, r#""s""#, r#"true"#, r#"{"a":[{}]}"#] {
            let body = format!(r#"{{"messages":{not_array},"model":"m"}}"#);
            assert!(matches!(ChatBody::parse(body.as_bytes()), Err(WireError::NoMessages)), "{not_array}");
        }
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
