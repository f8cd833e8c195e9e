//! Reading bodies back: resolving a stored message list through its delta bases and concatenating
//! segments into the exact original bytes. Shared by the writer (to resume a session after a restart),
//! the audit queries, `verify` and export.

use std::collections::HashMap;

use super::ArchiveError;
use super::body::{self, Item, Part, Segment};
use super::db::{Db, params};
use super::store;

/// Which of an exchange's two bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Exactly what the agent sent.
    Raw,
    /// What was forwarded upstream (the raw body when compaction changed nothing).
    Forwarded,
}

/// Longest delta chain followed before giving up (a key frame is written every
/// [`body::KEYFRAME_EVERY`] requests, so a sound store never comes near it).
const MAX_DELTA_DEPTH: usize = 100_000;

/// The decoded template of one body of an exchange.
pub fn template(conn: &Db, exchange: i64, kind: BodyKind) -> Result<Vec<Part>, ArchiveError> {
    template_of(conn, exchange, kind).map(|(parts, _)| parts)
}

/// The decoded template and the kind it was actually stored as: a forwarded body identical to the raw
/// one is not stored, and its message list (and the deltas below it) are the raw ones.
pub fn template_of(conn: &Db, exchange: i64, kind: BodyKind) -> Result<(Vec<Part>, BodyKind), ArchiveError> {
    let row = conn
        .query_opt("SELECT raw_template, fwd_template FROM exchanges WHERE id = ?1", params![exchange])?
        .ok_or(ArchiveError::MissingExchange(exchange))?;
    let (raw, fwd): (Vec<u8>, Option<Vec<u8>>) = (row.get(0)?, row.get(1)?);
    let (bytes, stored_as) = match (kind, fwd) {
        (BodyKind::Forwarded, Some(fwd)) => (fwd, BodyKind::Forwarded),
        _ => (raw, BodyKind::Raw),
    };
    let parts = body::decode(&bytes).map_err(|e| ArchiveError::CorruptTemplate { exchange, why: e.0 })?;
    Ok((parts, stored_as))
}

/// The full message list of a body, following delta bases back to a key frame.
pub fn resolve_items(conn: &Db, exchange: i64, kind: BodyKind) -> Result<Vec<Item>, ArchiveError> {
    let mut chain: Vec<(u64, Vec<Item>)> = Vec::new();
    let mut at = exchange;
    let mut kind = kind;
    loop {
        if chain.len() > MAX_DELTA_DEPTH {
            return Err(ArchiveError::CorruptTemplate { exchange, why: "delta chain too long" });
        }
        let (parts, stored_as) = template_of(conn, at, kind)?;
        kind = stored_as;
        let Some(m) = body::messages_part(&parts) else {
            if chain.is_empty() {
                return Ok(Vec::new());
            }
            return Err(ArchiveError::CorruptTemplate { exchange: at, why: "delta base has no message list" });
        };
        chain.push((m.n_shared, m.new.clone()));
        if m.base == 0 {
            break;
        }
        if m.base >= at {
            return Err(ArchiveError::CorruptTemplate { exchange: at, why: "delta base is not an earlier exchange" });
        }
        at = m.base;
    }
    let mut items: Vec<Item> = Vec::new();
    for (n_shared, new) in chain.into_iter().rev() {
        if n_shared as usize > items.len() {
            return Err(ArchiveError::CorruptTemplate {
                exchange,
                why: "delta shares more messages than its base has",
            });
        }
        items.truncate(n_shared as usize);
        items.extend(new);
    }
    Ok(items)
}

/// Apply one template's message delta to its base's resolved list.
pub fn apply_delta(base_items: &[Item], parts: &[Part]) -> Option<Vec<Item>> {
    let m = body::messages_part(parts)?;
    let n = m.n_shared as usize;
    if m.base != 0 && n > base_items.len() {
        return None;
    }
    let mut items = if m.base == 0 { Vec::new() } else { base_items[..n].to_vec() };
    items.extend(m.new.iter().cloned());
    Some(items)
}

/// Concatenate segments into bytes, reading blobs through `cache`.
pub fn materialize(
    conn: &Db,
    segments: &[Segment],
    cache: &mut HashMap<i64, Vec<u8>>,
) -> Result<Vec<u8>, ArchiveError> {
    let mut out = Vec::new();
    for seg in segments {
        match seg {
            Segment::Lit(b) => out.extend_from_slice(b),
            Segment::Blob(id) => {
                if !cache.contains_key(id) {
                    let bytes = store::read_blob(conn, *id)?;
                    cache.insert(*id, bytes);
                }
                out.extend_from_slice(&cache[id]);
            }
        }
    }
    Ok(out)
}

/// The exact bytes of one body of an exchange.
pub fn body_bytes(conn: &Db, exchange: i64, kind: BodyKind) -> Result<Vec<u8>, ArchiveError> {
    let parts = template(conn, exchange, kind)?;
    let items = if body::messages_part(&parts).is_some() { resolve_items(conn, exchange, kind)? } else { Vec::new() };
    let segments = body::flatten(&parts, &items);
    materialize(conn, &segments, &mut HashMap::new())
}
