//! The one partial read of a neutral message: its [`Shape`] — role, tool calls, the call a result
//! answers — in one pass over its text, each string borrowed when it has no escape and every value
//! of another type than a shape expects skipped rather than refused where the message can still
//! have a place in the conversation (a content array, a call's odd function). The session tracker
//! keys messages by it, the pairing validator checks it ([`crate::compact::validate::Skeleton`]),
//! and the budget and the evaluation find turns by its role; the rules read whole messages
//! ([`super::Message::read`]).

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};

/// What a neutral message says about its place in the conversation, borrowed from its text. Its
/// content is a [`Text`] (any value), or a [`Str`] for a reader that wants only string contents
/// (it then refuses any other at once, without reading the rest of the message).
#[derive(Debug, Deserialize)]
#[serde(bound(deserialize = "C: Deserialize<'de>"))]
pub struct Shape<'a, C = Text<'a>> {
    /// `""` when absent (a `null` or non-string role is no shape).
    #[serde(borrow, default)]
    pub role: Cow<'a, str>,
    /// `None` when absent or null.
    #[serde(default = "Option::default")]
    pub content: Option<C>,
    #[serde(borrow, default)]
    pub tool_calls: Option<Vec<CallShape<'a>>>,
    #[serde(borrow, default)]
    pub tool_call_id: Option<Cow<'a, str>>,
}

/// One entry of an assistant's `tool_calls`.
#[derive(Debug, Deserialize)]
pub struct CallShape<'a> {
    #[serde(borrow, default)]
    pub id: Option<Cow<'a, str>>,
    /// `None` when absent or null.
    #[serde(borrow, default)]
    pub function: Option<FunctionShape<'a>>,
}

/// A call's `function`: its `name` and `arguments` when it is an object (each `None` when absent
/// or null), or any other value, skipped.
#[derive(Debug, PartialEq, Eq)]
pub enum FunctionShape<'a> {
    Object { name: Option<Text<'a>>, arguments: Option<Text<'a>> },
    Other,
}

/// A string, decoded (borrowed when it has no escape); any other value is refused.
#[derive(Debug, PartialEq, Eq)]
pub struct Str<'a>(pub Cow<'a, str>);

/// A value a shape reads as text: a string, decoded, or any other value, skipped.
#[derive(Debug, PartialEq, Eq)]
pub enum Text<'a> {
    Str(Cow<'a, str>),
    Other,
}

impl<'a> Text<'a> {
    /// The string, or `None` for another value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Text::Str(text) => Some(text),
            Text::Other => None,
        }
    }
}

/// An absent or null text as `""`, a string as itself; `None` for another value.
fn str_or_empty<'t>(text: &'t Option<Text<'_>>) -> Option<&'t str> {
    text.as_ref().map_or(Some(""), Text::as_str)
}

impl<'a> Shape<'a> {
    /// The shape of `raw`, when it is one JSON object whose `role` and `tool_call_id` are strings
    /// (or absent; a null `tool_call_id` too) and whose `tool_calls`, if any, are objects with a
    /// string or null `id`. `None` otherwise, and for JSON serde_json refuses (a lone surrogate
    /// escape: see [`read`]).
    pub fn parse(raw: &'a str) -> Option<Shape<'a>> {
        Shape::parse_as(raw)
    }

    /// The content when it is a string (`""` when null or absent); `None` for an array or any other
    /// value.
    pub fn content_text(&self) -> Option<&str> {
        str_or_empty(&self.content)
    }
}

impl<'a, C: Deserialize<'a>> Shape<'a, C> {
    /// [`Shape::parse`] with a content read as `C`.
    pub fn parse_as(raw: &'a str) -> Option<Shape<'a, C>> {
        // A struct reads from an array too; a message is an object.
        if raw.trim_start_matches([' ', '\t', '\n', '\r']).as_bytes().first() != Some(&b'{') {
            return None;
        }
        serde_json::from_str(raw).ok()
    }
}

impl CallShape<'_> {
    /// The call's function name and arguments when both are strings, null or absent (`""` then),
    /// in an object function or none; `None` otherwise.
    pub fn name_and_arguments(&self) -> Option<(&str, &str)> {
        match &self.function {
            None => Some(("", "")),
            Some(FunctionShape::Object { name, arguments }) => Some((str_or_empty(name)?, str_or_empty(arguments)?)),
            Some(FunctionShape::Other) => None,
        }
    }
}

/// `f` of the shape of `raw` ([`Shape::parse`]); a message serde_json refuses for a lone surrogate
/// escape is read from its [`super::lone_surrogates_replaced`] text, which reads each as U+FFFD.
pub fn read<R>(raw: &str, f: impl FnOnce(&Shape<'_>) -> R) -> Option<R> {
    match Shape::parse(raw) {
        Some(shape) => Some(f(&shape)),
        None => read_replaced(raw, f),
    }
}

/// `f` of the shape of `raw`'s [`super::lone_surrogates_replaced`] text, when `raw` has a lone
/// surrogate escape: what [`read`] falls back on once [`Shape::parse`] refused `raw`.
pub fn read_replaced<R>(raw: &str, f: impl FnOnce(&Shape<'_>) -> R) -> Option<R> {
    match super::lone_surrogates_replaced(raw) {
        Cow::Owned(readable) => Shape::parse(&readable).map(|shape| f(&shape)),
        Cow::Borrowed(_) => None,
    }
}

/// The visitor of [`Text`] and [`FunctionShape`]: a string, a map, or any other value skipped.
struct Visit<'a, T>(PhantomData<(&'a (), T)>);

/// What a [`Visit`] makes of each kind of value.
trait Shaped<'a>: Sized {
    const EXPECTING: &'static str;
    fn other() -> Self;
    fn string(_text: Cow<'a, str>) -> Self {
        Self::other()
    }
    fn map<'de: 'a, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Self::other())
    }
}

impl<'a> Shaped<'a> for Text<'a> {
    const EXPECTING: &'static str = "a string or any value";
    fn other() -> Self {
        Text::Other
    }
    fn string(text: Cow<'a, str>) -> Self {
        Text::Str(text)
    }
}

impl<'a> Shaped<'a> for FunctionShape<'a> {
    const EXPECTING: &'static str = "a function object or any value";
    fn other() -> Self {
        FunctionShape::Other
    }
    fn map<'de: 'a, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "lowercase")]
        enum Key {
            Name,
            Arguments,
            #[serde(other)]
            Other,
        }
        let (mut name, mut arguments, mut repeated) = (None, None, false);
        while let Some(key) = map.next_key::<Key>()? {
            let slot = match key {
                Key::Name => &mut name,
                Key::Arguments => &mut arguments,
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            // A repeated key: serde_json's map keeps the last value, a derived read refuses it.
            repeated |= slot.is_some();
            *slot = Some(map.next_value::<Option<Text<'a>>>()?);
        }
        if repeated {
            return Ok(FunctionShape::Other);
        }
        Ok(FunctionShape::Object { name: name.flatten(), arguments: arguments.flatten() })
    }
}

impl<'de: 'a, 'a, T: Shaped<'a>> Visitor<'de> for Visit<'a, T> {
    type Value = T;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(T::EXPECTING)
    }
    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<T, E> {
        Ok(T::string(Cow::Borrowed(text)))
    }
    fn visit_str<E>(self, text: &str) -> Result<T, E> {
        Ok(T::string(Cow::Owned(text.to_owned())))
    }
    fn visit_string<E>(self, text: String) -> Result<T, E> {
        Ok(T::string(Cow::Owned(text)))
    }
    fn visit_bool<E>(self, _: bool) -> Result<T, E> {
        Ok(T::other())
    }
    fn visit_i64<E>(self, _: i64) -> Result<T, E> {
        Ok(T::other())
    }
    fn visit_u64<E>(self, _: u64) -> Result<T, E> {
        Ok(T::other())
    }
    fn visit_f64<E>(self, _: f64) -> Result<T, E> {
        Ok(T::other())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(T::other())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::map(map)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct StrVisit<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for StrVisit<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Borrowed(text)))
            }
            fn visit_str<E>(self, text: &str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(text.to_owned())))
            }
            fn visit_string<E>(self, text: String) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(text)))
            }
        }
        d.deserialize_str(StrVisit(PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Visit::<'a, Text<'a>>(PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for FunctionShape<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Visit::<'a, FunctionShape<'a>>(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_reads_role_calls_and_result_id_and_skips_what_it_does_not_read() {
        let raw = r#"{"role":"assistant","content":[{"type":"text","text":"a"}],"tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{\"a\":1}","strict":true}},{"id":null,"function":"odd"},{"id":"c3","function":{"name":"g","arguments":{"a":1}}},{"id":"c4"}]}"#;
        let shape = Shape::parse(raw).unwrap();
        assert_eq!(shape.role, "assistant");
        assert_eq!(shape.content, Some(Text::Other));
        assert_eq!(shape.content_text(), None);
        let calls = shape.tool_calls.as_ref().unwrap();
        let ids: Vec<_> = calls.iter().map(|c| c.id.as_deref()).collect();
        assert_eq!(ids, [Some("c1"), None, Some("c3"), Some("c4")]);
        let functions: Vec<_> = calls.iter().map(CallShape::name_and_arguments).collect();
        assert_eq!(functions, [Some(("f", r#"{"a":1}"#)), None, None, Some(("", ""))]);
    }

    #[test]
    fn string_content_decodes_and_borrows_when_it_has_no_escape() {
        let shape = Shape::parse(r#"{"role":"tool","tool_call_id":"c","content":"plain"}"#).unwrap();
        assert_eq!(shape.content, Some(Text::Str(Cow::Borrowed("plain"))));
        assert_eq!(shape.tool_call_id.as_deref(), Some("c"));
        let shape = Shape::parse(r#"{"role":"user","content":"a\n\"b\" \u00e9"}"#).unwrap();
        assert_eq!(shape.content_text(), Some("a\n\"b\" é"));
        for raw in [r#"{"role":"user","content":null}"#, r#"{"role":"user"}"#] {
            assert_eq!(Shape::parse(raw).unwrap().content_text(), Some(""));
        }
        assert_eq!(Shape::parse(r#"{"role":"user","content":7}"#).unwrap().content_text(), None);
    }

    #[test]
    fn a_shape_of_string_content_refuses_any_other() {
        let shape = Shape::<Str<'_>>::parse_as(r#"{"role":"user","content":"a\tb"}"#).unwrap();
        assert_eq!(shape.content, Some(Str(Cow::Owned("a\tb".to_owned()))));
        assert!(Shape::<Str<'_>>::parse_as(r#"{"role":"user","content":null}"#).unwrap().content.is_none());
        assert!(Shape::<Str<'_>>::parse_as(r#"{"role":"user","content":[{"text":"a"}]}"#).is_none());
    }

    #[test]
    fn a_function_with_a_repeated_name_has_no_name() {
        let raw = r#"{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","name":"g"}}]}"#;
        let shape = Shape::parse(raw).unwrap();
        assert_eq!(shape.tool_calls.unwrap()[0].name_and_arguments(), None);
    }

    #[test]
    fn what_is_not_a_message_object_has_no_shape() {
        for raw in [
            r#"["user","hi",null,null]"#,
            r#""text""#,
            r#"{"role":7}"#,
            r#"{"role":null}"#,
            r#"{"role":"tool","tool_call_id":3}"#,
            r#"{"role":"assistant","tool_calls":[{"id":1}]}"#,
            r#"{"role":"assistant","tool_calls":{"id":"c"}}"#,
            r#"{"role":"user","content":"first","content":"second"}"#,
            r#"{"role":"user","content":"cut"#,
        ] {
            assert!(Shape::parse(raw).is_none(), "{raw}");
        }
    }

    #[test]
    fn a_lone_surrogate_escape_is_read_as_a_replacement_character() {
        // serde_json refuses the message: `read` reads the replaced text.
        let raw = r#"{"role":"tool","tool_call_id":"c\udc80"}"#;
        assert!(Shape::parse(raw).is_none());
        let id = read(raw, |shape| shape.tool_call_id.as_deref().map(str::to_owned));
        assert_eq!(id, Some(Some("c\u{fffd}".to_owned())));
    }
}
