//! Recent chat bodies, so that a request extending one of them — an agent's next turn: the same
//! top level and history, then what came since — is scanned only after the messages they share.
//!
//! The scan of a body ([`ChatBody::parse`]) validates every byte: on a warm request of a long
//! session nearly all of them were validated in the previous request. A body here is remembered
//! with where its top-level keys before `messages` and each of its messages lie. A new body that
//! starts with the same bytes up to the end of one's last message (compared byte for byte, the
//! last bytes first so that another session's body is told apart at once) is scanned from there;
//! the body it extends is replaced by it. Nothing else changes: the same slices, the same
//! declines to serde_json, the whole body still checked to be UTF-8.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

use super::{ChatBody, Wire, WireBody, WireError};
use crate::neutral::scan::Resume;

/// Bodies remembered at most.
const MAX_BODIES: usize = 64;

/// Bytes one compares from its end before comparing all of what it shares.
const TAIL_CHECK: usize = 64;

/// A remembered body and where its values lie.
struct Remembered {
    body: Bytes,
    /// The top-level keys before `messages` and their values' (start, end).
    fields: Vec<(String, (usize, usize))>,
    array_start: usize,
    /// Each message's (start, end); not empty.
    messages: Vec<(usize, usize)>,
}

impl Remembered {
    /// Whether `bytes` starts with this body's bytes up to the end of its last message, and one byte
    /// more when that message ends in a digit (a number could go on).
    fn extended_by(&self, bytes: &[u8]) -> bool {
        let end = self.messages.last().map_or(0, |m| m.1);
        let shared = end + usize::from(self.body[end - 1].is_ascii_digit());
        let tail = shared.saturating_sub(TAIL_CHECK);
        bytes.len() > shared && bytes[tail..shared] == self.body[tail..shared] && bytes[..tail] == self.body[..tail]
    }

    fn resume(&self) -> Resume<'_> {
        Resume { fields: &self.fields, array_start: self.array_start, elements: &self.messages }
    }
}

/// The last chat bodies parsed (see the module docs). Holds at most [`RecentBodies::MAX_BYTES`]
/// of bodies (which are the requests' own buffers, shared with the archive's queue), and at most 64.
pub struct RecentBodies {
    bodies: Mutex<VecDeque<Remembered>>,
}

impl Default for RecentBodies {
    fn default() -> Self {
        RecentBodies::new()
    }
}

impl RecentBodies {
    /// Bytes of bodies held at most.
    pub const MAX_BYTES: u64 = 16 * 1024 * 1024;

    pub fn new() -> RecentBodies {
        RecentBodies { bodies: Mutex::new(VecDeque::new()) }
    }

    /// [`super::parse`], where a chat body extending a remembered body is scanned only after the
    /// messages they share; a chat body is then remembered.
    pub fn parse<'b>(&self, wire: Wire, bytes: &'b Bytes) -> Result<Box<dyn WireBody + 'b>, WireError> {
        if wire != Wire::Chat {
            return super::parse(wire, bytes);
        }
        let extended = self.take_extended(bytes);
        let body = ChatBody::parse_resumed(bytes, extended.as_ref().map(Remembered::resume).as_ref())?;
        self.remember(bytes, &body);
        Ok(Box::new(body))
    }

    /// Bodies remembered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no body is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Remembered>> {
        self.bodies.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most recent remembered body that `bytes` extends, no longer remembered.
    fn take_extended(&self, bytes: &[u8]) -> Option<Remembered> {
        let mut bodies = self.lock();
        let idx = bodies.iter().rposition(|r| r.extended_by(bytes))?;
        bodies.remove(idx)
    }

    fn remember(&self, bytes: &Bytes, body: &ChatBody<'_>) {
        let split = &body.split;
        let Some(spans) = split.spans_in(bytes) else { return };
        if spans.elements.is_empty() || bytes.len() as u64 > Self::MAX_BYTES {
            return;
        }
        let n_before = split.array_idx.min(split.fields.len());
        let fields = split.fields[..n_before].iter().zip(&spans.fields).map(|((key, _), span)| (key.clone(), *span));
        let remembered = Remembered {
            body: bytes.clone(),
            fields: fields.collect(),
            array_start: spans.array.0,
            messages: spans.elements,
        };
        let mut bodies = self.lock();
        bodies.push_back(remembered);
        let mut held: u64 = bodies.iter().map(|r| r.body.len() as u64).sum();
        while bodies.len() > MAX_BODIES || held > Self::MAX_BYTES {
            let Some(oldest) = bodies.pop_front() else { break };
            held -= oldest.body.len() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Split;

    /// Messages and top-level fields of `body` read through `recent`, checked equal to a fresh
    /// parse's (and the same spans); empty when both refuse it.
    fn parse_both(recent: &RecentBodies, body: &str) -> (Vec<String>, Vec<(String, String)>) {
        let bytes = Bytes::from(body.to_owned());
        let read = |top: &Split<'_>| {
            let fields: Vec<(String, String)> =
                top.fields.iter().map(|(k, v)| (k.clone(), v.get().to_owned())).collect();
            let messages: Vec<String> = top.elements.iter().map(|m| (*m).to_owned()).collect();
            (messages, fields, top.array_idx, top.spans_in(&bytes))
        };
        let fresh = ChatBody::parse(&bytes);
        let parsed = recent.parse(Wire::Chat, &bytes);
        match (&parsed, fresh) {
            (Ok(parsed), Ok(fresh)) => {
                let resumed = read(parsed.top());
                assert_eq!(resumed, read(&fresh.split), "{body}");
                (resumed.0, resumed.1)
            }
            (Err(_), Err(_)) => (Vec::new(), Vec::new()),
            _ => panic!("the two parses disagree on {body}"),
        }
    }

    /// A body that extends a remembered one reads exactly as a fresh parse reads it, and replaces it;
    /// one that does not (another session, an edited history, invalid JSON after the shared part)
    /// is read as a fresh parse reads it too.
    #[test]
    fn a_resumed_scan_reads_what_a_fresh_one_reads() {
        let recent = RecentBodies::new();
        let system = r#"{"role":"system","content":"you are an agent"}"#;
        let first = format!(r#"{{"model":"m","messages":[{system},{{"role":"user","content":"go"}}],"tools":[]}}"#);
        parse_both(&recent, &first);
        assert_eq!(recent.len(), 1);
        let bodies = [
            // The next turn: the same bytes up to the last message, then more.
            format!(
                r#"{{"model":"m","messages":[{system},{{"role":"user","content":"go"}} , {{"role":"assistant","content":"ok"}}],"tools":[],"n":1}}"#
            ),
            // The next one, the array closing right after the shared part.
            format!(
                r#"{{"model":"m","messages":[{system},{{"role":"user","content":"go"}} , {{"role":"assistant","content":"ok"}}]}}"#
            ),
            // A repeated key after the shared part: declined to serde_json, last value wins.
            format!(
                r#"{{"model":"m","messages":[{system},{{"role":"user","content":"go"}} , {{"role":"assistant","content":"ok"}}],"model":"x"}}"#
            ),
            // Invalid after the shared part.
            format!(
                r#"{{"model":"m","messages":[{system},{{"role":"user","content":"go"}} , {{"role":"assistant","content":"ok"}},]}}"#
            ),
            // An edited history.
            format!(r#"{{"model":"m","messages":[{system},{{"role":"user","content":"stop"}}]}}"#),
        ];
        parse_both(&recent, &bodies[0]);
        assert_eq!(recent.len(), 1, "the body it extends is replaced");
        let read: Vec<usize> = bodies.iter().map(|body| parse_both(&recent, body).0.len()).collect();
        assert_eq!(read, vec![3, 3, 3, 0, 2]);
        let (messages, fields) = parse_both(&recent, &bodies[2]);
        assert_eq!(messages.len(), 3);
        assert_eq!(fields, vec![("model".to_owned(), r#""x""#.to_owned())]);
    }

    /// A body whose shared part ends inside a number is not resumed at that number's end.
    #[test]
    fn a_number_that_goes_on_is_scanned_again() {
        let recent = RecentBodies::new();
        parse_both(&recent, r#"{"messages":[{"role":"user"},1]}"#);
        let (messages, _) = parse_both(&recent, r#"{"messages":[{"role":"user"},12]}"#);
        assert_eq!(messages, vec![r#"{"role":"user"}"#.to_owned(), "12".to_owned()]);
        let (messages, _) = parse_both(&recent, r#"{"messages":[{"role":"user"},12,3]}"#);
        assert_eq!(messages.len(), 3);
    }

    #[test]
    fn at_most_64_bodies_are_remembered() {
        let recent = RecentBodies::new();
        for n in 0..100 {
            parse_both(&recent, &format!(r#"{{"messages":[{{"role":"user","content":"{n}"}}]}}"#));
        }
        assert_eq!(recent.len(), MAX_BODIES);
    }
}
