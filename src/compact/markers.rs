//! Markers: pare's one-line stand-ins for what it removed, their `{placeholder}` templates, the
//! cheap facts they carry, and recognising pare's own output so that compaction is idempotent.
//!
//! Every marker starts with one of [`MARKER_PREFIXES`] (`[pare`, `[tool:`, `[retried:`,
//! `[system prompt:`, `[...truncated`): a bracketed note, never JSON and never a call syntax, so the
//! model reads it as a note about history rather than something to imitate.

use rustc_hash::FxHashSet;

pub use crate::config::pack::{MARKER_PREFIXES, placeholders};

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
///
/// Only the `[`s are visited (`memchr` from one to the next): one opens a marker when nothing but
/// spaces and tabs precede it on its line. What follows it is read up to the end of the text rather
/// than of the line, which decides the same: no marker head contains a newline, and a newline after
/// `[pare` or `[...truncated ` is neither a word char nor a digit.
pub fn is_compacted(text: &str) -> bool {
    let bytes = text.as_bytes();
    for at in memchr::memchr_iter(b'[', bytes) {
        let blank = |b: &u8| matches!(b, b' ' | b'\t');
        // Most `[`s follow a char of their line's text: one byte tells.
        if at > 0 && !blank(&bytes[at - 1]) && bytes[at - 1] != b'\n' {
            continue;
        }
        // Back over the blanks only (each blank run is read once, by the `[` that ends it).
        if bytes[..at].iter().rposition(|b| !blank(b)).is_some_and(|p| bytes[p] != b'\n') {
            continue;
        }
        let rest = &text[at + 1..];
        let pare = rest.strip_prefix("pare").is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric() || c == '_'));
        let truncated = rest.strip_prefix("...truncated ").is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()));
        if pare || truncated || MARKER_HEADS.iter().any(|h| rest.starts_with(h)) {
            return true;
        }
    }
    false
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
    /// How many tool calls the assistant message made (this one included).
    pub siblings: usize,
}

impl CallFacts {
    /// `tool("arg")`, or `tool()` when there is no key argument.
    pub fn call(&self) -> String {
        format!("{}({})", self.tool, self.arg)
    }

    /// What names the call in a marker that answers it: the call itself stays right above, so the
    /// tool's name is enough — `tool("arg")` only when the message made several calls, which the
    /// markers must then tell apart.
    pub fn reference(&self) -> String {
        if self.siblings > 1 { self.call() } else { self.tool.clone() }
    }

    /// Value of a placeholder common to every call marker.
    pub fn value(&self, name: &str) -> Option<String> {
        Some(match name {
            "tool" => self.tool.clone(),
            "arg" => self.arg.clone(),
            "call" => self.call(),
            "ref" => self.reference(),
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

/// `; names: read_dataset, 8JX2WO` or nothing.
pub fn names_suffix<S: std::borrow::Borrow<str>>(names: &[S]) -> String {
    if names.is_empty() { String::new() } else { format!("; names: {}", names.join(", ")) }
}

/// What an elision marker in the default form says: `[pare: 12 earlier messages elided — read_file ×5,
/// assistant notes ×2; files: a.py]`. A later elision that swallows the marker adds these to its own
/// counts, so that markers from successive epochs merge into one instead of piling up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ElisionSummary {
    pub messages: usize,
    /// Per tool (or `system`), how many results; in the marker's order.
    pub tools: Vec<(String, usize)>,
    pub notes: usize,
    pub files: Vec<String>,
    /// The identifiers it lists (`{names}`), most recent first.
    pub names: Vec<String>,
    /// The content ids of the outputs it stands for (`{retrieve}`), most recent first; with
    /// `listed`, the one id of their id list.
    pub ids: Vec<String>,
    /// The marker names an id list ([`id_list_text`]) rather than the outputs' ids.
    pub listed: bool,
}

/// Read back an elision marker rendered from the default `elision_template`; `None` for anything else
/// (a custom template's markers are then never merged, only kept).
pub fn parse_elision(text: &str) -> Option<ElisionSummary> {
    let rest = text.strip_prefix("[pare: ")?.strip_suffix(']')?;
    let (count, rest) = rest.split_once(" earlier messages elided — ")?;
    let messages = count.replace(',', "").parse().ok()?;
    let (rest, names) = match rest.split_once("; names: ") {
        Some((rest, names)) => (rest, names.split(", ").map(str::to_owned).collect()),
        None => (rest, Vec::new()),
    };
    let (rest, ids, listed) = match rest.split_once("; ids") {
        Some((rest, ids)) => match ids.split_once(" listed in ") {
            Some((_, list)) => (rest, vec![list.to_owned()], true),
            None => (rest, ids.split_once(": ")?.1.split(", ").map(str::to_owned).collect(), false),
        },
        None => (rest, Vec::new(), false),
    };
    let (what, files) = match rest.split_once("; files: ") {
        Some((what, files)) => (what, files.split(", ").map(str::to_owned).collect()),
        None => (rest, Vec::new()),
    };
    let mut summary = ElisionSummary { messages, files, names, ids, listed, ..ElisionSummary::default() };
    for item in what.split(", ").filter(|i| !i.is_empty()) {
        let (name, k) = item.rsplit_once(" ×")?;
        let k: usize = k.replace(',', "").parse().ok()?;
        if name == "assistant notes" {
            summary.notes += k;
        } else {
            summary.tools.push((name.to_owned(), k));
        }
    }
    Some(summary)
}

/// How many hex digits of a content's SHA-256 a marker shows after `pare:`: 48 bits, a few tokens,
/// and unique in an archive of millions of contents (the archive resolves any unique prefix of 8 or
/// more digits).
pub const CONTENT_ID_HEX: usize = 12;

/// The id a marker names a hidden content by: `pare:` and the first [`CONTENT_ID_HEX`] lowercase hex
/// digits of the SHA-256 of the content's exact text (what the agent sent). A pure function of the
/// text, so the same content has the same id in `pare replay`, across restarts and epochs, and the
/// archive, which stores each named content under its SHA-256, resolves it.
pub fn content_id(text: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(text.as_bytes());
    let mut out = String::with_capacity(5 + CONTENT_ID_HEX);
    out.push_str("pare:");
    for byte in &digest[..CONTENT_ID_HEX / 2] {
        out.push(char::from(b"0123456789abcdef"[usize::from(byte >> 4)]));
        out.push(char::from(b"0123456789abcdef"[usize::from(byte & 15)]));
    }
    out
}

/// The hex digits of every content id in a text (`pare:` then exactly [`CONTENT_ID_HEX`] lowercase
/// hex digits, not part of a longer word), in order, repeats included.
pub fn content_ids_in(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    memchr::memmem::find_iter(bytes, b"pare:").filter_map(move |at| {
        let start = at + 5;
        let end = start + CONTENT_ID_HEX;
        let word_before = at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        let hex = bytes.get(start..end)?.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
        let word_after = bytes.get(end).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_');
        (!word_before && hex && !word_after).then(|| &text[start..end])
    })
}

/// The texts of a message a marker may stand for, each of which a content id can name: the
/// message's text (a tool's output, a system prompt, an assistant note) and, for each tool call,
/// its arguments and each of their top-level string values (what the arguments rule cuts). Empty
/// texts are left out. The archive stores the ones the forwarded markers name; `pare eval` resolves
/// ids against them.
pub fn content_texts(message: &crate::neutral::Message) -> Vec<String> {
    let mut out = Vec::new();
    let text = message.text();
    if !text.is_empty() {
        out.push(text);
    }
    for call in message.tool_calls.iter().flatten() {
        let Some(function) = &call.function else { continue };
        let arguments = match &function.arguments {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => continue,
            other => other.to_string(),
        };
        if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(&arguments) {
            out.extend(map.into_iter().filter_map(|(_, v)| match v {
                serde_json::Value::String(s) if !s.is_empty() => Some(s),
                _ => None,
            }));
        }
        if !arguments.is_empty() {
            out.push(arguments);
        }
    }
    out
}

/// How many outputs an elision marker names by their own ids, at most: a run of more names one id,
/// that of its id list ([`id_list_text`]), which the archive stores like any named content. One
/// list id costs fewer tokens than the ids it replaces from two ids on (measured with the default
/// tokenizer: `one_list_id_is_cheaper_than_two_ids`), so only a lone output is named inline.
pub const IDS_INLINE_MAX: usize = 1;

/// How an id list describes a member that is itself an id list (an earlier elision's).
pub const LIST_ENTRY: &str = "list of the ids an earlier elision hid";

/// One line of an id list: the id, then what it names when known (the call that produced the
/// output, `read_file("src/a.py")`, or [`LIST_ENTRY`]).
pub fn id_entry(id: &str, what: &str) -> String {
    if what.is_empty() { id.to_owned() } else { format!("{id} {what}") }
}

/// The id an id-list line starts with.
pub fn entry_id(entry: &str) -> &str {
    entry.split_once(' ').map_or(entry, |(id, _)| id)
}

/// Whether an id-list line names an id list.
fn names_a_list(entry: &str) -> bool {
    entry.split_once(' ').is_some_and(|(_, what)| what.starts_with(LIST_ENTRY))
}

/// The text an elision marker's list id names: a heading line, then one [`id_entry`] per line, most
/// recent output first. A pure function of the entries, so the same run has the same list id in
/// `pare replay`, across restarts and epochs.
pub fn id_list_text<S: std::borrow::Borrow<str>>(entries: &[S]) -> String {
    let mut out = format!(
        "content ids of the {} outputs a pare elision marker stands for, most recent first; each line: an id, \
         then the call whose output it names\n",
        entries.len()
    );
    for entry in entries {
        out.push_str(entry.borrow());
        out.push('\n');
    }
    out
}

/// Whether an elision marker for these id-list entries names one list id rather than the ids: more
/// than [`IDS_INLINE_MAX`] distinct ids, or a member that is an id list itself (a list is named
/// as a list, never inline among outputs).
pub fn ids_listed<S: std::borrow::Borrow<str>>(entries: &[S]) -> bool {
    let mut distinct: Vec<&str> = Vec::with_capacity(IDS_INLINE_MAX + 1);
    for entry in entries {
        let entry = entry.borrow();
        if names_a_list(entry) {
            return true;
        }
        let id = entry_id(entry);
        if !distinct.contains(&id) {
            if distinct.len() == IDS_INLINE_MAX {
                return true;
            }
            distinct.push(id);
        }
    }
    false
}

/// The id list an elision marker for these entries names that compaction derives ([`id_list_text`]),
/// when it names one: `None` when it names its outputs' ids inline, or the list of an earlier marker
/// alone.
pub fn derived_id_list<S: std::borrow::Borrow<str>>(entries: &[S]) -> Option<String> {
    (ids_listed(entries) && entries.len() > 1).then(|| id_list_text(entries))
}

/// What an elision marker says to get its outputs back (`{retrieve}`), given its id-list entries
/// (most recent first): `; ids: pare:…`, or for more than [`IDS_INLINE_MAX`] outputs
/// `; ids listed in pare:…` (the id of [`id_list_text`]); with pare's retrieve tool in the request,
/// `; ids (get back with TOOL): …` / `; ids (get back with TOOL) listed in pare:…`; nothing without
/// entries.
pub fn ids_suffix<S: std::borrow::Borrow<str>>(entries: &[S], tool: Option<&str>) -> String {
    if entries.is_empty() {
        return String::new();
    }
    let how = tool.map(|tool| format!(" (get back with {tool})")).unwrap_or_default();
    if ids_listed(entries) {
        let list = match entries {
            // An earlier marker's list alone (that marker elided again): its own id, not a list of it.
            [one] => entry_id(one.borrow()).to_owned(),
            _ => content_id(&id_list_text(entries)),
        };
        return format!("; ids{how} listed in {list}");
    }
    let mut ids: Vec<&str> = Vec::with_capacity(entries.len());
    for entry in entries {
        let id = entry_id(entry.borrow());
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    format!("; ids{how}: {}", ids.join(", "))
}

/// The name of pare's retrieve tool (the MCP server's tool, see the README).
pub const RETRIEVE_TOOL: &str = "retrieve";

/// The name of the tool in a request's tool definitions (raw JSON of any wire format) that is pare's
/// retrieve tool, when there is one: a tool named `retrieve` or ending in `_retrieve` (MCP clients
/// name a server's tools `mcp__SERVER__TOOL`, `SERVER__TOOL` or `mcp_SERVER_TOOL`) whose name or
/// description names pare as a word. Markers then say to call it; without it they show the id only.
pub fn retrieve_tool(tools: Option<&str>) -> Option<String> {
    let tools = tools?;
    // Most requests have no such tool: one substring search decides before any parse.
    memchr::memmem::find(tools.as_bytes(), b"retrieve\"")?;
    let parsed: serde_json::Value = serde_json::from_str(tools).ok()?;
    let list = parsed.as_array()?;
    list.iter().find_map(|tool| {
        let def = tool.get("function").unwrap_or(tool);
        let name = def.get("name")?.as_str()?;
        let named = name == RETRIEVE_TOOL || name.ends_with("_retrieve");
        let about_pare = names_pare(name) || def.get("description").and_then(|d| d.as_str()).is_some_and(names_pare);
        (named && about_pare).then(|| name.to_owned())
    })
}

/// Whether `text` has `pare` as a word of its own (`mcp__pare__retrieve`, "…pare's archive"), not
/// inside another (`compare`, `prepared`).
fn names_pare(text: &str) -> bool {
    let bytes = text.as_bytes();
    memchr::memmem::find_iter(bytes, b"pare").any(|at| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + 4).copied();
        !before.is_some_and(|b| b.is_ascii_alphanumeric()) && !after.is_some_and(|b| b.is_ascii_alphanumeric())
    })
}

/// What a marker says to get content `text` back (`{retrieve}`): `; pare:0123456789ab`, or with
/// pare's retrieve tool in the request, `; get it back with TOOL("pare:0123456789ab")`.
pub fn retrieve_suffix(id: &str, tool: Option<&str>) -> String {
    match tool {
        Some(tool) => format!("; get it back with {tool}(\"{id}\")"),
        None => format!("; {id}"),
    }
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

/// [`group_digits`] for a signed count (`-1,234`).
pub fn group_signed(n: i64) -> String {
    let digits = group_digits(n.unsigned_abs() as usize);
    if n < 0 { format!("-{digits}") } else { digits }
}

/// One line, at most `max` chars, with `…` when cut. Never splits a char.
pub fn one_line(text: &str, max: usize) -> String {
    let line = text.trim().lines().next().unwrap_or("").trim();
    shorten(line, max)
}

pub use super::outline::shorten;

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

/// How many identifiers a marker's `{names}` lists. Measured on the corpus (eager mode, 32k): with
/// 24, next-step needle recall rises from 0.79 to the figure in BENCHMARKS.md for a few points of
/// savings. On the tuning half of the shared and long corpora (`pare eval --split tune`, coding
/// sessions, with [`NAMES_PER_ELISION`] at 96) 36 rather than 24 raises epoch 32k recall from 0.975
/// to 0.988 at the same savings (33.9 %); 48 finds nothing more.
pub const NAMES_PER_MARKER: usize = 36;

/// How many identifiers an elision marker lists for the whole run it stands for. Measured on the
/// tuning half (`pare eval --split tune`, coding sessions, 24 per marker): 24 → 96 raises epoch 16k
/// recall from 0.816 to 0.838 and eager 32k from 0.822 to 0.862, savings unchanged to 0.1 point;
/// 192 gives less (0.831 at epoch 16k): tiers then elide more to pay for the longer markers.
pub const NAMES_PER_ELISION: usize = 96;

/// How many identifiers an elision marker lists when the history floor raised the compaction's target
/// (`HistoryFloor`): the window leaves the history so little that its elision markers are most of what
/// the request keeps of old outputs. Measured on the tuning half (`pare eval --split tune`, coding
/// sessions, epoch 16k): needle recall 0.916 at 96, 0.921 at 128, 0.939 at 192, 0.944 at 256, 0.946 at
/// 384, 0.945 uncapped, savings 64.0–64.1 % and prefill 1.63–1.64× throughout. Raised everywhere
/// instead, epoch 32k forwards more (58,484,916 tokens against 58,460,658, all tune sessions); raised
/// where the floor rises, a window whose low water leaves the history more is not changed.
pub const NAMES_PER_ELISION_AT_FLOOR: usize = 256;

/// How much of a text `{names}` reads: its first 8 KiB. Measured with `pare eval` on the corpus, reading
/// whole texts finds no needle more (recall equal at 16k and 32k, epoch and eager) and costs the engine
/// a full identifier scan of every large output.
pub const NAMES_SCAN_BYTES: usize = 8192;

/// The identifiers of a text that an agent is likely to reuse in its next step, in order of first
/// appearance, deduplicated, at most `max`, skipping those in `skip` (already in the marker) and those
/// in `shown` (what the forwarded request shows whole elsewhere, see [`shown_names`]: a marker would
/// only repeat them): IDs that mix letters and digits (`8JX2WO`, `call_0042`), snake_case and
/// camelCase names, paths, and numbers of 4+ digits. Plain words are not identifiers, and neither are
/// JSON object keys (`"user_id":`), which name the schema rather than the data. Reads the first
/// [`NAMES_SCAN_BYTES`].
pub fn salient_names(text: &str, max: usize, skip: &[&str], shown: &FxHashSet<String>) -> Vec<String> {
    salient_names_where(text, max, skip, shown, |_| true)
}

/// [`salient_names`] of those identifiers `keep` accepts (the cap counts only what is listed).
pub fn salient_names_where(
    text: &str,
    max: usize,
    skip: &[&str],
    shown: &FxHashSet<String>,
    keep: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    if max == 0 {
        return out;
    }
    // FxHash: far cheaper per lookup than SipHash on these short tokens; flooding it is pointless
    // (one request's tokens, and the output does not depend on the hash).
    // What the marker shows and what is already listed, in one set: one lookup per token.
    // Sized once for the skip tokens (at most one per 5 bytes) and the names: no rehash as it fills.
    let skip_bytes: usize = skip.iter().map(|s| s.len()).sum();
    let mut seen: FxHashSet<&str> = FxHashSet::with_capacity_and_hasher(skip_bytes / 5 + max, Default::default());
    seen.extend(skip.iter().flat_map(|s| identifiers(s)));
    let text = prefix_at_char_boundary(text, NAMES_SCAN_BYTES);
    for token in identifiers(text) {
        if out.len() >= max {
            break;
        }
        if seen.insert(token) && !shown.contains(token) && keep(token) {
            out.push(token.to_owned());
        }
    }
    out
}

/// Every identifier (as [`salient_names`] reads them) of `texts`, whole: what messages forwarded
/// unchanged show, so that markers need not list those names again.
pub fn shown_names<'t>(texts: impl IntoIterator<Item = &'t str>) -> FxHashSet<String> {
    let mut out: FxHashSet<String> = FxHashSet::default();
    for text in texts {
        for token in identifiers(text) {
            if !out.contains(token) {
                out.insert(token.to_owned());
            }
        }
    }
    out
}

/// Byte classes of the identifier scan. Word bytes start and end a token; `.`, `/` and `-` may sit
/// inside one. The other bits let one pass over a token classify it.
const WORD: u16 = 1;
const INNER: u16 = 1 << 1;
const LOWER: u16 = 1 << 2;
const UPPER: u16 = 1 << 3;
const DIGIT: u16 = 1 << 4;
const UNDERSCORE: u16 = 1 << 5;
const DOT: u16 = 1 << 6;
const SEPARATOR: u16 = 1 << 7; // `/` or `-`
const SLASH: u16 = 1 << 8; // `/` (a path), so that no token is searched for one
static CLASS: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = if c.is_ascii_lowercase() {
            WORD | INNER | LOWER
        } else if c.is_ascii_uppercase() {
            WORD | INNER | UPPER
        } else if c.is_ascii_digit() {
            WORD | INNER | DIGIT
        } else if c == b'_' {
            WORD | INNER | UNDERSCORE
        } else if c == b'.' {
            INNER | DOT
        } else if c == b'/' {
            INNER | SEPARATOR | SLASH
        } else if c == b'-' {
            INNER | SEPARATOR
        } else {
            0
        };
        b += 1;
    }
    table
};

/// The identifier tokens of a text, in order, repeats included (see [`salient_names`]). One pass over
/// the bytes that also classifies each token: it runs over every replaced output.
pub fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < bytes.len() {
            // Slice iterators rather than indexing: no bounds check per byte in these two loops.
            i += bytes[i..].iter().position(|&b| CLASS[b as usize] & WORD != 0).unwrap_or(bytes.len() - i);
            let start = i;
            // Bytes outside a token have no class bits, so the one that ends it adds nothing.
            let mut seen = 0u16;
            i += bytes[i..]
                .iter()
                .position(|&b| {
                    let class = CLASS[b as usize];
                    seen |= class;
                    class & INNER == 0
                })
                .unwrap_or(bytes.len() - i);
            // A plain lowercase word (most tokens of prose and code) is never an identifier; with no
            // `.`, `/` or `-` in it, it has no trailing separator to cut either.
            if i - start < 4 || seen & !(WORD | INNER) == LOWER {
                continue;
            }
            let mut end = i;
            while end > start && CLASS[bytes[end - 1] as usize] & WORD == 0 {
                end -= 1;
            }
            if end - start < 4 || end - start > 120 {
                continue;
            }
            let token = &text[start..end];
            if end < i {
                // Trailing separators were cut: classify what is left.
                seen = token.bytes().fold(0, |seen, b| seen | CLASS[b as usize]);
            }
            // Nor is one that was a plain word followed by separators.
            if seen & !(WORD | INNER) == LOWER {
                continue;
            }
            // camelCase is only worth a second look at a token of letters that nothing else qualifies.
            let camel = seen & LOWER != 0
                && seen & UPPER != 0
                && token.as_bytes().windows(2).any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase());
            if !is_identifier(token, seen, camel) {
                continue;
            }
            // The line-number prefix of a numbered view (`  1227\tcode`, `1227|code`) numbers the view,
            // not the data; the next ones would fill the list with 1228, 1229…
            // A content id (`pare:0123456789ab`) is pare's handle, not the agent's data: a marker
            // that lists names does not list it again.
            if start >= 5 && &bytes[start - 5..start] == b"pare:" {
                continue;
            }
            if seen & !(WORD | INNER) == DIGIT && is_line_number(text, start, end) {
                continue;
            }
            // A JSON (or Python) object key names the schema, not the data.
            if start > 0 && matches!(bytes[start - 1], b'"' | b'\'') {
                let after = text[end..].trim_start_matches(['"', '\'']).trim_start();
                if after.starts_with(':') {
                    continue;
                }
            }
            // An absolute path keeps its leading `/`.
            if start > 0 && bytes[start - 1] == b'/' && seen & SLASH != 0 {
                return Some(&text[start - 1..end]);
            }
            return Some(token);
        }
        None
    })
}

/// Whether the digits at `start..end` of `text` are the line number that opens a line of a numbered
/// view (`  1227\tcode`, `1227|code`), as the structural map reads such lines.
fn is_line_number(text: &str, start: usize, end: usize) -> bool {
    // Only spaces stand before a numbered line's number: look back over them, never over the whole
    // line (a long line of numbers would make the scan quadratic).
    let bytes = text.as_bytes();
    let line_start = start - bytes[..start].iter().rev().take_while(|&&b| b == b' ').count();
    if line_start > 0 && bytes[line_start - 1] != b'\n' {
        return false;
    }
    let line = &text[line_start..];
    // `split_numbered` gives the code after the separator that follows the number.
    super::outline::split_numbered(line).is_some_and(|(_, code)| line.len() - code.len() == end + 1 - line_start)
}

/// IDs mixing letters and digits, snake_case and camelCase names, paths, numbers of 4+ digits, from
/// the classes `seen` in the token.
fn is_identifier(token: &str, seen: u16, camel: bool) -> bool {
    let alpha = seen & (LOWER | UPPER) != 0;
    if !alpha {
        // Only digits (no separators) make a number.
        return seen & (UNDERSCORE | DOT | SEPARATOR) == 0;
    }
    let dot = seen & DOT != 0;
    if seen & SLASH != 0 || (seen & UNDERSCORE != 0 && seen & LOWER != 0) || camel || (seen & DIGIT != 0 && !dot) {
        return true;
    }
    // The last `.` by a byte loop: the extension is short.
    dot && token.bytes().rposition(|b| b == b'.').is_some_and(|at| has_extension(&token[..at], &token[at + 1..]))
}

fn has_extension(stem: &str, ext: &str) -> bool {
    !stem.is_empty()
        && (1..=5).contains(&ext.len())
        && ext.bytes().all(|c| c.is_ascii_alphanumeric())
        && ext.bytes().any(|c| c.is_ascii_lowercase())
}

/// Maximal runs of path characters that contain a `.`, in order. Found from the dots (`memchr`), each
/// run read outwards from its first dot: the runs without one (most words) are never read.
fn path_tokens(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    // Where the previous run ended: the start of the text or a byte that is not a path character.
    let mut i = 0;
    std::iter::from_fn(move || {
        let dot = i + memchr::memchr(b'.', &bytes[i..])?;
        let start = bytes[i..dot].iter().rposition(|&b| !PATH_BYTES[b as usize]).map_or(i, |p| i + p + 1);
        let end = bytes[dot..].iter().position(|&b| !PATH_BYTES[b as usize]).map_or(bytes.len(), |p| dot + p);
        i = end;
        // Path characters are ASCII: both ends are char boundaries.
        Some(&text[start..end])
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

    /// The line-by-line reading `is_compacted` replaced: the `[` scan must agree with it.
    fn is_compacted_by_lines(text: &str) -> bool {
        text.split('\n').any(|line| {
            let Some(rest) = line.trim_start_matches([' ', '\t']).strip_prefix('[') else { return false };
            let pare =
                rest.strip_prefix("pare").is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric() || c == '_'));
            let truncated =
                rest.strip_prefix("...truncated ").is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()));
            pare || truncated || MARKER_HEADS.iter().any(|h| rest.starts_with(h))
        })
    }

    #[test]
    fn bracket_scan_agrees_with_the_line_reading() {
        for text in [
            "",
            "[",
            "[pare",
            "[pare\n",
            "[parent",
            "x [pare: a]",
            "x\n \t[pare: a]",
            "x\r\n[pare]",
            "x\n\r[pare]",
            "a[b\n[c [pare\n  [tool: x]",
            "[...truncated \n1",
            "[...truncated 3",
            "\t[...truncated 3 lines...]",
            "[system prompt: x",
            "[retried:x",
            "é[pare]\n[ré]\n [retried: y",
            "[[pare]",
            "\n\n\n[",
        ] {
            assert_eq!(is_compacted(text), is_compacted_by_lines(text), "{text:?}");
        }
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
        // `{ref}`: the tool alone when its message made one call, the call when it made several.
        assert_eq!(f.render("[tool: {ref} → {status}]"), "[tool: terminal → failed (exit 1)]");
        let parallel = CallFacts { siblings: 2, ..f };
        assert_eq!(parallel.render("[tool: {ref} → {status}]"), "[tool: terminal(\"pytest -x\") → failed (exit 1)]");
    }

    #[test]
    fn path_tokens_are_the_dotted_runs() {
        let by_bytes = |text: &str| -> Vec<String> {
            let mut out = Vec::new();
            for run in text.split(|c: char| !c.is_ascii() || !PATH_BYTES[c as usize]) {
                if run.contains('.') {
                    out.push(run.to_owned());
                }
            }
            out
        };
        for text in
            ["", ".", "a.b", "x a.b y", "..", "a . b", "é.py a/b.rs,c.md;", "no dots here", " .x/y. ", "a.b.c d"]
        {
            assert_eq!(path_tokens(text).collect::<Vec<_>>(), by_bytes(text), "{text:?}");
        }
    }

    #[test]
    fn files_are_found_and_deduplicated() {
        let files = mentioned_files("edit ./src/app.py then src/app.py and /w/x/util.rs; v1.2 and .gitignore", 5);
        assert_eq!(files, vec!["src/app.py".to_string(), "/w/x/util.rs".to_string()]);
    }

    #[test]
    fn salient_names_keep_ids_names_paths_and_long_numbers() {
        let text = r#"{"reservation_id": "8JX2WO", "flights": [{"flight_number": "HAT170", "date": "2024-05-16"}]}
Reading src/app/models.py: def load_user(user_id): return UserCache.get(user_id)  # ticket 40213, 12 rows
see /srv/app/conf/base.toml
and the plain words here are not identifiers; again 8JX2WO"#;
        let none = FxHashSet::default();
        let names = salient_names(text, 10, &["src/app/models.py"], &none);
        assert_eq!(
            names,
            vec!["8JX2WO", "HAT170", "load_user", "user_id", "UserCache.get", "40213", "/srv/app/conf/base.toml"]
        );
        assert_eq!(salient_names(text, 2, &[], &none), vec!["8JX2WO", "HAT170"]);
        assert!(salient_names(text, 0, &[], &none).is_empty());
        // Names shown elsewhere are skipped, and the cap counts only what is listed.
        let shown = shown_names(["ticket HAT170 for load_user"]);
        assert_eq!(salient_names(text, 3, &["src/app/models.py"], &shown), vec!["8JX2WO", "user_id", "UserCache.get"]);
    }

    #[test]
    fn line_numbers_of_a_numbered_view_are_not_names() {
        let none = FxHashSet::default();
        // `cat -n` / OpenHands' viewer (spaces, number, tab) and Hermes (number, `|`): the prefixes go,
        // the same numbers inside a line stay, and so does a `grep -n` hit's line number (`1459:`).
        let view =
            "  1227\tdef load_user(user_id):\n  1228\t    return 40213 + 1227\n1229|x = HAT170\n1459:    sep_2\n";
        assert_eq!(
            salient_names(view, 10, &[], &none),
            vec!["load_user", "user_id", "40213", "1227", "HAT170", "1459", "sep_2"]
        );
        // Digits followed by a tab elsewhere than at the start of a line are data.
        assert_eq!(salient_names("id\t20240516\tok", 10, &[], &none), vec!["20240516"]);
        assert_eq!(salient_names("id \t 20240516\tok", 10, &[], &none), vec!["20240516"]);
        // After a long line of numbers, a numbered line's number is still found (the scan looks back
        // over the spaces before a number only).
        let long = (0..5000).map(|k| (10_000 + k).to_string()).collect::<Vec<_>>().join(" ");
        let text = format!("{long}\n   4321\tsep_2\n");
        let names: Vec<&str> = identifiers(&text).collect();
        assert_eq!(names.len(), 5001, "{:?}", &names[4990..]);
        assert_eq!(names.last(), Some(&"sep_2"));
    }

    #[test]
    fn elision_markers_read_back() {
        let text =
            "[pare: 1,012 earlier messages elided — read_file ×5, system ×1, assistant notes ×2; files: a.py, b/c.rs]";
        let s = parse_elision(text).expect("default form");
        assert_eq!(s.messages, 1012);
        assert_eq!(s.tools, vec![("read_file".to_string(), 5), ("system".to_string(), 1)]);
        assert_eq!(s.notes, 2);
        assert_eq!(s.files, vec!["a.py".to_string(), "b/c.rs".to_string()]);
        assert!(s.names.is_empty());
        let named = parse_elision("[pare: 3 earlier messages elided — bash ×3; files: a.py; names: load_user, HAT170]")
            .expect("default form with names");
        assert_eq!((named.files, named.names), (vec!["a.py".to_string()], vec!["load_user".into(), "HAT170".into()]));
        assert_eq!(parse_elision("[pare: 2 earlier messages elided — terminal ×2]").map(|s| s.files.len()), Some(0));
        assert_eq!(parse_elision("[pare: assistant note, 12 chars omitted]"), None);
        assert_eq!(parse_elision("[pare: 2 earlier messages elided — terminal twice]"), None);
    }

    #[test]
    fn the_retrieve_tool_is_pares_by_name_or_description() {
        let tools = |name: &str, description: &str| {
            Some(format!(r#"[{{"type":"function","function":{{"name":"{name}","description":"{description}"}}}}]"#))
        };
        let found = |name: &str, description: &str| retrieve_tool(tools(name, description).as_deref());
        assert_eq!(found("mcp__pare__retrieve", "x"), Some("mcp__pare__retrieve".into()));
        assert_eq!(found("mcp_pare_retrieve", "x"), Some("mcp_pare_retrieve".into()));
        assert_eq!(found("retrieve", "Get back content pare replaced"), Some("retrieve".into()));
        assert_eq!(found("retrieve", "search the docs"), None);
        assert_eq!(found("headroom_retrieve", "content compared and compressed"), None, "not pare as a word");
        assert_eq!(found("mcp__pare__search", "pare"), None);
        // Anthropic's and the Responses API's shape: the name at the top level.
        let anthropic = r#"[{"name":"mcp__pare__retrieve","input_schema":{}}]"#;
        assert_eq!(retrieve_tool(Some(anthropic)), Some("mcp__pare__retrieve".into()));
        assert_eq!(retrieve_tool(None), None);
    }

    #[test]
    fn content_ids_are_found_only_whole() {
        let id = content_id("hello");
        assert_eq!(id.len(), 5 + CONTENT_ID_HEX);
        let text = format!("[tool: x; {id}] also pare:0123456789abc and xpare:0123456789ab and pare:0123456789ab.");
        let found: Vec<&str> = content_ids_in(&text).collect();
        assert_eq!(found, vec![&id[5..], "0123456789ab"]);
        // A marker's id is not one of the names markers list.
        let none = FxHashSet::default();
        assert_eq!(salient_names(&format!("{text} load_user"), 10, &[], &none), vec!["load_user"]);
    }

    /// [`IDS_INLINE_MAX`] measured: with the default tokenizer one list id costs more tokens than one
    /// id inline and fewer than two or more (means over 40 ids, whose hex digits tokenize unevenly;
    /// with or without the retrieve tool named).
    #[test]
    fn one_list_id_is_cheaper_than_two_ids() {
        let counter = crate::tokens::TokenCounter::new(&crate::tokens::CounterConfig::default());
        let entries: Vec<String> = (0..40)
            .map(|k| id_entry(&content_id(&format!("output {k}")), &format!("bash(\"make test_{k}\")")))
            .collect();
        for tool in [None, Some("mcp__pare__retrieve")] {
            let how = tool.map(|t| format!(" (get back with {t})")).unwrap_or_default();
            // Mean tokens of the suffix naming `k` consecutive entries inline, and by a list id.
            let mean = |k: usize, listed: bool| -> f64 {
                let runs = entries.windows(k);
                let n = runs.len() as f64;
                let total: u64 = runs
                    .map(|run| match listed {
                        true => counter.text(&format!("; ids{how} listed in {}", content_id(&id_list_text(run)))),
                        false => {
                            let ids: Vec<&str> = run.iter().map(|e| entry_id(e)).collect();
                            counter.text(&format!("; ids{how}: {}", ids.join(", ")))
                        }
                    })
                    .sum();
                total as f64 / n
            };
            assert!(mean(1, false) < mean(1, true), "{tool:?}: one id inline is cheaper than a list of one");
            for k in 2..=4 {
                assert!(mean(k, true) < mean(k, false), "{tool:?}: a list id is cheaper than {k} ids");
            }
            // `ids_suffix` takes the cheaper form.
            assert_eq!(ids_suffix(&entries[..1], tool), format!("; ids{how}: {}", entry_id(&entries[0])));
            assert!(ids_suffix(&entries[..2], tool).contains(" listed in pare:"));
        }
    }

    #[test]
    fn elision_ids_are_inline_for_one_output_and_a_list_id_for_more() {
        let a = id_entry("pare:0123456789ab", "read_file(\"src/a.py\")");
        let b = id_entry("pare:ba9876543210", "bash(\"make test\")");
        assert_eq!(ids_suffix(&[a.as_str()], None), "; ids: pare:0123456789ab");
        assert_eq!(
            ids_suffix(&[a.as_str(), a.as_str()], Some("retrieve")),
            "; ids (get back with retrieve): pare:0123456789ab"
        );
        let list = id_list_text(&[b.as_str(), a.as_str()]);
        assert_eq!(
            list,
            "content ids of the 2 outputs a pare elision marker stands for, most recent first; each line: an id, \
             then the call whose output it names\npare:ba9876543210 bash(\"make test\")\npare:0123456789ab \
             read_file(\"src/a.py\")\n"
        );
        let listed = ids_suffix(&[b.as_str(), a.as_str()], Some("retrieve"));
        assert_eq!(listed, format!("; ids (get back with retrieve) listed in {}", content_id(&list)));
        // A list's ids are those of its lines; its heading names none.
        assert_eq!(content_ids_in(&list).collect::<Vec<_>>(), vec!["ba9876543210", "0123456789ab"]);
        // An earlier list is named as a list even alone.
        // An earlier list alone is named by its own id, and no list is derived.
        let earlier = id_entry("pare:ffffffffffff", &format!("{LIST_ENTRY} (70 messages)"));
        assert_eq!(ids_suffix(&[earlier.as_str()], None), "; ids listed in pare:ffffffffffff");
        assert_eq!(derived_id_list(&[earlier.as_str()]), None);
        assert_eq!(derived_id_list(&[a.as_str()]), None);
        assert_eq!(derived_id_list(&[b.as_str(), a.as_str()]), Some(list.clone()));
        let nested = id_list_text(&[earlier.as_str(), a.as_str()]);
        assert!(ids_suffix(&[earlier.as_str(), a.as_str()], None).ends_with(&content_id(&nested)));
        // The marker reads back with its list id.
        let marker = format!("[pare: 4 earlier messages elided — bash ×2, read_file ×2{listed}; names: load_user]");
        let parsed = parse_elision(&marker).expect("default form");
        assert_eq!((parsed.ids, parsed.listed), (vec![content_id(&list)], true));
        assert_eq!(parsed.names, vec!["load_user".to_string()]);
        let inline = parse_elision("[pare: 2 earlier messages elided — bash ×2; ids: pare:0123456789ab]").unwrap();
        assert_eq!((inline.ids, inline.listed), (vec!["pare:0123456789ab".to_string()], false));
    }

    #[test]
    fn shorten_never_splits_chars() {
        assert_eq!(shorten("héllo wörld", 5), "héll…");
        assert_eq!(one_line("  first\nsecond", 80), "first");
    }
}
