//! pare's neutral conversation form: what the engine, the session tracker and the budget read,
//! whatever the wire format of the request.
//!
//! A conversation is a list of messages, each one JSON object in the shape of a Chat Completions
//! message: `role` (`system`, `developer`, `user`, `assistant`, `tool`), `content` (a string, an
//! array of parts with `text`, or null), an assistant's `tool_calls` (`id`, `function.name`,
//! `function.arguments`) and a tool result's `tool_call_id`, which pairs it with its call. Other keys
//! are carried and never read. A message the engine does not understand (not an object, or a role it
//! does not know) is kept in place, never rewritten, never elided across; that is what an adapter
//! makes of the wire parts it does not read: an [`opaque`] entry, the parts as sent in an array.
//!
//! Each wire format is an adapter ([`crate::wire`]) that reads a request into this form once and
//! writes the forwarded request back from it. An entry is its text — what is hashed, counted and
//! archived — and is typed ([`Message`]) when the engine needs it, by whoever made it ([`View`]).
//! For Chat Completions the neutral form is the wire's own bytes, so nothing is copied, and a
//! message is typed by reading them ([`Message::read`], with its fast path in `read` over the
//! scanner in `scan`). The other formats read their items or turns into [`Draft`]s (a role, the
//! content's JSON, calls, the id a result answers), write each with the one writer,
//! [`Draft::write`], and type it from the same parts ([`Draft::read`]), never from that text. The
//! messages the engine writes come typed from it ([`crate::compact::Compacted::typed`]).

mod draft;
mod read;
pub(crate) mod scan;
pub mod shape;
#[cfg(test)]
pub(crate) mod testing;

pub use draft::{Arguments, Draft, DraftCall};
pub use read::{MemberValue, Want, object_members, raw_members, raw_members_around};
pub use scan::{lone_surrogates_replaced, push_json_string, written_as_pare_writes};
pub use shape::Shape;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A JSON object's members as (key, raw value text), in order.
pub type Members<'a> = Vec<(&'a str, &'a str)>;

/// A request as the engine sees it: its conversation in the neutral form, and the parts of the
/// request the engine never changes but must count.
#[derive(Clone, Copy)]
pub struct View<'a> {
    /// One neutral message per entry, as JSON text, in order: what is hashed, counted and
    /// forwarded when kept.
    pub messages: &'a [&'a str],
    /// The request's tool definitions as raw JSON (counted, never touched), when it has any.
    pub tools: Option<&'a str>,
    /// The typed entries, from whoever holds them typed; an entry it has not is read from its text.
    pub typed: Option<Typed<'a>>,
}

impl<'a> View<'a> {
    /// A conversation whose entries are all read from their texts.
    pub fn of_texts(messages: &'a [&'a str], tools: Option<&'a str>) -> View<'a> {
        View { messages, tools, typed: None }
    }

    /// Entry `i` typed: from [`View::typed`] when it has it, else read from the text.
    pub fn read(&self, i: usize) -> Read<'a> {
        let text = self.messages[i];
        if let Some((message, members)) = self.typed.and_then(|typed| typed(i)) {
            let members = members.map(|members| members.into_iter().map(|(key, at)| (key, &text[at])).collect());
            return (message, members);
        }
        let (message, members) = Message::read(text);
        (message.ok(), members)
    }
}

impl std::fmt::Debug for View<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View").field("messages", &self.messages).field("tools", &self.tools).finish_non_exhaustive()
    }
}

/// A neutral entry typed: its message (`None`: the entry reads as no message) and its members as
/// (key, raw value) in the entry's text, when known.
pub type Read<'a> = (Option<Message>, Option<Members<'a>>);

/// A neutral entry typed by whoever holds it typed: its message (`None`: the entry reads as no
/// message) and where its members' values lie in the entry's text, when known.
pub type Typing = (Option<Message>, Option<Vec<(&'static str, std::ops::Range<usize>)>>);

/// Entry `i` of a conversation typed by whoever holds it typed — an adapter, from the parts it read
/// the entry from ([`Draft::read`]); the engine, for a message it wrote — or `None`, for an entry
/// that is only text (a Chat Completions message as sent, a prefix restored from the archive),
/// which is then read.
pub type Typed<'a> = &'a (dyn Fn(usize) -> Option<Typing> + Sync + 'a);

/// Each message's xxh3-128 hash of its exact bytes. The pipeline computes them once per request; the
/// session tracker, the session compactor and the token cache all key on a message's bytes and share
/// them, so a warm request hashes its history once.
pub fn message_hashes<M: AsRef<str>>(messages: &[M]) -> Vec<u128> {
    messages.iter().map(|m| xxhash_rust::xxh3::xxh3_128(m.as_ref().as_bytes())).collect()
}

/// The neutral entry standing for wire parts pare does not read (an item type it does not know, a
/// turn of another role, reasoning): the parts themselves, as sent, in a JSON array. An array is
/// no message, so the engine keeps the entry in place, never rewritten and never elided across;
/// its tokens are the parts'.
pub fn opaque(parts: &[&str]) -> String {
    format!("[{}]", parts.join(","))
}

/// Whether a neutral entry is an [`opaque`] one: a JSON array, not a message object.
pub fn is_opaque(text: &str) -> bool {
    text.trim_start().starts_with('[')
}

/// The `role` of a neutral message: `""` when it has none or no [`Shape`].
pub fn role_of(raw: &str) -> std::borrow::Cow<'_, str> {
    if let Some(shape) = Shape::parse(raw) {
        return shape.role;
    }
    shape::read_replaced(raw, |shape| std::borrow::Cow::Owned(shape.role.to_string())).unwrap_or_default()
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
    Value::deserialize(d).map(|v| Some(Content::of_value(v)))
}

impl Content {
    /// The content a message whose `content` is `v` holds.
    fn of_value(v: Value) -> Content {
        match v {
            Value::String(s) => Content::Text(s),
            // Read the parts from the borrowed value: a failed attempt must not cost a copy of the text.
            Value::Array(_) => match Vec::<ContentPart>::deserialize(&v) {
                Ok(parts) => Content::Parts(parts),
                Err(_) => Content::Other(v),
            },
            other => Content::Other(other),
        }
    }
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
    /// derived read gives; whatever it declines is read by serde_json. A lone surrogate escape
    /// (`\udc80`), valid JSON that serde_json refuses to decode, reads as U+FFFD either way (see
    /// [`lone_surrogates_replaced`]).
    pub fn from_raw(raw: &str) -> serde_json::Result<Message> {
        Message::read(raw).0
    }

    /// [`Message::from_raw`], and the message's members as (key, raw value) in order when the fast
    /// read gave them (whoever rewrites the message then need not find them again).
    pub fn read(raw: &str) -> (serde_json::Result<Message>, Option<Members<'_>>) {
        match read::message(raw) {
            Some((message, members)) => (Ok(message), Some(members)),
            None => (serde_json::from_str(&lone_surrogates_replaced(raw)), None),
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

/// The text of a content array whose parts are `parts` (raw JSON objects) as [`Message::text`]
/// reads it from a message holding them: each part's `text` string, joined by newlines; "" when a
/// part is not a content part (then the content is no array of parts). An adapter reads what a
/// turn says this way without writing the turn's neutral message to read it back.
pub fn parts_text<'p>(parts: impl IntoIterator<Item = &'p str>) -> String {
    #[derive(Deserialize)]
    struct Part<'a> {
        #[serde(rename = "type", borrow, default)]
        _kind: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow, default)]
        text: Option<std::borrow::Cow<'a, str>>,
    }
    let mut texts: Vec<String> = Vec::new();
    for raw in parts {
        let raw = lone_surrogates_replaced(raw);
        match serde_json::from_str::<Part<'_>>(&raw) {
            Ok(part) => texts.extend(part.text.map(std::borrow::Cow::into_owned)),
            Err(_) => return String::new(),
        }
    }
    texts.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_read_alone_give_the_text_of_the_message_holding_them() {
        let cases: [&[&str]; 6] = [
            &[r#"{"type":"text","text":"a"}"#, r#"{"type":"text","text":"b\nc","cache_control":{"type":"ephemeral"}}"#],
            &[
                r#"{"text":"gemini part","thoughtSignature":"s"}"#,
                r#"{"type":"text"}"#,
                r#"{"type":"text","text":null}"#,
            ],
            &[r#"{"type":"text","text":"a"}"#, r#"{"type":5,"text":"b"}"#],
            &[r#"{"type":"text","text":"lone \udc80 surrogate"}"#],
            &[r#"{"type":"text","text":["no string"]}"#],
            &[],
        ];
        for parts in cases {
            let content = if parts.is_empty() { "null".to_owned() } else { format!("[{}]", parts.join(",")) };
            let message = Message::from_raw(&format!(r#"{{"role":"assistant","content":{content}}}"#)).unwrap();
            assert_eq!(parts_text(parts.iter().copied()), message.text(), "{parts:?}");
        }
        assert_eq!(parts_text([r#"{"type":"text","text":"x"}"#, r#"{"type":"text","text":"y"}"#]), "x\ny");
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
