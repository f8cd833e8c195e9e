//! The edits rules make to the messages before the boundary, and turning them into forwarded
//! message bytes. A message no rule touched is forwarded as its original bytes; an edited one is
//! re-serialized from its original JSON object with only the edited keys changed, so key order and
//! unknown keys survive.

use std::borrow::Cow;

use serde_json::Value;
use serde_json::value::RawValue;

use super::conversation::Conversation;
use super::markers::is_compacted;
use super::report::RuleId;
use crate::neutral::{Content, push_json_string, raw_members};

/// New text for a message's content.
#[derive(Debug, Clone)]
pub struct TextEdit {
    pub text: String,
    /// Put the text back into the result's original shape (e.g. Hermes' `{"output": …}`); when false
    /// the text replaces the whole content.
    pub embed: bool,
}

/// Content part types that carry reasoning.
pub const THINKING_PARTS: &[&str] = &["thinking", "redacted_thinking", "reasoning"];

/// All edits of one compaction.
#[derive(Debug, Clone)]
pub struct Edits {
    pub text: Vec<Option<TextEdit>>,
    /// Keys removed from the message (reasoning).
    pub removed: Vec<Vec<&'static str>>,
    /// Drop content parts of the [`THINKING_PARTS`] types.
    pub drop_thinking_parts: Vec<bool>,
    /// New JSON of an assistant message's `tool_calls` (arguments rule): same calls, shorter arguments.
    pub tool_calls: Vec<Option<String>>,
    pub dropped: Vec<bool>,
    /// A rule replaced the result by a marker: later rules leave it alone.
    pub claimed: Vec<bool>,
    /// A user rule said `keep`: no rule and no tier touches it.
    pub kept: Vec<bool>,
    /// The message already carries a pare marker (an earlier compaction): nothing touches it.
    pub compacted: Vec<bool>,
    /// The structural map a salience tier forwards in place of a read the rules leave whole (the
    /// latest full read of a file the conversation edits): the Focus tier keeps the read, every
    /// other tier forwards this map.
    pub deferred_map: Vec<Option<String>>,
    /// Relevance kept lines of this output under its marker (`compact::relevance`): salience ranks
    /// its group as one the current work names.
    pub relevant: Vec<bool>,
    /// Per message, the characters each rule removed (for the report).
    pub savings: Vec<Vec<(RuleId, i64)>>,
    /// Per message, tokens saved (raw count minus forwarded count), once rendered.
    pub tokens_saved: Vec<i64>,
}

impl Edits {
    pub fn new(conv: &Conversation<'_>) -> Edits {
        let n = conv.boundary;
        let compacted = (0..n)
            .map(|i| match (&conv.outcomes[i], &conv.msgs[i]) {
                (Some(o), _) => o.marker,
                (None, Some(m)) => m.role != "user" && is_compacted(&m.text()),
                (None, None) => false,
            })
            .collect();
        Edits {
            text: vec![None; n],
            removed: vec![Vec::new(); n],
            drop_thinking_parts: vec![false; n],
            tool_calls: vec![None; n],
            dropped: vec![false; n],
            claimed: vec![false; n],
            kept: vec![false; n],
            compacted,
            deferred_map: vec![None; n],
            relevant: vec![false; n],
            savings: vec![Vec::new(); n],
            tokens_saved: vec![0; n],
        }
    }

    /// Whether rules may still change message `idx`.
    pub fn open(&self, idx: usize) -> bool {
        !self.kept[idx] && !self.claimed[idx] && !self.compacted[idx] && !self.dropped[idx]
    }

    /// The text rules currently see for message `idx`: a tool result's inner text, else the content text.
    pub fn current_text(&self, conv: &Conversation<'_>, idx: usize) -> String {
        if let Some(edit) = &self.text[idx] {
            return edit.text.clone();
        }
        match (&conv.outcomes[idx], &conv.msgs[idx]) {
            (Some(o), _) => o.text.clone(),
            (None, Some(m)) => m.text(),
            _ => String::new(),
        }
    }

    /// Length in chars of [`Edits::current_text`], without copying.
    pub fn current_chars(&self, conv: &Conversation<'_>, idx: usize) -> usize {
        if let Some(edit) = &self.text[idx] {
            return edit.text.chars().count();
        }
        match (&conv.outcomes[idx], &conv.msgs[idx]) {
            (Some(_), _) => conv.text_chars(idx),
            (None, Some(m)) => m.text().chars().count(),
            _ => 0,
        }
    }

    /// Replace the text of message `idx` on behalf of `rule`.
    pub fn set_text(&mut self, conv: &Conversation<'_>, idx: usize, rule: RuleId, text: String, embed: bool) {
        let before = self.current_chars(conv, idx) as i64;
        let after = text.chars().count() as i64;
        // A result already re-embedded stays embedded: the shape is a property of the message.
        let embed = embed && self.text[idx].as_ref().is_none_or(|e| e.embed);
        self.text[idx] = Some(TextEdit { text, embed });
        self.savings[idx].push((rule, before - after));
    }

    /// Leave tool result `idx` whole for the salience tiers, which forward `map` in its place below
    /// the Focus tier (no later rule touches it).
    pub fn defer_map(&mut self, idx: usize, map: String) {
        self.deferred_map[idx] = Some(map);
        self.claimed[idx] = true;
    }

    /// Replace a tool result (or a later system message) by a marker line (no later rule touches it).
    pub fn set_marker(&mut self, conv: &Conversation<'_>, idx: usize, rule: RuleId, marker: String) {
        self.set_text(conv, idx, rule, marker, false);
        self.claimed[idx] = true;
    }

    /// [`Edits::set_marker`] for a marker whose reason lies in other messages (an identical later
    /// output, a later retry, a loop of calls), set only when it surely saves: its JSON text at least
    /// `MARKER_MARGIN` bytes shorter than the text it replaces. Otherwise nothing changes and the
    /// message stays open to the later rules. A claim that the final count reverts for saving nothing
    /// would keep the message whole; compacting the output again — where that reason may be gone (the
    /// later duplicate collapsed, the retry's arguments shortened) — would then let another rule change
    /// it, and compaction would not be idempotent.
    pub fn set_marker_if_saving(&mut self, conv: &Conversation<'_>, idx: usize, rule: RuleId, marker: String) {
        if json_len(&marker) + MARKER_MARGIN <= self.current_bytes(conv, idx) {
            self.set_marker(conv, idx, rule, marker);
        }
    }

    /// Length in bytes of [`Edits::current_text`], without copying a tool result's text (what replacing
    /// it removes from the message's JSON is at least this: escapes and a JSON result's other members
    /// only add to it).
    fn current_bytes(&self, conv: &Conversation<'_>, idx: usize) -> usize {
        match (&self.text[idx], &conv.outcomes[idx]) {
            (Some(edit), _) => edit.text.len(),
            (None, Some(o)) => o.text.len(),
            (None, None) => conv.msgs[idx].as_ref().map_or(0, |m| m.text().len()),
        }
    }

    /// Append `lines` (an excerpt kept by relevance) under the marker a rule set for message `idx`:
    /// what they cost is counted against `RuleId::Relevance`.
    pub fn append_kept_lines(&mut self, idx: usize, lines: &str) {
        if let Some(edit) = self.text[idx].as_mut() {
            edit.text.push('\n');
            edit.text.push_str(lines);
            self.savings[idx].push((RuleId::Relevance, -(lines.chars().count() as i64 + 1)));
            self.relevant[idx] = true;
        }
    }

    pub fn drop_message(&mut self, conv: &Conversation<'_>, idx: usize, rule: RuleId) {
        self.dropped[idx] = true;
        self.savings[idx].push((rule, conv.raw[idx].len() as i64));
    }

    pub fn changed(&self, idx: usize) -> bool {
        self.text[idx].is_some()
            || !self.removed[idx].is_empty()
            || self.drop_thinking_parts[idx]
            || self.tool_calls[idx].is_some()
    }

    /// Undo every edit of message `idx` (used when an edit would not save tokens).
    pub fn revert(&mut self, idx: usize) {
        self.text[idx] = None;
        self.relevant[idx] = false;
        self.removed[idx].clear();
        self.drop_thinking_parts[idx] = false;
        self.tool_calls[idx] = None;
        self.dropped[idx] = false;
        self.claimed[idx] = false;
        self.savings[idx].clear();
        self.tokens_saved[idx] = 0;
    }

    /// The forwarded JSON of message `idx`: the original bytes when unchanged.
    pub fn render(&self, conv: &Conversation<'_>, idx: usize) -> String {
        self.render_as(conv, idx, self.text[idx].as_ref())
    }

    /// The forwarded JSON of message `idx` if its text were `text` (used to price tier forms). The
    /// message is read shallowly: every key it does not change keeps its original bytes and order.
    pub fn render_as(&self, conv: &Conversation<'_>, idx: usize, text: Option<&TextEdit>) -> String {
        let raw = conv.raw[idx];
        if text.is_none()
            && self.removed[idx].is_empty()
            && !self.drop_thinking_parts[idx]
            && self.tool_calls[idx].is_none()
        {
            return raw.to_owned();
        }
        // The members the message's read found, else a scan for them, else serde_json's map.
        let members = conv.members[idx].as_deref().map(Cow::Borrowed).or_else(|| raw_members(raw).map(Cow::Owned));
        let object: Vec<(Cow<'_, str>, &str)> = match members {
            Some(entries) => entries.iter().map(|&(k, v)| (Cow::Borrowed(k), v)).collect(),
            None => match serde_json::from_str::<indexmap::IndexMap<String, &RawValue>>(raw) {
                Ok(map) => map.into_iter().map(|(k, v)| (Cow::Owned(k), v.get())).collect(),
                Err(_) => return raw.to_owned(),
            },
        };
        let original = conv.msgs[idx].as_ref().and_then(|m| m.content.as_ref());
        let content: Option<String> = match text {
            Some(edit) => {
                let text = match (&conv.outcomes[idx], edit.embed) {
                    (Some(o), true) => {
                        let before = conv.msgs[idx].as_ref().map(|m| m.text()).unwrap_or_default();
                        o.shape.embed(&before, &edit.text)
                    }
                    _ => edit.text.clone(),
                };
                Some(content_with_text(original, &text))
            }
            None if self.drop_thinking_parts[idx] => object.iter().find(|(k, _)| k == "content").and_then(|(_, c)| {
                let mut parts: Vec<Value> = serde_json::from_str(c).ok()?;
                parts.retain(|p| !p.get("type").and_then(Value::as_str).is_some_and(|t| THINKING_PARTS.contains(&t)));
                Some(Value::Array(parts).to_string())
            }),
            None => None,
        };
        let mut out = String::with_capacity(raw.len().min(4096) + content.as_ref().map_or(0, String::len));
        out.push('{');
        let mut first = true;
        let mut push = |out: &mut String, key: &str, value: &str| {
            if !first {
                out.push(',');
            }
            first = false;
            push_json_string(out, key);
            out.push(':');
            out.push_str(value);
        };
        let mut wrote_content = false;
        for (key, value) in &object {
            if self.removed[idx].contains(&key.as_ref()) {
                continue;
            }
            match (&content, key.as_ref(), &self.tool_calls[idx]) {
                (Some(c), "content", _) => {
                    push(&mut out, key, c);
                    wrote_content = true;
                }
                (_, "tool_calls", Some(calls)) => push(&mut out, key, calls),
                _ => push(&mut out, key, value),
            }
        }
        if let (Some(c), false) = (&content, wrote_content) {
            push(&mut out, "content", c);
        }
        out.push('}');
        out
    }
}

/// The JSON of a content holding `text`, in the original's form: a string stays a string; an array
/// of parts becomes one text part that keeps the first text part's other keys (e.g.
/// `cache_control`). Written as serde_json writes the same value, without building it.
pub fn content_with_text(original: Option<&Content>, text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 32);
    match original {
        Some(Content::Parts(parts)) => {
            out.push_str(r#"[{"type":"text","text":"#);
            push_json_string(&mut out, text);
            // The typed `type` and `text` are never among a part's other keys.
            if let Some(first) = parts.iter().find(|p| p.kind.as_deref() == Some("text")) {
                for (key, value) in &first.extra {
                    out.push(',');
                    push_json_string(&mut out, key);
                    out.push(':');
                    out.push_str(&value.to_string());
                }
            }
            out.push_str("}]");
        }
        _ => push_json_string(&mut out, text),
    }
    out
}

/// How much shorter than the text it replaces a marker's JSON must be to be set: four bytes are one
/// token to the bytes/4 estimate, so a marker that passes always saves there.
const MARKER_MARGIN: usize = 4;

/// Length of `s` written as a JSON string's contents (quotes excluded), as serde_json escapes it.
fn json_len(s: &str) -> usize {
    s.len()
        + s.bytes()
            .map(|b| match b {
                b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
                0..0x20 => 5,
                _ => 0,
            })
            .sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The member scan a rewrite falls back on must read what serde reads, or decline.
    #[test]
    fn raw_members_agree_with_serde_or_decline() {
        let cases = [
            r#"{"role":"tool","tool_call_id":"c1","content":"a \"quoted\" \\\\ line\n{[","x":[1,{"y":"]}"}],"n":-1.5e3,"t":true,"z":null}"#,
            " { \"a\" : \"b\\\\\" ,\n\"c\":\t{ } , \"d\" : [ ] } ",
            r#"{}"#,
            r#"{"k":"é\u00e9 ✓","v":{"nested":{"deep":["}"]}}}"#,
        ];
        for raw in cases {
            let ours = raw_members(raw).unwrap_or_else(|| panic!("declined {raw}"));
            let theirs: indexmap::IndexMap<String, &RawValue> = serde_json::from_str(raw).unwrap();
            let theirs: Vec<(&str, &str)> = theirs.iter().map(|(k, v)| (k.as_str(), v.get())).collect();
            assert_eq!(ours, theirs, "{raw}");
        }
        // Escaped or repeated keys go to serde.
        assert_eq!(raw_members(r#"{"a\u0062":1}"#), None);
        assert_eq!(raw_members(r#"{"a":1,"a":2}"#), None);
        assert_eq!(raw_members("[1]"), None);
    }

    /// The content written directly is what serde_json writes for the same value.
    #[test]
    fn content_with_text_writes_what_serde_json_writes() {
        let parts: Vec<crate::neutral::ContentPart> = serde_json::from_str(
            r#"[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"old","cache_control":{"type":"ephemeral"},"n":1.5}]"#,
        )
        .unwrap();
        let text = "marker \"quoted\" \\ \n\t\u{1} é 🦀";
        let mut part = serde_json::Map::new();
        part.insert("type".into(), Value::String("text".into()));
        part.insert("text".into(), Value::String(text.into()));
        part.insert("cache_control".into(), serde_json::json!({"type": "ephemeral"}));
        part.insert("n".into(), serde_json::json!(1.5));
        let expected = Value::Array(vec![Value::Object(part)]).to_string();
        assert_eq!(content_with_text(Some(&Content::Parts(parts)), text), expected);
        assert_eq!(content_with_text(None, text), Value::String(text.into()).to_string());
        let plain = Content::Text("old".into());
        assert_eq!(content_with_text(Some(&plain), text), Value::String(text.into()).to_string());
    }
}
