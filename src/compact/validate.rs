//! Invariant 1 of MISSION.md: every assistant `tool_calls[].id` is answered by a `role: tool`
//! message before the next non-tool message, no tool message answers a call that is not open, and
//! parallel calls are answered all-or-none. Checked on the input (an invalid input is forwarded
//! unchanged: pare does not repair what it did not break) and on every output.
//!
//! This is pare's one pairing validator: every wire format checks the pairing of its neutral view
//! here (`WireBody::check` and the adapters' writers), and adds only the rules of its own that the
//! neutral form cannot express.

/// The part of a message invariant 1 is about: its [`crate::neutral::Shape`]'s role, call ids
/// (an absent id is `""`) and result id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skeleton {
    pub role: String,
    pub tool_calls: Vec<String>,
    pub tool_call_id: Option<String>,
}

impl Skeleton {
    /// The skeleton of a raw message; a message with no [`crate::neutral::Shape`] has none, an
    /// [`crate::neutral::opaque`] entry the [`Skeleton::opaque`] one.
    pub fn of(raw: &str) -> Option<Skeleton> {
        if crate::neutral::is_opaque(raw) {
            return Some(Skeleton::opaque());
        }
        crate::neutral::shape::read(raw, |shape| Skeleton {
            role: shape.role.to_string(),
            tool_calls: shape.tool_calls.iter().flatten().map(|c| c.id.as_deref().unwrap_or("").to_owned()).collect(),
            tool_call_id: shape.tool_call_id.as_deref().map(str::to_owned),
        })
    }

    /// The skeleton of an [`crate::neutral::opaque`] entry: no role, no call, no result. It
    /// pairs with nothing, so it closes a run of results like any message that is not one.
    pub fn opaque() -> Skeleton {
        Skeleton::default()
    }
}

/// Why a `messages` array breaks invariant 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("message {idx} is not a chat message object")]
    NotAMessage { idx: usize },
    #[error("assistant message {idx} has a tool call without an id")]
    EmptyCallId { idx: usize },
    #[error("assistant message {idx} repeats tool call id `{id}`")]
    DuplicateCallId { idx: usize, id: String },
    #[error("tool message {idx} answers `{id}`, which is not an open call")]
    OrphanResult { idx: usize, id: String },
    #[error("tool call `{id}` of assistant message {call_idx} has no answer before message {idx}")]
    Unanswered { call_idx: usize, id: String, idx: usize },
}

impl Violation {
    /// Index of the offending message: the call left unanswered, else the message that breaks the
    /// rule.
    pub fn message_idx(&self) -> usize {
        match self {
            Violation::NotAMessage { idx }
            | Violation::EmptyCallId { idx }
            | Violation::DuplicateCallId { idx, .. }
            | Violation::OrphanResult { idx, .. } => *idx,
            Violation::Unanswered { call_idx, .. } => *call_idx,
        }
    }
}

/// Check invariant 1 over a sequence of skeletons (`None` = not a message object).
pub fn check(messages: &[Option<Skeleton>]) -> Result<(), Violation> {
    let mut open: Vec<&str> = Vec::new();
    let mut open_from = 0;
    for (idx, m) in messages.iter().enumerate() {
        let m = m.as_ref().ok_or(Violation::NotAMessage { idx })?;
        if m.role == "tool" {
            let id = m.tool_call_id.as_deref().unwrap_or("");
            match open.iter().position(|o| *o == id) {
                Some(pos) => {
                    open.swap_remove(pos);
                }
                None => {
                    return Err(Violation::OrphanResult { idx, id: id.to_owned() });
                }
            }
            continue;
        }
        if let Some(id) = open.first() {
            return Err(Violation::Unanswered { call_idx: open_from, id: (*id).to_owned(), idx });
        }
        if m.role == "assistant" && !m.tool_calls.is_empty() {
            for (j, id) in m.tool_calls.iter().enumerate() {
                if id.is_empty() {
                    return Err(Violation::EmptyCallId { idx });
                }
                if m.tool_calls[..j].contains(id) {
                    return Err(Violation::DuplicateCallId { idx, id: id.clone() });
                }
            }
            open = m.tool_calls.iter().map(String::as_str).collect();
            open_from = idx;
        }
    }
    if let Some(id) = open.first() {
        return Err(Violation::Unanswered { call_idx: open_from, id: (*id).to_owned(), idx: messages.len() });
    }
    Ok(())
}

/// [`check`] over neutral messages as JSON text: the Chat Completions pairing rules, which every
/// wire format's neutral view must satisfy too.
pub fn check_messages<M: AsRef<str>>(messages: &[M]) -> Result<(), Violation> {
    let skeletons: Vec<Option<Skeleton>> = messages.iter().map(|m| Skeleton::of(m.as_ref())).collect();
    check(&skeletons)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skel(list: &[&str]) -> Vec<Option<Skeleton>> {
        list.iter().map(|s| Skeleton::of(s)).collect()
    }

    const CALL2: &str = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}},{"id":"b","function":{"name":"g","arguments":"{}"}}]}"#;
    const RES_A: &str = r#"{"role":"tool","tool_call_id":"a","content":"x"}"#;
    const RES_B: &str = r#"{"role":"tool","tool_call_id":"b","content":"y"}"#;
    const USER: &str = r#"{"role":"user","content":"hi"}"#;

    #[test]
    fn parallel_calls_answered_in_any_order_are_valid() {
        assert_eq!(check(&skel(&[USER, CALL2, RES_B, RES_A, USER])), Ok(()));
    }

    #[test]
    fn partial_answer_is_refused() {
        assert!(matches!(check(&skel(&[USER, CALL2, RES_A, USER])), Err(Violation::Unanswered { call_idx: 1, .. })));
        assert!(matches!(check(&skel(&[USER, CALL2, RES_A])), Err(Violation::Unanswered { .. })));
    }

    #[test]
    fn orphan_and_duplicate_results_are_refused() {
        assert!(matches!(check(&skel(&[USER, RES_A])), Err(Violation::OrphanResult { idx: 1, .. })));
        assert!(matches!(check(&skel(&[CALL2, RES_A, RES_A, RES_B])), Err(Violation::OrphanResult { idx: 2, .. })));
        assert!(matches!(check(&skel(&[USER, "42"])), Err(Violation::NotAMessage { idx: 1 })));
    }

    #[test]
    fn an_empty_or_repeated_call_id_is_refused() {
        let nameless = r#"{"role":"assistant","tool_calls":[{"id":"","function":{"name":"f","arguments":"{}"}}]}"#;
        assert_eq!(check(&skel(&[USER, nameless])), Err(Violation::EmptyCallId { idx: 1 }));
        let twice = r#"{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}},{"id":"a","function":{"name":"f","arguments":"{}"}}]}"#;
        assert_eq!(check(&skel(&[USER, twice, RES_A])), Err(Violation::DuplicateCallId { idx: 1, id: "a".into() }));
        // An id answered may open again.
        assert_eq!(check(&skel(&[CALL2, RES_A, RES_B, USER, CALL2, RES_A, RES_B])), Ok(()));
    }

    #[test]
    fn the_offending_message_of_an_unanswered_call_is_the_call() {
        let violation = check(&skel(&[USER, CALL2, RES_A, USER])).unwrap_err();
        assert_eq!(violation, Violation::Unanswered { call_idx: 1, id: "b".into(), idx: 3 });
        assert_eq!(violation.message_idx(), 1);
        assert_eq!(check(&skel(&[USER, RES_A])).unwrap_err().message_idx(), 1);
    }
}
