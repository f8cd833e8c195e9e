//! Large arguments of old tool calls: in a call whose result succeeded, each long top-level string
//! value of the arguments (a heredoc script, a file written whole, an edit's old and new text) keeps
//! its first and last lines around a marker line such as
//! `[pare: 184 lines, 6,112 chars of this old file_text elided; the call was sent in full]`: the
//! marker says the call ran with the whole value, so that the model does not take an elided value
//! for one it may send.
//!
//! The call stays: same id, type, function name and unknown keys; `arguments` stays a JSON string
//! holding an object with the same keys in the same order (servers such as llama.cpp and vLLM parse
//! it to render their chat templates). A failed call keeps its arguments whole: they are what the
//! model is about to fix. Arguments that are not a JSON object, values that are not strings, and
//! values already carrying a pare marker are left alone.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::{content_id, group_digits, is_compacted, render, retrieve_suffix};
use super::super::pack::ArgumentsRule;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.arguments;
    // One assistant message's calls at a time, in the order of its `tool_calls`.
    for calls in conv.calls.chunk_by(|a, b| a.msg == b.msg) {
        let msg = calls[0].msg;
        if msg >= conv.boundary || edits.kept[msg] || edits.dropped[msg] || edits.compacted[msg] {
            continue;
        }
        let mut shortened: Vec<Option<String>> = Vec::with_capacity(calls.len());
        let mut saved = 0i64;
        for call in calls {
            // A result that already carries a marker (an earlier compaction) no longer tells how the
            // call went (`Outcome::succeeded`): its arguments were shortened then, or were meant to
            // stay whole.
            let succeeded = call.result.is_some_and(|r| {
                r < conv.boundary && !edits.kept[r] && conv.outcomes[r].as_ref().is_some_and(|o| o.succeeded())
            });
            let short = if succeeded {
                shorten_arguments(&call.arguments, &call.name, conv.retrieve_tool.as_deref(), rule)
            } else {
                None
            };
            if let Some((_, chars)) = &short {
                saved += chars;
            }
            shortened.push(short.map(|(arguments, _)| arguments));
        }
        if saved == 0 {
            continue;
        }
        if let Some(json) = tool_calls_with(conv.raw[msg], &shortened) {
            edits.tool_calls[msg] = Some(json);
            edits.savings[msg].push((RuleId::Arguments, saved));
        }
    }
}

/// The arguments with their long string values shortened, and the chars removed; `None` when the
/// arguments are not a JSON object or nothing is long enough to cut.
fn shorten_arguments(
    arguments: &str,
    tool: &str,
    retrieve_tool: Option<&str>,
    rule: &ArgumentsRule,
) -> Option<(String, i64)> {
    if arguments.len() <= rule.max_chars {
        return None;
    }
    let entries = Entries::parse(arguments)?;
    // New JSON per key that is cut. A JSON string literal is never shorter than the chars it decodes
    // to: short values and non-strings are not decoded.
    let cut: Vec<(&str, String)> = entries
        .0
        .iter()
        .filter(|(_, raw)| raw.get().len() > rule.max_chars && raw.get().starts_with('"'))
        .filter_map(|(key, raw)| {
            let value: String = serde_json::from_str(raw.get()).ok()?;
            let short = shorten_value(&value, key, tool, retrieve_tool, rule)?;
            Some((key.as_str(), serde_json::to_string(&short).expect("a string always serializes")))
        })
        .collect();
    if cut.is_empty() {
        return None;
    }
    let out = entries.write(&|key| cut.iter().find(|(k, _)| *k == key).map(|(_, json)| json.clone()));
    let saved = arguments.chars().count() as i64 - out.chars().count() as i64;
    (saved > 0).then_some((out, saved))
}

/// One long string value cut to its first and last lines around a marker line, or — when those
/// lines alone are over `max_chars` or there are too few — to its first third and last sixth of
/// `max_chars` chars. Leading blank space is kept and not counted as head: the first line with text
/// is what markers show as the call's key argument. `None` when the value is short or blank,
/// already carries a marker, or nothing would be saved.
fn shorten_value(
    value: &str,
    key: &str,
    tool: &str,
    retrieve_tool: Option<&str>,
    rule: &ArgumentsRule,
) -> Option<String> {
    let total = value.chars().count();
    if total <= rule.max_chars || is_compacted(value) || value.trim().is_empty() {
        return None;
    }
    let (blank, text) = value.split_at(value.len() - value.trim_start().len());
    let marker = |elided: &str| {
        let lines = elided.split('\n').count();
        render(&rule.template, &|name| match name {
            "lines" => Some(group_digits(lines)),
            "chars" => Some(group_digits(elided.chars().count())),
            "key" => Some(key.to_owned()),
            "tool" => Some(tool.to_owned()),
            "retrieve" => Some(retrieve_suffix(&content_id(value), retrieve_tool)),
            _ => None,
        })
    };
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let (head, tail) = (rule.head_lines, rule.tail_lines);
    let by_lines = (lines.len() > head + tail + 1)
        .then(|| {
            let head_end: usize = lines[..head].iter().map(|l| l.len()).sum();
            let tail_start = text.len() - lines[lines.len() - tail..].iter().map(|l| l.len()).sum::<usize>();
            (head_end, tail_start)
        })
        .filter(|(head_end, tail_start)| {
            value.len() - text.len() + text[..*head_end].chars().count() + text[*tail_start..].chars().count()
                <= rule.max_chars
        });
    let cut = match by_lines {
        Some((head_end, tail_start)) => {
            // The head ends with its newline; the marker line ends the cut middle's last line.
            let elided = text[head_end..tail_start].strip_suffix('\n').unwrap_or(&text[head_end..tail_start]);
            let mut out = format!("{}{}", &text[..head_end], marker(elided));
            if tail > 0 {
                out.push('\n');
                out.push_str(&text[tail_start..]);
            }
            out
        }
        None => {
            let n = text.chars().count();
            let head_end = text.char_indices().nth(rule.max_chars / 3).map_or(text.len(), |(i, _)| i);
            let tail_start =
                text.char_indices().nth(n.saturating_sub(rule.max_chars / 6)).map_or(text.len(), |(i, _)| i);
            if head_end >= tail_start {
                return None;
            }
            format!("{}\n{}\n{}", &text[..head_end], marker(&text[head_end..tail_start]), &text[tail_start..])
        }
    };
    let out = format!("{blank}{cut}");
    // A template that pare would not recognise as its own would be cut again on the next request.
    (is_compacted(&out) && out.chars().count() < total).then_some(out)
}

/// A JSON object's entries in order, keys decoded, values as written; `None` for anything else and
/// for an object that repeats a key (rewriting it would change which value a parser keeps).
struct Entries<'a>(Vec<(String, &'a RawValue)>);

impl<'a> Entries<'a> {
    /// The object written compactly, each value as written unless `replace` gives new JSON for its key.
    fn write(&self, replace: &dyn Fn(&str) -> Option<String>) -> String {
        let mut out = String::with_capacity(self.0.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum::<usize>() + 2);
        out.push('{');
        for (n, (key, value)) in self.0.iter().enumerate() {
            if n > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(key).expect("a string always serializes"));
            out.push(':');
            match replace(key) {
                Some(json) => out.push_str(&json),
                None => out.push_str(value.get()),
            }
        }
        out.push('}');
        out
    }

    fn parse(text: &'a str) -> Option<Entries<'a>> {
        let entries: Entries<'a> = serde_json::from_str(text).ok()?;
        let mut keys: Vec<&str> = entries.0.iter().map(|(k, _)| k.as_str()).collect();
        keys.sort_unstable();
        keys.windows(2).all(|w| w[0] != w[1]).then_some(entries)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Entries<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Entries<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<Entries<'a>, M::Error> {
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value: &'de RawValue = map.next_value()?;
                    out.push((key, value));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// The message's `tool_calls` JSON with the given calls' `function.arguments` replaced; calls with
/// `None` keep their original bytes, and every other key of a changed call keeps its bytes and place.
fn tool_calls_with(message: &str, arguments: &[Option<String>]) -> Option<String> {
    #[derive(Deserialize)]
    struct Calls<'a> {
        #[serde(borrow)]
        tool_calls: Vec<&'a RawValue>,
    }
    let calls: Calls<'_> = serde_json::from_str(message).ok()?;
    if calls.tool_calls.len() != arguments.len() {
        return None;
    }
    let mut out = String::with_capacity(message.len().min(4096));
    out.push('[');
    for (n, (raw, new)) in calls.tool_calls.iter().zip(arguments).enumerate() {
        if n > 0 {
            out.push(',');
        }
        let Some(new) = new else {
            out.push_str(raw.get());
            continue;
        };
        let call = Entries::parse(raw.get())?;
        let (_, function) = call.0.iter().find(|(k, _)| k == "function")?;
        let function = Entries::parse(function.get())?;
        let (_, old) = function.0.iter().find(|(k, _)| k == "arguments")?;
        if !old.get().starts_with('"') {
            return None;
        }
        let new = serde_json::to_string(new).expect("a string always serializes");
        let function = function.write(&|key| (key == "arguments").then(|| new.clone()));
        out.push_str(&call.write(&|key| (key == "function").then(|| function.clone())));
    }
    out.push(']');
    Some(out)
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value};

    use super::*;

    fn rule() -> ArgumentsRule {
        ArgumentsRule::default()
    }

    fn numbered(n: usize) -> String {
        (1..=n).map(|i| format!("    print('line {i} of the script')\n")).collect()
    }

    #[test]
    fn keeps_head_and_tail_lines_around_a_marker() {
        let value = format!("cat <<'EOF' > /w/fix.py\n{}EOF\n", numbered(40));
        let out = shorten_value(&value, "command", "bash", None, &rule()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "cat <<'EOF' > /w/fix.py");
        assert_eq!(lines[3], "    print('line 3 of the script')");
        // The marker names the whole value it stands for.
        let id = content_id(&value);
        assert_eq!(
            lines[4],
            format!("[pare: 36 lines, 1,253 chars of this old command elided; the call was sent in full; {id}]")
        );
        assert_eq!(&lines[5..], ["    print('line 40 of the script')", "EOF"]);
        assert!(out.ends_with("EOF\n"), "the value's last newline stays");
        assert!(is_compacted(&out));
        assert_eq!(shorten_value(&out, "command", "bash", None, &rule()), None, "a shortened value is not cut again");
    }

    #[test]
    fn few_long_lines_are_cut_by_chars_on_char_boundaries() {
        let value = format!("python -c \"{}\"", "é".repeat(3000));
        let out = shorten_value(&value, "command", "bash", None, &rule()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].chars().count(), 166);
        assert!(lines[0].starts_with("python -c \"éé"));
        let id = content_id(&value);
        assert_eq!(
            lines[1],
            format!("[pare: 1 lines, 2,763 chars of this old command elided; the call was sent in full; {id}]")
        );
        assert_eq!(lines[2].chars().count(), 83);
        assert_eq!(shorten_value(&out, "command", "bash", None, &rule()), None);
    }

    #[test]
    fn leading_blank_space_is_kept_and_blank_values_are_left_alone() {
        let value = format!("\n\n  \n{}", numbered(40));
        let out = shorten_value(&value, "code", "x", None, &rule()).unwrap();
        assert!(out.starts_with("\n\n  \n    print('line 1 of the script')\n"), "{out}");
        assert_eq!(
            out.trim_start().lines().nth(4),
            Some(
                format!(
                    "[pare: 34 lines, 1,184 chars of this old code elided; the call was sent in full; {}]",
                    content_id(&value)
                )
                .as_str()
            )
        );
        assert_eq!(shorten_value(&" ".repeat(900), "code", "x", None, &rule()), None);
        assert_eq!(shorten_value(&format!("{}x", " ".repeat(900)), "code", "x", None, &rule()), None, "nothing to cut");
    }

    #[test]
    fn short_or_marked_values_are_left_alone() {
        assert_eq!(shorten_value(&numbered(10), "code", "x", None, &rule()), None, "under max_chars");
        let marked = format!("{}[pare: 3 lines, 90 chars elided]\n{}", numbered(4), numbered(30));
        assert_eq!(shorten_value(&marked, "code", "x", None, &rule()), None);
        // A template pare would not recognise is refused at run time too (idempotence).
        let odd = ArgumentsRule { template: "[parenthesis {lines}]".into(), ..rule() };
        assert_eq!(shorten_value(&numbered(40), "code", "x", None, &odd), None);
    }

    #[test]
    fn arguments_keep_keys_order_and_other_values() {
        let args =
            serde_json::json!({"command": "create", "path": "/w/a.py", "file_text": numbered(40), "n": 1.50, "z": [1]})
                .to_string();
        let (out, saved) = shorten_arguments(&args, "str_replace_editor", None, &rule()).unwrap();
        assert!(saved > 1000, "{saved}");
        let v: Map<String, Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(v.keys().collect::<Vec<_>>(), ["command", "path", "file_text", "n", "z"]);
        assert_eq!(v["path"], "/w/a.py");
        assert!(v["file_text"].as_str().unwrap().contains("\n[pare: 34 lines, "), "{out}");
        assert!(out.contains(r#""n":1.5"#), "{out}");
        assert_eq!(shorten_arguments(&out, "str_replace_editor", None, &rule()), None);
    }

    #[test]
    fn non_objects_and_repeated_keys_are_left_alone() {
        let long = serde_json::to_string(&numbered(40)).unwrap();
        assert_eq!(shorten_arguments(&long, "x", None, &rule()), None);
        assert_eq!(shorten_arguments(&format!("[{long}]"), "x", None, &rule()), None);
        assert_eq!(shorten_arguments(&format!("{{\"a\":{long},\"a\":1}}"), "x", None, &rule()), None);
        assert_eq!(shorten_arguments(&format!("{{\"a\":{long}"), "x", None, &rule()), None, "not JSON");
        assert_eq!(shorten_arguments(&format!("{{\"a\":{{\"b\":{long}}}}}"), "x", None, &rule()), None, "nested");
    }

    #[test]
    fn tool_calls_keep_unknown_keys_and_untouched_bytes() {
        let message = r#"{"role":"assistant","tool_calls":[{"type":"function","id":"a","function":{"arguments":"{\"x\": 1}","name":"f","z":1.50},"w":[2, 1e3]},{"id":"b" , "function":{"name":"g","arguments":"{}"}}]}"#;
        let out = tool_calls_with(message, &[Some("{\"x\":2}".into()), None]).unwrap();
        assert_eq!(
            out,
            r#"[{"type":"function","id":"a","function":{"arguments":"{\"x\":2}","name":"f","z":1.50},"w":[2, 1e3]},{"id":"b" , "function":{"name":"g","arguments":"{}"}}]"#
        );
        assert_eq!(tool_calls_with(message, &[None]), None, "one entry per call");
        let object_arguments = r#"{"tool_calls":[{"id":"a","function":{"name":"f","arguments":{"x":1}}}]}"#;
        assert_eq!(tool_calls_with(object_arguments, &[Some("{}".into())]), None, "arguments sent as an object");
        let repeated = r#"{"tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}","name":"g"}}]}"#;
        assert_eq!(tool_calls_with(repeated, &[Some("{}".into())]), None, "a repeated key");
    }
}
