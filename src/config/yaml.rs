//! A YAML document as a tree that remembers the line of every node, and the machinery that turns
//! serde's first-error-only deserialization into a report of **every** problem, each with its line.
//!
//! The method: deserialize the tree into the strict target type with `serde_path_to_error`; on an
//! error, record it (the path locates its line in the tree), remove the offending node so that its
//! default applies, and try again — until the type deserializes. Semantic checks then report by path
//! through the same tree.

use serde::Deserialize;
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_saphyr::Spanned;

/// One YAML node and the 1-based line it starts on (0 when unknown).
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub line: u64,
    pub value: NodeValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum NodeValue {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    /// Entries in document order: key, the key's line, value.
    Map(Vec<(String, u64, Node)>),
}

impl<'de> Deserialize<'de> for NodeValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

fn spanned(s: Spanned<NodeValue>) -> Node {
    Node { line: s.referenced.line(), value: s.value }
}

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = NodeValue;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a YAML value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<NodeValue, E> {
        Ok(NodeValue::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<NodeValue, E> {
        Ok(NodeValue::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<NodeValue, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<NodeValue, E> {
        Ok(NodeValue::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<NodeValue, E> {
        Ok(NodeValue::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<NodeValue, E> {
        Ok(NodeValue::UInt(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<NodeValue, E> {
        Ok(NodeValue::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<NodeValue, E> {
        Ok(NodeValue::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<NodeValue, E> {
        Ok(NodeValue::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NodeValue, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<NodeValue>>()? {
            items.push(spanned(item));
        }
        Ok(NodeValue::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NodeValue, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<NodeValue>>()? {
            let key_line = key.referenced.line();
            let key = match key.value {
                NodeValue::Str(s) => s,
                NodeValue::Int(i) => i.to_string(),
                NodeValue::UInt(u) => u.to_string(),
                NodeValue::Bool(b) => b.to_string(),
                NodeValue::Null => "null".to_owned(),
                _ => return Err(de::Error::custom(format!("line {key_line}: mapping keys must be scalars"))),
            };
            let value = map.next_value::<Spanned<NodeValue>>()?;
            entries.push((key, key_line, spanned(value)));
        }
        Ok(NodeValue::Map(entries))
    }
}

/// Parse YAML text into a line-aware tree. An empty document is an empty mapping.
pub fn parse(text: &str) -> Result<Node, Problem> {
    if text.trim().is_empty() {
        return Ok(Node { line: 1, value: NodeValue::Map(Vec::new()) });
    }
    // YAML 1.2 booleans only: `n`, `no`, `off` stay strings (a config key named `n` is not `false`).
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    match serde_saphyr::from_str_with_options::<Spanned<NodeValue>>(text, options) {
        // A document of only comments is empty, not null.
        Ok(root) if root.value == NodeValue::Null => Ok(Node { line: 1, value: NodeValue::Map(Vec::new()) }),
        Ok(root) => Ok(spanned(root)),
        Err(err) => {
            let location = err.location().filter(|l| l.line() > 0);
            let line = location.map(|l| l.line());
            let message = first_line(&err.to_string());
            // The message repeats the location ("error: line 2 column 15: unclosed bracket"): keep the rest.
            let what =
                message.find("column ").and_then(|at| message[at..].split_once(": ")).map_or(&*message, |(_, w)| w);
            let message = match location {
                Some(l) => format!("YAML syntax error at line {}, column {}: {what}", l.line(), l.column()),
                None => format!("YAML syntax error: {what}"),
            };
            let path = line.and_then(|line| key_path_at(text, line)).unwrap_or_else(|| "(document)".into());
            Err(Problem { line, path, message })
        }
    }
}

/// The dotted path of the block-mapping keys that enclose line `line` (1-based), read from the
/// indentation of the lines up to it: where a syntax error sits when the document cannot be parsed.
fn key_path_at(text: &str, line: u64) -> Option<String> {
    let mut open: Vec<(usize, &str)> = Vec::new();
    for l in text.lines().take(line as usize) {
        let body = l.trim_start();
        let indent = l.len() - body.len();
        let (indent, body) = match body.strip_prefix("- ") {
            Some(rest) => (indent + 2, rest.trim_start()),
            None => (indent, body),
        };
        let Some((key, _)) = body.split_once(':') else { continue };
        if key.is_empty() || body.starts_with('#') || !key.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
            continue;
        }
        open.retain(|(i, _)| *i < indent);
        open.push((indent, key));
    }
    (!open.is_empty()).then(|| open.iter().map(|(_, k)| *k).collect::<Vec<_>>().join("."))
}

/// The required field named in a serde error message, if it is one.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

/// The known word closest to `given` when it is close enough to be a misspelling of it.
pub fn did_you_mean<'a>(given: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let best = known.into_iter().map(|k| (strsim::jaro_winkler(given, k), k)).max_by(|a, b| a.0.total_cmp(&b.0));
    best.filter(|(score, _)| *score >= 0.85).map(|(_, k)| k)
}

/// The words between backticks in a serde list ("one of `a`, `b`").
fn quoted(list: &str) -> Vec<&str> {
    list.split('`').skip(1).step_by(2).collect()
}

/// "unknown field `x`, expected one of `a`, `b`" → "unknown key `x`; did you mean `a`?" when one
/// known key is close to it (a misspelling), else "unknown key `x` (known keys: a, b)".
fn suggest(message: &str, field: &str) -> String {
    let known = message.split_once("expected").map(|(_, expected)| quoted(expected)).unwrap_or_default();
    match did_you_mean(field, known.iter().copied()) {
        Some(key) => format!("unknown key `{field}`; did you mean `{key}`?"),
        None if known.is_empty() => format!("unknown key `{field}` (this section takes no keys)"),
        None => format!("unknown key `{field}` (known keys: {})", known.join(", ")),
    }
}

/// A serde message in the words of a YAML file's author: "invalid type: string \"lots\", expected
/// u64" → "expected a whole number (0 or more), got the text \"lots\"". Messages of other shapes
/// are returned as they are.
pub fn plain(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("missing field ") {
        return format!("missing key {rest}");
    }
    if let Some(rest) = message.strip_prefix("duplicate field ") {
        return format!("key {rest} is given twice");
    }
    if let Some(rest) = message.strip_prefix("unknown variant ") {
        let (value, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let known = quoted(expected);
        let given = value.trim_matches('`');
        return match did_you_mean(given, known.iter().copied()) {
            Some(word) => format!("unknown value `{given}`; did you mean `{word}`? (expected {})", known.join(", ")),
            None => format!("unknown value `{given}` (expected {})", known.join(", ")),
        };
    }
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some((found, expected)) = message.strip_prefix(prefix).and_then(|rest| rest.rsplit_once(", expected ")) {
            return format!("expected {}, got {}", expected_words(expected), found_words(found));
        }
    }
    message.to_owned()
}

/// What serde says it expected, as a YAML author would say it.
fn expected_words(expected: &str) -> String {
    let words = match expected {
        "u8" => "a whole number from 0 to 255",
        "u16" => "a whole number from 0 to 65535",
        "u32" => "a whole number from 0 to 4294967295",
        "u64" | "usize" | "u128" => "a whole number (0 or more)",
        "i8" | "i16" | "i32" | "i64" | "isize" | "i128" => "a whole number",
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a string" | "a borrowed string" | "a character" => "text",
        "a sequence" => "a list",
        "a map" => "a mapping (indented `key: value` lines)",
        other if other.starts_with("struct ") => "a mapping (indented `key: value` lines)",
        other if other.starts_with("enum ") || other == "variant identifier" => "one of the words it allows",
        other => other,
    };
    words.to_owned()
}

/// What serde says it found, as a YAML author would say it.
fn found_words(found: &str) -> String {
    let unquoted = |s: &str| s.trim_matches('`').to_owned();
    if let Some(text) = found.strip_prefix("string ") {
        return format!("the text {text}");
    }
    for prefix in ["integer ", "floating point ", "boolean "] {
        if let Some(value) = found.strip_prefix(prefix) {
            return unquoted(value);
        }
    }
    match found {
        "unit value" => "nothing (null)".into(),
        "map" => "a mapping".into(),
        "sequence" => "a list".into(),
        other => other.to_owned(),
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().trim().to_owned()
}

impl Node {
    /// The equivalent JSON value (the form the strict types are deserialized from).
    pub fn to_json(&self) -> Value {
        match &self.value {
            NodeValue::Null => Value::Null,
            NodeValue::Bool(b) => Value::Bool(*b),
            NodeValue::Int(i) => Value::from(*i),
            NodeValue::UInt(u) => Value::from(*u),
            NodeValue::Float(f) => serde_json::Number::from_f64(*f).map(Value::Number).unwrap_or(Value::Null),
            NodeValue::Str(s) => Value::String(s.clone()),
            NodeValue::Seq(items) => Value::Array(items.iter().map(Node::to_json).collect()),
            NodeValue::Map(entries) => {
                Value::Object(entries.iter().map(|(k, _, v)| (k.clone(), v.to_json())).collect())
            }
        }
    }

    /// The line of the node at a dotted path (`a.b.0.c`); for a missing key, the line of the nearest
    /// existing ancestor. A key's own line is preferred to its value's (a nested map starts below it).
    pub fn line_of(&self, path: &str) -> Option<u64> {
        let mut node = self;
        let mut line = (self.line > 0).then_some(self.line);
        for seg in path.split('.').filter(|s| !s.is_empty()) {
            let next = match &node.value {
                NodeValue::Map(entries) => entries.iter().find(|(k, _, _)| k == seg).map(|(_, kl, v)| (*kl, v)),
                NodeValue::Seq(items) => seg.parse::<usize>().ok().and_then(|i| items.get(i)).map(|v| (v.line, v)),
                _ => None,
            };
            match next {
                Some((key_line, child)) => {
                    if key_line > 0 {
                        line = Some(key_line);
                    }
                    node = child;
                }
                None => break,
            }
        }
        line
    }
}

/// Remove the value at `path` from a JSON tree. Returns false when nothing was there to remove.
fn remove_at(value: &mut Value, path: &[String]) -> bool {
    let Some((last, parents)) = path.split_last() else { return false };
    let mut cur = value;
    for seg in parents {
        cur = match cur {
            Value::Object(map) => match map.get_mut(seg) {
                Some(v) => v,
                None => return false,
            },
            Value::Array(items) => match seg.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                Some(v) => v,
                None => return false,
            },
            _ => return false,
        };
    }
    match cur {
        Value::Object(map) => map.shift_remove(last).is_some(),
        Value::Array(items) => match last.parse::<usize>() {
            Ok(i) if i < items.len() => {
                items.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// Segments of a `serde_path_to_error` path as plain strings (`?` segments become empty).
fn segments(path: &serde_path_to_error::Path) -> Vec<String> {
    use serde_path_to_error::Segment;
    path.iter()
        .map(|seg| match seg {
            Segment::Seq { index } => index.to_string(),
            Segment::Map { key } => key.clone(),
            Segment::Enum { variant } => variant.clone(),
            Segment::Unknown => String::new(),
        })
        .collect()
}

/// The unknown field named in a serde error message, if it is one.
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

/// Deserialize `T` from the tree, collecting every problem. Returns the value with defaults in place
/// of the bad nodes (so that semantic checks can still run on the rest), or `None` when even that fails.
pub fn deserialize_all<T: DeserializeOwned>(root: &Node, problems: &mut Vec<Problem>) -> Option<T> {
    deserialize_value_all(root.to_json(), &|path| root.line_of(path), problems)
}

/// [`deserialize_all`] over a JSON tree (e.g. a pack with a config's overrides merged in); `line_of`
/// places a dotted path, when it can.
pub fn deserialize_value_all<T: DeserializeOwned>(
    mut json: serde_json::Value,
    line_of: &dyn Fn(&str) -> Option<u64>,
    problems: &mut Vec<Problem>,
) -> Option<T> {
    // Each round removes one node, so the loop ends; the bound is a guard against a pathological input.
    let mut removed: Vec<Vec<String>> = Vec::new();
    for _ in 0..1000 {
        match serde_path_to_error::deserialize::<_, T>(json.clone()) {
            Ok(value) => return Some(value),
            Err(err) => {
                let mut segs = segments(err.path());
                let mut message = first_line(&err.inner().to_string());
                // For an unknown key the path names the map that holds it; point at the key itself.
                if let Some(field) = unknown_field(&message) {
                    message = suggest(&message, &field);
                    if segs.last() != Some(&field) {
                        segs.push(field);
                    }
                }
                segs.retain(|s| !s.is_empty());
                // A required key this loop removed for being bad is missing now: that was said
                // already, so the node that needs it goes without a second problem.
                let missing = missing_field(&message).map(|f| [segs.as_slice(), &[f]].concat());
                if missing.is_some_and(|path| removed.contains(&path)) {
                    if !remove_at(&mut json, &segs) {
                        return None;
                    }
                    continue;
                }
                let dotted = segs.join(".");
                problems.push(Problem { line: line_of(&dotted), path: dotted, message: plain(&message) });
                if !remove_at(&mut json, &segs) {
                    return None;
                }
                removed.push(segs);
            }
        }
    }
    None
}

/// One problem in a configuration or rule pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, when the problem can be placed.
    pub line: Option<u64>,
    /// Dotted path of the key, e.g. `budget.high_water`.
    pub path: String,
    pub message: String,
}

/// The informative line of a regex error (its Display spans several lines: pattern, caret, reason).
pub fn regex_error(e: &regex::Error) -> String {
    let text = e.to_string();
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Default)]
    #[serde(deny_unknown_fields, default)]
    struct Inner {
        n: u32,
        s: String,
    }

    #[derive(Debug, Deserialize, Default)]
    #[serde(deny_unknown_fields, default)]
    struct Outer {
        a: Inner,
        b: bool,
        list: Vec<Inner>,
    }

    #[test]
    fn lines_are_tracked_for_keys_and_items() {
        let root = parse("a:\n  n: 3\n  s: x\nlist:\n  - n: 1\n  - n: 2\n").unwrap();
        assert_eq!(root.line_of("a"), Some(1));
        assert_eq!(root.line_of("a.s"), Some(3));
        assert_eq!(root.line_of("list.1.n"), Some(6));
        assert_eq!(root.line_of("a.missing"), Some(1));
    }

    #[test]
    fn every_problem_is_reported_with_its_line() {
        let text = "a:\n  n: -1\n  typo: 1\nb: maybe\nlist:\n  - n: 1\n  - s: [1]\nextra: 2\n";
        let root = parse(text).unwrap();
        let mut problems = Vec::new();
        let out: Option<Outer> = deserialize_all(&root, &mut problems);
        assert_eq!(out.map(|o| o.list.len()), Some(2), "the good parts survive with defaults");
        let got: Vec<(Option<u64>, &str)> = problems.iter().map(|p| (p.line, p.path.as_str())).collect();
        assert_eq!(
            got,
            vec![(Some(2), "a.n"), (Some(3), "a.typo"), (Some(4), "b"), (Some(7), "list.1.s"), (Some(8), "extra")]
        );
    }

    #[test]
    fn a_clean_document_deserializes() {
        let root = parse("a: {n: 4}\nb: true\n").unwrap();
        let mut problems = Vec::new();
        let out: Outer = deserialize_all(&root, &mut problems).unwrap();
        assert_eq!((out.a.n, out.b), (4, true));
        assert!(problems.is_empty());
    }

    #[test]
    fn syntax_errors_carry_a_line_a_column_and_the_enclosing_keys() {
        let err = parse("a:\n  n: 1\n b: [\n").unwrap_err();
        assert!(err.line.is_some(), "{err:?}");
        let err = parse("budget:\n  tiers:\n    high_water: [1\n").unwrap_err();
        assert_eq!(err.line, Some(3), "{err:?}");
        assert_eq!(err.path, "budget.tiers.high_water");
        assert!(err.message.starts_with("YAML syntax error at line 3, column "), "{}", err.message);
        assert!(!err.message.contains("error: line"), "the location is said once: {}", err.message);
        assert_eq!(parse("[1, 2\n").unwrap_err().path, "(document)");
    }

    #[test]
    fn a_misspelt_key_gets_a_suggestion_and_a_foreign_one_the_list() {
        let root = parse("a:\n  nn: 1\nlsit: []\nzzzzzz: 0\n").unwrap();
        let mut problems = Vec::new();
        let _: Option<Outer> = deserialize_all(&root, &mut problems);
        let got: Vec<(&str, &str)> = problems.iter().map(|p| (p.path.as_str(), p.message.as_str())).collect();
        assert_eq!(got[0], ("a.nn", "unknown key `nn`; did you mean `n`?"));
        assert_eq!(got[1], ("lsit", "unknown key `lsit`; did you mean `list`?"));
        assert_eq!(got[2], ("zzzzzz", "unknown key `zzzzzz` (known keys: a, b, list)"));
    }

    /// Regression: messages carried serde's type names ("invalid type: string \"lots\", expected u64").
    #[test]
    fn messages_speak_of_numbers_and_text_not_rust_types() {
        let root = parse("a:\n  n: lots\n  s: [1]\nb: 3\nlist:\n  - n: -1\n  - n: 0.5\n").unwrap();
        let mut problems = Vec::new();
        let _: Option<Outer> = deserialize_all(&root, &mut problems);
        let got: Vec<&str> = problems.iter().map(|p| p.message.as_str()).collect();
        assert_eq!(
            got,
            [
                "expected a whole number from 0 to 4294967295, got the text \"lots\"",
                "expected text, got a list",
                "expected true or false, got 3",
                "expected a whole number from 0 to 4294967295, got -1",
                "expected a whole number from 0 to 4294967295, got 0.5",
            ]
        );
        for message in got {
            assert!(!["u32", "u64", "invalid type", "invalid value"].iter().any(|j| message.contains(j)), "{message}");
        }
        assert_eq!(plain("missing field `action`"), "missing key `action`");
        assert_eq!(
            plain("unknown variant `epcoh`, expected one of `epoch`, `eager`, `off`"),
            "unknown value `epcoh`; did you mean `epoch`? (expected epoch, eager, off)"
        );
        assert_eq!(plain("invalid type: map, expected f64"), "expected a number, got a mapping");
    }

    #[test]
    fn duplicate_keys_are_refused() {
        assert!(parse("a: 1\na: 2\n").is_err());
    }
}
