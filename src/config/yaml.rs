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

use super::Problem;

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
        Err(err) => Err(Problem {
            line: err.location().map(|l| l.line()).filter(|&l| l > 0),
            path: String::new(),
            message: first_line(&err.to_string()),
        }),
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
    for _ in 0..1000 {
        match serde_path_to_error::deserialize::<_, T>(json.clone()) {
            Ok(value) => return Some(value),
            Err(err) => {
                let mut segs = segments(err.path());
                let message = first_line(&err.inner().to_string());
                // For an unknown key the path names the map that holds it; point at the key itself.
                if let Some(field) = unknown_field(&message)
                    && segs.last() != Some(&field)
                {
                    segs.push(field);
                }
                segs.retain(|s| !s.is_empty());
                let dotted = segs.join(".");
                problems.push(Problem { line: line_of(&dotted), path: dotted, message });
                if !remove_at(&mut json, &segs) {
                    return None;
                }
            }
        }
    }
    None
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
    fn syntax_errors_carry_a_line() {
        let err = parse("a:\n  n: 1\n b: [\n").unwrap_err();
        assert!(err.line.is_some(), "{err:?}");
    }

    #[test]
    fn duplicate_keys_are_refused() {
        assert!(parse("a: 1\na: 2\n").is_err());
    }
}
