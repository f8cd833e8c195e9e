//! The files a conversation edits, and what that says about its reads of them: which read of a path
//! is the latest (an older full read of the same path is superseded), and which lines of a read the
//! conversation's edits of that file touch (an edit's old text found in the read: the agent edits
//! there after reading; its new text found there: the agent edited there before reading).
//!
//! Read from the calls' arguments only (`old_str`/`new_str` and their spellings, `insert_line`), over
//! the whole conversation including the protected tail, so it is a pure function of the request:
//! compaction stays deterministic.

use std::collections::HashMap;

use serde_json::Value;

use super::conversation::{Conversation, path_argument, read_path};

/// Keys of an edit call's argument that hold text the edit replaces or writes.
const EDIT_TEXT_KEYS: [&str; 6] = ["old_str", "new_str", "old_string", "new_string", "old_text", "new_text"];

/// Keys that make a call with a path an edit rather than a read.
const EDIT_KEYS: [&str; 9] =
    ["old_str", "new_str", "old_string", "new_string", "old_text", "new_text", "insert_line", "file_text", "content"];

/// One edit call of a file.
#[derive(Debug, Clone)]
struct Edit {
    /// The texts it replaced or wrote, each as its trimmed, non-blank lines in pieces: an old call's
    /// text that compaction shortened (the `arguments` rule) keeps its first and last lines around
    /// a pare marker line, and each side of the marker is a piece found on its own.
    texts: Vec<Vec<Vec<String>>>,
    /// `insert_line`: the line it inserted after.
    insert_line: Option<usize>,
}

/// What the conversation's calls say about the files it reads and edits (see the module docs).
#[derive(Debug, Default)]
pub struct FileEdits {
    /// Path → its edits, in call order.
    edits: HashMap<String, Vec<Edit>>,
    /// Path → the result index of its latest full read.
    latest_read: HashMap<String, usize>,
    /// Result index → the path it reads in full.
    reads: HashMap<usize, String>,
    /// Path → the result indices of its full reads, in order.
    reads_of: HashMap<String, Vec<usize>>,
    /// Path → the assistant message of the latest call that names it (its path argument, or in its
    /// arguments' text): where the agent last worked on the file.
    last_touch: HashMap<String, usize>,
}

impl FileEdits {
    pub fn new(conv: &Conversation<'_>) -> FileEdits {
        let mut out = FileEdits::default();
        for call in &conv.calls {
            let Ok(Value::Object(args)) = serde_json::from_str::<Value>(&call.arguments) else { continue };
            let is_edit = EDIT_KEYS.iter().any(|k| args.contains_key(*k));
            if is_edit {
                let Some(path) = path_argument(&call.arguments) else { continue };
                let texts = EDIT_TEXT_KEYS
                    .iter()
                    .filter_map(|k| args.get(*k).and_then(Value::as_str))
                    .map(pieces)
                    .filter(|pieces: &Vec<Vec<String>>| !pieces.is_empty())
                    .collect();
                let insert_line = args.get("insert_line").and_then(Value::as_u64).map(|n| n as usize);
                out.edits.entry(path).or_default().push(Edit { texts, insert_line });
                continue;
            }
            let Some(result) = call.result else { continue };
            if args.contains_key("view_range") || !conv.outcomes[result].as_ref().is_some_and(|o| o.status.is_ok()) {
                continue;
            }
            // A path-argument call whose `command` is not `view` writes or undoes (an editor's
            // `create`, `undo_edit`): not a read.
            let command = args.get("command").and_then(Value::as_str);
            if path_argument(&call.arguments).is_some() && command.is_some_and(|c| c != "view") {
                continue;
            }
            if let Some((path, 1)) = read_path(&call.arguments) {
                out.latest_read.insert(path.clone(), result);
                out.reads_of.entry(path.clone()).or_default().push(result);
                out.reads.insert(result, path);
            }
        }
        let paths: Vec<&String> = out.edits.keys().collect();
        for call in &conv.calls {
            for path in &paths {
                if call.arguments.contains(path.as_str()) {
                    out.last_touch.insert((*path).clone(), call.msg);
                }
            }
        }
        out
    }

    /// When result `idx` is the latest full read of a file the conversation edits: the assistant
    /// message of the latest call that names that file.
    pub fn last_touch_of_latest_read(&self, idx: usize) -> Option<usize> {
        let path = self.reads.get(&idx)?;
        (self.latest_read.get(path) == Some(&idx)).then(|| self.last_touch.get(path).copied()).flatten()
    }

    /// The conversation edits `path`.
    pub fn is_edited(&self, path: &str) -> bool {
        self.edits.contains_key(path)
    }

    /// Result `idx` is a full read of a path that a later full read before message `end` shows again.
    pub fn is_superseded_before(&self, idx: usize, end: usize) -> bool {
        self.reads
            .get(&idx)
            .and_then(|path| self.reads_of.get(path))
            .is_some_and(|reads| reads.iter().any(|&r| r > idx && r < end))
    }

    /// Result `idx` is the latest full read of a file the conversation edits.
    pub fn is_latest_read_of_edited(&self, idx: usize) -> bool {
        self.reads.get(&idx).is_some_and(|path| self.latest_read.get(path) == Some(&idx) && self.is_edited(path))
    }

    /// The line ranges (1-based, inclusive, in the file's numbering) of a read of `path` that its
    /// edits touch, each widened by `context` lines on both sides, merged, the most recent edits'
    /// first, at most `max_lines` lines in all; `lines` are the read's numbered lines. Sorted.
    pub fn regions(
        &self,
        path: &str,
        lines: &[(usize, &str)],
        context: usize,
        max_lines: usize,
    ) -> Vec<(usize, usize)> {
        let Some(edits) = self.edits.get(path) else { return Vec::new() };
        let (Some(&(first, _)), Some(&(last, _))) = (lines.first(), lines.last()) else { return Vec::new() };
        let trimmed: Vec<&str> = lines.iter().map(|(_, l)| l.trim()).collect();
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for edit in edits.iter().rev() {
            for text in &edit.texts {
                if let Some((a, b)) = find_pieces(&trimmed, text) {
                    spans.push((lines[a].0, lines[b].0));
                }
            }
            if let Some(n) = edit.insert_line.filter(|n| (first..=last).contains(n)) {
                spans.push((n, n));
            }
        }
        let mut kept: Vec<(usize, usize)> = Vec::new();
        let mut total = 0;
        for (a, b) in spans {
            let (a, b) = (a.saturating_sub(context).max(first), (b + context).min(last));
            let mut merged = kept.clone();
            merged.push((a, b));
            let merged = merge(merged);
            let size: usize = merged.iter().map(|(a, b)| b - a + 1).sum();
            if size > max_lines {
                if total == 0 {
                    // Even the latest edit's region alone is over: keep its first `max_lines`.
                    kept = vec![(a, (a + max_lines - 1).min(b))];
                }
                break;
            }
            kept = merged;
            total = size;
        }
        kept
    }
}

/// A text's trimmed, non-blank lines, split at pare's marker lines (see [`Edit::texts`]).
fn pieces(text: &str) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = vec![Vec::new()];
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with("[pare") {
            out.push(Vec::new());
        } else if let Some(piece) = out.last_mut() {
            piece.push(line.to_owned());
        }
    }
    out.retain(|piece| !piece.is_empty());
    out
}

/// Where the pieces of a text lie in `hay`, in order (the first piece's first place, each next one
/// after it): the indices of the first line of the first piece and the last line of the last. A
/// shortened text may be cut inside a line, so a piece's line next to a marker need only end (after
/// the marker) or start (before it) like the line it stands for.
fn find_pieces(hay: &[&str], pieces: &[Vec<String>]) -> Option<(usize, usize)> {
    let n = pieces.len();
    let mut span: Option<(usize, usize)> = None;
    for (k, piece) in pieces.iter().enumerate() {
        let from = span.map_or(0, |(_, end)| end + 1);
        let (start, end) = find_lines(hay, piece, from, k > 0, k + 1 < n)?;
        span = Some((span.map_or(start, |(first, _)| first), end));
    }
    span
}

/// The first place from `from` on where `needle`'s lines follow each other in `hay` (blank lines of
/// `hay` skipped, as `needle` has none): the indices of its first and last line. With `cut_head`
/// its first line need only end the line it matches, with `cut_tail` its last line only start it.
fn find_lines(hay: &[&str], needle: &[String], from: usize, cut_head: bool, cut_tail: bool) -> Option<(usize, usize)> {
    let last = needle.len().checked_sub(1)?;
    let matches = |k: usize, line: &str| -> bool {
        let want = needle[k].as_str();
        match (k == 0 && cut_head, k == last && cut_tail) {
            (true, true) => line.contains(want),
            (true, false) => line.ends_with(want),
            (false, true) => line.starts_with(want),
            (false, false) => line == want,
        }
    };
    'start: for start in from..hay.len() {
        if !matches(0, hay[start]) {
            continue;
        }
        let mut at = start;
        for k in 1..=last {
            at += 1;
            while at < hay.len() && hay[at].is_empty() {
                at += 1;
            }
            if at >= hay.len() || !matches(k, hay[at]) {
                continue 'start;
            }
        }
        return Some((start, at));
    }
    None
}

/// Sorted, overlapping or touching ranges joined.
fn merge(mut spans: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    spans.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (a, b) in spans {
        match out.last_mut() {
            Some(last) if a <= last.1 + 1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(n: usize) -> Vec<(usize, String)> {
        (1..=n).map(|i| (i, format!("line_{i} = value_{i}"))).collect()
    }

    fn edits_of(path: &str, texts: &[&str]) -> FileEdits {
        let edit = Edit { texts: texts.iter().map(|t| pieces(t)).collect(), insert_line: None };
        FileEdits { edits: HashMap::from([(path.to_owned(), vec![edit])]), ..FileEdits::default() }
    }

    #[test]
    fn an_edit_keeps_the_lines_it_touches_with_their_context() {
        let lines = numbered(200);
        let view: Vec<(usize, &str)> = lines.iter().map(|(n, l)| (*n, l.as_str())).collect();
        let edits = edits_of("/w/a.py", &["line_100 = value_100\n    line_101 = value_101"]);
        assert_eq!(edits.regions("/w/a.py", &view, 5, 100), vec![(95, 106)]);
        assert!(edits.regions("/w/b.py", &view, 5, 100).is_empty());
        // Text not in the view touches nothing; the cap keeps the start of a region too large.
        assert!(edits_of("/w/a.py", &["nowhere"]).regions("/w/a.py", &view, 5, 100).is_empty());
        assert_eq!(edits.regions("/w/a.py", &view, 50, 30), vec![(50, 79)]);
    }

    /// An old edit call whose text compaction shortened (first and last lines around a marker line)
    /// still finds its whole span: its first lines, then its last lines after them.
    #[test]
    fn a_shortened_edit_text_spans_from_its_first_to_its_last_lines() {
        let lines = numbered(200);
        let view: Vec<(usize, &str)> = lines.iter().map(|(n, l)| (*n, l.as_str())).collect();
        let shortened = "line_60 = value_60\nline_61 = value_61\n[pare: 20 lines, 400 chars of this old old_str elided; the call was sent in full]\nline_84 = value_84";
        assert_eq!(edits_of("p", &[shortened]).regions("p", &view, 2, 100), vec![(58, 86)]);
        // The last lines must follow the first ones.
        let backwards = "line_60 = value_60\n[pare: elided]\nline_10 = value_10";
        assert!(edits_of("p", &[backwards]).regions("p", &view, 2, 100).is_empty());
        // Cut inside lines: the head ends mid-line, the tail starts mid-line.
        let cut = "line_60 = value_60\nline_61 = val\n[pare: …truncated…]\nue_70\nline_71 = value_71";
        assert_eq!(edits_of("p", &[cut]).regions("p", &view, 0, 100), vec![(60, 71)]);
    }

    #[test]
    fn regions_merge_and_stop_at_the_cap_with_the_latest_edits_first() {
        let lines = numbered(300);
        let view: Vec<(usize, &str)> = lines.iter().map(|(n, l)| (*n, l.as_str())).collect();
        let older = Edit { texts: vec![pieces("line_20 = value_20")], insert_line: None };
        let newer = Edit { texts: vec![pieces("line_250 = value_250")], insert_line: Some(30) };
        let edits = FileEdits { edits: HashMap::from([("p".to_owned(), vec![older, newer])]), ..FileEdits::default() };
        assert_eq!(edits.regions("p", &view, 5, 100), vec![(15, 35), (245, 255)]);
        // Room for the newest edit's regions only.
        assert_eq!(edits.regions("p", &view, 5, 25), vec![(25, 35), (245, 255)]);
    }
}
