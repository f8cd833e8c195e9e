//! The invariant every adapter's fuzz target checks of a body's neutral view.

use pare::neutral::{Message, raw_members};
use pare::wire::WireBody;
use serde_json::Value;
use serde_json::value::RawValue;

/// Each of `messages`, the neutral view of the body `data`, is a message object, or an opaque
/// entry: an array of the body's own entries, as sent.
pub fn assert_messages_or_parts_as_sent(data: &[u8], messages: &[&str]) {
    let sent = String::from_utf8_lossy(data);
    for m in messages {
        if pare::neutral::is_opaque(m) {
            let parts: Vec<&RawValue> = serde_json::from_str(m).expect("an opaque entry is an array");
            assert!(parts.iter().all(|p| sent.contains(p.get())), "an opaque entry carries what was not sent: {m}");
        } else {
            assert!(serde_json::from_str::<serde_json::Map<String, Value>>(m).is_ok(), "neutral message is not an object: {m}");
        }
    }
}

/// Each neutral entry the adapter types is typed as reading its text would type it, with its members
/// where the text holds them.
pub fn assert_typed_as_read(body: &dyn WireBody, messages: &[&str]) {
    for (i, text) in messages.iter().enumerate() {
        let Some((message, members)) = body.typed(i) else { continue };
        let (read, read_members) = Message::read(text);
        assert_eq!(message, read.ok(), "entry {i} typed otherwise than its text reads: {text}");
        if let (Some(members), Some(expected)) = (members, read_members.or_else(|| raw_members(text))) {
            let members: Vec<(&str, &str)> = members.into_iter().map(|(k, at)| (k, &text[at])).collect();
            assert_eq!(members, expected, "entry {i}'s members are not where its text holds them: {text}");
        }
    }
}
