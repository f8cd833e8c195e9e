//! The fast path of [`Message::from_raw`]: a typed read of one message with the scanner of
//! [`super::scan`], which decodes each string as it checks it (6.7 M instructions for the engine
//! bench's messages, where serde_json's derive takes 9.8 M).
//!
//! It reads the shapes agents send — string or null values where the message's typed fields expect
//! them, `content` as a string, null or an array of part objects, `tool_calls` as an array of call
//! objects — and gives exactly the [`Message`] serde_json's derived read gives. Whatever else it meets
//! (a repeated key, an escaped key, a typed field of another type, a content array that is not all
//! objects, invalid JSON) makes it decline, and the caller reads the message with serde_json, which
//! decides and words any error. Values of keys the rules do not read are handed to serde_json as
//! their raw text (a string is decoded here). A lone surrogate escape reads as U+FFFD, as serde_json
//! reads the message's [`super::lone_surrogates_replaced`] text.

use serde_json::{Map, Value};

use super::scan::Scanner;
use super::{Content, ContentPart, FunctionCall, Members, Message, ToolCall};

/// The message `raw` holds and its members as (key, raw value) in order, or `None` when the fast
/// read declines (see the module's doc).
pub(super) fn message(raw: &str) -> Option<(Message, Members<'_>)> {
    let mut r = Reader::new(raw);
    r.s.whitespace();
    let mut m = Message {
        role: String::new(),
        content: None,
        tool_calls: None,
        tool_call_id: None,
        name: None,
        reasoning_content: None,
        reasoning: None,
        extra: Map::new(),
    };
    let mut typed = Seen::default();
    let mut members = Vec::with_capacity(8);
    r.object(|r, key| {
        let start = r.s.at;
        match key {
            "role" => {
                typed.once(0)?;
                m.role = r.string()?;
            }
            "content" => {
                typed.once(1)?;
                m.content = Some(r.content()?);
            }
            "tool_calls" => {
                typed.once(2)?;
                m.tool_calls = r.nullable(|r| r.array(Reader::tool_call))?;
            }
            "tool_call_id" => {
                typed.once(3)?;
                m.tool_call_id = r.nullable(Reader::string)?;
            }
            "name" => {
                typed.once(4)?;
                m.name = r.nullable(Reader::string)?;
            }
            "reasoning_content" => {
                typed.once(5)?;
                m.reasoning_content = r.nullable(Reader::value)?;
            }
            "reasoning" => {
                typed.once(6)?;
                m.reasoning = r.nullable(Reader::value)?;
            }
            other => r.extra(&mut m.extra, other)?,
        }
        members.push((key, &r.text[start..r.s.at]));
        Some(())
    })?;
    r.s.whitespace();
    (r.s.at == raw.len()).then_some((m, members))
}

/// The content a message whose `content` member is the JSON text `text` holds, as
/// [`Message::read`] reads it from the message (this read, serde_json where it declines); `None`
/// when `text` is not one JSON value. `depth`: how many objects and arrays enclose the member in
/// the message (1: the message's own).
pub(super) fn content(text: &str, depth: usize) -> Option<Content> {
    read_member(text, depth, |r| r.content()).or_else(|| {
        let value: Value = serde_json::from_str(&super::lone_surrogates_replaced(text)).ok()?;
        Some(Content::of_value(value))
    })
}

/// An untyped member's value (a call's `arguments`) as [`Message::read`] reads it: see [`content`].
pub(super) fn value(text: &str, depth: usize) -> Option<Value> {
    read_member(text, depth, |r| r.value())
        .or_else(|| serde_json::from_str(&super::lone_surrogates_replaced(text)).ok())
}

/// `read` over the whole of `text`, a member's value `depth` levels deep, or `None` when it declines.
fn read_member<'t, T>(text: &'t str, depth: usize, read: impl FnOnce(&mut Reader<'t>) -> Option<T>) -> Option<T> {
    let mut r = Reader::new(text);
    r.depth = depth;
    r.s.whitespace();
    let value = read(&mut r)?;
    r.s.whitespace();
    (r.s.at == text.len()).then_some(value)
}

/// What [`object_members`] should do with a member's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Skip it (it is still checked).
    Skip,
    /// Its raw JSON text.
    Raw,
    /// A string decoded; any other value as its raw JSON text.
    Text,
}

/// One wanted member's value (see [`Want`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberValue<'a> {
    Text(String),
    Raw(&'a str),
}

/// The members of the JSON object `text` that `want` asks for, in order (repeats included), or
/// `None` when the fast read declines: `text` is not exactly one object (whitespace around it
/// aside), a key has an escape, or the nesting comes within a few levels of serde_json's limit (a
/// wanted string's lone surrogate escape decodes as U+FFFD). For a caller that needs a few keys of a large object (a tool's
/// JSON result) and reads it with serde_json when this declines.
pub fn object_members<'a>(text: &'a str, want: impl Fn(&str) -> Want) -> Option<Vec<(&'a str, MemberValue<'a>)>> {
    members_around(text, None, want)
}

/// [`object_members`], taking the value at `known` (a range of `text` that a parse of it found to
/// be one member's whole value) as it lies, without scanning it again.
fn members_around<'a>(
    text: &'a str,
    known: Option<std::ops::Range<usize>>,
    want: impl Fn(&str) -> Want,
) -> Option<Vec<(&'a str, MemberValue<'a>)>> {
    let mut r = Reader::new(text);
    let mut out = Vec::new();
    r.s.whitespace();
    r.object(|r, key| {
        if let Some(known) = known.clone().filter(|k| k.start == r.s.at) {
            r.s.at = known.end;
            out.push((key, MemberValue::Raw(&text[known])));
            return Some(());
        }
        let value = match want(key) {
            Want::Skip => {
                r.raw()?;
                return Some(());
            }
            Want::Text if r.s.peek()? == b'"' => MemberValue::Text(r.string()?),
            Want::Raw | Want::Text => MemberValue::Raw(r.raw()?),
        };
        out.push((key, value));
        Some(())
    })?;
    r.s.whitespace();
    (r.s.at == text.len()).then_some(out)
}

/// The members of the JSON object `text` as (key, raw value) in order, or `None` when
/// [`object_members`] declines or a key repeats (a map's semantics — first position, last value —
/// decide those).
pub fn raw_members(text: &str) -> Option<Members<'_>> {
    raw_members_around(text, None)
}

/// [`raw_members`] of `text`, where `known`, when given, is one member's whole value as a parse of
/// `text` found it (a slice of `text`): that value is taken as it lies instead of being scanned
/// again, so the members of an object holding a large value cost its other members only. A `known`
/// that is no slice of `text` is scanned as any other value.
pub fn raw_members_around<'a>(text: &'a str, known: Option<&str>) -> Option<Members<'a>> {
    let known = known.and_then(|k| {
        let start = (k.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
        (start + k.len() <= text.len()).then_some(start..start + k.len())
    });
    let members = members_around(text, known, |_| Want::Raw)?;
    let mut out: Members<'_> = Vec::with_capacity(members.len());
    for (key, value) in members {
        let MemberValue::Raw(raw) = value else { return None };
        if out.iter().any(|(k, _)| *k == key) {
            return None;
        }
        out.push((key, raw));
    }
    Some(out)
}

/// Which typed keys an object has had: a repeated one makes the read decline (serde_json refuses it).
#[derive(Default)]
struct Seen(u8);

impl Seen {
    fn once(&mut self, bit: u8) -> Option<()> {
        let mask = 1 << bit;
        (self.0 & mask == 0).then(|| self.0 |= mask)
    }
}

struct Reader<'a> {
    s: Scanner<'a>,
    /// The scanner's bytes as a `str`.
    text: &'a str,
    /// Where strings are decoded before they are copied out at their size: at least eight bytes
    /// longer than `text` (no string of it is longer than it, and the decoding copies eight bytes at a
    /// time). Taken from the thread's [`SCRATCH`] and given back when the reader is dropped.
    scratch: Vec<u8>,
    /// How many objects and arrays enclose the value being read (the message itself is 1).
    depth: usize,
}

/// Values of untyped keys are scanned with this many levels to spare under the scanner's nesting
/// limit, so that the fast read declines well before serde_json's own limit would refuse the message.
const DEPTH_MARGIN: usize = 4;

thread_local! {
    /// The decoding buffer of the reads on this thread: reused, so that each read does not allocate
    /// and zero a buffer the size of its message (the engine reads every message of a request).
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A buffer this large is not kept for the next read (the size of a message over which a thread
/// would keep holding that much memory for nothing).
const SCRATCH_KEPT_BYTES: usize = 1 << 20;

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        let scratch = std::mem::take(&mut self.scratch);
        if scratch.len() <= SCRATCH_KEPT_BYTES {
            SCRATCH.set(scratch);
        }
    }
}

impl<'a> Reader<'a> {
    /// A reader of `text`, with the thread's scratch buffer (a nested read on the same thread finds
    /// it taken and starts its own).
    fn new(text: &'a str) -> Reader<'a> {
        let mut scratch = SCRATCH.take();
        // Only what the buffer grows by is zeroed.
        if scratch.len() < text.len() + 8 {
            scratch.resize(text.len() + 8, 0);
        }
        Reader { s: Scanner::new(text.as_bytes()), text, scratch, depth: 0 }
    }

    /// The members of the object starting here, each handed to `member` with its key (the reader is
    /// then at the value, which `member` must read). Keys with escapes are declined.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.s.expect(b'{')?;
        self.depth += 1;
        self.s.whitespace();
        if self.s.peek()? == b'}' {
            self.s.at += 1;
            self.depth -= 1;
            return Some(());
        }
        loop {
            let start = self.s.at;
            self.s.string()?;
            let key = &self.text[start + 1..self.s.at - 1];
            if key.as_bytes().contains(&b'\\') {
                return None;
            }
            self.s.whitespace();
            self.s.expect(b':')?;
            self.s.whitespace();
            member(self, key)?;
            self.s.whitespace();
            match self.s.next()? {
                b',' => self.s.whitespace(),
                b'}' => {
                    self.depth -= 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The elements of the array starting here, each read by `element`.
    fn array<T>(&mut self, mut element: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        self.s.expect(b'[')?;
        self.depth += 1;
        self.s.whitespace();
        let mut out = Vec::new();
        if self.s.peek()? == b']' {
            self.s.at += 1;
            self.depth -= 1;
            return Some(out);
        }
        loop {
            out.push(element(self)?);
            self.s.whitespace();
            match self.s.next()? {
                b',' => self.s.whitespace(),
                b']' => {
                    self.depth -= 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// `null` as `None` (serde's `Option`), anything else read by `read`.
    fn nullable<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.s.peek()? == b'n' {
            self.s.literal(b"null")?;
            return Some(None);
        }
        read(self).map(Some)
    }

    fn string(&mut self) -> Option<String> {
        let len = self.s.decode_string(&mut self.scratch)?;
        // UTF-8 by construction; checked anyway (under one instruction a byte) so that the crate needs
        // no `unsafe`.
        std::str::from_utf8(&self.scratch[..len]).ok().map(str::to_owned)
    }

    /// Any value: a string or `null` read here, anything else by serde_json from its raw text.
    fn value(&mut self) -> Option<Value> {
        match self.s.peek()? {
            b'"' => self.string().map(Value::String),
            b'n' => self.s.literal(b"null").map(|()| Value::Null),
            _ => serde_json::from_str(self.raw()?).ok(),
        }
    }

    /// The raw text of the value here, checked.
    fn raw(&mut self) -> Option<&'a str> {
        let start = self.s.at;
        self.s.value(self.depth + 1 + DEPTH_MARGIN)?;
        Some(&self.text[start..self.s.at])
    }

    /// A key the struct does not type, into its flattened map; a repeated one declines.
    fn extra(&mut self, extra: &mut Map<String, Value>, key: &str) -> Option<()> {
        if extra.contains_key(key) {
            return None;
        }
        let value = self.value()?;
        extra.insert(key.to_owned(), value);
        Some(())
    }

    /// `content`, present: see [`super::deserialize_present`].
    fn content(&mut self) -> Option<Content> {
        match self.s.peek()? {
            b'"' => self.string().map(Content::Text),
            b'[' => self.array(Reader::part).map(Content::Parts),
            _ => self.value().map(Content::Other),
        }
    }

    /// One part of an array `content`; anything but an object declines (serde_json then keeps the
    /// array as a value).
    fn part(&mut self) -> Option<ContentPart> {
        let mut part = ContentPart { kind: None, text: None, extra: Map::new() };
        let mut typed = Seen::default();
        self.object(|r, key| match key {
            "type" => {
                typed.once(0)?;
                part.kind = r.nullable(Reader::string)?;
                Some(())
            }
            "text" => {
                typed.once(1)?;
                part.text = r.nullable(Reader::string)?;
                Some(())
            }
            other => r.extra(&mut part.extra, other),
        })?;
        Some(part)
    }

    fn tool_call(&mut self) -> Option<ToolCall> {
        let mut call = ToolCall { id: String::new(), kind: None, function: None, extra: Map::new() };
        let mut typed = Seen::default();
        self.object(|r, key| match key {
            "id" => {
                typed.once(0)?;
                call.id = r.string()?;
                Some(())
            }
            "type" => {
                typed.once(1)?;
                call.kind = r.nullable(Reader::string)?;
                Some(())
            }
            "function" => {
                typed.once(2)?;
                call.function = r.nullable(Reader::function)?;
                Some(())
            }
            other => r.extra(&mut call.extra, other),
        })?;
        Some(call)
    }

    fn function(&mut self) -> Option<FunctionCall> {
        let mut function = FunctionCall { name: String::new(), arguments: Value::Null, extra: Map::new() };
        let mut typed = Seen::default();
        self.object(|r, key| match key {
            "name" => {
                typed.once(0)?;
                function.name = r.string()?;
                Some(())
            }
            "arguments" => {
                typed.once(1)?;
                function.arguments = r.value()?;
                Some(())
            }
            other => r.extra(&mut function.extra, other),
        })?;
        Some(function)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    use super::*;

    /// The fast read never disagrees with serde_json's derived read: when it answers, serde_json
    /// reads the same message.
    fn agrees(raw: &str) -> Result<Option<Message>, TestCaseError> {
        let fast = message(raw).map(|(m, members)| {
            let by_serde: Vec<(String, &serde_json::value::RawValue)> =
                serde_json::from_str::<indexmap::IndexMap<String, &serde_json::value::RawValue>>(raw)
                    .unwrap()
                    .into_iter()
                    .collect();
            let by_serde: Vec<(&str, &str)> = by_serde.iter().map(|(k, v)| (k.as_str(), v.get())).collect();
            assert_eq!(members, by_serde, "members of {raw}");
            m
        });
        if let Some(fast) = &fast {
            let by_serde = serde_json::from_str::<Message>(&crate::neutral::lone_surrogates_replaced(raw));
            prop_assert!(by_serde.is_ok(), "accepted what serde_json refuses ({:?}): {}", by_serde, raw);
            prop_assert_eq!(fast, &by_serde.unwrap(), "raw: {}", raw);
        }
        Ok(fast)
    }

    #[test]
    fn reads_agent_messages_as_serde_json_does() {
        for raw in [
            r#"{"role":"user","content":"fix the \"tests\"\\n\ttab \u00e9 \ud83e\udd80 \/ \b\f\r\n"}"#,
            r#" { "role" : "assistant" , "content" : null , "tool_calls" : [ {"id":"c1","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls -la\"}","x":[1,2.50,{"y":null}]},"index":0} ] } "#,
            r#"{"role":"tool","tool_call_id":"c1","name":"terminal","content":[{"type":"text","text":"out\nput","cache_control":{"type":"ephemeral"}},{"type":"image_url","image_url":{"url":"data:x"}}]}"#,
            r#"{"role":"assistant","content":"","reasoning_content":"think","reasoning":{"steps":[1]},"tool_calls":null,"name":null,"tool_call_id":null}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","arguments":{"k":1}}},{"id":"b","type":null,"function":null}]}"#,
            r#"{"content":{"k":"v"},"zz":-1.5e-3,"aa":true,"mm":"\u0000"}"#,
            r#"{"role":"user","content":[]}"#,
            r#"{"role":"user","content":5}"#,
            r#"{}"#,
        ] {
            let fast = agrees(raw).unwrap();
            assert!(fast.is_some(), "declined: {raw}");
        }
        let (m, _) = message(r#"{"role":"user","content":"\ud83e\udd80"}"#).unwrap();
        assert_eq!(m.content, Some(Content::Text("🦀".into())));
    }

    /// Reads on one thread share a decoding buffer: a message larger than the buffer kept between
    /// reads, then smaller ones over its stale bytes, then a larger one again, all read as serde_json
    /// reads them.
    #[test]
    fn reads_alike_across_sizes_on_one_thread() {
        // JSON text: escapes, a non-ASCII character and an astral one as a surrogate pair.
        let line = r#"    12\tdef run(self):  # \"quoted\" \u00e9 é \ud83e\udd80\n"#;
        let big = format!(
            r#"{{"role":"tool","tool_call_id":"c","content":"{}"}}"#,
            line.repeat((SCRATCH_KEPT_BYTES / line.len()) + 10)
        );
        assert!(big.len() > SCRATCH_KEPT_BYTES);
        let small = r#"{"role":"user","content":"hi \n there"}"#;
        let medium = format!(r#"{{"role":"assistant","content":"{}"}}"#, line.repeat(500));
        for raw in [big.as_str(), small, medium.as_str(), small, big.as_str(), medium.as_str()] {
            assert!(agrees(raw).unwrap().is_some(), "declined a message of {} bytes", raw.len());
        }
    }

    /// Every message of the real requests the golden tests use (Hermes, mini-swe-agent, OpenHands,
    /// SWE-agent, tau-bench captures) is read by the fast path, as serde_json reads it.
    #[test]
    fn reads_every_message_of_the_real_fixtures() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compact");
        let mut read = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            if !name.ends_with(".json") || name.ends_with(".out.json") || name.ends_with(".report.json") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            for raw in crate::wire::ChatBody::parse(&bytes).unwrap().messages() {
                let fast = agrees(raw).unwrap();
                assert!(fast.is_some(), "{name}: declined {raw}");
                read += 1;
            }
        }
        assert!(read > 100, "only {read} messages read");
    }

    /// Regression: a lone surrogate escape in one old tool output made the
    /// message unreadable, and with it the whole request uncompactable. JSON allows it; it reads as
    /// U+FFFD, by the fast read and by serde_json alike, a valid pair around it still as its character.
    #[test]
    fn lone_surrogates_read_as_replacement_characters() {
        for (raw, text) in [
            (r#"{"role":"tool","tool_call_id":"c","content":"bad \udc80 byte"}"#, "bad \u{fffd} byte"),
            (r#"{"role":"user","content":"\ud800"}"#, "\u{fffd}"),
            (r#"{"role":"user","content":"\udc00\ud800"}"#, "\u{fffd}\u{fffd}"),
            (r#"{"role":"user","content":"\ud800\u0041 \ud83e\udd80 \\ud800"}"#, "\u{fffd}A 🦀 \\ud800"),
            (r#"{"role":"user","content":"\uDBFF\uDFFF\uDBFF"}"#, "\u{10ffff}\u{fffd}"),
        ] {
            let (m, _) = message(raw).unwrap_or_else(|| panic!("declined {raw}"));
            assert_eq!(m.content, Some(Content::Text(text.to_owned())), "{raw}");
            agrees(raw).unwrap();
            assert_eq!(Message::from_raw(raw).unwrap(), m);
            assert_eq!(crate::neutral::role_of(raw), m.role);
        }
        // What the fast read declines (a content array with a string) is read by serde_json, the lone
        // surrogate alike; an extra key keeps its value.
        let raw = r#"{"role":"user","content":["a\udc80"],"x":"\udc80"}"#;
        assert!(message(raw).is_none());
        let m = Message::from_raw(raw).unwrap();
        assert_eq!(m.content, Some(Content::Other(json!(["a\u{fffd}"]))));
        assert_eq!(m.extra.get("x"), Some(&json!("\u{fffd}")));
    }

    /// What the fast read leaves to serde_json: each is refused by serde_json or read there
    /// differently (an escaped key is decoded before it is matched).
    #[test]
    fn declines_what_serde_json_must_decide() {
        for raw in [
            r#"{"role":"user","role":"assistant"}"#,
            r#"{"role":"user","x":1,"x":2}"#,
            r#"{"rol\u0065":"user"}"#,
            r#"{"role":null}"#,
            r#"{"role":1}"#,
            r#"{"role":"user","content":["a"]}"#,
            r#"{"role":"user","content":[{"type":"text","text":5}]}"#,
            r#"{"tool_calls":{}}"#,
            r#"{"tool_calls":[{"id":null}]}"#,
            r#"{"tool_calls":[{"function":{"name":null}}]}"#,
            r#"{"name":5}"#,
            r#"{"x":1e400}"#,
            r#"{"role":"user"} x"#,
            r#"{"role":"user",}"#,
            r#"{"role":"user"#,
            r#"["role"]"#,
            "{\"content\":\"a\nb\"}",
        ] {
            assert!(message(raw).is_none(), "read: {raw}");
        }
        // Nesting: serde_json refuses 128 levels; the fast read declines before it.
        for depth in [100, 124, 125, 126, 127, 128, 130] {
            let raw = format!("{{\"x\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
            agrees(&raw).unwrap();
            let raw = format!(
                "{{\"tool_calls\":[{{\"function\":{{\"arguments\":{}{}}}}}]}}",
                "[".repeat(depth),
                "]".repeat(depth)
            );
            agrees(&raw).unwrap();
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        super::super::testing::json_value(3, 4, "[a-z]{0,5}", text())
    }

    /// Quotes, backslashes, control characters, non-ASCII and astral characters, long runs.
    fn text() -> impl Strategy<Value = String> {
        "(\\PC|[\"\\\\/\u{0}\u{1}\u{1f}\n\t\r]|é|🦀){0,60}"
    }

    /// A typed field's value: usually what agents send, sometimes another JSON value.
    fn string_or(other: impl Strategy<Value = Value> + 'static) -> impl Strategy<Value = Value> {
        prop_oneof![6 => text().prop_map(Value::String), 1 => Just(Value::Null), 1 => other]
    }

    /// A message of agent shape with extra keys, some typed fields of unexpected types.
    fn agent_message() -> impl Strategy<Value = Value> {
        let part = (
            string_or(json_value()),
            string_or(json_value()),
            prop::collection::btree_map("[a-z_]{1,6}", json_value(), 0..2),
        )
            .prop_map(|(kind, text, extra)| {
                let mut part = json!({"type": kind, "text": text});
                part.as_object_mut().unwrap().extend(extra);
                part
            });
        let content = prop_oneof![
            3 => text().prop_map(Value::String),
            1 => Just(Value::Null),
            2 => prop::collection::vec(part, 0..3).prop_map(Value::Array),
            1 => json_value(),
        ];
        let call = (
            string_or(json_value()),
            string_or(json_value()),
            text(),
            prop_oneof![text().prop_map(Value::String), json_value()],
            any::<bool>(),
        )
            .prop_map(|(id, kind, name, arguments, index)| {
                let mut call = json!({"id": id, "type": kind, "function": {"name": name, "arguments": arguments}});
                if index {
                    call["index"] = json!(0);
                }
                call
            });
        let calls = prop_oneof![3 => prop::collection::vec(call, 0..3).prop_map(Value::Array), 1 => json_value()];
        (
            prop::sample::select(vec!["user", "assistant", "tool", "system"]),
            prop::option::of(content),
            prop::option::of(calls),
            prop::option::of(string_or(json_value())),
            prop::option::of(json_value()),
            prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..3),
        )
            .prop_map(|(role, content, calls, id, reasoning, extra)| {
                let mut m = Map::new();
                m.insert("role".into(), json!(role));
                let typed = [
                    ("content", content),
                    ("tool_calls", calls),
                    ("tool_call_id", id),
                    ("reasoning_content", reasoning),
                ];
                for (key, value) in typed {
                    if let Some(value) = value {
                        m.insert(key.into(), value);
                    }
                }
                for (key, value) in extra {
                    m.entry(key).or_insert(value);
                }
                Value::Object(m)
            })
    }

    #[test]
    fn a_known_value_is_taken_as_it_lies() {
        // The value the caller's parse found is not read again: here it is no JSON at all, which a
        // scan would refuse.
        let raw = r#"{"a":1, "big":<not scanned>,"z":[2]}"#;
        let known = &raw[raw.find('<').unwrap()..raw.find('>').unwrap() + 1];
        assert_eq!(raw_members(raw), None);
        assert_eq!(raw_members_around(raw, Some(known)), Some(vec![("a", "1"), ("big", known), ("z", "[2]")]));
    }

    proptest! {
        /// Every message serde_json writes is read as serde_json reads it, and the shapes agents send
        /// (strings where the message types them) are read by the fast path.
        #[test]
        fn reads_messages_as_serde_json(m in agent_message(), pretty in any::<bool>()) {
            let raw = if pretty { serde_json::to_string_pretty(&m) } else { serde_json::to_string(&m) }.unwrap();
            let fast = agrees(&raw)?;
            let plain = m.as_object().unwrap().iter().all(|(k, v)| match k.as_str() {
                "content" => v.is_string() || v.is_null(),
                "tool_calls" => v.is_null() || v.as_array().is_some_and(|calls| calls.iter().all(|c| {
                    c["id"].is_string() && (c["type"].is_string() || c["type"].is_null()) && c["function"]["name"].is_string()
                })),
                "tool_call_id" => v.is_string() || v.is_null(),
                _ => true,
            });
            if plain {
                prop_assert!(fast.is_some(), "declined: {}", raw);
            }
        }

        /// Given any member's value as serde_json's parse finds it (as the adapters' heads do), the
        /// member scan reads what it reads without it, whitespace and all.
        #[test]
        fn members_around_a_known_value_are_the_members(
            object in prop::collection::vec(("[a-z]{1,3}", super::super::testing::json_value(3, 4, "[a-z]{1,2}", ".{0,12}")), 1..6),
            pretty in any::<bool>(),
            pick in any::<prop::sample::Index>(),
        ) {
            let value: Value = Value::Object(object.into_iter().collect());
            let raw = if pretty { serde_json::to_string_pretty(&value) } else { serde_json::to_string(&value) }.unwrap();
            let members = raw_members(&raw).expect("serde_json's object");
            let by_serde: indexmap::IndexMap<&str, &serde_json::value::RawValue> = serde_json::from_str(&raw).unwrap();
            let known = by_serde[pick.index(by_serde.len())].get();
            prop_assert_eq!(raw_members_around(&raw, Some(known)), Some(members.clone()));
            // A value that is no slice of the object is scanned as any other.
            let copy = known.to_owned();
            prop_assert_eq!(raw_members_around(&raw, Some(copy.as_str())), Some(members));
        }

        /// After a small corruption the fast read declines or reads what serde_json reads.
        #[test]
        fn never_reads_what_serde_json_refuses(m in agent_message(), edits in super::super::testing::edits()) {
            let raw = super::super::testing::corrupt(serde_json::to_vec(&m).unwrap(), edits);
            if let Ok(raw) = std::str::from_utf8(&raw) {
                agrees(raw)?;
            }
        }
    }
}
