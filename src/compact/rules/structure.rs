//! Structural maps: a large successful read of a source file (by the call's `path` argument, or a
//! `cat`/`nl`/`head`/`sed -n` command on one file) becomes the list of its definitions with 1-based
//! line ranges — what the model needs to navigate the file again — instead of its whole body.

use std::sync::LazyLock;

use regex::Regex;

use super::super::Policy;
use super::super::conversation::{Conversation, line_count, path_argument};
use super::super::edits::Edits;
use super::super::markers::{NAMES_PER_MARKER, group_digits, names_suffix, render, salient_names};
use super::super::outline::{Language, outline};
use super::super::report::RuleId;

static READ_COMMAND: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\s*(?:cd\s+\S+\s*&&\s*)?(?:cat(?:\s+-n)?|nl(?:\s+-\w+)*|head(?:\s+-n?\s*\d+)?|sed\s+-n\s+['"]?\d+,\d+p['"]?)\s+['"]?([^\s'"|;&>]+)['"]?\s*$"#)
        .expect("static regex")
});

static SED_RANGE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"sed\s+-n\s+['"]?(\d+),\d+p"#).expect("static regex"));

/// The source file a call read, when it is one, and the line of the file its output starts at: a
/// `sed -n 'A,Bp'` view without line numbers starts at A, so that the map's line ranges are the
/// file's and one `sed -n` of a range brings that definition back.
fn read_path(arguments: &str) -> Option<(String, usize)> {
    if let Some(path) = path_argument(arguments) {
        return Some((path, 1));
    }
    let v: serde_json::Value = serde_json::from_str(arguments).ok()?;
    let command = v.get("command").or_else(|| v.get("cmd"))?.as_str()?;
    let path = READ_COMMAND.captures(command).map(|c| c[1].to_owned())?;
    let first_line = SED_RANGE.captures(command).and_then(|c| c[1].parse().ok()).unwrap_or(1usize).max(1);
    Some((path, first_line))
}

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
        // Identifiers of the body that the map does not already show.
        "names" => Some(names_suffix(&salient_names(&outcome.text, NAMES_PER_MARKER, &[&body, &path], conv.shown()))),
        "lines" => Some(group_digits(n_lines)),
        "chars" => Some(group_digits(n_chars)),
        "language" => Some(language.name().to_owned()),
        _ => conv.fact(idx, name),
    });
    let map = format!("{header}\n{body}");
    (map.len() < outcome.text.len()).then_some(map)
}

#[cfg(test)]
mod tests {
    #[test]
    fn read_commands_name_their_file() {
        let read = |args: &str| super::read_path(args);
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
}
