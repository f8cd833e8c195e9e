//! Reading a tool result: its shape (plain text, or a JSON object carrying the text in a field, as
//! Hermes sends), whether it succeeded, and its first error line.
//!
//! Success is read from an explicit status when there is one — JSON `exit_code`/`returncode`,
//! `error`, `success`; mini-swe-agent's `<returncode>N</returncode>`; OpenHands'
//! `[Command finished with exit code N]` — and otherwise from the configured error patterns.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::markers::is_compacted;
use crate::neutral::{self, MemberValue, Want};

/// The JSON keys that carry a result's main text, tried in order.
const TEXT_FIELDS: &[&str] = &["output", "content", "stdout", "result", "text"];

/// How a tool result's text is laid out.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    /// The content is the text.
    Plain,
    /// The content is a JSON object whose `field` holds the text (Hermes `{"output": …}`); `error`
    /// is its `error` text when it has one.
    JsonField { field: String, error: Option<String> },
}

/// A tool result's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// `exit` when an exit status said so.
    Failed {
        exit: Option<i64>,
    },
}

impl Status {
    pub fn is_ok(&self) -> bool {
        matches!(self, Status::Ok)
    }

    /// How markers show it.
    pub fn label(&self) -> String {
        match self {
            Status::Ok => "ok".into(),
            Status::Failed { exit: Some(code) } => format!("failed (exit {code})"),
            Status::Failed { exit: None } => "error".into(),
        }
    }
}

/// What the engine knows about one tool result.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub shape: Shape,
    /// The text the rules work on (the JSON field's value, or the whole content).
    pub text: String,
    pub status: Status,
    pub first_error: Option<String>,
    /// The text is (or holds) a pare marker: an earlier compaction replaced the output, so its
    /// status says nothing about how the call went.
    pub marker: bool,
}

impl Outcome {
    /// The call this result answers succeeded, as far as the result can tell.
    pub fn succeeded(&self) -> bool {
        self.status.is_ok() && !self.marker
    }
}

/// The compiled success policy.
#[derive(Debug)]
pub struct SuccessPolicy {
    /// All patterns as one alternation: one pass over the text decides, and one match per line
    /// finds the first matching line.
    errors: Regex,
    trust_exit_code: bool,
}

static EXCEPTION_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*").expect("static regex"));

impl SuccessPolicy {
    /// Patterns were validated with the pack; an invalid one is skipped here rather than failing.
    pub fn new(spec: &super::pack::SuccessSpec) -> SuccessPolicy {
        let patterns: Vec<Regex> = spec.error_patterns.iter().filter_map(|p| Regex::new(p).ok()).collect();
        let alternation = patterns.iter().map(|r| format!("(?:{})", r.as_str())).collect::<Vec<_>>().join("|");
        let errors = if patterns.is_empty() {
            Regex::new(r"[^\s\S]").expect("static regex")
        } else {
            Regex::new(&alternation).expect("patterns compiled one by one")
        };
        SuccessPolicy { errors, trust_exit_code: spec.trust_exit_code }
    }

    /// Read a tool result's content text.
    pub fn read(&self, content: &str) -> Outcome {
        self.read_owned(content.to_owned())
    }

    /// [`SuccessPolicy::read`] without copying the content.
    pub fn read_owned(&self, content: String) -> Outcome {
        let (shape, text, json_status) = split_shape(content);
        let exit = json_status.or_else(|| exit_from_text(&text));
        // A trusted zero exit decides alone: no need to scan the output for error patterns.
        let trusted_success =
            self.trust_exit_code && matches!(exit, Some(ExitInfo::Code(0)) | Some(ExitInfo::Success(true)));
        let matches_error = !trusted_success && self.errors.is_match(&text);
        let status = match exit {
            Some(ExitInfo::Code(0)) | Some(ExitInfo::Success(true)) if self.trust_exit_code || !matches_error => {
                Status::Ok
            }
            Some(ExitInfo::Code(0)) | Some(ExitInfo::Success(true)) => Status::Failed { exit: None },
            Some(ExitInfo::Code(code)) => Status::Failed { exit: Some(code) },
            Some(ExitInfo::Success(false)) | Some(ExitInfo::Error) => Status::Failed { exit: None },
            None if matches_error => Status::Failed { exit: None },
            None => Status::Ok,
        };
        let first_error = if matches_error || !status.is_ok() { self.first_error_line(&text, &shape) } else { None };
        let marker = is_compacted(&text);
        Outcome { shape, text, status, first_error, marker }
    }

    /// The most telling error line: a Python exception line, else the first line matching an error
    /// pattern, else the JSON `error` text.
    fn first_error_line(&self, text: &str, shape: &Shape) -> Option<String> {
        let mut first_match: Option<String> = None;
        let mut exception = None;
        let mut traceback_end = None;
        let mut in_traceback = false;
        let mut lines = super::outline::short_lines(text).filter(|l| !l.trim().is_empty()).peekable();
        while let Some(raw_line) = lines.next() {
            let l = raw_line.trim();
            // A Python traceback ends at its first unindented line: `module.Error: message`.
            if l.starts_with("Traceback (most recent call last)") {
                in_traceback = true;
            } else if in_traceback && !raw_line.starts_with(char::is_whitespace) {
                traceback_end = Some(l);
                in_traceback = false;
            }
            if is_exception_line(l) {
                exception = Some(l);
            }
            // The alternation matches a line exactly when one of the patterns does.
            if first_match.is_none() && self.errors.is_match(l) {
                // A bare `ERROR:` heading says nothing by itself: take the line that follows too.
                first_match = Some(match lines.peek() {
                    Some(next) if l.ends_with(':') && l.len() <= 16 => format!("{l} {}", next.trim()),
                    _ => l.to_owned(),
                });
            }
        }
        let exception = traceback_end.or(exception);
        let json_error: Option<String> = match shape {
            Shape::JsonField { error, .. } => error.clone(),
            Shape::Plain if text.trim_start().starts_with('{') => serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned)),
            Shape::Plain => None,
        };
        exception
            .map(str::to_owned)
            .or(first_match)
            .or(json_error.filter(|s| !s.is_empty()))
            .map(|l| super::markers::one_line(&l, 160))
            .filter(|l| !l.is_empty())
    }
}

/// `EXCEPTION_LINE.is_match(line)`, read byte by byte while the bytes are ASCII (this runs on every
/// line of every failed result), with the regex deciding at the first byte that is not. The name
/// must sit in the leading run of `[\w.]` chars after the first char and end at a word boundary.
fn is_exception_line(line: &str) -> bool {
    const NAMES: [&[u8]; 4] = [b"Error", b"Exception", b"Exit", b"Interrupt"];
    let bytes = line.as_bytes();
    match bytes.first() {
        Some(b) if b.is_ascii_alphabetic() || *b == b'_' => {}
        Some(b) if !b.is_ascii() => return EXCEPTION_LINE.is_match(line),
        _ => return false,
    }
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    for at in 1..bytes.len() {
        let b = bytes[at];
        if !b.is_ascii() {
            return EXCEPTION_LINE.is_match(line);
        }
        if !word(b) && b != b'.' {
            return false;
        }
        for name in NAMES {
            if bytes[at..].starts_with(name) {
                match bytes.get(at + name.len()) {
                    None => return true,
                    Some(next) if !next.is_ascii() => return EXCEPTION_LINE.is_match(line),
                    Some(&next) if !word(next) => return true,
                    Some(_) => {}
                }
            }
        }
    }
    false
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ExitInfo {
    Code(i64),
    Success(bool),
    Error,
}

/// The keys that carry an exit status, tried in order.
const EXIT_FIELDS: &[&str] = &["exit_code", "returncode", "exitCode", "return_code"];

/// What [`split_shape`] reads of a JSON object result, in one pass over it: the [`TEXT_FIELDS`]
/// decoded when they are strings, the status keys as raw JSON text, everything else skipped. As in
/// any JSON object map, a repeated key's last value decides.
#[derive(Debug, Default, PartialEq)]
struct ResultObject<'a> {
    texts: [Option<String>; TEXT_FIELDS.len()],
    exits: [Option<&'a str>; EXIT_FIELDS.len()],
    success: Option<&'a str>,
    error: Option<&'a str>,
}

/// Which part of a [`ResultObject`] a key fills: one mapping for both reads of it.
#[derive(Clone, Copy)]
enum Field {
    Text(usize),
    Exit(usize),
    Success,
    Error,
    Other,
}

impl Field {
    fn of(key: &str) -> Field {
        if let Some(i) = TEXT_FIELDS.iter().position(|k| *k == key) {
            Field::Text(i)
        } else if let Some(i) = EXIT_FIELDS.iter().position(|k| *k == key) {
            Field::Exit(i)
        } else {
            match key {
                "success" => Field::Success,
                "error" => Field::Error,
                _ => Field::Other,
            }
        }
    }
}

impl<'a> ResultObject<'a> {
    /// `content` read as a JSON object, or `None` when it is not one. The fast member read of
    /// [`neutral::object_members`] decodes only the text fields; what it declines (an escaped key, say)
    /// is read by serde_json.
    fn read(content: &'a str) -> Option<ResultObject<'a>> {
        let want = |key: &str| match Field::of(key) {
            Field::Text(_) => Want::Text,
            Field::Other => Want::Skip,
            _ => Want::Raw,
        };
        let Some(members) = neutral::object_members(content, want) else {
            return serde_json::from_str::<ResultObject<'_>>(content).ok();
        };
        let mut out = ResultObject::default();
        for (key, value) in members {
            match (Field::of(key), value) {
                (Field::Text(i), MemberValue::Text(text)) => out.texts[i] = Some(text),
                // A text field that is not a string.
                (Field::Text(i), MemberValue::Raw(_)) => out.texts[i] = None,
                (field, MemberValue::Raw(raw)) => out.set_status(field, raw),
                // Only text fields are decoded.
                (_, MemberValue::Text(_)) => {}
            }
        }
        Some(out)
    }

    /// A status key's raw value (text fields and other keys are not statuses).
    fn set_status(&mut self, field: Field, raw: &'a str) {
        match field {
            Field::Exit(i) => self.exits[i] = Some(raw),
            Field::Success => self.success = Some(raw),
            Field::Error => self.error = Some(raw),
            Field::Text(_) | Field::Other => {}
        }
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for ResultObject<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for ObjectVisitor<'a> {
            type Value = ResultObject<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ResultObject<'a>, A::Error> {
                let mut out = ResultObject::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match Field::of(&key) {
                        Field::Text(i) => out.texts[i] = map.next_value::<MaybeString>()?.0,
                        Field::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                        field => out.set_status(field, map.next_value::<&RawValue>()?.get()),
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(ObjectVisitor(std::marker::PhantomData))
    }
}

/// A JSON string's value, or `None` for any other JSON value (which is skipped).
struct MaybeString(Option<String>);

impl<'de> serde::Deserialize<'de> for MaybeString {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct StringVisitor;
        impl<'de> serde::de::Visitor<'de> for StringVisitor {
            type Value = MaybeString;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(v)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<MaybeString, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<MaybeString, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
        }
        d.deserialize_any(StringVisitor)
    }
}

/// Split the content into shape and text, reading any explicit status in a JSON object. The object
/// is read in one pass: only the status keys and the text fields are decoded.
fn split_shape(content: String) -> (Shape, String, Option<ExitInfo>) {
    if !content.trim_start().starts_with('{') {
        return (Shape::Plain, content, None);
    }
    let Some(mut object) = ResultObject::read(&content) else {
        return (Shape::Plain, content, None);
    };
    let mut status =
        object.exits.iter().flatten().find_map(|v| serde_json::from_str::<i64>(v).ok()).map(ExitInfo::Code);
    if status.is_none()
        && let Some(ok) = object.success.and_then(|v| serde_json::from_str::<bool>(v).ok())
    {
        status = Some(ExitInfo::Success(ok));
    }
    let mut error = None;
    match object.error.map(str::trim) {
        None | Some("null") | Some("false") | Some("\"\"") => {}
        Some(raw) => {
            status = Some(ExitInfo::Error);
            error = serde_json::from_str::<String>(raw).ok();
        }
    }
    if status.is_none() && object.error.is_some_and(|v| v.trim() == "null") {
        status = Some(ExitInfo::Success(true));
    }
    let text_field = object.texts.iter_mut().position(|t| t.is_some());
    match text_field {
        Some(i) => {
            let text = object.texts[i].take().expect("position found a text");
            drop(object);
            (Shape::JsonField { field: TEXT_FIELDS[i].to_owned(), error }, text, status)
        }
        None => {
            drop(object);
            (Shape::Plain, content, status)
        }
    }
}

/// `<returncode>N</returncode>` at the start (mini-swe-agent) or the last
/// `[Command finished with exit code N]` (OpenHands). Hand-written: this runs on every result.
fn exit_from_text(text: &str) -> Option<ExitInfo> {
    if let Some(rest) = text.trim_start().strip_prefix("<returncode>") {
        let end = rest.find("</returncode>")?;
        return rest[..end].trim().parse().ok().map(ExitInfo::Code);
    }
    const FINISHED: &str = "[Command finished with exit code ";
    // The last `[` that opens the marker (`memrchr` from the end; most texts have few `[`).
    let at = memchr::memrchr_iter(b'[', text.as_bytes()).find(|&at| text[at..].starts_with(FINISHED))?;
    let rest = &text[at + FINISHED.len()..];
    let end = rest.find(']')?;
    rest[..end].parse().ok().map(ExitInfo::Code)
}

impl Shape {
    /// The content with the text replaced, keeping the shape: a JSON object keeps its other keys
    /// (`original` is the content the shape was read from).
    pub fn embed(&self, original: &str, text: &str) -> String {
        match self {
            Shape::Plain => text.to_owned(),
            Shape::JsonField { field, .. } => match serde_json::from_str::<Map<String, Value>>(original) {
                Ok(mut object) => {
                    object.insert(field.clone(), Value::String(text.to_owned()));
                    serde_json::to_string(&object).expect("a JSON map always serializes")
                }
                Err(_) => text.to_owned(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::pack::SuccessSpec;

    fn read(s: &str) -> Outcome {
        SuccessPolicy::new(&SuccessSpec::default()).read(s)
    }

    #[test]
    fn hermes_json_success_and_failure() {
        let ok = read(r#"{"output": "a\nb", "exit_code": 0, "error": null}"#);
        assert_eq!(ok.status, Status::Ok);
        assert_eq!(ok.text, "a\nb");
        let bad = read(
            r#"{"output": "Traceback (most recent call last):\n  x\nValueError: nope", "exit_code": 1, "error": null}"#,
        );
        assert_eq!(bad.status, Status::Failed { exit: Some(1) });
        assert_eq!(bad.first_error.as_deref(), Some("ValueError: nope"));
        let err = read(r#"{"error": "file not found: a.py"}"#);
        assert_eq!(err.status, Status::Failed { exit: None });
        assert_eq!(err.first_error.as_deref(), Some("file not found: a.py"));
        let read_file = read(r#"{"content": "1|x", "total_lines": 1}"#);
        assert_eq!(read_file.status, Status::Ok);
        assert!(matches!(read_file.shape, Shape::JsonField { ref field, .. } if field == "content"));
    }

    #[test]
    fn returncode_and_openhands_exit() {
        assert_eq!(read("<returncode>0</returncode>\n<output>\nerror: x\n</output>").status, Status::Ok);
        assert_eq!(read("<returncode>2</returncode>\n<output>\n</output>").status, Status::Failed { exit: Some(2) });
        assert_eq!(read("ok\n[Command finished with exit code 1]").status, Status::Failed { exit: Some(1) });
        assert_eq!(read("ok\n[Command finished with exit code 0]").status, Status::Ok);
    }

    #[test]
    fn python_traceback_reports_its_exception_line() {
        let r = read(
            "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    x()\ndjango.core.exceptions.ImproperlyConfigured: settings missing\nafter",
        );
        assert_eq!(r.first_error.as_deref(), Some("django.core.exceptions.ImproperlyConfigured: settings missing"));
    }

    #[test]
    fn exception_lines_read_like_the_regex() {
        for line in [
            "",
            "E",
            "ValueError: x",
            "ValueError",
            "ValueErrors: x",
            "django.core.exceptions.ImproperlyConfigured: settings missing",
            "KeyboardInterrupt",
            "SystemExit: 2",
            "Exit",
            "xExit",
            "x.Exit.y",
            "ErrorError",
            "FooErrorBar Error",
            "_Error",
            "1Error",
            " ValueError",
            "tests/test_a.py::test_x PASSED",
            "ÉtatError: x",
            "ValueErroré",
            "ValueError\u{e9}",
            "Value\u{e9}Error",
            "a.b_c9.DError(x)",
            "Error-prone",
        ] {
            assert_eq!(is_exception_line(line), EXCEPTION_LINE.is_match(line), "{line:?}");
        }
    }

    #[test]
    fn bare_error_heading_takes_the_next_line() {
        let r = read("ERROR:\nInvalid `path` parameter: /w/a.py. File already exists");
        assert_eq!(r.first_error.as_deref(), Some("ERROR: Invalid `path` parameter: /w/a.py. File already exists"));
    }

    #[test]
    fn text_patterns_decide_without_status() {
        assert_eq!(read("all good").status, Status::Ok);
        let r = read("running\nthread 'main' panicked at src/x.rs:3:5\nbye");
        assert_eq!(r.status, Status::Failed { exit: None });
        assert_eq!(r.first_error.as_deref(), Some("thread 'main' panicked at src/x.rs:3:5"));
    }

    /// The one-pass object reader must read what a JSON map would: the last of repeated keys
    /// decides, text fields that are not strings are skipped, status keys are tried in order.
    #[test]
    fn json_results_read_like_a_map() {
        let r = read(r#"{"output": "first", "output": 3, "content": "second", "exit_code": "x", "returncode": 2}"#);
        assert_eq!(r.text, "second");
        assert!(matches!(r.shape, Shape::JsonField { ref field, .. } if field == "content"));
        assert_eq!(r.status, Status::Failed { exit: Some(2) });
        let r = read(r#"{"stdout": [1, {"a": "b"}], "text": "t\u00e9\n", "success": false, "error": ""}"#);
        assert_eq!(r.text, "té\n");
        assert_eq!(r.status, Status::Failed { exit: None });
        let r = read(r#"{"result": {"output": "nested"}, "error": null, "error": {"code": 1}}"#);
        assert_eq!(r.shape, Shape::Plain);
        assert_eq!(r.status, Status::Failed { exit: None });
        let r = read(r#"{"exit_code": 0, "exit_code": null, "error": null}"#);
        assert_eq!(r.status, Status::Ok);
        assert_eq!(r.shape, Shape::Plain);
        // Not an object after all: plain text.
        assert_eq!(read(r#"{"output": "x""#).shape, Shape::Plain);
        assert_eq!(read(r#"{"output": "x"} trailing"#).text, r#"{"output": "x"} trailing"#);
    }

    #[test]
    fn embed_keeps_other_json_keys() {
        let r = read(r#"{"output": "long", "exit_code": 0, "error": null}"#);
        let original = r#"{"output": "long", "exit_code": 0, "error": null}"#;
        assert_eq!(r.shape.embed(original, "short"), r#"{"output":"short","exit_code":0,"error":null}"#);
    }

    /// The fast member read fills a result object exactly as serde_json's read of the same text,
    /// repeated keys, non-string text fields, escapes and odd values included; it answers for every
    /// object serde_json writes with plain keys.
    mod object_read {
        use proptest::prelude::*;
        use serde_json::{Value, json};

        use super::super::ResultObject;

        fn value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                "(\\PC|[\"\\\\\u{1}\n\t]|é|🦀){0,40}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 16, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                    prop::collection::vec(("[a-z]{0,4}", inner), 0..3)
                        .prop_map(|entries| Value::Object(entries.into_iter().collect())),
                ]
            })
        }

        /// An object's text with repeats allowed (serde_json's maps cannot hold them).
        fn object_text() -> impl Strategy<Value = String> {
            let key = prop::sample::select(vec![
                "output",
                "content",
                "stdout",
                "result",
                "text",
                "exit_code",
                "returncode",
                "exitCode",
                "return_code",
                "success",
                "error",
                "other",
                "meta",
            ]);
            (prop::collection::vec((key, value()), 0..7), any::<bool>()).prop_map(|(members, spaced)| {
                let sep = if spaced { ", " } else { "," };
                let colon = if spaced { ": " } else { ":" };
                let body: Vec<String> = members.iter().map(|(k, v)| format!("{}{colon}{v}", json!(k))).collect();
                format!("{{{}}}", body.join(sep))
            })
        }

        proptest! {
            #[test]
            fn reads_result_objects_as_serde_json(text in object_text()) {
                let by_serde = serde_json::from_str::<ResultObject<'_>>(&text).ok();
                prop_assert!(crate::neutral::object_members(&text, |_| crate::neutral::Want::Skip).is_some(), "declined: {}", text);
                prop_assert_eq!(ResultObject::read(&text), by_serde, "text: {}", text);
            }
        }
    }
}
