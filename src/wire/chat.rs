//! The Chat Completions adapter: a body split around `messages`, whose elements are already pare's
//! neutral messages, so the adapter copies and converts nothing.

use super::{Forward, Invalid, Spans, Split, Wire, WireBody, WireError};
use crate::neutral::scan;

/// A Chat Completions request body: its [`Split`] around `messages`. The chat messages are the
/// split's elements, as sent ([`ChatBody::messages`]).
#[derive(Debug)]
pub struct ChatBody<'a> {
    /// The body split around `messages`.
    pub split: Split<'a>,
}

impl<'a> ChatBody<'a> {
    /// Read a Chat Completions body: [`Split::parse`] around `messages` (the whole body checked to be
    /// valid JSON, no value built inside a message; a `messages` that is not an array is refused).
    pub fn parse(bytes: &'a [u8]) -> Result<ChatBody<'a>, WireError> {
        Self::parse_resumed(bytes, None)
    }

    /// [`ChatBody::parse`] whose scan starts again after `resume` (see [`scan::split_resumed`] for
    /// what the caller vouches for).
    pub(crate) fn parse_resumed(bytes: &'a [u8], resume: Option<&scan::Resume<'_>>) -> Result<ChatBody<'a>, WireError> {
        Ok(ChatBody { split: Split::parse_resumed(bytes, "messages", resume)? })
    }

    /// The chat messages, one per entry as its original JSON text, in order: the neutral messages.
    pub fn messages(&self) -> &[&'a str] {
        &self.split.elements
    }

    /// The request as the engine reads it: its messages are already the neutral form.
    pub fn view(&self) -> crate::neutral::View<'_> {
        crate::neutral::View::of_texts(&self.split.elements, WireBody::tools(self))
    }

    /// The body written with `messages` in place of its own; every other key keeps its position and
    /// bytes.
    pub fn to_vec_with_messages<M: AsRef<str>>(&self, messages: &[M]) -> Vec<u8> {
        self.split.to_vec_and_spans(messages).0
    }
}

impl WireBody for ChatBody<'_> {
    fn wire(&self) -> Wire {
        Wire::Chat
    }
    fn messages(&self) -> Vec<&str> {
        self.split.elements.clone()
    }
    fn top(&self) -> &Split<'_> {
        &self.split
    }
    fn output_limit(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|key| self.split.field(key).and_then(|v| serde_json::from_str::<u64>(v.get()).ok()))
    }
    fn write(&self, forwarded: &[Forward<'_>]) -> Result<(Vec<u8>, Spans), WireError> {
        let elements = &self.split.elements;
        let mut messages: Vec<&str> = Vec::with_capacity(forwarded.len());
        for entry in forwarded {
            messages.push(entry.text(elements).ok_or_else(|| {
                WireError::Unwritable(format!("a forwarded message stands for none of the request's: {entry:?}"))
            })?);
        }
        Ok(self.split.to_vec_and_spans(&messages))
    }
    fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        self.split.spans_in(body)
    }
    fn check(&self) -> Result<(), Invalid> {
        crate::compact::validate::check_messages(&self.split.elements)
            .map_err(|violation| Invalid::Pairing { violation, origin: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::validate::Violation;

    #[test]
    fn the_messages_are_the_elements_of_messages_and_write_back_as_sent() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}, 7],"max_tokens":12}"#;
        let parsed = ChatBody::parse(body).unwrap();
        assert_eq!(parsed.messages(), [r#"{"role":"user","content":"hi"}"#, "7"]);
        assert_eq!(WireBody::messages(&parsed), parsed.messages());
        assert_eq!(parsed.output_limit(), Some(12));
        assert_eq!(parsed.model().as_deref(), Some("m"));
        let one = [r#"{"role":"user","content":"hi"}"#];
        let written = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":12}"#;
        assert_eq!(parsed.to_vec_with_messages(&one), written.to_vec());
        assert_eq!(parsed.write(&Forward::unchanged(1)).unwrap().0, written.to_vec());
        // A body keyed on another array is not a chat body.
        assert!(matches!(ChatBody::parse(br#"{"input":[]}"#), Err(WireError::NoArray("messages"))));
    }

    #[test]
    fn a_chat_body_forwards_kept_messages_as_sent_and_written_ones_as_their_text() {
        let body =
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"a","content":"long"}]}"#;
        let parsed = ChatBody::parse(body).unwrap();
        let written = [
            r#"{"role":"assistant","content":"[pare: marker]"}"#,
            r#"{"role":"tool","tool_call_id":"a","content":"x"}"#,
        ];
        let reads = crate::wire::WrittenReads::new(written.len());
        let entries = [
            Forward::Kept(0),
            Forward::New(reads.written(0, written[0])),
            Forward::Rewritten(1, reads.written(1, written[1])),
        ];
        let out = parsed.write(&entries).unwrap().0;
        let want = format!(r#"{{"messages":[{{"role":"user","content":"hi"}},{},{}]}}"#, written[0], written[1]);
        assert_eq!(String::from_utf8(out).unwrap(), want);
        assert!(matches!(parsed.write(&[Forward::Kept(2)]), Err(WireError::Unwritable(_))));
    }

    #[test]
    fn a_chat_body_checks_its_messages_with_the_pairing_validator() {
        let valid = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
        assert_eq!(ChatBody::parse(valid).unwrap().check(), Ok(()));
        let orphan =
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
        let violation = Violation::OrphanResult { idx: 1, id: "a".into() };
        let refused = ChatBody::parse(orphan).unwrap().check().unwrap_err();
        // The messages are the neutral ones: the violation says where, no origin is added.
        assert_eq!(refused.to_string(), violation.to_string());
        assert_eq!(refused, Invalid::Pairing { violation, origin: None });
    }
}
