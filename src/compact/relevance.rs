//! Relevance: which lines of an old tool output the conversation's current work names, kept
//! verbatim when the rest of the output goes to a marker.
//!
//! What is *in play* ([`InPlay`]): the identifiers (the classes `{names}` lists: snake_case and
//! camelCase names, IDs mixing letters and digits, paths, numbers of 4+ digits, and the dotted
//! parts of each) of the task (the first user message), of the last assistant turns before the
//! protected tail and of the tail itself — assistant texts, the strings of calls' arguments, the
//! tail's tool results. An agent's next step very often quotes an old output near a name it has
//! just written or read: the method it said it would change, the file a test failure points into.
//!
//! What an output keeps ([`excerpt`]): around each line naming an identifier in play, the smallest
//! definition of a numbered source view that holds the line (when it is at most
//! [`RelevanceRule::chunk_lines`] long: an exact-quote edit replaces whole statements of one
//! function), else the line with [`RelevanceRule::context_lines`] on each side; and a test run's
//! failing lines (pytest's `E …`, `FAILED …`, the last frames of a traceback). At most
//! [`RelevanceRule::max_lines`] lines, the failing ones first, then the regions naming the most
//! identifiers in play. The lines are kept byte for byte, with the line numbers a numbered view
//! shows, so an edit quoting them still matches; one `[pare: …]` line before them says which lines
//! were kept and which identifiers kept them. Nothing depends on anything but the request:
//! deterministic, and a message carrying that line is pare's own, never touched again.

use std::sync::LazyLock;

use regex::Regex;
use rustc_hash::FxHashMap;

use super::conversation::{Conversation, read_path};
use super::in_play::{InPlay, keys_of};
use super::markers::{group_digits, identifiers};
use super::outline::{Entry, Language, outline, split_numbered};
use crate::config::pack::RelevanceRule;

/// An identifier that names the lines it is on in more than this many lines of one output is too
/// common there to choose any of them (`self.assertEqual`, `model._meta`).
pub const MAX_HITS_PER_NAME: usize = 12;

/// The lines of one output kept for relevance: spans of line indices (0-based, inclusive, sorted,
/// disjoint) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excerpt {
    pub spans: Vec<(usize, usize)>,
    /// The identifiers in play that chose them, in order of first appearance.
    pub names: Vec<String>,
    /// Failing lines (a test's assertion, a traceback's last frames) are among them.
    pub failures: bool,
    /// The output is a numbered view: its lines carry their own numbers.
    pub numbered: bool,
}

/// Lines of a test run or a traceback that say what failed.
static FAILURE_LINE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^(?:E\s|FAILED\b|ERROR\b|[A-Za-z_.]*(?:Error|Exception)\b.*:|AssertionError\b|thread '.*' panicked at|assert(?:ion)? failed)",
    )
    .expect("static regex")
});

/// A traceback's frame line.
static FRAME_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"^\s*File "[^"]+", line \d+"#).expect("static regex"));

/// How many of a traceback's last frames are kept (each with the source line under it).
const LAST_FRAMES: usize = 2;

/// The excerpt of `text` for what is in play, or `None` when nothing in it is (or it would keep
/// almost all of it: then the text is not worth cutting this way). `language` and `first_line`:
/// a view of a source file, whose definitions are the chunks kept whole.
pub fn excerpt(
    text: &str,
    language: Option<Language>,
    first_line: usize,
    in_play: &InPlay,
    rule: &RelevanceRule,
) -> Option<Excerpt> {
    if rule.max_lines == 0 {
        return None;
    }
    let lines: Vec<&str> = text.lines().collect();
    let numbers: Vec<Option<usize>> = lines.iter().map(|l| split_numbered(l).map(|(n, _)| n)).collect();
    let numbered = numbers.iter().filter(|n| n.is_some()).count() * 10 >= lines.len() * 6 && !lines.is_empty();

    // Failing lines first: what a test run says went wrong.
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut failures = Vec::new();
    for (j, line) in lines.iter().enumerate() {
        let code = if numbered { split_numbered(line).map_or(*line, |(_, c)| c) } else { *line };
        if FAILURE_LINE.is_match(code.trim_start_matches(' ')) {
            failures.push((j, j));
        }
    }
    let frames: Vec<usize> = (0..lines.len()).filter(|&j| FRAME_LINE.is_match(lines[j])).collect();
    for &j in frames.iter().rev().take(LAST_FRAMES) {
        failures.push((j, (j + 1).min(lines.len() - 1)));
    }
    for (start, end) in failures {
        candidates.push(Candidate { start, end, weight: usize::MAX, names: Vec::new(), failure: true });
    }

    // Lines naming an identifier in play, with the identifiers each names.
    let mut hits: FxHashMap<&str, usize> = FxHashMap::default();
    let mut line_keys: Vec<Vec<&str>> = vec![Vec::new(); lines.len()];
    if !in_play.is_empty() {
        for (j, line) in lines.iter().enumerate() {
            // A numbered view's own header (`Here's the result of running `cat -n` on PATH:`) names
            // the path its call did: not a line of the file.
            let code = match (numbered, split_numbered(line)) {
                (true, Some((_, code))) => code,
                (true, None) => continue,
                (false, _) => *line,
            };
            for token in identifiers(code) {
                for key in keys_of(token) {
                    if in_play.contains(key) && !line_keys[j].contains(&key) {
                        line_keys[j].push(key);
                        *hits.entry(key).or_default() += 1;
                    }
                }
            }
        }
        for keys in &mut line_keys {
            keys.retain(|k| hits[k] <= MAX_HITS_PER_NAME);
        }
    }
    let entries = match (language, numbered) {
        (Some(language), true) => outline(language, text, 8, first_line),
        _ => Vec::new(),
    };
    let index_of = |n: usize| numbers.iter().position(|&m| m == Some(n));
    for j in (0..lines.len()).filter(|&j| !line_keys[j].is_empty()) {
        let chunk = numbers[j]
            .and_then(|n| innermost(&entries, n, rule.chunk_lines))
            .and_then(|e| Some((index_of(e.start)?, index_of(e.end)?)));
        let (start, end) =
            chunk.unwrap_or((j.saturating_sub(rule.context_lines), (j + rule.context_lines).min(lines.len() - 1)));
        let mut names: Vec<&str> = Vec::new();
        for k in line_keys[start..=end].iter().flatten() {
            if !names.contains(k) {
                names.push(k);
            }
        }
        // A definition whose own line names what is in play is the agent's subject, not a mention.
        let defined = chunk.is_some() && !line_keys[start].is_empty();
        let weight = names.len() + if defined { 4 } else { 0 };
        candidates.push(Candidate {
            start,
            end,
            weight,
            names: names.into_iter().map(str::to_owned).collect(),
            failure: false,
        });
    }
    if candidates.is_empty() {
        return None;
    }
    // The heaviest first; on ties the earliest lines (the order must be total).
    candidates.sort_by(|a, b| b.weight.cmp(&a.weight).then(a.start.cmp(&b.start)).then(a.end.cmp(&b.end)));
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut failures = false;
    for c in &candidates {
        let mut trial = spans.clone();
        trial.push((c.start, c.end));
        let trial = merge(trial);
        if covered(&trial) > rule.max_lines {
            continue;
        }
        spans = trial;
        failures |= c.failure;
        for n in &c.names {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    // Nothing fit, or nearly the whole output: not an excerpt.
    if spans.is_empty() || covered(&spans) * 10 >= lines.len() * 8 {
        return None;
    }
    // Names in the order the kept lines show them.
    let mut ordered: Vec<String> = Vec::new();
    for &(a, b) in &spans {
        for key in line_keys[a..=b].iter().flatten() {
            if names.iter().any(|n| n == key) && !ordered.iter().any(|n| n == key) {
                ordered.push((*key).to_owned());
            }
        }
    }
    Some(Excerpt { spans, names: ordered, failures, numbered })
}

/// The excerpt of tool result `idx` for what `conv` has in play, when `rule` asks for one: an
/// output of at least `rule.min_chars`; a view of a source file keeps its definitions whole.
pub fn excerpt_of(rule: &RelevanceRule, conv: &Conversation<'_>, idx: usize) -> Option<Excerpt> {
    if !rule.enabled {
        return None;
    }
    let text = &conv.outcomes[idx].as_ref()?.text;
    if text.len() < rule.min_chars {
        return None;
    }
    let call = conv.call_of_result[idx].map(|c| &conv.calls[c]);
    let (language, first_line) =
        call.and_then(|c| read_path(&c.arguments)).map_or((None, 1), |(path, first)| (Language::of_path(&path), first));
    excerpt(text, language, first_line, conv.in_play(rule.recent_turns), rule)
}

struct Candidate {
    start: usize,
    end: usize,
    weight: usize,
    names: Vec<String>,
    failure: bool,
}

/// The smallest definition holding file line `n`, when it is at most `max_lines` long.
fn innermost(entries: &[Entry], n: usize, max_lines: usize) -> Option<&Entry> {
    entries
        .iter()
        .filter(|e| e.start <= n && n <= e.end && e.end - e.start < max_lines)
        .min_by_key(|e| (e.end - e.start, e.start))
}

/// Overlapping or adjacent spans merged, sorted.
fn merge(mut spans: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    spans.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (a, b) in spans {
        match out.last_mut() {
            Some(last) if a <= last.1 + 1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn covered(spans: &[(usize, usize)]) -> usize {
    spans.iter().map(|(a, b)| b - a + 1).sum()
}

/// How many identifiers the explaining line names.
pub const NAMES_SHOWN: usize = 12;

impl Excerpt {
    /// The lines kept, after one line saying which and why: a view's lines keep their own numbers;
    /// an output without them shows `[pare: N lines omitted]` where lines were left out.
    pub fn render(&self, text: &str) -> String {
        let lines: Vec<&str> = text.lines().collect();
        let number = |j: usize| -> usize {
            if self.numbered { lines.get(j).and_then(|l| split_numbered(l)).map_or(j + 1, |(n, _)| n) } else { j + 1 }
        };
        let ranges: Vec<String> = self
            .spans
            .iter()
            .map(|&(a, b)| if a == b { number(a).to_string() } else { format!("{}-{}", number(a), number(b)) })
            .collect();
        let mut why: Vec<String> = Vec::new();
        if !self.names.is_empty() {
            let shown: Vec<&str> = self.names.iter().take(NAMES_SHOWN).map(String::as_str).collect();
            let more = self.names.len().saturating_sub(NAMES_SHOWN);
            let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
            why.push(format!("they name {}{tail}", shown.join(", ")));
        }
        if self.failures {
            why.push("failing lines".to_owned());
        }
        let what = if self.numbered { "lines" } else { "output lines" };
        let mut out = format!("[pare: {what} {} kept as they were: {}]", ranges.join(", "), why.join("; "));
        let mut next = 0;
        for &(a, b) in &self.spans {
            if !self.numbered && a > next {
                out.push_str(&format!("\n[pare: {} lines omitted]", group_digits(a - next)));
            }
            for line in &lines[a..=b] {
                out.push('\n');
                out.push_str(line);
            }
            next = b + 1;
        }
        if !self.numbered && next < lines.len() {
            out.push_str(&format!("\n[pare: {} lines omitted]", group_digits(lines.len() - next)));
        }
        out
    }

    /// The same excerpt without the lines of a numbered view whose numbers fall in `ranges` (lines
    /// shown elsewhere in the same marker); `None` when nothing is left.
    pub fn without_numbers(self, text: &str, ranges: &[(usize, usize)]) -> Option<Excerpt> {
        if ranges.is_empty() || !self.numbered {
            return Some(self);
        }
        let lines: Vec<&str> = text.lines().collect();
        let shown =
            |j: usize| split_numbered(lines[j]).is_some_and(|(n, _)| ranges.iter().any(|&(a, b)| (a..=b).contains(&n)));
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for &(a, b) in &self.spans {
            let mut open: Option<usize> = None;
            for j in a..=b {
                match (shown(j), open) {
                    (false, None) => open = Some(j),
                    (true, Some(start)) => {
                        spans.push((start, j - 1));
                        open = None;
                    }
                    _ => {}
                }
            }
            if let Some(start) = open {
                spans.push((start, b));
            }
        }
        (!spans.is_empty()).then_some(Excerpt { spans, ..self })
    }

    /// The kept lines' text joined (what a marker's `{names}` need not list again).
    pub fn kept_text<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let lines: Vec<&str> = text.lines().collect();
        self.spans.iter().flat_map(|&(a, b)| lines[a..=b].iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> RelevanceRule {
        RelevanceRule::default()
    }

    /// A numbered Python view of `n` lines: a function every 20 lines.
    fn view(n: usize) -> String {
        let mut out = String::from("Here's the result of running `cat -n` on /w/app.py:\n");
        for i in 1..=n {
            let code = match i % 20 {
                1 => format!("def handler_{i}(request):"),
                _ => format!("    value_{i} = compute(request, {i})"),
            };
            out.push_str(&format!("{i:6}\t{code}\n"));
        }
        out
    }

    #[test]
    fn a_definition_named_in_play_is_kept_whole_with_its_numbers() {
        let text = view(200);
        let play = InPlay::of_texts(["I will change handler_41 to check the request"]);
        let ex = excerpt(&text, Some(Language::Python), 1, &play, &rule()).expect("an excerpt");
        let kept = ex.kept_text(&text).join("\n");
        for i in 41..=60 {
            assert!(kept.contains(&format!("{i:6}\t")), "line {i}: {kept}");
        }
        assert!(!kept.contains("value_61 "), "{kept}");
        assert_eq!(ex.names, ["handler_41"]);
        let rendered = ex.render(&text);
        assert!(rendered.starts_with("[pare: lines 41-60 kept as they were: they name handler_41]"), "{rendered}");
    }

    #[test]
    fn nothing_in_play_keeps_nothing() {
        let text = view(200);
        let play = InPlay::of_texts(["unrelated_name elsewhere"]);
        assert_eq!(excerpt(&text, Some(Language::Python), 1, &play, &rule()), None);
    }

    #[test]
    fn a_test_run_keeps_its_failing_lines() {
        let mut text = String::new();
        for i in 0..80 {
            text.push_str(&format!("tests/test_app.py::test_case_{i} PASSED\n"));
        }
        text.push_str("    def test_total():\n>       assert total(3) == 4\nE       assert 3 == 4\nE        +  where 3 = total(3)\n");
        for i in 0..40 {
            text.push_str(&format!("noise line {i}\n"));
        }
        text.push_str("FAILED tests/test_app.py::test_total - assert 3 == 4\n");
        let ex = excerpt(&text, None, 1, &InPlay::default(), &rule()).expect("an excerpt");
        assert!(ex.failures);
        let rendered = ex.render(&text);
        assert!(rendered.contains("\nE       assert 3 == 4\nE        +  where 3 = total(3)\n"), "{rendered}");
        assert!(rendered.contains("\nFAILED tests/test_app.py::test_total - assert 3 == 4"), "{rendered}");
        assert!(rendered.contains("[pare: 82 lines omitted]"), "{rendered}");
        assert!(!rendered.contains("noise line 3"), "{rendered}");
    }

    #[test]
    fn a_call_meets_its_definition() {
        let play = InPlay::of_texts(["self._remake_table(model)"]);
        assert!(play.contains("_remake_table"));
        assert!(!play.contains("self"));
    }

    #[test]
    fn the_excerpt_is_bounded_and_deterministic() {
        let text = view(2000);
        let names: Vec<String> = (0..100).map(|k| format!("handler_{}", 20 * k + 1)).collect();
        let play = InPlay::of_texts(names.iter().map(String::as_str));
        let a = excerpt(&text, Some(Language::Python), 1, &play, &rule()).unwrap();
        let b = excerpt(&text, Some(Language::Python), 1, &play, &rule()).unwrap();
        assert_eq!(a, b);
        assert!(covered(&a.spans) <= rule().max_lines);
    }

    /// A session: system, task, `work`, then five small turns (the protected tail), the first
    /// saying `note`.
    fn session(work: Vec<[serde_json::Value; 2]>, note: &str) -> Vec<serde_json::Value> {
        use serde_json::json;
        let mut messages =
            vec![json!({"role": "system", "content": "agent"}), json!({"role": "user", "content": "fix the totals"})];
        messages.extend(work.into_iter().flatten());
        for k in 0..5 {
            let mut t = turn(&format!("t{k}"), json!({"command": "ls"}), "ok");
            if k == 0 {
                t[0]["content"] = json!(note);
            }
            messages.extend(t);
        }
        messages
    }

    fn turn(id: &str, args: serde_json::Value, output: &str) -> [serde_json::Value; 2] {
        use serde_json::json;
        [
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "str_replace_editor", "arguments": args.to_string()}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": output}),
        ]
    }

    /// The forwarded messages' contents joined, and the forwarded messages.
    fn forwarded(messages: &[serde_json::Value]) -> (String, Vec<String>) {
        use crate::compact::{CompactOptions, Engine};
        use crate::tokens::QuarterCounter;
        let body = serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap();
        let parsed = crate::wire::ChatBody::parse(&body).unwrap();
        let view = parsed.view();
        let out = Engine::default_pack().compact(&view, &CompactOptions::default(), &QuarterCounter);
        let mut all = out.prefix.clone();
        all.extend(view.messages[out.boundary..].iter().map(|m| (*m).to_owned()));
        let text = all
            .iter()
            .map(|m| serde_json::from_str::<serde_json::Value>(m).unwrap()["content"].as_str().unwrap_or("").to_owned())
            .collect::<Vec<_>>()
            .join("\n");
        (text, all)
    }

    /// The exact-quote rule: the lines an edit will quote, around the definition the agent says it
    /// will change, stay in the forwarded request byte for byte, with their numbers; compacting the
    /// forwarded request again changes nothing. With nothing naming it, the view is only its map.
    #[test]
    fn a_quoted_definition_in_play_stays_byte_identical() {
        use serde_json::json;
        let file = view(300);
        let lines: Vec<&str> = file.lines().skip(1).collect();
        let old_str: Vec<&str> = lines[142..146].iter().map(|l| split_numbered(l).unwrap().1).collect();
        let work = || {
            vec![
                turn("v1", json!({"command": "view", "path": "/w/app.py"}), &file),
                turn("l1", json!({"command": "ls"}), "app.py"),
                turn("l2", json!({"command": "ls"}), "app.py"),
            ]
        };
        let (text, out) = forwarded(&session(work(), "The totals go wrong in handler_141: I will change it."));
        assert!(text.contains("[pare: structure of /w/app.py"), "{text}");
        assert!(text.contains("[pare: lines 141-160 kept as they were: they name handler_141]"), "{text}");
        for (k, code) in old_str.iter().enumerate() {
            assert!(text.contains(&format!("{:6}\t{code}\n", 143 + k)), "line {}: {text}", 143 + k);
        }
        // Idempotent: pare's output compacted again is itself.
        let again: Vec<serde_json::Value> = out.iter().map(|m| serde_json::from_str(m).unwrap()).collect();
        assert_eq!(forwarded(&again).1, out);
        // Not in play: the map alone.
        let (text, _) = forwarded(&session(work(), "Let me look around."));
        assert!(text.contains("[pare: structure of /w/app.py"), "{text}");
        assert!(!text.contains(old_str[0]), "{text}");
    }

    /// A failed test run before the tail keeps its failing lines between its first and last lines.
    #[test]
    fn a_failed_test_run_keeps_its_e_lines() {
        use serde_json::json;
        let mut log = String::from("============ test session starts ============\n");
        for i in 0..120 {
            log.push_str(&format!("tests/test_totals.py::test_case_{i} PASSED\n"));
        }
        log.push_str("    def test_total():\n>       assert total([1, 2]) == 4\nE       assert 3 == 4\nE        +  where 3 = total([1, 2])\n");
        for i in 0..60 {
            log.push_str(&format!("tests/test_other.py::test_more_{i} PASSED\n"));
        }
        log.push_str("=========== short test summary info ===========\n1 failed, 180 passed\n[Command finished with exit code 1]");
        let work = vec![turn("p1", json!({"command": "pytest"}), &log)];
        let (text, _) = forwarded(&session(work, "Let me look around."));
        assert!(text.contains("\nE       assert 3 == 4\nE        +  where 3 = total([1, 2])\n"), "{text}");
        assert!(text.contains("kept as they were: failing lines]"), "{text}");
        assert!(text.contains("[...truncated "), "{text}");
        assert!(!text.contains("test_case_60 "), "{text}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// On any output and any identifiers in play: the same excerpt every time, at most
        /// `max_lines` lines, spans sorted and disjoint, every kept line one of the output's own;
        /// rendered, it is pare's own text (compacting it again leaves it alone).
        #[test]
        fn excerpts_are_deterministic_bounded_and_verbatim(
            lines in proptest::collection::vec("(E  |    |def |)[a-z_]{0,6}[0-9]{0,2}( [a-zA-Z_.]{0,12})?", 0..160),
            names in proptest::collection::vec("[a-z]{1,4}_[0-9]{1,2}", 0..6),
            numbered in proptest::bool::ANY,
            max_lines in 1usize..60,
        ) {
            let text: String = lines
                .iter()
                .enumerate()
                .map(|(i, l)| if numbered { format!("{:6}\t{l}\n", i + 1) } else { format!("{l}\n") })
                .collect();
            let play = InPlay::of_texts(names.iter().map(String::as_str));
            let rule = RelevanceRule { max_lines, ..RelevanceRule::default() };
            let language = numbered.then_some(Language::Python);
            let a = excerpt(&text, language, 1, &play, &rule);
            proptest::prop_assert_eq!(&a, &excerpt(&text, language, 1, &play, &rule));
            if let Some(a) = a {
                proptest::prop_assert!(covered(&a.spans) <= max_lines);
                proptest::prop_assert!(a.spans.windows(2).all(|w| w[0].1 + 1 < w[1].0));
                let all: Vec<&str> = text.lines().collect();
                for line in a.kept_text(&text) {
                    proptest::prop_assert!(all.contains(&line));
                }
                proptest::prop_assert!(crate::compact::markers::is_compacted(&a.render(&text)));
            }
        }
    }
}
