//! A neutral message as a wire adapter reads it from its body: typed (a role, the content's JSON,
//! calls paired by id, the id a result answers), written once into the neutral form's text by the
//! one writer every adapter shares ([`Draft::write`]).

use std::borrow::Cow;

use super::push_json_string;

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
    use super::*;
    use crate::neutral::{Message, Shape};

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
