//! A JSON request body split around its conversation array: the other top-level keys with their
//! bytes, and the array's elements as raw text. Every adapter holds one (Chat Completions keyed on
//! `messages`, Responses on `input`, Anthropic Messages on `messages`, Gemini on `contents`) and
//! writes the forwarded body through it, so that every key it does not read keeps its position and
//! bytes.

use serde_json::value::RawValue;

use super::WireError;
use crate::neutral::scan;

/// A request body parsed shallowly around its conversation array (see the module docs). The array's
/// elements are checked to be valid JSON; nothing inside them is built.
#[derive(Debug)]
pub struct Split<'a> {
    /// The key of the conversation array (`messages`, `input`, `contents`).
    pub array_key: &'static str,
    /// Top-level keys other than the array's, in their original order, each with its original bytes.
    pub fields: Vec<(String, &'a RawValue)>,
    /// Position of the array's key among the top-level keys: it comes before `fields[array_idx]`
    /// (after the last field when `array_idx == fields.len()`).
    pub array_idx: usize,
    /// The array as it is in the body, brackets and whitespace inside included (the archive stores
    /// the bytes between elements).
    pub array_raw: &'a str,
    /// The array's elements, one per entry as its original JSON text (valid JSON, not necessarily an
    /// object), in order.
    pub elements: Vec<&'a str>,
    /// The body as sent.
    pub body: &'a [u8],
}

/// Where a body's values lie, as byte ranges (start, end) into it: each top-level value other than
/// the conversation array (in [`Split::fields`] order), the array, and each of its elements. What
/// the archive splits a body along ([`crate::archive::body::split_along`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spans {
    pub fields: Vec<(usize, usize)>,
    pub array: (usize, usize),
    pub elements: Vec<(usize, usize)>,
}

impl<'a> Split<'a> {
    /// Parse the top level and split the array under `array_key` into its raw elements, checking that
    /// the whole body is valid JSON but building no value inside an element. A repeated key keeps
    /// its first position and its last value (as a JSON object map does); an `array_key` whose value
    /// is not an array is refused.
    ///
    /// A body is read by the fast scan of `neutral::scan` when it can; whatever the scan declines (invalid
    /// JSON included) is parsed by serde_json, which also words the error.
    pub fn parse(bytes: &'a [u8], array_key: &'static str) -> Result<Split<'a>, WireError> {
        Self::parse_resumed(bytes, array_key, None)
    }

    /// [`Split::parse`] whose scan starts again after `resume` (see [`scan::split_resumed`] for what
    /// the caller vouches for).
    pub(crate) fn parse_resumed(
        bytes: &'a [u8],
        array_key: &'static str,
        resume: Option<&scan::Resume<'_>>,
    ) -> Result<Split<'a>, WireError> {
        if let Some(split) = Self::from_scan(bytes, array_key, resume) {
            return Ok(split);
        }
        // The array's elements are read in a second pass over its bytes: this path is for bodies the
        // scan declines, which are rare and small.
        let top: TopLevel<'a> = TopLevel::parse(bytes, array_key)?;
        let (array_idx, array_raw, elements) = top.elements().ok_or(WireError::NoArray(array_key))?;
        Ok(Split {
            array_key,
            fields: top.fields.into_iter().collect(),
            array_idx,
            array_raw: array_raw.get(),
            elements: elements.into_iter().map(RawValue::get).collect(),
            body: bytes,
        })
    }

    /// The fast path: the scan's split, with the (few, small) top-level values handed to serde_json
    /// as raw values.
    fn from_scan(bytes: &'a [u8], array_key: &'static str, resume: Option<&scan::Resume<'_>>) -> Option<Split<'a>> {
        let scanned = scan::split_resumed(bytes, array_key, resume)?;
        let fields = scanned
            .fields
            .into_iter()
            .map(|(key, value)| Some((key.into_owned(), serde_json::from_str::<&'a RawValue>(value).ok()?)))
            .collect::<Option<Vec<_>>>()?;
        Some(Split {
            array_key,
            fields,
            array_idx: scanned.array_idx,
            array_raw: scanned.array_raw,
            elements: scanned.elements,
            body: bytes,
        })
    }

    /// The raw value of a top-level key other than the array's.
    pub fn field(&self, key: &str) -> Option<&'a RawValue> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The request's `model`, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.field("model").and_then(|v| serde_json::from_str::<String>(v.get()).ok())
    }

    /// The body written with `elements` as its array; every other key keeps its position and bytes.
    /// Also where in the bytes written each value lies (what a parse of them would find, without
    /// the parse).
    pub fn to_vec_and_spans<E: AsRef<str>>(&self, elements: &[E]) -> (Vec<u8>, Spans) {
        let fields_len: usize = self.fields.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum();
        let elements_len: usize = elements.iter().map(|e| e.as_ref().len() + 1).sum();
        let mut out = Vec::with_capacity(fields_len + elements_len + 16);
        let mut spans = Spans {
            fields: Vec::with_capacity(self.fields.len()),
            array: (0, 0),
            elements: Vec::with_capacity(elements.len()),
        };
        out.push(b'{');
        let write_array = |out: &mut Vec<u8>, spans: &mut Spans| {
            out.push(b'"');
            out.extend_from_slice(self.array_key.as_bytes());
            out.extend_from_slice(b"\":");
            let array_start = out.len();
            out.push(b'[');
            for (j, element) in elements.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                let start = out.len();
                out.extend_from_slice(element.as_ref().as_bytes());
                spans.elements.push((start, out.len()));
            }
            out.push(b']');
            spans.array = (array_start, out.len());
        };
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if i == self.array_idx {
                write_array(&mut out, &mut spans);
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key).expect("writing a string to a Vec cannot fail");
            out.push(b':');
            let start = out.len();
            out.extend_from_slice(value.get().as_bytes());
            spans.fields.push((start, out.len()));
        }
        if self.array_idx >= self.fields.len() {
            if !self.fields.is_empty() {
                out.push(b',');
            }
            write_array(&mut out, &mut spans);
        }
        out.push(b'}');
        (out, spans)
    }

    /// The body written with its own array: the body as sent, whitespace and all, and where its
    /// values lie.
    pub fn to_vec_and_spans_keeping_array(&self) -> (Vec<u8>, Spans) {
        (self.body.to_vec(), self.spans_in(self.body).expect("a body's values lie in it"))
    }

    /// Where this body's values lie in `body`, the bytes it was parsed from (`None` for other bytes).
    pub fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        let span = |inner: &str| {
            let start = (inner.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            (start + inner.len() <= body.len()).then_some((start, start + inner.len()))
        };
        Some(Spans {
            fields: self.fields.iter().map(|(_, v)| span(v.get())).collect::<Option<_>>()?,
            array: span(self.array_raw)?,
            elements: self.elements.iter().map(|e| span(e)).collect::<Option<_>>()?,
        })
    }
}

/// The top level as serde_json reads it for [`Split::parse`]: every key kept raw, the conversation
/// array's key apart.
pub(crate) struct TopLevel<'a> {
    pub(crate) fields: indexmap::IndexMap<String, &'a RawValue>,
    /// Position of the first array key among the keys, and its last value.
    pub(crate) array: Option<(usize, &'a RawValue)>,
}

impl<'a> TopLevel<'a> {
    /// Read `bytes` with serde_json, the value under `array_key` apart.
    pub(crate) fn parse(bytes: &'a [u8], array_key: &'static str) -> serde_json::Result<TopLevel<'a>> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let top = serde::de::DeserializeSeed::deserialize(TopSeed(array_key, std::marker::PhantomData), &mut de)?;
        de.end()?;
        Ok(top)
    }

    /// The position of the array, the array and its elements, when the value under the array key
    /// is an array.
    pub(crate) fn elements(&self) -> Option<(usize, &'a RawValue, Vec<&'a RawValue>)> {
        let (idx, raw) = self.array?;
        if !raw.get().starts_with('[') {
            return None;
        }
        Some((idx, raw, serde_json::from_str(raw.get()).ok()?))
    }
}

/// Reads a [`TopLevel`] with the value under `.0` apart.
struct TopSeed<'a>(&'static str, std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::DeserializeSeed<'de> for TopSeed<'a> {
    type Value = TopLevel<'a>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<TopLevel<'a>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> serde::de::Visitor<'de> for TopSeed<'a> {
    type Value = TopLevel<'a>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<TopLevel<'a>, A::Error> {
        let mut top = TopLevel { fields: indexmap::IndexMap::new(), array: None };
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let value = map.next_value::<&'a RawValue>()?;
            if key == self.0 {
                let position = top.array.map_or(top.fields.len(), |(p, _)| p);
                top.array = Some((position, value));
            } else {
                top.fields.insert(key.into_owned(), value);
            }
        }
        Ok(top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn written(split: &Split<'_>, elements: &[&str]) -> String {
        String::from_utf8(split.to_vec_and_spans(elements).0).unwrap()
    }

    #[test]
    fn untouched_top_level_keeps_order_and_bytes() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.50,"x":{"b":1,"a":2}}"#;
        let split = Split::parse(body.as_bytes(), "messages").unwrap();
        assert_eq!(written(&split, &split.elements), body);
    }

    /// The one-pass parse must agree with a JSON object map: a repeated key keeps its first position
    /// and its last value, the array's key included.
    #[test]
    fn repeated_keys_keep_first_position_and_last_value() {
        let body = br#"{"a":1,"messages":[{"role":"user"}],"b":2,"a":3,"messages":[{"role":"tool"},7]}"#;
        let split = Split::parse(body, "messages").unwrap();
        assert_eq!(split.elements, vec![r#"{"role":"tool"}"#, "7"]);
        assert_eq!(written(&split, &split.elements), r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#);
        // The same reading as a generic JSON map gives.
        let map: indexmap::IndexMap<String, Value> = serde_json::from_slice(body).unwrap();
        assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#);
        // A later non-array value wins and is refused; a later array makes an earlier odd one valid.
        let refused = Split::parse(br#"{"messages":[],"messages":{"x":[1]}}"#, "messages");
        assert!(matches!(refused, Err(WireError::NoArray("messages"))));
        let split = Split::parse(br#"{"messages":"x","m":null,"messages":[]}"#, "messages").unwrap();
        assert_eq!(written(&split, &[]), r#"{"messages":[],"m":null}"#);
    }

    #[test]
    fn the_array_first_last_or_alone_is_written_in_place() {
        for (body, array_key) in [
            (r#"{"messages":[{"role":"user","content":"hi"}],"model":"m"}"#, "messages"),
            (r#"{"model":"m","stream":true,"messages":[]}"#, "messages"),
            (r#"{"messages":[1,2,3]}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"user"}],"tools":[{"type":"function"}],"n":1}"#, "messages"),
            (r#"{"model":"m","input":[{"type":"message"}],"messages":[1]}"#, "input"),
            (r#"{"contents":[{"role":"user","parts":[]}],"generationConfig":{}}"#, "contents"),
        ] {
            let split = Split::parse(body.as_bytes(), array_key).unwrap();
            assert_eq!(written(&split, &split.elements), body);
            assert_eq!(split.field(array_key).map(|v| v.get()), None);
            // Where the writing put each value is where a parse of what it wrote finds it, also with
            // other elements than the parsed ones.
            for elements in [split.elements.clone(), vec![r#"{"role":"user","content":"new"}"#, "7"], Vec::new()] {
                let (bytes, spans) = split.to_vec_and_spans(&elements);
                assert_eq!(Split::parse(&bytes, array_key).unwrap().spans_in(&bytes), Some(spans), "{body}");
            }
            // Its own array written as sent is the body, and its spans are the parse's.
            let (bytes, spans) = split.to_vec_and_spans_keeping_array();
            assert_eq!(bytes, body.as_bytes());
            assert_eq!(split.spans_in(body.as_bytes()), Some(spans));
            assert_eq!(split.spans_in(b"other bytes"), None);
        }
    }

    #[test]
    fn a_body_written_with_its_own_array_is_the_body_as_sent() {
        for body in ["\t{\"model\": \"m\",\n \"messages\" : [ {\"role\":\"user\"} ] }\n", "{\"a\":1,\"messages\":[]}"] {
            let split = Split::parse(body.as_bytes(), "messages").unwrap();
            let (bytes, spans) = split.to_vec_and_spans_keeping_array();
            assert_eq!(bytes, body.as_bytes());
            assert_eq!(Some(spans), split.spans_in(body.as_bytes()));
        }
    }

    #[test]
    fn the_model_is_read_when_it_is_a_string() {
        let split = Split::parse(br#"{"model":"qwen3","input":[]}"#, "input").unwrap();
        assert_eq!(split.model().as_deref(), Some("qwen3"));
        let split = Split::parse(br#"{"model":7,"input":[]}"#, "input").unwrap();
        assert_eq!(split.model(), None);
    }

    #[test]
    fn body_without_the_array_is_refused() {
        fn parse(body: &[u8]) -> Result<Split<'_>, WireError> {
            Split::parse(body, "messages")
        }
        assert!(matches!(parse(br#"{"model":"m"}"#), Err(WireError::NoArray("messages"))));
        assert!(matches!(Split::parse(br#"{"messages":[]}"#, "contents"), Err(WireError::NoArray("contents"))));
        assert!(matches!(parse(b"{nope"), Err(WireError::Json(_))));
        assert!(matches!(parse(br#"{"messages":[1,]}"#), Err(WireError::Json(_))));
        assert!(matches!(parse(b"[1]"), Err(WireError::Json(_))));
        for not_array in [r#"null"#, r#"3"#, r#"-1.5"#, r#""s""#, r#"true"#, r#"{"a":[{}]}"#] {
            let body = format!(r#"{{"messages":{not_array},"model":"m"}}"#);
            assert!(matches!(parse(body.as_bytes()), Err(WireError::NoArray(_))), "{not_array}");
        }
    }
}
