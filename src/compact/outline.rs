//! Structural maps of source files: the definitions (functions, types, impls, classes…) with their
//! 1-based line ranges, chosen by file extension. A careful line scanner, not a parser: braces are
//! counted outside strings and comments (Rust, Go, Java, JS/TS, C/C++), indentation is tracked for
//! Python. Line-numbered views (`cat -n`, Hermes' `12|code`) keep their real line numbers.

use std::sync::LazyLock;

use regex::Regex;

/// A language family the scanner knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Rust,
    Python,
    Script,
    Go,
    Java,
    C,
}

impl Language {
    /// The language of a path, by extension.
    pub fn of_path(path: &str) -> Option<Language> {
        let ext = path.rsplit_once('.')?.1.to_ascii_lowercase();
        Some(match ext.as_str() {
            "rs" => Language::Rust,
            "py" | "pyi" => Language::Python,
            "js" | "jsx" | "mjs" | "cjs" | "ts" | "tsx" | "mts" | "cts" => Language::Script,
            "go" => Language::Go,
            "java" | "kt" | "scala" | "cs" => Language::Java,
            "c" | "h" | "cc" | "cpp" | "cxx" | "hpp" | "hh" | "hxx" => Language::C,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Language::Rust => "rust",
            Language::Python => "python",
            Language::Script => "javascript/typescript",
            Language::Go => "go",
            Language::Java => "java",
            Language::C => "c/c++",
        }
    }
}

/// One definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// 0 = top level.
    pub depth: usize,
    pub start: usize,
    pub end: usize,
    pub signature: String,
}

/// `    12\tcode` (`cat -n`, `nl`) or `12|code` (Hermes): the number and the code. Reads bytes: it runs
/// on every line of every source read.
pub(super) fn split_numbered(line: &str) -> Option<(usize, &str)> {
    let bytes = line.as_bytes();
    let mut at = bytes.iter().position(|&b| b != b' ')?;
    let digits_start = at;
    let mut number = 0usize;
    while let Some(digit) = bytes.get(at).filter(|b| b.is_ascii_digit()) {
        number = number * 10 + usize::from(digit - b'0');
        at += 1;
        if at - digits_start > 9 {
            return None;
        }
    }
    if at == digits_start || !matches!(bytes.get(at), Some(b'\t' | b'|')) {
        return None;
    }
    Some((number, &line[at + 1..]))
}

/// [`str::lines`] with the `memchr` crate finding each line's end (cheaper than a byte loop even on
/// the short lines of source code; the standard library's `memchr` is not).
pub(super) fn short_lines(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= bytes.len() {
            return None;
        }
        let line_start = start;
        match memchr::memchr(b'\n', &bytes[start..]) {
            Some(len) => {
                start += len + 1;
                let line = &text[line_start..line_start + len];
                Some(line.strip_suffix('\r').unwrap_or(line))
            }
            None => {
                start = bytes.len();
                Some(&text[line_start..])
            }
        }
    })
}

/// The source lines with their real 1-based numbers (line-number prefixes and wrappers removed). A
/// view without line numbers is numbered from `first_line`: the line of the file it starts at (a
/// `sed -n '120,160p'` view starts at 120).
pub fn numbered_lines(text: &str, first_line: usize) -> Vec<(usize, &str)> {
    // One pass for the common case, a line-numbered view: split and number-parse together.
    let mut numbered: Vec<(usize, &str)> = Vec::with_capacity(text.len() / 32);
    let mut n_lines = 0;
    for line in short_lines(text) {
        n_lines += 1;
        if let Some(entry) = split_numbered(line) {
            numbered.push(entry);
        }
    }
    if numbered.len() * 10 >= n_lines * 6 && !numbered.is_empty() {
        return numbered;
    }
    let lines: Vec<&str> = text.lines().collect();
    // mini-swe-agent wraps plain output in `<returncode>…</returncode>\n<output>\n…\n</output>`.
    let mut start = 0;
    if lines.first().is_some_and(|l| l.trim_start().starts_with("<returncode>"))
        && let Some(pos) = lines.iter().position(|l| l.trim() == "<output>")
    {
        start = pos + 1;
    }
    let mut end = lines.len();
    if start > 0 && lines.last().is_some_and(|l| l.trim() == "</output>") {
        end -= 1;
    }
    lines[start..end.max(start)].iter().enumerate().map(|(i, l)| (i + first_line, *l)).collect()
}

/// The definitions of a source text, or `None` when the language is unknown.
pub fn outline(language: Language, text: &str, max_depth: usize, first_line: usize) -> Vec<Entry> {
    let lines = numbered_lines(text, first_line);
    let mut entries = match language {
        Language::Python => python(&lines),
        other => braces(other, &lines),
    };
    entries.retain(|e| e.depth < max_depth);
    entries.sort_by_key(|e| (e.start, e.depth));
    entries
}

fn signature(line: &str) -> String {
    let s = line.trim();
    let s = memchr::memchr(b'{', s.as_bytes()).map_or(s, |at| &s[..at]).trim_end();
    let s = s.strip_suffix(':').unwrap_or(s).trim_end();
    shorten(s, 100)
}

/// At most `max` chars, with `…` when cut.
pub fn shorten(text: &str, max: usize) -> String {
    // A char takes at least one byte: no need to count the chars of a text of at most `max` bytes.
    if text.len() <= max || text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

static PY_DEF: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\s*)(?:async\s+def|def|class)\s+\w+").expect("static regex"));

/// `PY_DEF.is_match(line)` for a line whose `head` (the line without its indentation) starts with
/// `def `, `class ` or `async `: read byte by byte while the bytes are ASCII (this runs on every
/// definition of every Python read), with the regex deciding as soon as one is not.
fn py_def(head: &str, line: &str) -> bool {
    let ascii_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    // `keyword\s+\w` at the start of `rest`: Some(answer), or None at a non-ASCII byte.
    let keyword_then_word = |rest: &[u8], keyword: &[u8]| -> Option<bool> {
        let Some(after) = rest.strip_prefix(keyword) else { return Some(false) };
        let spaces = after.iter().take_while(|b| ascii_space(b)).count();
        match after.get(spaces) {
            Some(b) if !b.is_ascii() => None,
            Some(b) => Some(spaces > 0 && (b.is_ascii_alphanumeric() || *b == b'_')),
            None => Some(false),
        }
    };
    let bytes = head.as_bytes();
    let fast = if let Some(after) = bytes.strip_prefix(b"async") {
        let spaces = after.iter().take_while(|b| ascii_space(b)).count();
        match after.get(spaces) {
            Some(b) if !b.is_ascii() => None,
            _ if spaces == 0 => Some(false),
            _ => keyword_then_word(&after[spaces..], b"def"),
        }
    } else if bytes.starts_with(b"def") {
        keyword_then_word(bytes, b"def")
    } else {
        keyword_then_word(bytes, b"class")
    };
    fast.unwrap_or_else(|| PY_DEF.is_match(line))
}

fn indent_of(line: &str) -> usize {
    line.chars().take_while(|c| c.is_whitespace()).map(|c| if c == '\t' { 4 } else { 1 }).sum()
}

/// `(indent_of(line), line.trim_start())` in one pass over the indentation; ASCII bytes are read
/// directly, a line indented with other whitespace takes the char path.
fn split_indent(line: &str) -> (usize, &str) {
    let mut width = 0;
    for (i, &b) in line.as_bytes().iter().enumerate() {
        match b {
            b'\t' => width += 4,
            b' ' | b'\n' | b'\r' | 0x0b | 0x0c => width += 1,
            0x80.. => return (indent_of(line), line.trim_start()),
            _ => return (width, &line[i..]),
        }
    }
    (width, "")
}

fn python(lines: &[(usize, &str)]) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    let mut open: Vec<(usize, usize)> = Vec::new(); // (index in out, indent)
    let mut last_code = 0;
    let mut in_string: Option<&str> = None;
    for &(num, line) in lines {
        let (indent, head) = split_indent(line);
        let trimmed = head.trim_end();
        if let Some(q) = in_string {
            if count_occurrences(trimmed, q) % 2 == 1 {
                in_string = None;
            }
            last_code = num;
            continue;
        }
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        while let Some(&(i, ind)) = open.last() {
            if indent <= ind {
                out[i].end = last_code.max(out[i].start);
                open.pop();
            } else {
                break;
            }
        }
        if (head.starts_with("def ") || head.starts_with("class ") || head.starts_with("async ")) && py_def(head, line)
        {
            out.push(Entry { depth: open.len(), start: num, end: num, signature: signature(line) });
            open.push((out.len() - 1, indent));
        }
        if memchr::memchr2(b'"', b'\'', trimmed.as_bytes()).is_some() {
            for q in ["\"\"\"", "'''"] {
                if count_occurrences(trimmed, q) % 2 == 1 {
                    in_string = Some(q);
                    break;
                }
            }
        }
        last_code = num;
    }
    for (i, _) in open {
        out[i].end = last_code.max(out[i].start);
    }
    out
}

/// Non-overlapping occurrences of a 3-byte quote (`"""` or `'''`) in a line: a byte scan, cheaper
/// than a substring searcher on short lines.
fn count_occurrences(line: &str, quote: &str) -> usize {
    // From one quote char to the next (`memchr`): most lines have few or none.
    let (bytes, q) = (line.as_bytes(), quote.as_bytes());
    let (mut i, mut n) = (0, 0);
    while let Some(found) = memchr::memchr(q[0], &bytes[i..]) {
        let at = i + found;
        if bytes[at..].starts_with(q) {
            n += 1;
            i = at + quote.len();
        } else {
            i = at + 1;
        }
    }
    n
}

static RUST_DEF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:default|async|const|unsafe|extern(?:\s+"[^"]*")?)\s+)*(?:fn|struct|enum|trait|impl|mod|union|macro_rules!)[\s<!]"#)
        .expect("static regex")
});
static GO_DEF: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(?:func\s|type\s+\w+\s+(?:struct|interface)\b)").expect("static regex"));
static JAVA_TYPE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:@\w+\s+)*(?:(?:public|private|protected|internal|static|final|abstract|sealed|open|data|strictfp|partial)\s+)*(?:class|interface|enum|record|object|struct|@interface)\s+\w+")
        .expect("static regex")
});
static JAVA_METHOD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:@\w+\s+)*(?:(?:public|private|protected|internal|static|final|abstract|synchronized|native|default|override|virtual|async)\s+)*(?:<[^>]+>\s+)?[\w<>\[\],.?]+(?:\s*<[^>]*>)?\s+\w+\s*\([^;]*$")
        .expect("static regex")
});
static SCRIPT_DEF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:export\s+)?(?:default\s+)?(?:declare\s+)?(?:abstract\s+)?(?:async\s+)?(?:function\*?\s*\w*\s*[(<]|class\s+\w+|interface\s+\w+|enum\s+\w+|namespace\s+\w+|(?:const|let|var)\s+\w+\s*(?::[^=]+)?=\s*(?:async\s+)?(?:function\b|\([^)]*\)\s*(?::[^=]+)?=>|\w+\s*=>))")
        .expect("static regex")
});
static SCRIPT_METHOD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s+(?:(?:public|private|protected|static|async|readonly|get|set|override)\s+)*\*?\w+\s*(?:<[^>]*>)?\s*\([^;]*\)\s*(?::\s*[^{;=]+)?\{\s*$")
        .expect("static regex")
});
static C_TYPE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^\s*(?:typedef\s+)?(?:template\s*<[^>]*>\s*)?(?:struct|class|enum(?:\s+class)?|union|namespace)\s+\w+[^;]*$",
    )
    .expect("static regex")
});
static C_FUNC: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:\s{0,4})(?:[\w:*&<>,~]+\s+)+[*&]*~?[\w:]+\s*\([^;]*(?:\)\s*;)?\s*$").expect("static regex")
});
static KEYWORD_START: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:if|else|for|while|switch|return|case|do|catch|try|new|throw|sizeof|await|yield|delete|using|goto|import|package|#)\b")
        .expect("static regex")
});

/// Words one of which a definition line of the language must contain (a cheap filter before the regexes).
fn may_define(language: Language, line: &str) -> bool {
    let any = |words: &[&str]| words.iter().any(|w| line.contains(w));
    match language {
        Language::Rust => any(&["fn ", "struct ", "enum ", "trait ", "impl", "mod ", "union ", "macro_rules!"]),
        Language::Go => line.starts_with("func ") || line.starts_with("type "),
        Language::Java | Language::C => {
            line.contains('(')
                || any(&["class ", "interface ", "enum ", "record ", "struct ", "union ", "namespace ", "object "])
        }
        Language::Script => line.contains('(') || any(&["class ", "interface ", "enum ", "namespace ", "function"]),
        Language::Python => false,
    }
}

fn is_definition(language: Language, line: &str) -> bool {
    if !may_define(language, line) {
        return false;
    }
    match language {
        Language::Rust => RUST_DEF.is_match(line),
        Language::Go => GO_DEF.is_match(line),
        Language::Java => JAVA_TYPE.is_match(line) || (!KEYWORD_START.is_match(line) && JAVA_METHOD.is_match(line)),
        Language::Script => {
            SCRIPT_DEF.is_match(line) || (!KEYWORD_START.is_match(line) && SCRIPT_METHOD.is_match(line))
        }
        Language::C => {
            C_TYPE.is_match(line) || (!KEYWORD_START.is_match(line) && !line.contains('=') && C_FUNC.is_match(line))
        }
        Language::Python => false,
    }
}

/// Remove string/char literals and comments from a line; `in_block` carries `/* … */` across lines.
fn clean(language: Language, line: &str, in_block: &mut bool) -> String {
    let mut out = String::with_capacity(line.len());
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if *in_block {
            if bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/') {
                *in_block = false;
                i += 2;
            } else {
                i += 1;
            }
            continue;
        }
        let b = bytes[i];
        match b {
            b'/' if bytes.get(i + 1) == Some(&b'/') => break,
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                *in_block = true;
                i += 2;
            }
            b'"' | b'`' => {
                let quote = b;
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' if language == Language::Script => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'\'' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("''");
            }
            b'\'' => {
                // A char literal ('x', '\n', '{'); a Rust lifetime ('a) is left alone.
                let close = if bytes.get(i + 1) == Some(&b'\\') { i + 3 } else { i + 2 };
                if bytes.get(close) == Some(&b'\'') {
                    i = close + 1;
                    out.push_str("' '");
                } else {
                    out.push('\'');
                    i += 1;
                }
            }
            _ => {
                // Copy up to the next byte that may open a literal or a comment (all ASCII, so the
                // slice ends on a char boundary).
                let start = i;
                i += 1;
                while i < bytes.len() && !matches!(bytes[i], b'/' | b'"' | b'`' | b'\'') {
                    i += 1;
                }
                out.push_str(&line[start..i]);
            }
        }
    }
    out
}

fn braces(language: Language, lines: &[(usize, &str)]) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    let mut open: Vec<(usize, i64)> = Vec::new(); // (index in out, depth before its `{`)
    let mut pending: Option<(usize, i64, usize)> = None; // (index in out, depth, lines waited)
    let mut depth: i64 = 0;
    let mut in_block = false;
    for &(num, line) in lines {
        let cleaned = clean(language, line, &mut in_block);
        if pending.is_none() && !cleaned.trim().is_empty() && is_definition(language, &cleaned) {
            out.push(Entry { depth: open.len(), start: num, end: num, signature: signature(line) });
            pending = Some((out.len() - 1, depth, 0));
        }
        for c in cleaned.bytes() {
            match c {
                b'{' => {
                    if let Some((i, d, _)) = pending
                        && d == depth
                    {
                        open.push((i, d));
                        pending = None;
                    }
                    depth += 1;
                }
                b'}' => {
                    depth -= 1;
                    while let Some(&(i, d)) = open.last() {
                        if depth <= d {
                            out[i].end = num;
                            open.pop();
                        } else {
                            break;
                        }
                    }
                }
                b';' => {
                    if let Some((i, d, _)) = pending
                        && d == depth
                    {
                        out[i].end = num;
                        pending = None;
                    }
                }
                _ => {}
            }
        }
        if let Some((i, d, waited)) = pending {
            if waited >= 6 {
                // No body and no `;` soon after: not a definition.
                out.remove(i);
                pending = None;
            } else {
                pending = Some((i, d, waited + 1));
            }
        }
    }
    if let Some((i, _, _)) = pending {
        out.remove(i);
    }
    let last = lines.last().map_or(0, |l| l.0);
    for (i, _) in open {
        out[i].end = last;
    }
    out
}

/// The map as text lines: `  12-40  fn foo(x: u32) -> u32`, indented by depth.
pub fn render(entries: &[Entry], max_entries: usize) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(entries.len().min(max_entries) * 48);
    for e in entries.iter().take(max_entries) {
        for _ in 0..=e.depth {
            out.push_str("  ");
        }
        let _ = write!(out, "{}", e.start);
        if e.start != e.end {
            let _ = write!(out, "-{}", e.end);
        }
        out.push_str("  ");
        out.push_str(&e.signature);
        out.push('\n');
    }
    if entries.len() > max_entries {
        let _ = writeln!(out, "  … {} more definitions", entries.len() - max_entries);
    }
    out.truncate(out.trim_end().len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(language: Language, text: &str) -> Vec<(usize, usize, usize, String)> {
        outline(language, text, 3, 1).into_iter().map(|e| (e.depth, e.start, e.end, e.signature)).collect()
    }

    #[test]
    fn short_lines_split_like_lines() {
        for text in ["", "a", "a\n", "\n", "a\nb", "a\r\nb\r\n", "\n\n", "a\r", "a\rb\n\r", "é\n\r\n x"] {
            assert_eq!(short_lines(text).collect::<Vec<_>>(), text.lines().collect::<Vec<_>>(), "{text:?}");
        }
    }

    #[test]
    fn py_def_agrees_with_the_regex() {
        for line in [
            "def f():",
            "def  f",
            "def _x",
            "def (",
            "def ",
            "def \t\u{a0}f",
            "def é()",
            "def \u{2003}x",
            "class A(B):",
            "class 1",
            "class \u{a0}",
            "async def f():",
            "async  def\tg",
            "async defx",
            "async def",
            "async def ",
            "async \u{a0}def f",
            "async def\u{a0}f",
            "async class A",
            "async",
            "    def g(self):",
        ] {
            let (_, head) = split_indent(line);
            if head.starts_with("def ") || head.starts_with("class ") || head.starts_with("async ") {
                assert_eq!(py_def(head, line), PY_DEF.is_match(line), "{line:?}");
            }
        }
    }

    #[test]
    fn triple_quotes_are_counted_without_overlap() {
        let by_bytes = |line: &str, q: u8| {
            let bytes = line.as_bytes();
            let (mut i, mut n) = (0, 0);
            while i + 2 < bytes.len() {
                if bytes[i] == q && bytes[i + 1] == q && bytes[i + 2] == q {
                    n += 1;
                    i += 3;
                } else {
                    i += 1;
                }
            }
            n
        };
        for line in
            ["", "\"", "\"\"\"", "\"\"\"\"", "\"\"\"\"\"\"", "x = '''a''' + \"\"\"b", "é\"\"\"é\"\"", "''''''''"]
        {
            assert_eq!(count_occurrences(line, "\"\"\""), by_bytes(line, b'"'), "{line:?}");
            assert_eq!(count_occurrences(line, "'''"), by_bytes(line, b'\''), "{line:?}");
        }
    }

    #[test]
    fn map_lines_write_their_numbers_in_decimal() {
        for (start, end) in [(0, 0), (7, 7), (10, 99), (100, 12_345), (1, usize::MAX)] {
            let entry = Entry { depth: 0, start, end, signature: "fn f()".into() };
            let range = if start == end { format!("{start}") } else { format!("{start}-{end}") };
            assert_eq!(render(&[entry], 10), format!("  {range}  fn f()"));
        }
    }

    #[test]
    fn numbered_prefixes() {
        assert_eq!(split_numbered("    12\tfn a()"), Some((12, "fn a()")));
        assert_eq!(split_numbered("7|x|y"), Some((7, "x|y")));
        assert_eq!(split_numbered("123456789\t"), Some((123_456_789, "")));
        for line in ["", "   ", "1234567890\tx", "12 x", "\t12\tx", "x1\ty", "  12"] {
            assert_eq!(split_numbered(line), None, "{line:?}");
        }
    }

    #[test]
    fn rust_items_with_nesting_and_tricky_literals() {
        let src = "use x;\n\npub struct A { a: u32 }\n\nimpl A {\n    pub fn new() -> Self {\n        let s = \"}\";\n        let c = '{';\n        A { a: 1 }\n    }\n\n    fn get<'a>(&'a self) -> &'a u32 {\n        &self.a\n    }\n}\n\n// fn commented() {}\nfn main() {}\n";
        assert_eq!(
            ranges(Language::Rust, src),
            vec![
                (0, 3, 3, "pub struct A".into()),
                (0, 5, 15, "impl A".into()),
                (1, 6, 10, "pub fn new() -> Self".into()),
                (1, 12, 14, "fn get<'a>(&'a self) -> &'a u32".into()),
                (0, 18, 18, "fn main()".into()),
            ]
        );
    }

    #[test]
    fn python_indentation_and_docstrings() {
        let src = "import os\n\nclass A:\n    \"\"\"Doc.\n\nnot code\n\"\"\"\n    def f(self):\n        return 1\n\n    async def g(self):\n        pass\n\ndef top():\n    x = 1\n";
        assert_eq!(
            ranges(Language::Python, src),
            vec![
                (0, 3, 12, "class A".into()),
                (1, 8, 9, "def f(self)".into()),
                (1, 11, 12, "async def g(self)".into()),
                (0, 14, 15, "def top()".into()),
            ]
        );
    }

    #[test]
    fn split_indent_agrees_with_the_char_path() {
        for line in
            ["", "x", "    def f():", "\t\tx = 1", " \t y", "   ", "\u{a0} z", "  \u{2003}w", "é", "\x0b\x0cq\r"]
        {
            assert_eq!(split_indent(line), (indent_of(line), line.trim_start()), "{line:?}");
        }
    }

    #[test]
    fn numbered_views_keep_real_line_numbers() {
        let cat_n =
            "Here's the result of running `cat -n` on /w/a.py:\n    40\tdef f():\n    41\t    return 1\n    42\t\n";
        assert_eq!(ranges(Language::Python, cat_n), vec![(0, 40, 41, "def f()".into())]);
        let hermes = "1|def greet(name):\n2|    return name\n3|";
        assert_eq!(ranges(Language::Python, hermes), vec![(0, 1, 2, "def greet(name)".into())]);
    }

    #[test]
    fn go_java_script_and_c() {
        let go = "package main\n\ntype S struct {\n\tA int\n}\n\nfunc (s *S) Run() error {\n\tif x {\n\t}\n\treturn nil\n}\n";
        assert_eq!(
            ranges(Language::Go, go),
            vec![(0, 3, 5, "type S struct".into()), (0, 7, 11, "func (s *S) Run() error".into())]
        );
        let java = "public class A {\n    private int x;\n    public int get(int y) {\n        if (y) { return 1; }\n        return x;\n    }\n}\n";
        assert_eq!(
            ranges(Language::Java, java),
            vec![(0, 1, 7, "public class A".into()), (1, 3, 6, "public int get(int y)".into())]
        );
        let ts = "export function f(a: string): number {\n  return 1;\n}\nexport const g = (x) => {\n  return '}';\n};\nclass C {\n  m(x) {\n    if (x) {\n    }\n  }\n}\n";
        assert_eq!(
            ranges(Language::Script, ts),
            vec![
                (0, 1, 3, "export function f(a: string): number".into()),
                (0, 4, 6, "export const g = (x) =>".into()),
                (0, 7, 12, "class C".into()),
                (1, 8, 11, "m(x)".into()),
            ]
        );
        let c = "#include <x.h>\nstatic int add(int a, int b)\n{\n    return a + b;\n}\nint proto(void);\nstruct P {\n  int x;\n};\n";
        assert_eq!(
            ranges(Language::C, c),
            vec![
                (0, 2, 5, "static int add(int a, int b)".into()),
                (0, 6, 6, "int proto(void);".into()),
                (0, 7, 9, "struct P".into()),
            ]
        );
    }

    #[test]
    fn languages_by_extension() {
        assert_eq!(Language::of_path("src/a.RS"), Some(Language::Rust));
        assert_eq!(Language::of_path("a.tsx"), Some(Language::Script));
        assert_eq!(Language::of_path("Makefile"), None);
        assert_eq!(Language::of_path("notes.md"), None);
    }
}
