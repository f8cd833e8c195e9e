//! Recent request bodies, so that a request extending one of them — an agent's next turn: the same
//! top level and history, then what came since — is split only after the conversation entries
//! they share (chat messages, Responses items, Messages or Gemini turns).
//!
//! The split of a body ([`super::Split::parse`]) validates every byte: on a warm request of a long
//! session nearly all of them were validated in the previous request. A body here is remembered
//! with its format and where its top-level keys before the conversation array and each of its
//! entries lie. A new body of the same format that starts with the same bytes up to the end of
//! one's last entry (compared byte for byte, the last bytes first so that another session's body is
//! told apart at once) is split from there; the body it extends is replaced by it. Otherwise it is
//! split after the longest run of first entries it shares with one (an agent that moves its cache
//! mark to its newest turn changes the turn that held it), which it replaces when only the last
//! two entries differ. Nothing else changes: the same slices, the same declines to
//! serde_json, the whole body still checked to be UTF-8; each format's adapter then reads the
//! entries as it reads them in any body.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

use super::{Split, Wire, WireBody, WireError};
use crate::neutral::scan::Resume;

/// Bodies remembered at most.
const MAX_BODIES: usize = 64;

/// Bytes one compares from its end before comparing all of what it shares.
const TAIL_CHECK: usize = 64;

/// Entries at the end of a remembered body a request may change and still replace it (the next
/// request of its conversation, whose agent moved a cache mark or re-rendered its last turn); a
/// body sharing less with it is split after what it shares and leaves it remembered (another
/// conversation with the same opening).
const CHANGED_TAIL: usize = 2;

/// A remembered body and where its values lie.
#[derive(Clone)]
struct Remembered {
    wire: Wire,
    body: Bytes,
    /// The top-level keys before the conversation array and their values' (start, end).
    fields: Vec<(String, (usize, usize))>,
    array_start: usize,
    /// Each entry's (start, end); not empty.
    messages: Vec<(usize, usize)>,
}

impl Remembered {
    /// Bytes of this body `bytes` must start with to share its first `n` entries: up to the end of
    /// the `n`th, and one byte more when it ends in a digit (a number could go on).
    fn shared_bytes(&self, n: usize) -> usize {
        let end = self.messages[n - 1].1;
        end + usize::from(self.body[end - 1].is_ascii_digit())
    }

    /// Whether `bytes`, a body of format `wire`, starts with this body's bytes up to the end of its
    /// last entry (see [`Remembered::shared_bytes`]).
    fn extended_by(&self, wire: Wire, bytes: &[u8]) -> bool {
        let shared = self.shared_bytes(self.messages.len());
        let tail = shared.saturating_sub(TAIL_CHECK);
        wire == self.wire
            && bytes.len() > shared
            && bytes[tail..shared] == self.body[tail..shared]
            && bytes[..tail] == self.body[..tail]
    }

    /// How many of this body's first entries `bytes`, a body of format `wire`, starts with (see
    /// [`Remembered::shared_bytes`]): an agent that moves a cache mark, or re-renders its last turn,
    /// changes only the last entries of the body it extends.
    fn entries_shared_with(&self, wire: Wire, bytes: &[u8]) -> usize {
        if wire != self.wire {
            return 0;
        }
        let common = common_prefix(bytes, &self.body);
        let fits = |n: usize| {
            let shared = self.shared_bytes(n);
            shared <= common && bytes.len() > shared
        };
        (1..=self.messages.len()).take_while(|&n| fits(n)).last().unwrap_or(0)
    }

    /// Where the split goes on after this body's first `n` entries.
    fn resume(&self, n: usize) -> Resume<'_> {
        Resume { fields: &self.fields, array_start: self.array_start, elements: &self.messages[..n] }
    }
}

/// How many bytes `a` and `b` start with alike, compared a block at a time, then in smaller
/// blocks within the first block that differs.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut at = 0;
    for block in [4096, 64, 1] {
        while at + block <= n && a[at..at + block] == b[at..at + block] {
            at += block;
        }
    }
    at
}

/// The last bodies parsed (see the module docs). Holds at most [`RecentBodies::MAX_BYTES`]
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

    /// [`super::parse_at`], where a body extending a remembered body of its format is split only
    /// after the entries they share; the body is then remembered.
    pub fn parse<'b>(&self, wire: Wire, path: &str, bytes: &'b Bytes) -> Result<Box<dyn WireBody + 'b>, WireError> {
        let extended = self.take_extended(wire, bytes);
        let resume = extended.as_ref().map(|(remembered, n)| remembered.resume(*n));
        let body = super::parse_resumed(wire, path, bytes, resume.as_ref())?;
        self.remember(wire, bytes, body.top());
        Ok(body)
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

    /// The most recent remembered body that `bytes`, of format `wire`, extends, else the one it
    /// shares the most entries with, and how many entries they share. The body is no longer
    /// remembered when `bytes` shares all of it but its last [`CHANGED_TAIL`] entries.
    fn take_extended(&self, wire: Wire, bytes: &[u8]) -> Option<(Remembered, usize)> {
        let mut bodies = self.lock();
        let (idx, n) = match bodies.iter().rposition(|r| r.extended_by(wire, bytes)) {
            Some(idx) => (idx, bodies[idx].messages.len()),
            None => bodies
                .iter()
                .enumerate()
                .map(|(idx, r)| (idx, r.entries_shared_with(wire, bytes)))
                .filter(|&(_, n)| n > 0)
                .max_by_key(|&(idx, n)| (n, idx))?,
        };
        if n + CHANGED_TAIL >= bodies[idx].messages.len() {
            Some((bodies.remove(idx)?, n))
        } else {
            Some((bodies[idx].clone(), n))
        }
    }

    fn remember(&self, wire: Wire, bytes: &Bytes, split: &Split<'_>) {
        let Some(spans) = split.spans_in(bytes) else { return };
        if spans.elements.is_empty() || bytes.len() as u64 > Self::MAX_BYTES {
            return;
        }
        let n_before = split.array_idx.min(split.fields.len());
        let fields = split.fields[..n_before].iter().zip(&spans.fields).map(|((key, _), span)| (key.clone(), *span));
        let remembered = Remembered {
            wire,
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
        let fresh = super::super::parse(Wire::Chat, &bytes);
        let parsed = recent.parse(Wire::Chat, "/v1/chat/completions", &bytes);
        match (&parsed, fresh) {
            (Ok(parsed), Ok(fresh)) => {
                let resumed = read(parsed.top());
                assert_eq!(resumed, read(fresh.top()), "{body}");
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

    /// A body that changes the last entries of a remembered one (an agent moving its cache mark)
    /// is split after the entries they share and replaces it; one that shares only the opening
    /// leaves it remembered (another conversation).
    #[test]
    fn a_changed_tail_or_a_shared_opening_is_resumed_after_what_is_shared() {
        let recent = RecentBodies::new();
        let system = r#"{"role":"system","content":"you are an agent"}"#;
        let turns = |marked: usize, n: usize| -> String {
            let turns: Vec<String> = (0..n)
                .map(|k| match k == marked {
                    true => format!(r#"{{"role":"user","content":"turn {k}","cache_control":{{"type":"ephemeral"}}}}"#),
                    false => format!(r#"{{"role":"user","content":"turn {k}"}}"#),
                })
                .collect();
            format!(r#"{{"model":"m","messages":[{system},{}]}}"#, turns.join(","))
        };
        parse_both(&recent, &turns(3, 4));
        let next = Bytes::from(turns(5, 6));
        let (remembered, n) = recent.take_extended(Wire::Chat, &next).expect("shares its first entries");
        assert_eq!((remembered.messages.len(), n), (5, 4), "the system and three unmarked turns");
        assert_eq!(recent.len(), 0, "the body it goes on from is replaced");
        recent.remember(Wire::Chat, &remembered.body, &Split::parse(&remembered.body, "messages").unwrap());
        assert_eq!(parse_both(&recent, &turns(5, 6)).0.len(), 7);
        assert_eq!(recent.len(), 1);
        // Another conversation with the same system prompt.
        let other = format!(r#"{{"model":"m","messages":[{system},{{"role":"user","content":"else"}}]}}"#);
        assert_eq!(parse_both(&recent, &other).0.len(), 2);
        assert_eq!(recent.len(), 2, "the first conversation's body stays");
        assert_eq!(
            recent.take_extended(Wire::Chat, turns(7, 8).as_bytes()).map(|(r, n)| (r.messages.len(), n)),
            Some((7, 6))
        );
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

    /// Each format's body is resumed from a remembered body of its own format only, and its adapter
    /// reads the same neutral messages as from a fresh parse.
    #[test]
    fn every_format_resumes_from_a_body_of_its_own_format() {
        let recent = RecentBodies::new();
        let turn = |n: usize| format!(r#"{{"role":"user","content":"turn {n}"}}"#);
        type Body = fn(&str) -> String;
        let bodies: [(Wire, &str, Body); 3] = [
            (Wire::Responses, "/v1/responses", |items| format!(r#"{{"model":"m","input":[{items}],"stream":true}}"#)),
            (Wire::Messages, "/v1/messages", |turns| format!(r#"{{"model":"m","messages":[{turns}],"max_tokens":9}}"#)),
            (Wire::Gemini, "/v1beta/models/m:streamGenerateContent", |turns| {
                format!(
                    r#"{{"contents":[{}]}}"#,
                    turns.replace("\"content\":", "\"parts\":[{\"text\":").replace("\"}", "\"}]}")
                )
            }),
        ];
        for (wire, path, body) in bodies {
            for n in 1..=3 {
                let turns: Vec<String> = (0..n).map(turn).collect();
                let bytes = Bytes::from(body(&turns.join(",")));
                let fresh = super::super::parse_at(wire, path, &bytes).unwrap();
                let before = recent.len();
                let parsed = recent.parse(wire, path, &bytes).unwrap();
                assert_eq!(parsed.messages(), fresh.messages(), "{wire:?} {n}");
                assert_eq!(parsed.top().spans_in(&bytes), fresh.top().spans_in(&bytes));
                // The first body of a format is new; each next one replaces the body it extends.
                assert_eq!(recent.len(), if n == 1 { before + 1 } else { before }, "{wire:?} {n}");
            }
        }
        // A chat body with the bytes of a remembered Messages body is no extension of it.
        let turns: Vec<String> = (0..4).map(turn).collect();
        let messages = Bytes::from(format!(r#"{{"model":"m","messages":[{}],"max_tokens":9}}"#, turns.join(",")));
        assert!(recent.take_extended(Wire::Chat, &messages).is_none());
        assert!(recent.take_extended(Wire::Messages, &messages).is_some());
    }

    #[test]
    fn the_common_prefix_is_found_across_block_sizes() {
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for at in [0, 1, 63, 64, 65, 4095, 4096, 4097, 9_999] {
            let mut b = a.clone();
            b[at] ^= 1;
            assert_eq!(common_prefix(&a, &b), at);
        }
        assert_eq!(common_prefix(&a, &a[..5_000]), 5_000);
        assert_eq!(common_prefix(&a, &a), a.len());
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
