//! The contents markers name: each hidden text a forwarded marker names by its content id (`pare:`
//! and hex digits of the text's SHA-256, [`crate::compact::markers::content_id`]) is stored as a
//! blob (under that same SHA-256) and listed in the `contents` table, so that the id resolves to
//! the text exactly as the agent sent it ([`ArchiveReader::content`]), on this archive and after a
//! restart.
//!
//! The writer indexes an exchange after storing it (`ContentIndex::index`): it looks for ids in
//! the forwarded body and, only when one is not stored yet (a compaction that hid something new),
//! stores the texts those ids name: from the record's derived texts (an elision marker's id list)
//! and the raw body's conversation. An epoch's markers come
//! back unchanged request after request, so most requests cost one scan of the forwarded body.
//!
//! The lookup is one range query over the `contents` table's primary key joined with `blobs`: any
//! SQL store (PostgreSQL: `bytea` comparison) answers it the same way.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;

use super::db::{Db, Param, params};
use lru::LruCache;

use super::query::ArchiveReader;
use super::{ArchiveError, ExchangeRecord, store};
use crate::compact::markers::{CONTENT_ID_HEX, content_ids_in, content_texts};

/// The fewest hex digits an id may have to be looked up: 32 bits.
pub const MIN_ID_HEX: usize = 8;

/// How many ids the writer remembers as stored, and as not found in the raw body that named them.
const KNOWN_IDS: usize = 1 << 16;

/// Why an id does not resolve to one content.
#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    #[error("content id {0:?} is not 8 to 64 lowercase hex digits (optionally after `pare:`)")]
    BadId(String),
    #[error("no content with id pare:{0} in the archive")]
    Unknown(String),
    #[error("content id pare:{id} is ambiguous: it begins {n} stored contents (give more digits)")]
    Ambiguous { id: String, n: usize },
    #[error(transparent)]
    Archive(#[from] ArchiveError),
}

impl From<super::db::DbError> for ContentError {
    fn from(e: super::db::DbError) -> ContentError {
        ContentError::Archive(ArchiveError::Database(e))
    }
}

/// A stored content: its full SHA-256 (hex) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Content {
    pub sha256: String,
    pub text: String,
}

/// The hex digits of an id as an agent or a person may write it: `pare:0123abcd…` or the digits
/// alone, any case, 8 to 64 of them; lowercased.
pub fn parse_id(id: &str) -> Result<String, ContentError> {
    let trimmed = id.trim();
    let digits = trimmed.strip_prefix("pare:").unwrap_or(trimmed);
    if !(MIN_ID_HEX..=64).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ContentError::BadId(id.to_owned()));
    }
    Ok(digits.to_ascii_lowercase())
}

/// The inclusive range of 32-byte hashes that begin with the hex digits `prefix`.
fn hash_range(prefix: &str) -> ([u8; 32], [u8; 32]) {
    let (mut low, mut high) = ([0u8; 32], [0xffu8; 32]);
    for (at, digit) in prefix.bytes().enumerate() {
        let nibble = (digit as char).to_digit(16).expect("checked hex") as u8;
        let (byte, shift) = (at / 2, if at % 2 == 0 { 4 } else { 0 });
        low[byte] = (low[byte] & !(0xf << shift)) | (nibble << shift);
        high[byte] = (high[byte] & !(0xf << shift)) | (nibble << shift);
    }
    (low, high)
}

/// The content a (unique) id prefix names, from an open store.
pub fn lookup(conn: &Db, id: &str) -> Result<Content, ContentError> {
    let digits = parse_id(id)?;
    let (low, high) = hash_range(&digits);
    let found: Vec<(i64, Vec<u8>)> = conn
        .query_all(
            "SELECT b.id, b.sha256 FROM contents c JOIN blobs b ON b.sha256 = c.sha256
             WHERE c.sha256 BETWEEN ?1 AND ?2 ORDER BY c.sha256 LIMIT 2",
            params![&low, &high],
        )?
        .iter()
        .map(|r| Ok((r.get(0)?, r.get(1)?)))
        .collect::<Result<_, super::db::DbError>>()?;
    match found.as_slice() {
        [] => Err(ContentError::Unknown(digits)),
        [(blob, sha256)] => {
            let bytes = store::read_blob(conn, *blob)?;
            let text = String::from_utf8(bytes)
                .map_err(|_| ArchiveError::CorruptBlob { id: *blob, why: "content is not UTF-8".into() })?;
            Ok(Content { sha256: store::hex(sha256), text })
        }
        _ => {
            let n: i64 = conn
                .query_one(
                    "SELECT count(*) FROM contents c JOIN blobs b ON b.sha256 = c.sha256 WHERE c.sha256 BETWEEN ?1 AND ?2",
                    params![&low, &high],
                )?
                .get(0)?;
            Err(ContentError::Ambiguous { id: digits, n: n as usize })
        }
    }
}

impl ArchiveReader {
    /// The content an id names (`pare:0123456789ab`, or a unique prefix of 8 or more hex digits of
    /// its SHA-256), exactly as the agent sent it.
    pub fn content(&self, id: &str) -> Result<Content, ContentError> {
        lookup(self.conn(), id)
    }
}

/// Most distinct ids of one record the writer looks up: ids pare wrote itself are counted only
/// (see `ContentIndex::index`), so this bounds a compaction's markers, not what an agent sends.
pub const MAX_IDS_PER_RECORD: usize = 65_536;

/// Ids looked up by one query (two parameters each).
const IDS_PER_QUERY: usize = 256;

/// An id's key: the number its hex digits write ([`CONTENT_ID_HEX`] of them, 48 bits).
fn key_of_hex(hex: &str) -> u64 {
    u64::from_str_radix(hex, 16).expect("ids are hex")
}

/// The key of the id of the text whose SHA-256 is `hash`.
fn key_of_hash(hash: &[u8]) -> u64 {
    hash[..CONTENT_ID_HEX / 2].iter().fold(0u64, |key, byte| key << 8 | u64::from(*byte))
}

/// The inclusive range of 32-byte hashes whose id has `key`.
fn key_range(key: u64) -> ([u8; 32], [u8; 32]) {
    let (mut low, mut high) = ([0u8; 32], [0xffu8; 32]);
    let bytes = key.to_be_bytes();
    low[..CONTENT_ID_HEX / 2].copy_from_slice(&bytes[8 - CONTENT_ID_HEX / 2..]);
    high[..CONTENT_ID_HEX / 2].copy_from_slice(&bytes[8 - CONTENT_ID_HEX / 2..]);
    (low, high)
}

/// The writer's side: which ids are stored already, so that a request whose markers name only
/// known contents costs no lookup and no parse.
pub(crate) struct ContentIndex {
    /// Ids (their 6 bytes as a number) stored, or looked for in a raw body that did not have them.
    known: LruCache<u64, ()>,
    /// Lookup queries run since start (what a test counts).
    n_queries: u64,
}

impl ContentIndex {
    pub(crate) fn new() -> ContentIndex {
        ContentIndex { known: LruCache::new(NonZeroUsize::new(KNOWN_IDS).expect("non-zero")), n_queries: 0 }
    }

    /// Forget what was stored (a rolled-back transaction).
    pub(crate) fn clear(&mut self) {
        self.known.clear();
    }

    /// Lookup queries run since start.
    #[cfg(test)]
    pub(crate) fn n_queries(&self) -> u64 {
        self.n_queries
    }

    /// The keys among `keys` (no repeats) that are neither known nor stored; those found stored
    /// become known. One query per [`IDS_PER_QUERY`] keys not known.
    fn unstored(&mut self, conn: &Db, keys: impl IntoIterator<Item = u64>) -> Result<HashSet<u64>, ArchiveError> {
        let unknown: Vec<u64> = keys.into_iter().filter(|key| self.known.get(key).is_none()).collect();
        let mut unstored: HashSet<u64> = unknown.iter().copied().collect();
        for chunk in unknown.chunks(IDS_PER_QUERY) {
            let ranges: Vec<([u8; 32], [u8; 32])> = chunk.iter().map(|key| key_range(*key)).collect();
            let terms: Vec<String> =
                (0..ranges.len()).map(|at| format!("sha256 BETWEEN ?{} AND ?{}", 2 * at + 1, 2 * at + 2)).collect();
            let sql = format!("SELECT sha256 FROM contents WHERE {}", terms.join(" OR "));
            let params: Vec<Param<'_>> =
                ranges.iter().flat_map(|(low, high)| [Param::from(low), Param::from(high)]).collect();
            self.n_queries += 1;
            for row in conn.query_all(&sql, &params)? {
                let hash: Vec<u8> = row.get(0)?;
                let key = key_of_hash(&hash);
                if unstored.remove(&key) {
                    self.known.put(key, ());
                }
            }
        }
        Ok(unstored)
    }

    /// Store the contents that `rec`'s forwarded body names and the store lacks, from `rec`'s raw
    /// conversation; `put_blob` stores one text as a blob of the record's session and gives its id.
    ///
    /// Only ids pare wrote count: an id of the forwarded body that the raw body holds too is the
    /// agent's text (a quoted marker, or a string made to look like one), never looked up. What is
    /// looked up is looked up in bulk, and every step is linear in the bodies' size: many ids or
    /// many small outputs cost time in proportion, not in their square.
    pub(crate) fn index(
        &mut self,
        conn: &Db,
        rec: &ExchangeRecord,
        mut put_blob: impl FnMut(&[u8]) -> Result<i64, ArchiveError>,
    ) -> Result<(), ArchiveError> {
        let Some(forwarded) = rec.forwarded.as_ref() else { return Ok(()) };
        let Ok(forwarded) = std::str::from_utf8(forwarded) else { return Ok(()) };
        let mut named: HashSet<u64> = HashSet::new();
        for hex in content_ids_in(forwarded) {
            let key = key_of_hex(hex);
            if self.known.peek(&key).is_none() {
                named.insert(key);
            }
        }
        if named.is_empty() {
            return Ok(());
        }
        // The agent's own ids (the raw body is what it sent) are not pare's to store.
        let raw_text = String::from_utf8_lossy(&rec.raw);
        for hex in content_ids_in(&raw_text) {
            named.remove(&key_of_hex(hex));
        }
        if named.len() > MAX_IDS_PER_RECORD {
            tracing::warn!(
                session = %rec.session, ids = named.len(), at_most = MAX_IDS_PER_RECORD,
                "archive: the forwarded body names more content ids than are looked up; the rest are not stored"
            );
        }
        let mut wanted = self.unstored(conn, named.into_iter().take(MAX_IDS_PER_RECORD))?;
        // The texts compaction derived (elision markers' id lists) first: no raw body holds them.
        // A list stored now names outputs (and earlier lists) the forwarded body does not: they are
        // wanted too, looked up a level of lists at a time.
        let mut lists: HashMap<u64, &str> =
            rec.lists.iter().map(|list| (key_of_hash(&store::sha256(list.as_bytes())), list.as_str())).collect();
        let mut level: Vec<u64> = wanted.iter().copied().collect();
        while !level.is_empty() && !lists.is_empty() {
            let mut named_by_lists: HashSet<u64> = HashSet::new();
            for key in level {
                let Some(list) = lists.remove(&key) else { continue };
                put_blob(list.as_bytes())?;
                let hash = store::sha256(list.as_bytes());
                conn.execute("INSERT OR IGNORE INTO contents (sha256) VALUES (?1)", params![&hash])?;
                wanted.remove(&key);
                self.known.put(key, ());
                named_by_lists.extend(content_ids_in(list).map(key_of_hex).filter(|k| !wanted.contains(k)));
            }
            let room = MAX_IDS_PER_RECORD.saturating_sub(wanted.len());
            let new = self.unstored(conn, named_by_lists.into_iter().take(room))?;
            level = new.iter().copied().collect();
            wanted.extend(new);
        }
        if wanted.is_empty() {
            return Ok(());
        }
        for key in &wanted {
            // Found or not, a raw body is read once for an id: one that names no text of it (an
            // output the agent no longer sends) is not looked for again.
            self.known.put(*key, ());
        }
        // A gateway compress call (`POST /v1/compress`) is recorded with the chat body it stands for.
        let gateway = rec.path.ends_with("/v1/compress").then_some(crate::wire::Wire::Chat);
        let Some(wire) = crate::wire::Wire::of_path(&rec.path).or(gateway) else { return Ok(()) };
        let Ok(body) = crate::wire::parse(wire, &rec.raw) else { return Ok(()) };
        for raw in body.messages() {
            let Ok(message) = crate::neutral::Message::from_raw(raw) else { continue };
            for text in content_texts(&message) {
                let hash = store::sha256(text.as_bytes());
                // Each text is stored once, however often the body repeats it.
                if !wanted.remove(&key_of_hash(&hash)) {
                    continue;
                }
                put_blob(text.as_bytes())?;
                conn.execute("INSERT OR IGNORE INTO contents (sha256) VALUES (?1)", params![&hash])?;
            }
            if wanted.is_empty() {
                break;
            }
        }
        Ok(())
    }
}

/// A selective read of a content: some lines, or the lines matching a pattern.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// 1-based, inclusive; `None` for the whole text.
    pub lines: Option<(usize, usize)>,
    pub grep: Option<String>,
}

/// Why a selection is refused. A pattern is named by its beginning only ([`pattern_head`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectionError {
    #[error("lines {0} is not a range A-B of line numbers from 1 (or A- for A to the end)")]
    BadLines(String),
    #[error("grep pattern {pattern} is not a valid regular expression: {why}")]
    BadGrep { pattern: String, why: String },
    #[error("grep pattern {pattern} is longer than {MAX_GREP_PATTERN} bytes")]
    LongGrep { pattern: String },
}

/// Longest `grep` pattern accepted, in bytes: refused before it is parsed.
pub const MAX_GREP_PATTERN: usize = 1024;

/// How large a compiled `grep` pattern may grow (the regex crate's size limit, and its lazy DFA's).
const GREP_SIZE_LIMIT: usize = 1 << 18;

/// How long one `grep` may scan a content: past it the answer ends with a line saying where it
/// stopped (a pattern that defeats the regex crate's lazy DFA costs time in proportion to its size
/// times the content's).
pub const GREP_TIME_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

/// A pattern (or a line range) as an error names it, quoted: its first characters and its length
/// when it is long, never the whole of it.
pub fn pattern_head(pattern: &str) -> String {
    const SHOWN: usize = 40;
    match pattern.char_indices().nth(SHOWN) {
        None => format!("{pattern:?}"),
        Some((at, _)) => format!("{:?}… ({} bytes)", &pattern[..at], pattern.len()),
    }
}

fn grep_regex(pattern: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(pattern).size_limit(GREP_SIZE_LIMIT).dfa_size_limit(GREP_SIZE_LIMIT).build()
}

impl Selection {
    /// `lines` (`A-B`, `A-` or `A`) and `grep` as given in a query or a tool call.
    pub fn parse(lines: Option<&str>, grep: Option<&str>) -> Result<Selection, SelectionError> {
        let lines = match lines.map(str::trim).filter(|l| !l.is_empty()) {
            None => None,
            Some(spec) => {
                let bad = || SelectionError::BadLines(pattern_head(spec));
                let (from, to) = match spec.split_once('-') {
                    Some((from, "")) => (from.trim().parse().map_err(|_| bad())?, usize::MAX),
                    Some((from, to)) => {
                        (from.trim().parse().map_err(|_| bad())?, to.trim().parse().map_err(|_| bad())?)
                    }
                    None => {
                        let line = spec.parse().map_err(|_| bad())?;
                        (line, line)
                    }
                };
                if from == 0 || to < from {
                    return Err(bad());
                }
                Some((from, to))
            }
        };
        let grep = grep.filter(|g| !g.is_empty()).map(str::to_owned);
        if let Some(pattern) = &grep {
            if pattern.len() > MAX_GREP_PATTERN {
                return Err(SelectionError::LongGrep { pattern: pattern_head(pattern) });
            }
            grep_regex(pattern).map_err(|e| {
                // The parser's message quotes the whole pattern above its last line, which says why.
                let message = e.to_string();
                let why = message.lines().last().unwrap_or_default().trim().trim_start_matches("error: ");
                SelectionError::BadGrep { pattern: pattern_head(pattern), why: why.to_owned() }
            })?;
        }
        Ok(Selection { lines, grep })
    }

    /// Whether applying it scans the text with a pattern (CPU work to keep off the async workers).
    pub fn greps(&self) -> bool {
        self.grep.is_some()
    }

    /// The selected part of `text`: the whole text, its lines `A..=B` as they are (each with its line
    /// ending), or — with `grep` — each matching line within those lines as `N: line`, one per line,
    /// for at most [`GREP_TIME_BUDGET`].
    pub fn apply<'t>(&self, text: &'t str) -> std::borrow::Cow<'t, str> {
        self.apply_within(text, GREP_TIME_BUDGET)
    }

    fn apply_within<'t>(&self, text: &'t str, budget: std::time::Duration) -> std::borrow::Cow<'t, str> {
        if self.lines.is_none() && self.grep.is_none() {
            return std::borrow::Cow::Borrowed(text);
        }
        let (from, to) = self.lines.unwrap_or((1, usize::MAX));
        let lines = text.split_inclusive('\n').enumerate().map(|(at, line)| (at + 1, line));
        let in_range = lines.skip(from - 1).take_while(|(number, _)| *number <= to);
        match &self.grep {
            None => std::borrow::Cow::Owned(in_range.map(|(_, line)| line).collect()),
            Some(pattern) => {
                let re = grep_regex(pattern).expect("checked");
                let started = std::time::Instant::now();
                let mut out = String::new();
                for (number, line) in in_range {
                    if started.elapsed() > budget {
                        out.push_str(&format!(
                            "[pare: grep stopped before line {number}: it ran out of its {budget:?}; narrow it with `lines` or a simpler pattern]\n"
                        ));
                        break;
                    }
                    let bare = line.strip_suffix('\n').unwrap_or(line);
                    let bare = bare.strip_suffix('\r').unwrap_or(bare);
                    if re.is_match(bare) {
                        out.push_str(&format!("{number}: {bare}\n"));
                    }
                }
                std::borrow::Cow::Owned(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_with_or_without_prefix() {
        assert_eq!(parse_id("pare:0123456789AB").unwrap(), "0123456789ab");
        assert_eq!(parse_id(" 01234567 ").unwrap(), "01234567");
        for bad in ["pare:0123456", "pare:", "xyz01234567", &"a".repeat(65), "pare:0123456789ag"] {
            assert!(matches!(parse_id(bad), Err(ContentError::BadId(_))), "{bad}");
        }
    }

    #[test]
    fn hash_ranges_cover_exactly_the_prefix() {
        let (low, high) = hash_range("abc");
        assert_eq!(&low[..3], &[0xab, 0xc0, 0]);
        assert_eq!(&high[..3], &[0xab, 0xcf, 0xff]);
        let (low, high) = hash_range("0123456789ab");
        assert_eq!(&low[..7], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0]);
        assert_eq!(&high[..7], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xff]);
    }

    /// A chat body of `outputs` as tool results after `user`'s text; the same body forwarded with
    /// each output behind a marker naming its id.
    fn record_hiding(user: &str, outputs: &[String]) -> ExchangeRecord {
        let body = |hide: bool| {
            let mut messages = vec![serde_json::json!({"role": "user", "content": user})];
            for (k, output) in outputs.iter().enumerate() {
                let call = format!("call_{k}");
                messages.push(serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": call,
                    "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}));
                let text = if hide {
                    format!("[tool: bash; {}]", crate::compact::markers::content_id(output))
                } else {
                    output.clone()
                };
                messages.push(serde_json::json!({"role": "tool", "tool_call_id": call, "content": text}));
            }
            bytes::Bytes::from(serde_json::json!({"model": "m", "messages": messages}).to_string())
        };
        ExchangeRecord { forwarded: Some(body(true)), ..ExchangeRecord::unchanged("s", 0, body(false)) }
    }

    fn index_into(conn: &Db, index: &mut ContentIndex, rec: &ExchangeRecord) {
        index.index(conn, rec, |text| Ok(store::put_blob(conn, &store::sha256(text), text)?)).unwrap();
    }

    /// Regression (fake ids stalled the writer): ids the agent's own text holds, however many,
    /// cost no lookup; the id pare wrote beside them is stored.
    #[test]
    fn ids_in_the_agents_text_are_not_looked_up() {
        let dir = tempfile::tempdir().unwrap();
        let conn = store::open_rw(dir.path()).unwrap();
        let fake: String = (0..100_000u64).map(|k| format!("pare:{:012x} ", k * 7919)).collect();
        let rec = record_hiding(&fake, &["the one real output".to_owned()]);
        let mut index = ContentIndex::new();
        index_into(&conn, &mut index, &rec);
        assert_eq!(index.n_queries(), 1, "one lookup, for pare's id alone");
        let real = crate::compact::markers::content_id("the one real output");
        assert_eq!(lookup(&conn, &real).unwrap().text, "the one real output");
        assert!(matches!(lookup(&conn, "pare:000000001ede"), Err(ContentError::Unknown(_))));
    }

    /// The ids pare wrote are looked up a batch per query, and every hidden output is stored once.
    #[test]
    fn ids_pare_wrote_are_looked_up_in_bulk() {
        let dir = tempfile::tempdir().unwrap();
        let conn = store::open_rw(dir.path()).unwrap();
        let outputs: Vec<String> = (0..3000).map(|k| format!("output {k}")).collect();
        let rec = record_hiding("go", &outputs);
        let mut index = ContentIndex::new();
        index_into(&conn, &mut index, &rec);
        assert!(index.n_queries() <= 3000 / IDS_PER_QUERY as u64 + 1, "{} queries", index.n_queries());
        for output in outputs.iter().step_by(97) {
            let id = crate::compact::markers::content_id(output);
            assert_eq!(&lookup(&conn, &id).unwrap().text, output);
        }
        let n: i64 = conn.query_one("SELECT count(*) FROM contents", &[]).unwrap().get(0).unwrap();
        assert_eq!(n, 3000);
        // Known now: the same record again costs no query.
        let before = index.n_queries();
        index_into(&conn, &mut index, &rec);
        assert_eq!(index.n_queries(), before);
    }

    /// Regression (a 20 MB pattern was parsed for seconds, then echoed whole): a long pattern is
    /// refused before it is parsed, and no error names more than its beginning.
    #[test]
    fn long_patterns_are_refused_unparsed_and_never_echoed_whole() {
        let long = "a".repeat(20 << 20);
        let started = std::time::Instant::now();
        let err = Selection::parse(None, Some(&long)).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_millis(500), "{:?}", started.elapsed());
        assert!(matches!(err, SelectionError::LongGrep { .. }));
        let message = err.to_string();
        assert!(message.len() < 200 && message.contains("20971520 bytes"), "{message}");
        let bad = format!("({}", "b".repeat(900));
        let message = Selection::parse(None, Some(&bad)).unwrap_err().to_string();
        assert!(message.len() < 2000 && !message.contains(&"b".repeat(100)), "{message}");
        let lines = Selection::parse(Some(&"9".repeat(5000)), None).unwrap_err().to_string();
        assert!(lines.len() < 200, "{lines}");
    }

    /// A grep past its time budget stops and says where.
    #[test]
    fn a_grep_stops_at_its_time_budget() {
        let text: String = (0..1000).map(|k| format!("line {k}\n")).collect();
        let sel = Selection::parse(None, Some("line")).unwrap();
        let out = sel.apply_within(&text, std::time::Duration::ZERO);
        assert_eq!(
            out,
            "[pare: grep stopped before line 1: it ran out of its 0ns; narrow it with `lines` or a simpler pattern]\n"
        );
        assert_eq!(sel.apply(&text).lines().count(), 1000);
    }

    #[test]
    fn lines_and_grep_select() {
        let text = "one\ntwo\nthree\nfour";
        let sel =
            |lines: Option<&str>, grep: Option<&str>| Selection::parse(lines, grep).unwrap().apply(text).into_owned();
        assert_eq!(sel(None, None), text);
        assert_eq!(sel(Some("2-3"), None), "two\nthree\n");
        assert_eq!(sel(Some("3-"), None), "three\nfour");
        assert_eq!(sel(Some("4"), None), "four");
        assert_eq!(sel(Some("9-12"), None), "", "past the end: nothing");
        assert_eq!(sel(None, Some("o$")), "2: two\n");
        assert_eq!(sel(None, Some("^t")), "2: two\n3: three\n");
        assert_eq!(sel(Some("3-4"), Some("o")), "4: four\n");
        assert_eq!(sel(None, Some("zzz")), "");
        for bad in ["0-2", "3-1", "a-b", "-", "1-x"] {
            assert_eq!(Selection::parse(Some(bad), None), Err(SelectionError::BadLines(pattern_head(bad))), "{bad}");
        }
        assert!(matches!(Selection::parse(None, Some("(")), Err(SelectionError::BadGrep { .. })));
        assert!(matches!(Selection::parse(None, Some("a{1000}{1000}")), Err(SelectionError::BadGrep { .. })));
    }
}
