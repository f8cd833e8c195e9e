//! A neutral message as a wire adapter reads it from its body: typed (a role, the content's JSON,
//! calls paired by id, the id a result answers), written once into the neutral form's text by the
//! one writer every adapter shares ([`Draft::write`]), and typed for the engine from its own parts
//! ([`Draft::read`]): what the adapter wrote is never parsed back.

use std::borrow::Cow;
use std::ops::Range;

use serde_json::{Map, Value};

use super::{FunctionCall, Message, ToolCall, Typing, push_json_string, read};

/// A neutral message read from a wire body's parts. Keys are written in one order: `role`, then
/// `tool_call_id` (a result), `content`, then `tool_calls` (a calling turn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Draft<'a> {
    pub role: &'a str,
    /// The content as JSON text: a string, an array of parts, or `null`.
    pub content: Cow<'a, str>,
    pub tool_calls: Vec<DraftCall<'a>>,
    /// The id of the call a tool result answers.
    pub tool_call_id: Option<&'a str>,
}

/// One tool call of a [`Draft`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftCall<'a> {
    pub id: &'a str,
    pub name: &'a str,
    pub arguments: Arguments<'a>,
}

/// A call's `arguments`, as the wire gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arguments<'a> {
    /// A JSON string literal, as sent (the Responses API's `arguments`).
    Literal(&'a str),
    /// Text to be written as a JSON string (an input object's JSON text, a shell action).
    Text(&'a str),
}

impl<'a> Draft<'a> {
    /// A message of `role` whose content is `content`, JSON text.
    pub fn text(role: &'a str, content: impl Into<Cow<'a, str>>) -> Draft<'a> {
        Draft { role, content: content.into(), tool_calls: Vec::new(), tool_call_id: None }
    }

    /// The result of call `id`, whose content is `content`, JSON text.
    pub fn result(id: &'a str, content: impl Into<Cow<'a, str>>) -> Draft<'a> {
        Draft { role: "tool", content: content.into(), tool_calls: Vec::new(), tool_call_id: Some(id) }
    }

    /// The neutral message's JSON text.
    pub fn write(&self) -> String {
        let calls: usize = self.tool_calls.iter().map(|c| c.id.len() + c.name.len() + c.arguments.len() + 64).sum();
        let mut out = String::with_capacity(self.content.len() + calls + 48);
        out.push_str(r#"{"role":"#);
        push_json_string(&mut out, self.role);
        if let Some(id) = self.tool_call_id {
            out.push_str(r#","tool_call_id":"#);
            push_json_string(&mut out, id);
        }
        out.push_str(r#","content":"#);
        out.push_str(&self.content);
        if !self.tool_calls.is_empty() {
            out.push_str(r#","tool_calls":["#);
            for (n, call) in self.tool_calls.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                out.push_str(r#"{"id":"#);
                push_json_string(&mut out, call.id);
                out.push_str(r#","type":"function","function":{"name":"#);
                push_json_string(&mut out, call.name);
                out.push_str(r#","arguments":"#);
                match call.arguments {
                    Arguments::Literal(literal) => out.push_str(literal),
                    Arguments::Text(text) => push_json_string(&mut out, text),
                }
                out.push_str("}}");
            }
            out.push(']');
        }
        out.push('}');
        out
    }

    /// The message [`Draft::write`]'s text reads as ([`Message::read`]), typed from the draft's
    /// parts: only the content's JSON (and a literal call's arguments) is read, as the message's
    /// read reads it. `None` where the text reads as no message (a content that is not JSON).
    pub fn read(&self) -> Option<Message> {
        let content = read::content(&self.content, 1)?;
        let tool_calls = if self.tool_calls.is_empty() {
            None
        } else {
            let calls = self.tool_calls.iter().map(|call| {
                let arguments = match call.arguments {
                    // The arguments lie in the message, its `tool_calls`, the call and its `function`.
                    Arguments::Literal(literal) => read::value(literal, 4)?,
                    Arguments::Text(text) => Value::String(text.to_owned()),
                };
                Some(ToolCall {
                    id: call.id.to_owned(),
                    kind: Some("function".to_owned()),
                    function: Some(FunctionCall { name: call.name.to_owned(), arguments, extra: Map::new() }),
                    extra: Map::new(),
                })
            });
            Some(calls.collect::<Option<Vec<ToolCall>>>()?)
        };
        Some(Message {
            role: self.role.to_owned(),
            content: Some(content),
            tool_calls,
            tool_call_id: self.tool_call_id.map(str::to_owned),
            name: None,
            reasoning_content: None,
            reasoning: None,
            extra: Map::new(),
        })
    }

    /// The JSON value [`Draft::write`]'s text is (serde_json's read of it), built from the parts:
    /// what an answer's neutral message is for the archive's session keys. `None` where serde_json
    /// refuses the text (a content or literal arguments it cannot read as a value).
    pub fn value(&self) -> Option<Value> {
        let mut message = Map::new();
        message.insert("role".to_owned(), Value::String(self.role.to_owned()));
        if let Some(id) = self.tool_call_id {
            message.insert("tool_call_id".to_owned(), Value::String(id.to_owned()));
        }
        message.insert("content".to_owned(), serde_json::from_str(&self.content).ok()?);
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.iter().map(|call| {
                let arguments = match call.arguments {
                    Arguments::Literal(literal) => serde_json::from_str(literal).ok()?,
                    Arguments::Text(text) => Value::String(text.to_owned()),
                };
                Some(serde_json::json!({
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }))
            });
            message.insert("tool_calls".to_owned(), Value::Array(calls.collect::<Option<_>>()?));
        }
        Some(Value::Object(message))
    }

    /// The draft typed for the engine: its message and its members in its text (`len` bytes).
    pub fn typing(&self, len: usize) -> Typing {
        (self.read(), Some(self.members(len)))
    }

    /// Where the values of this draft's members lie in its text ([`Draft::write`], `len` bytes), in
    /// order: found from the parts' lengths, not by scanning the text.
    pub fn members(&self, len: usize) -> Vec<(&'static str, Range<usize>)> {
        let mut scratch = String::new();
        let mut json_len = |s: &str| {
            scratch.clear();
            push_json_string(&mut scratch, s);
            scratch.len()
        };
        let mut members = Vec::with_capacity(4);
        let mut at = r#"{"role":"#.len();
        let mut member = |key: &'static str, len: usize, at: &mut usize| {
            members.push((key, *at..*at + len));
            *at += len;
        };
        member("role", json_len(self.role), &mut at);
        if let Some(id) = self.tool_call_id {
            at += r#","tool_call_id":"#.len();
            member("tool_call_id", json_len(id), &mut at);
        }
        at += r#","content":"#.len();
        // The value, without the whitespace a content's JSON text may have around it.
        let lead = self.content.len() - self.content.trim_start().len();
        let trail = self.content.len() - self.content.trim_end().len();
        at += lead;
        member("content", self.content.trim().len(), &mut at);
        at += trail;
        if !self.tool_calls.is_empty() {
            at += r#","tool_calls":"#.len();
            member("tool_calls", len - 1 - at, &mut at);
        }
        members
    }
}

impl Arguments<'_> {
    fn len(&self) -> usize {
        match self {
            Arguments::Literal(s) | Arguments::Text(s) => s.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::neutral::testing::json_value;
    use crate::neutral::{Message, Shape, raw_members};

    /// JSON text of any value, compact or pretty, sometimes with a lone surrogate escape in a string.
    fn json_text() -> impl Strategy<Value = String> {
        (json_value(3, 4, "[a-z]{1,3}", "(\\PC|[\"\\\\\n]|é){0,12}"), 0..3u8, any::<bool>()).prop_map(
            |(v, form, lone)| {
                let text = match form {
                    0 => serde_json::to_string(&v).unwrap(),
                    1 => serde_json::to_string_pretty(&v).unwrap(),
                    _ => format!(" {} ", serde_json::to_string(&v).unwrap()),
                };
                match (lone, text.find('"')) {
                    (true, Some(at)) if text.starts_with('"') || text.starts_with('[') => {
                        format!("{}\\udc80{}", &text[..=at], &text[at + 1..])
                    }
                    _ => text,
                }
            },
        )
    }

    /// A content as adapters give it: a string, an array of text and other parts, null, or any value.
    fn content_text() -> impl Strategy<Value = String> {
        let part = ("(\\PC|[\"\\\\\n]){0,20}", any::<bool>(), prop::option::of(json_text())).prop_map(
            |(text, marked, extra)| {
                let mut part = format!(r#"{{"type":"text","text":{}"#, serde_json::to_string(&text).unwrap());
                if marked {
                    part.push_str(r#","cache_control":{"type":"ephemeral"}"#);
                }
                if let Some(extra) = extra {
                    part.push_str(&format!(r#","x":{extra}"#));
                }
                part.push('}');
                part
            },
        );
        prop_oneof![
            2 => "(\\PC|[\"\\\\\n]){0,30}".prop_map(|t| serde_json::to_string(&t).unwrap()),
            2 => prop::collection::vec(part, 0..3).prop_map(|parts| format!("[{}]", parts.join(","))),
            1 => Just("null".to_owned()),
            1 => json_text(),
        ]
    }

    /// A call's id, name, and arguments as a literal (`Ok`) or as text (`Err`).
    type OwnedCall = (String, String, Result<String, String>);

    /// The parts of a draft: role, content, calls, the id a result answers.
    fn owned_draft() -> impl Strategy<Value = (String, String, Vec<OwnedCall>, Option<String>)> {
        let arguments = prop_oneof![json_text().prop_map(Ok), "(\\PC|[\"\\\\\n]){0,20}".prop_map(Err)];
        (
            prop::sample::select(vec!["user", "assistant", "tool", "system", "we\"ird\n"]).prop_map(str::to_owned),
            content_text(),
            prop::collection::vec(("(\\PC|[\"\\\\]){0,8}", "(\\PC|[\"\\\\]){0,8}", arguments), 0..3),
            prop::option::of("(\\PC|[\"\\\\]){0,8}"),
        )
    }

    proptest! {
        /// A draft's typed read is the read of its text, its value serde_json's, and its members are
    /// where the text holds them.
        #[test]
        fn a_draft_reads_as_its_text((role, content, calls, id) in owned_draft()) {
            let draft = Draft {
                role: &role,
                content: Cow::Borrowed(&content),
                tool_calls: calls
                    .iter()
                    .map(|(id, name, arguments)| DraftCall {
                        id,
                        name,
                        arguments: match arguments {
                            Ok(literal) => Arguments::Literal(literal),
                            Err(text) => Arguments::Text(text),
                        },
                    })
                    .collect(),
                tool_call_id: id.as_deref(),
            };
            let text = draft.write();
            prop_assert_eq!(draft.read(), Message::from_raw(&text).ok(), "{}", text);
            prop_assert_eq!(draft.value(), serde_json::from_str::<Value>(&text).ok(), "{}", text);
            let members: Vec<(&str, &str)> =
                draft.members(text.len()).into_iter().map(|(key, at)| (key, &text[at])).collect();
            let scanned = raw_members(&text);
            if let Some(scanned) = scanned {
                prop_assert_eq!(members, scanned, "{}", text);
            } else {
                // The scan declines deep nesting; the members still lay the text out.
                let keys: Vec<&str> = members.iter().map(|(k, _)| *k).collect();
                prop_assert_eq!(keys.first(), Some(&"role"));
            }
        }
    }

    #[test]
    fn a_draft_writes_the_neutral_message_it_stands_for() {
        let call = |id, arguments| DraftCall { id, name: "sh\"ell", arguments };
        let draft = Draft {
            role: "assistant",
            content: Cow::Borrowed(r#"[{"type":"text","text":"Looking."}]"#),
            tool_calls: vec![
                call("c1", Arguments::Text(r#"{"cmd":"ls\n"}"#)),
                call("c2", Arguments::Literal(r#""{}""#)),
            ],
            tool_call_id: None,
        };
        let text = draft.write();
        let message = Message::from_raw(&text).unwrap();
        assert_eq!(message.text(), "Looking.");
        let calls = message.tool_calls.as_ref().unwrap();
        assert_eq!(calls[0].function.as_ref().unwrap().arguments, r#"{"cmd":"ls\n"}"#);
        assert_eq!(calls[1].function.as_ref().unwrap().name, "sh\"ell");
        assert_eq!(calls[1].function.as_ref().unwrap().arguments, "{}");
        let shape = Shape::parse(&text).unwrap();
        let ids: Vec<_> = shape.tool_calls.iter().flatten().filter_map(|c| c.id.as_deref()).collect();
        assert_eq!((shape.role.as_ref(), ids.as_slice()), ("assistant", &["c1", "c2"][..]));

        let result = Draft::result("c1", r#""a\nb""#).write();
        assert_eq!(result, r#"{"role":"tool","tool_call_id":"c1","content":"a\nb"}"#);
        assert_eq!(Draft::text("user", "null").write(), r#"{"role":"user","content":null}"#);
    }
}
