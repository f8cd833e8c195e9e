//! Structural maps: a large successful read of a source file (by the call's `path` argument, or a
//! `cat`/`nl`/`head`/`sed -n` command on one file) becomes the list of its definitions with 1-based
//! line ranges — what the model needs to navigate the file again — instead of its whole body. The
//! latest full read of a file the conversation edits is left whole for the salience tiers, which
//! keep it in the Focus tier and forward its map in every other; that map also keeps the lines
//! those edits touch, with [`EDIT_CONTEXT_LINES`] on each side (at most [`MAX_REGION_LINES`]): the
//! agent's next edit of the file is most often near its last ones, and quotes those lines exactly.

use super::super::Policy;
use super::super::conversation::{Conversation, line_count, read_path};
use super::super::edited::FileEdits;
use super::super::edits::Edits;
use super::super::markers::{NAMES_PER_MARKER, group_digits, names_suffix, render, salient_names_where};
use super::super::outline::{Language, numbered_lines, outline};
use super::super::relevance::excerpt_of;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.structure;
    let candidates: Vec<usize> = super::open_results(conv, edits)
        .filter(|&idx| {
            let outcome = conv.outcomes[idx].as_ref().expect("open results have an outcome");
            outcome.status.is_ok() && outcome.text.len() >= rule.min_chars
        })
        .collect();
    if candidates.is_empty() {
        return;
    }
    let file_edits = FileEdits::new(conv);
    // Outlining reads the whole body: the costly part, independent per result.
    let maps = conv.map_each(&candidates, |&idx| map_of(policy, conv, &file_edits, idx));
    for (idx, map) in candidates.into_iter().zip(maps) {
        let Some((map, relevant)) = map else { continue };
        // What the agent's next edit of the file quotes is in its latest read: the tiers keep it
        // whole where the budget allows and forward the map only below Focus.
        if file_edits.is_latest_read_of_edited(idx) {
            edits.defer_map(idx, map);
        } else {
            edits.set_marker(conv, idx, RuleId::Structure, map);
            if relevant {
                edits.savings[idx].push((RuleId::Relevance, 0));
            }
        }
        edits.relevant[idx] = relevant;
    }
}

/// Lines of the file kept on each side of the lines an edit touches, in the map of its latest read.
/// Measured on the tuning half of the generated file-heavy sessions (`benches/gen_file_heavy.py
/// --variants 3`, `pare eval --split tune`), with [`MAX_REGION_LINES`]: 16 and 96 lines give needle
/// recall 0.733 at epoch 16k and 0.638 in eager mode at 32k; 32 and 160 give 0.742 and 0.646, savings
/// within 0.2 points (0.721 and 0.602 without regions). On the shared and long corpora's tuning
/// half, epoch 16k is unchanged (coding recall 0.946, 64.1 % saved).
pub const EDIT_CONTEXT_LINES: usize = 32;

/// At most this many lines of edited regions join one map (about 2,000 tokens of code), the latest
/// edits' regions first.
pub const MAX_REGION_LINES: usize = 160;

/// The structural map standing for tool result `idx`, when it is a read of a source file whose
/// outline (plus the regions its edits touch, for the latest read of an edited file) is shorter than
/// the body.
/// With it, whether relevance kept lines of the read in it.
fn map_of(policy: &Policy, conv: &Conversation<'_>, file_edits: &FileEdits, idx: usize) -> Option<(String, bool)> {
    let rule = &policy.spec.structure;
    let outcome = conv.outcomes[idx].as_ref()?;
    let call = conv.call_of_result[idx].map(|c| &conv.calls[c])?;
    let (path, first_line) = read_path(&call.arguments)?;
    let language = Language::of_path(&path)?;
    let entries = outline(language, &outcome.text, rule.max_depth, first_line);
    if entries.is_empty() {
        return None;
    }
    let body = super::super::outline::render(&entries, rule.max_entries);
    let latest_of_edited = file_edits.is_latest_read_of_edited(idx);
    let spans = if latest_of_edited { edited_spans(file_edits, &path, &outcome.text, first_line) } else { Vec::new() };
    let regions = edited_regions(&outcome.text, first_line, &spans);
    // The lines that name what the conversation works on now, less those the edited regions show.
    let kept = excerpt_of(&policy.spec.relevance, conv, idx)
        .and_then(|excerpt| excerpt.without_numbers(&outcome.text, &spans))
        .map(|excerpt| (excerpt.render(&outcome.text), excerpt.kept_text(&outcome.text).join("\n")));
    if let Some((rendered, kept_text)) = &kept {
        let shown = format!("{regions}\n{kept_text}");
        let map = format!("{}\n{body}{regions}\n{rendered}", header(policy, conv, idx, &path, language, &body, &shown));
        if map.len() < outcome.text.len() {
            return Some((map, true));
        }
    }
    let map = format!("{}\n{body}{regions}", header(policy, conv, idx, &path, language, &body, &regions));
    if map.len() < outcome.text.len() {
        return Some((map, false));
    }
    // Regions that cover most of a short file: the outline alone, when that is shorter.
    if regions.is_empty() {
        return None;
    }
    let map = format!("{}\n{body}", header(policy, conv, idx, &path, language, &body, ""));
    (map.len() < outcome.text.len()).then_some((map, false))
}

/// The map's first line: the rule's template filled for result `idx`, its names those of the body
/// that neither the outline `body` nor the `regions` shown already show.
fn header(
    policy: &Policy,
    conv: &Conversation<'_>,
    idx: usize,
    path: &str,
    language: Language,
    body: &str,
    regions: &str,
) -> String {
    let rule = &policy.spec.structure;
    let text = conv.outcomes[idx].as_ref().map_or("", |o| o.text.as_str());
    render(&rule.template, &|name| match name {
        "path" => Some(path.to_owned()),
        // Identifiers of the body that the map does not already show, from its code, comments and
        // strings alike (they name tables, keys and messages the agent reuses), but not numbers or
        // a character set spelled out as one word, which no one navigates a file by.
        "names" => Some(names_suffix(&salient_names_where(
            text,
            NAMES_PER_MARKER,
            &[body, path, regions],
            conv.shown(),
            is_a_name,
        ))),
        "lines" => Some(group_digits(line_count(text))),
        "chars" => Some(group_digits(conv.text_chars(idx))),
        "language" => Some(language.name().to_owned()),
        // A read that is not a view call (a search tool given a path) has no exact restoring call.
        "restore" => Some(conv.restore(idx).unwrap_or_else(|| format!("a read of {path}"))),
        _ => conv.fact(idx, name),
    })
}

/// The line ranges of a read of `path` that the conversation's edits of it touch (see
/// [`FileEdits::regions`]).
fn edited_spans(file_edits: &FileEdits, path: &str, text: &str, first_line: usize) -> Vec<(usize, usize)> {
    file_edits.regions(path, &numbered_lines(text, first_line), EDIT_CONTEXT_LINES, MAX_REGION_LINES)
}

/// The lines of a read in `spans` (the file's numbering), as `cat -n` shows them, after a line
/// naming their ranges; empty when there are none.
fn edited_regions(text: &str, first_line: usize, spans: &[(usize, usize)]) -> String {
    use std::fmt::Write;
    if spans.is_empty() {
        return String::new();
    }
    let ranges: Vec<String> = spans.iter().map(|(a, b)| format!("{a}-{b}")).collect();
    let mut out = format!("\n[pare: lines {} as read, around this file's edits]", ranges.join(", "));
    for (n, code) in numbered_lines(text, first_line) {
        if spans.iter().any(|&(a, b)| (a..=b).contains(&n)) {
            let _ = write!(out, "\n{n:6}\t{code}");
        }
    }
    out
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
    use super::EDIT_CONTEXT_LINES;

    use crate::compact::{CompactOptions, Engine};
    use crate::tokens::QuarterCounter;
    use crate::wire::ChatBody;
    use serde_json::{Value, json};

    /// A Python file of `n` lines: a function every 10 lines, each line naming its own identifiers.
    fn source(n: usize, version: &str) -> Vec<String> {
        (1..=n)
            .map(|i| match i % 10 {
                1 => format!("def handler_{i}(request_{i}):"),
                _ => format!("    value_{i}_{version} = compute_{i}(request_{})", i - i % 10 + 1),
            })
            .collect()
    }

    fn view_of(path: &str, lines: &[String]) -> String {
        let body: Vec<String> = lines.iter().enumerate().map(|(i, l)| format!("{:6}\t{l}", i + 1)).collect();
        format!("Here's the result of running `cat -n` on {path}:\n{}", body.join("\n"))
    }

    fn turn(id: &str, args: Value, output: &str) -> [Value; 2] {
        [
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "str_replace_editor", "arguments": args.to_string()}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": output}),
        ]
    }

    /// The forwarded text of each message of `messages` compacted by the default pack (rules only).
    fn compacted(messages: &[Value]) -> Vec<String> {
        compacted_to(messages, None)
    }

    /// The forwarded text of each message of `messages` compacted by the default pack, brought under
    /// `share` % of the request's tokens when given (salience tiers, then elision).
    fn compacted_to(messages: &[Value], share: Option<u64>) -> Vec<String> {
        let body = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
        let parsed = ChatBody::parse(&body).unwrap();
        let view = parsed.view();
        let tokens = crate::tokens::request_tokens(&QuarterCounter, view.messages, view.tools);
        let options = CompactOptions { target_tokens: share.map(|s| tokens * s / 100), ..Default::default() };
        let out = Engine::default_pack().compact(&view, &options, &QuarterCounter);
        let mut texts: Vec<String> = out
            .prefix
            .iter()
            .map(|m| serde_json::from_str::<Value>(m).unwrap()["content"].as_str().unwrap_or("").to_owned())
            .collect();
        texts.extend(messages[out.boundary..].iter().map(|m| m["content"].as_str().unwrap_or("").to_owned()));
        texts
    }

    /// system, task, then `work`, then five small turns (the protected tail).
    fn session(work: Vec<[Value; 2]>) -> Vec<Value> {
        let mut messages =
            vec![json!({"role": "system", "content": "agent"}), json!({"role": "user", "content": "fix it"})];
        messages.extend(work.into_iter().flatten());
        for k in 0..5 {
            messages.extend(turn(&format!("t{k}"), json!({"command": "view", "path": "/w/notes.txt"}), "ok"));
        }
        messages
    }

    /// Regression: the latest view of a file the agent edits was outlined by the rules whatever the
    /// budget, so an edit quoting lines far from the earlier edits found only the outline. The rules
    /// leave it whole; a target that leaves room keeps it whole, an older view of the same file and
    /// a view of a file nobody edits are outlined.
    #[test]
    fn the_latest_view_of_an_edited_file_stays_whole_where_the_budget_allows() {
        let (path, other) = ("/w/app/handlers.py", "/w/app/models.py");
        let (before, after) = (source(300, "a"), source(300, "b"));
        let edit = json!({"command": "str_replace", "path": path, "old_str": before[200..204].join("\n"), "new_str": after[200..204].join("\n")});
        let work = vec![
            turn("v1", json!({"command": "view", "path": path}), &view_of(path, &before)),
            turn("e1", edit, &format!("The file {path} has been edited.")),
            turn("v2", json!({"command": "view", "path": path}), &view_of(path, &after)),
            turn("v3", json!({"command": "view", "path": other}), &view_of(other, &source(300, "c"))),
        ];
        for share in [None, Some(90)] {
            let out = compacted_to(&session(work.clone()), share);
            let (older, latest, unedited) = (&out[3], &out[7], &out[9]);
            assert_eq!(latest, &view_of(path, &after), "target {share:?}");
            assert!(older.starts_with("[pare: structure of /w/app/handlers.py"), "{older}");
            assert!(unedited.starts_with("[pare: structure of /w/app/models.py"), "{unedited}");
        }
    }

    #[test]
    fn a_later_edit_keeps_the_lines_it_touches_in_the_map() {
        let path = "/w/app/handlers.py";
        let file = source(300, "a");
        let edit = json!({"command": "str_replace", "path": path, "old_str": file[149..153].join("\n"), "new_str": "    pass"});
        // A target the whole view does not fit: the tiers forward its map.
        let out = compacted_to(
            &session(vec![
                turn("v1", json!({"command": "view", "path": path}), &view_of(path, &file)),
                turn("e1", edit, &format!("The file {path} has been edited.")),
            ]),
            Some(70),
        );
        let map = &out[3];
        assert!(map.starts_with("[pare: structure of /w/app/handlers.py"), "{map}");
        let region = format!("lines {}-{} as read", 150 - EDIT_CONTEXT_LINES, 153 + EDIT_CONTEXT_LINES);
        assert!(map.contains(&region), "{map}");
        // The edited lines and their context, as read; nothing far from them.
        for line in [150 - EDIT_CONTEXT_LINES, 150, 153, 153 + EDIT_CONTEXT_LINES] {
            assert!(map.contains(&format!("{line:6}\t{}", file[line - 1])), "line {line}: {map}");
        }
        assert!(!map.contains(&file[39]), "{map}");
        // Without the edit, the same read keeps its outline only.
        let out =
            compacted(&session(vec![turn("v1", json!({"command": "view", "path": path}), &view_of(path, &file))]));
        assert!(out[3].starts_with("[pare: structure of") && !out[3].contains("as read"), "{}", out[3]);
    }

    #[test]
    fn the_latest_view_of_a_path_keeps_the_edited_regions_and_an_older_one_does_not() {
        let path = "/w/app/handlers.py";
        let (before, after) = (source(300, "a"), source(300, "b"));
        let edit = json!({"command": "str_replace", "path": path, "old_str": before[200..204].join("\n"), "new_str": after[200..204].join("\n")});
        let out = compacted_to(
            &session(vec![
                turn("v1", json!({"command": "view", "path": path}), &view_of(path, &before)),
                turn("e1", edit, &format!("The file {path} has been edited.")),
                turn("v2", json!({"command": "view", "path": path}), &view_of(path, &after)),
            ]),
            Some(45),
        );
        let (older, latest) = (&out[3], &out[7]);
        assert!(!older.contains("as read"), "{older}");
        assert!(latest.starts_with("[pare: structure of") && latest.contains("as read"), "{latest}");
        // The latest view shows the edit's new text where it landed.
        assert!(latest.contains(&format!("{:6}\t{}", 201, after[200])), "{latest}");
    }
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
