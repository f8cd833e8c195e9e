//! Markers: pare's one-line stand-ins for what it removed, their `{placeholder}` templates, the
//! cheap facts they carry, and recognising pare's own output so that compaction is idempotent.
//!
//! Every marker starts with one of [`MARKER_PREFIXES`] (`[pare`, `[tool:`, `[retried:`,
//! `[system prompt:`, `[...truncated`): a bracketed note, never JSON and never a call syntax, so the
//! model reads it as a note about history rather than something to imitate.

pub use super::pack::MARKER_PREFIXES;

/// Placeholder names used in a template, in order (`{name}`; `{{` is not special).
pub fn placeholders(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) if after[..close].chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && close > 0 => {
                out.push(&after[..close]);
                rest = &after[close + 1..];
            }
            _ => rest = after,
        }
    }
    out
}

/// Fill a template; unknown placeholders are left as written (validation refuses them earlier).
pub fn render(template: &str, value_of: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) if close > 0 && after[..close].chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => {
                let name = &after[..close];
                match value_of(name) {
                    Some(v) => out.push_str(&v),
                    None => {
                        out.push('{');
                        out.push_str(name);
                        out.push('}');
                    }
                }
                rest = &after[close + 1..];
            }
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// What follows the `[` of each marker prefix (see [`MARKER_PREFIXES`]).
const MARKER_HEADS: &[&str] = &["tool: ", "retried: ", "system prompt: "];

/// Whether a text already carries a pare marker at the start of one of its lines (then no rule
/// touches it again). A hand-written scan: this runs on every message, so it must cost no more than
/// a pass over the text.
pub fn is_compacted(text: &str) -> bool {
    if !text.contains('[') {
        return false;
    }
    text.split('\n').any(|line| {
        let Some(rest) = line.trim_start_matches([' ', '\t']).strip_prefix('[') else { return false };
        let pare = rest.strip_prefix("pare").is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric() || c == '_'));
        let truncated = rest.strip_prefix("...truncated ").is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()));
        pare || truncated || MARKER_HEADS.iter().any(|h| rest.starts_with(h))
    })
}

/// The cheap facts about one tool call and its result that markers carry.
#[derive(Debug, Clone, Default)]
pub struct CallFacts {
    pub tool: String,
    /// The key argument, JSON-quoted and shortened, or empty.
    pub arg: String,
    pub id: String,
    /// `ok`, `failed (exit 2)`, `error`…
    pub status: String,
    pub chars: usize,
    pub lines: usize,
    pub first_error: Option<String>,
    pub files: Vec<String>,
}

impl CallFacts {
    /// `tool("arg")`, or `tool()` when there is no key argument.
    pub fn call(&self) -> String {
        format!("{}({})", self.tool, self.arg)
    }

    /// Value of a placeholder common to every call marker.
    pub fn value(&self, name: &str) -> Option<String> {
        Some(match name {
            "tool" => self.tool.clone(),
            "arg" => self.arg.clone(),
            "call" => self.call(),
            "id" => self.id.clone(),
            "status" => self.status.clone(),
            "chars" => group_digits(self.chars),
            "lines" => group_digits(self.lines),
            "error" => match &self.first_error {
                Some(e) => format!(": {e}"),
                None => String::new(),
            },
            "files" => files_suffix(&self.files),
            _ => return None,
        })
    }

    pub fn render(&self, template: &str) -> String {
        render(template, &|name| self.value(name))
    }
}

/// `; files: a.py, b.rs` or nothing.
pub fn files_suffix(files: &[String]) -> String {
    if files.is_empty() { String::new() } else { format!("; files: {}", files.join(", ")) }
}

/// 12345 → `12,345` (markers are read by models and people).
pub fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One line, at most `max` chars, with `…` when cut. Never splits a char.
pub fn one_line(text: &str, max: usize) -> String {
    let line = text.trim().lines().next().unwrap_or("").trim();
    shorten(line, max)
}

/// At most `max` chars, with `…` when cut.
pub fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Extensions that make a token a file path worth listing.
const FILE_EXTENSIONS: &[&str] = &[
    "py", "rs", "js", "jsx", "ts", "tsx", "mjs", "cjs", "go", "java", "kt", "c", "h", "cc", "cpp", "cxx", "hpp", "hh",
    "cs", "rb", "php", "swift", "scala", "sh", "bash", "toml", "yaml", "yml", "json", "md", "rst", "txt", "cfg", "ini",
    "html", "css", "sql", "lock", "xml", "proto",
];

const fn path_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.' | b'/')
}

/// [`path_char`] for every byte, as a table: the scan of [`mentioned_files`] tests every byte.
static PATH_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = path_char(b as u8);
        b += 1;
    }
    table
};

/// File paths mentioned in a text, in order of first appearance, deduplicated, at most `max`.
/// Only the first and last 2 KiB are scanned (a listing names its files early, a traceback its
/// culprit late): a marker lists a few names, not an index. A path is a run of `[A-Za-z0-9_.-/]`
/// whose last segment has a known extension and a name before it.
pub fn mentioned_files(text: &str, max: usize) -> Vec<String> {
    const EDGE: usize = 2048;
    let head = prefix_at_char_boundary(text, EDGE);
    let tail = if text.len() > 2 * EDGE {
        let mut start = text.len() - EDGE;
        while !text.is_char_boundary(start) {
            start += 1;
        }
        &text[start..]
    } else {
        &text[head.len()..]
    };
    let mut out: Vec<String> = Vec::new();
    for part in [head, tail] {
        for token in path_tokens(part) {
            if out.len() >= max {
                return out;
            }
            let token = token.trim_end_matches('.');
            let Some((stem, ext)) = token.rsplit_once('.') else { continue };
            if token.len() < 4 || !FILE_EXTENSIONS.contains(&ext) {
                continue;
            }
            let name = stem.rsplit('/').next().unwrap_or(stem);
            // `.gitignore`-like names and `..` segments are not what markers list.
            if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                continue;
            }
            if token.starts_with('.') && !token.starts_with("./") {
                continue;
            }
            let p = token.trim_start_matches("./");
            if !out.iter().any(|o| o == p) {
                out.push(p.to_owned());
            }
        }
    }
    out
}

/// Maximal runs of path characters that contain a `.` (a byte scan: path characters are ASCII).
fn path_tokens(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < bytes.len() {
            while i < bytes.len() && !PATH_BYTES[bytes[i] as usize] {
                i += 1;
            }
            let start = i;
            let mut dot = false;
            while i < bytes.len() && PATH_BYTES[bytes[i] as usize] {
                dot |= bytes[i] == b'.';
                i += 1;
            }
            if dot && i > start {
                return Some(&text[start..i]);
            }
        }
        None
    })
}

/// The longest prefix of at most `max` bytes ending on a char boundary.
pub fn prefix_at_char_boundary(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_fills_known_and_keeps_unknown() {
        let out = render("[tool: {a} {b} {} {c", &|n| (n == "a").then(|| "x".to_string()));
        assert_eq!(out, "[tool: x {b} {} {c");
        assert_eq!(placeholders("[pare: {n} x {tools}{files} {}"), vec!["n", "tools", "files"]);
    }

    #[test]
    fn compacted_text_is_recognised_only_at_line_start() {
        assert!(is_compacted("[tool: read_file(\"a\") → ok, 3 chars, 1 lines]"));
        assert!(is_compacted("a\nb\n[...truncated 12 lines...]\nc"));
        assert!(is_compacted("[pare: …truncated 10 chars…]"));
        assert!(!is_compacted("print('[tool: x')"));
        assert!(!is_compacted("[...truncated by the tool itself]"));
        assert!(!is_compacted("plain output"));
    }

    #[test]
    fn facts_render_with_optional_parts() {
        let f = CallFacts {
            tool: "terminal".into(),
            arg: "\"pytest -x\"".into(),
            status: "failed (exit 1)".into(),
            chars: 12345,
            lines: 3,
            first_error: Some("AssertionError: boom".into()),
            files: vec!["a.py".into()],
            ..Default::default()
        };
        assert_eq!(
            f.render("[tool: {call} → {status}, {chars} chars{error}{files}]"),
            "[tool: terminal(\"pytest -x\") → failed (exit 1), 12,345 chars: AssertionError: boom; files: a.py]"
        );
    }

    #[test]
    fn files_are_found_and_deduplicated() {
        let files = mentioned_files("edit ./src/app.py then src/app.py and /w/x/util.rs; v1.2 and .gitignore", 5);
        assert_eq!(files, vec!["src/app.py".to_string(), "/w/x/util.rs".to_string()]);
    }

    #[test]
    fn shorten_never_splits_chars() {
        assert_eq!(shorten("héllo wörld", 5), "héll…");
        assert_eq!(one_line("  first\nsecond", 80), "first");
    }
}
