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

use std::num::NonZeroUsize;

use super::db::{Db, params};
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

/// The writer's side: which ids are stored already, so that a request whose markers name only
/// known contents costs no lookup and no parse.
pub(crate) struct ContentIndex {
    /// Ids (their 6 bytes as a number) stored, or looked for in a raw body that did not have them.
    known: LruCache<u64, ()>,
}

impl ContentIndex {
    pub(crate) fn new() -> ContentIndex {
        ContentIndex { known: LruCache::new(NonZeroUsize::new(KNOWN_IDS).expect("non-zero")) }
    }

    /// Forget what was stored (a rolled-back transaction).
    pub(crate) fn clear(&mut self) {
        self.known.clear();
    }

    /// Add to `wanted` the keys of the ids among `ids` (hex digits) that are neither known nor
    /// stored (those found stored become known).
    fn want_unstored<'t>(
        &mut self,
        conn: &Db,
        ids: impl Iterator<Item = &'t str>,
        wanted: &mut Vec<u64>,
    ) -> Result<(), ArchiveError> {
        for hex in ids {
            let key = u64::from_str_radix(hex, 16).expect("ids are hex");
            if self.known.get(&key).is_some() || wanted.contains(&key) {
                continue;
            }
            let (low, high) = hash_range(hex);
            let stored = conn
                .query_opt("SELECT 1 FROM contents WHERE sha256 BETWEEN ?1 AND ?2 LIMIT 1", params![&low, &high])?
                .is_some();
            if stored {
                self.known.put(key, ());
            } else {
                wanted.push(key);
            }
        }
        Ok(())
    }

    /// Store the contents that `rec`'s forwarded body names and the store lacks, from `rec`'s raw
    /// conversation; `put_blob` stores one text as a blob of the record's session and gives its id.
    pub(crate) fn index(
        &mut self,
        conn: &Db,
        rec: &ExchangeRecord,
        mut put_blob: impl FnMut(&[u8]) -> Result<i64, ArchiveError>,
    ) -> Result<(), ArchiveError> {
        let Some(forwarded) = rec.forwarded.as_ref() else { return Ok(()) };
        let Ok(forwarded) = std::str::from_utf8(forwarded) else { return Ok(()) };
        let mut wanted: Vec<u64> = Vec::new();
        self.want_unstored(conn, content_ids_in(forwarded), &mut wanted)?;
        // The texts compaction derived (elision markers' id lists) first: no raw body holds them.
        // A list stored now names outputs (and earlier lists) the forwarded body does not: they are
        // wanted too.
        let mut stored_one = true;
        while stored_one {
            stored_one = false;
            for list in rec.lists.iter() {
                let hash = store::sha256(list.as_bytes());
                let key = hash[..CONTENT_ID_HEX / 2].iter().fold(0u64, |key, byte| key << 8 | u64::from(*byte));
                if let Some(at) = wanted.iter().position(|k| *k == key) {
                    put_blob(list.as_bytes())?;
                    conn.execute("INSERT OR IGNORE INTO contents (sha256) VALUES (?1)", params![&hash])?;
                    self.known.put(wanted.swap_remove(at), ());
                    self.want_unstored(conn, content_ids_in(list), &mut wanted)?;
                    stored_one = true;
                }
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        for key in &wanted {
            // Found or not, a raw body is read once for an id: one that names no text of it (an
            // agent quoting a marker) is not looked for again.
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
                let key = hash[..CONTENT_ID_HEX / 2].iter().fold(0u64, |key, byte| key << 8 | u64::from(*byte));
                if !wanted.contains(&key) {
                    continue;
                }
                put_blob(text.as_bytes())?;
                conn.execute("INSERT OR IGNORE INTO contents (sha256) VALUES (?1)", params![&hash])?;
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

/// Why a selection is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectionError {
    #[error("lines {0:?} is not a range A-B of line numbers from 1 (or A- for A to the end)")]
    BadLines(String),
    #[error("grep pattern {pattern:?} is not a valid regular expression: {why}")]
    BadGrep { pattern: String, why: String },
}

/// How large a compiled `grep` pattern may grow (the regex crate's size limit).
const GREP_SIZE_LIMIT: usize = 1 << 20;

impl Selection {
    /// `lines` (`A-B`, `A-` or `A`) and `grep` as given in a query or a tool call.
    pub fn parse(lines: Option<&str>, grep: Option<&str>) -> Result<Selection, SelectionError> {
        let lines = match lines.map(str::trim).filter(|l| !l.is_empty()) {
            None => None,
            Some(spec) => {
                let bad = || SelectionError::BadLines(spec.to_owned());
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
            regex::RegexBuilder::new(pattern)
                .size_limit(GREP_SIZE_LIMIT)
                .build()
                .map_err(|e| SelectionError::BadGrep { pattern: pattern.clone(), why: e.to_string() })?;
        }
        Ok(Selection { lines, grep })
    }

    /// The selected part of `text`: the whole text, its lines `A..=B` as they are (each with its line
    /// ending), or — with `grep` — each matching line within those lines as `N: line`, one per line.
    pub fn apply<'t>(&self, text: &'t str) -> std::borrow::Cow<'t, str> {
        if self.lines.is_none() && self.grep.is_none() {
            return std::borrow::Cow::Borrowed(text);
        }
        let (from, to) = self.lines.unwrap_or((1, usize::MAX));
        let lines = text.split_inclusive('\n').enumerate().map(|(at, line)| (at + 1, line));
        let in_range = lines.skip(from - 1).take_while(|(number, _)| *number <= to);
        match &self.grep {
            None => std::borrow::Cow::Owned(in_range.map(|(_, line)| line).collect()),
            Some(pattern) => {
                let re = regex::RegexBuilder::new(pattern).size_limit(GREP_SIZE_LIMIT).build().expect("checked");
                let mut out = String::new();
                for (number, line) in in_range {
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
            assert_eq!(Selection::parse(Some(bad), None), Err(SelectionError::BadLines(bad.into())), "{bad}");
        }
        assert!(matches!(Selection::parse(None, Some("(")), Err(SelectionError::BadGrep { .. })));
        assert!(matches!(Selection::parse(None, Some("a{1000}{1000}")), Err(SelectionError::BadGrep { .. })));
    }
}
