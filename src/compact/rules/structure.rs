//! Structural maps: a large successful read of a source file (by the call's `path` argument, or a
//! `cat`/`nl`/`head`/`sed -n` command on one file) becomes the list of its definitions with 1-based
//! line ranges — what the model needs to navigate the file again — instead of its whole body.

use super::super::Policy;
use super::super::conversation::{Conversation, line_count, read_path};
use super::super::edits::Edits;
use super::super::markers::{NAMES_PER_MARKER, group_digits, names_suffix, render, salient_names_where};
use super::super::outline::{Language, outline};
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.structure;
    let candidates: Vec<usize> = super::open_results(conv, edits)
        .filter(|&idx| {
            let outcome = conv.outcomes[idx].as_ref().expect("open results have an outcome");
            outcome.status.is_ok() && outcome.text.len() >= rule.min_chars
        })
        .collect();
    // Outlining reads the whole body: the costly part, independent per result.
    let maps = conv.map_each(&candidates, |&idx| map_of(policy, conv, idx));
    for (idx, map) in candidates.into_iter().zip(maps) {
        if let Some(map) = map {
            edits.set_marker(conv, idx, RuleId::Structure, map);
        }
    }
}

/// The structural map standing for tool result `idx`, when it is a read of a source file whose
/// outline is shorter than the body.
fn map_of(policy: &Policy, conv: &Conversation<'_>, idx: usize) -> Option<String> {
    let rule = &policy.spec.structure;
    let outcome = conv.outcomes[idx].as_ref()?;
    let call = conv.call_of_result[idx].map(|c| &conv.calls[c])?;
    let (path, first_line) = read_path(&call.arguments)?;
    let language = Language::of_path(&path)?;
    let entries = outline(language, &outcome.text, rule.max_depth, first_line);
    if entries.is_empty() {
        return None;
    }
    let n_lines = line_count(&outcome.text);
    let n_chars = conv.text_chars(idx);
    let body = super::super::outline::render(&entries, rule.max_entries);
    let header = render(&rule.template, &|name| match name {
        "path" => Some(path.clone()),
        // Identifiers of the body that the map does not already show, from its code, comments and
        // strings alike (they name tables, keys and messages the agent reuses), but not numbers or
        // a character set spelled out as one word, which no one navigates a file by.
        "names" => Some(names_suffix(&salient_names_where(
            &outcome.text,
            NAMES_PER_MARKER,
            &[&body, &path],
            conv.shown(),
            is_a_name,
        ))),
        "lines" => Some(group_digits(n_lines)),
        "chars" => Some(group_digits(n_chars)),
        "language" => Some(language.name().to_owned()),
        // A read that is not a view call (a search tool given a path) has no exact restoring call.
        "restore" => Some(conv.restore(idx).unwrap_or_else(|| format!("a read of {path}"))),
        _ => conv.fact(idx, name),
    });
    let map = format!("{header}\n{body}");
    (map.len() < outcome.text.len()).then_some(map)
}

/// A word of a source file worth listing in its map: not a number (`1998`, `30000`) and not a
/// character set (`ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_`: no lowercase letter and 16 or more
/// distinct characters, which no constant name has).
fn is_a_name(word: &str) -> bool {
    if word.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let mut distinct = [false; 256];
    let mut n_distinct = 0;
    for b in word.bytes() {
        if b.is_ascii_lowercase() {
            return true;
        }
        if !distinct[usize::from(b)] {
            distinct[usize::from(b)] = true;
            n_distinct += 1;
        }
    }
    n_distinct < 16
}

#[cfg(test)]
mod tests {
    #[test]
    fn read_commands_name_their_file() {
        let read = |args: &str| super::super::super::conversation::read_path(args);
        let at = |path: &str, line: usize| Some((path.to_owned(), line));
        assert_eq!(read(r#"{"path":"/w/a.py","command":"view"}"#), at("/w/a.py", 1));
        assert_eq!(read(r#"{"command":"cat src/x.rs"}"#), at("src/x.rs", 1));
        assert_eq!(read(r#"{"command":"nl -ba src/x.rs"}"#), at("src/x.rs", 1));
        assert_eq!(read(r#"{"command":"sed -n '1,200p' a/b.go"}"#), at("a/b.go", 1));
        assert_eq!(
            read(r#"{"command":"sed -n '420,500p' django/db/models/expressions.py"}"#),
            at("django/db/models/expressions.py", 420)
        );
        assert_eq!(read(r#"{"command":"cat a.py | grep x"}"#), None);
        assert_eq!(read(r#"{"command":"pytest"}"#), None);
    }

    #[test]
    fn restore_calls_use_the_agents_tool() {
        let view = r#"{"command":"view","path":"/w/a.py"}"#;
        assert_eq!(
            super::super::super::conversation::restore_call("str_replace_editor", view, "/w/a.py", 1, 420),
            "str_replace_editor /w/a.py lines 1-420"
        );
        let sed = r#"{"command":"sed -n '420,500p' x/e.py"}"#;
        assert_eq!(
            super::super::super::conversation::restore_call("bash", sed, "x/e.py", 420, 500),
            "sed -n '420,500p' x/e.py"
        );
    }

    #[test]
    fn numbers_and_character_sets_are_not_names() {
        for word in ["1998", "30000", "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", "0123456789ABCDEFGHIJ"] {
            assert!(!super::is_a_name(word), "{word}");
        }
        for word in ["lookup_table_v2", "MAX_BUFFER_SIZE", "LICENSE_1998_v2", "HTTP2", "abcdefghijklmnopqrstuvwxyz"] {
            assert!(super::is_a_name(word), "{word}");
        }
    }
}
