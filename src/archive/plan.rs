//! Stored plans: a session's compaction state ([`SessionPlan`]: epoch, eager frontier, saturation
//! and the frozen prefix) written with the exchange that changed it, so that a restarted pare, or one
//! that evicted the session from memory, goes on forwarding byte for byte what it would have
//! forwarded (`SessionCompactor::resume`).
//!
//! Most exchanges append to the frozen prefix and store nothing: the forwarded request is that
//! prefix followed by the exchange's raw messages after those it covers. A row is written only when
//! the state changes (an epoch, an eager advance, a history edit). A prefix message the epoch kept
//! as the agent sent it is stored as its index among the raw messages of the row's exchange (read
//! back from that request's archived body); a rewritten one as a content-addressed blob shared with
//! every other row that holds it. A row costs its hashes and references: 24 bytes per message.
//!
//! With the row, `plan_items` holds what became of each raw message the prefix covers (the
//! engine's [`Fate`]s: kept, rewritten by which rules, elided behind which marker, left out), 8
//! bytes each: what `sessions show --diff` and the audit UI show, read as stored ([`history`]).

use std::collections::HashMap;

use super::ArchiveError;
use super::db::{Db, params};
use super::read::{self, BodyKind};
use crate::budget::compactor::{FrozenPlan, SessionPlan};
use crate::compact::Fate;
use crate::compact::provenance::{Step, steps};
use crate::compact::report::RuleSet;
use crate::exchange::RawHead;
use crate::neutral::message_hashes;
use crate::wire::Wire;

/// Layout of a row's packed columns; rows of another layout are not read.
pub const FORMAT: i64 = 1;

/// A row of [`FORMAT`]'s layout holding a state mode `observe` projected
/// ([`SessionPlan::observed`]): what [`latest`] gives (the pipeline resumes mode `observe` from it,
/// and a compacting mode from the raw requests the upstream was sent), never what [`history`] and
/// [`latest_at`] say was forwarded. A pare that does not know this value skips such rows.
pub const OBSERVED: i64 = 2;

/// Store `plan` as the state `session` is in after `exchange` (the request whose compaction left
/// it); `blob_id` stores one rewritten prefix message and returns its blob id.
pub(crate) fn put(
    conn: &Db,
    exchange: i64,
    session: &str,
    plan: &SessionPlan,
    mut blob_id: impl FnMut(&[u8]) -> Result<i64, ArchiveError>,
) -> Result<(), ArchiveError> {
    let items = plan.frozen.as_ref().and_then(|f| f.plan.as_deref()).map(pack_fates);
    let (raw_hashes, prefix_blobs, prefix_seen) = match &plan.frozen {
        None => (None, None, None),
        Some(frozen) => {
            // Raw message hash → its first index: a prefix message with that hash is that message.
            let mut raw_index = HashMap::with_capacity(frozen.raw_hashes.len());
            for (idx, hash) in frozen.raw_hashes.iter().enumerate().rev() {
                raw_index.insert(*hash, idx);
            }
            let mut ids = Vec::with_capacity(frozen.prefix.len());
            for (message, hash) in frozen.prefix.iter().zip(message_hashes(&frozen.prefix)) {
                let reference = match raw_index.get(&hash) {
                    Some(&idx) => -(idx as i64) - 1,
                    None => blob_id(message.as_bytes())?,
                };
                ids.push(reference as u64);
            }
            (Some(pack_u128(&frozen.raw_hashes)), Some(pack_u64(&ids)), Some(pack_u64(&frozen.prefix_seen)))
        }
    };
    conn.execute(
        "INSERT INTO plans (exchange, session, format, epoch, advanced_at, saturated, raw_hashes, prefix_blobs, prefix_seen)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            exchange,
            session,
            if plan.observed { OBSERVED } else { FORMAT },
            plan.epoch as i64,
            plan.advanced_at_len as i64,
            plan.saturated,
            raw_hashes.as_ref(),
            prefix_blobs.as_ref(),
            prefix_seen.as_ref()
        ],
    )?;
    if let Some(items) = items {
        conn.execute(
            "INSERT INTO plan_items (exchange, session, items) VALUES (?1, ?2, ?3)",
            params![exchange, session, &items],
        )?;
    }
    Ok(())
}

/// The state `session` was last stored in, projected ones ([`OBSERVED`]) included, with the id of
/// the exchange that left it; `None` when none is stored (a session that never changed its state,
/// an archive written before plans were stored, a row of another [`FORMAT`]).
pub fn latest(conn: &Db, session: &str) -> Result<Option<(i64, SessionPlan)>, ArchiveError> {
    Ok(rows(conn, session, i64::MAX, "DESC LIMIT 1", Rows::WithObserved)?.pop())
}

/// The state exchange `exchange` was forwarded under: the latest stored at or before it, a
/// projected one ([`OBSERVED`]) aside (what [`in_force`] finds in the whole [`history`], read
/// without it).
pub fn latest_at(conn: &Db, session: &str, exchange: i64) -> Result<Option<(i64, SessionPlan)>, ArchiveError> {
    Ok(rows(conn, session, exchange, "DESC LIMIT 1", Rows::Forwarded)?.pop())
}

/// Every state `session`'s requests were forwarded under, oldest first, each with the id of the
/// exchange that left it (rows of another [`FORMAT`], and projected ones, are left out).
pub fn history(conn: &Db, session: &str) -> Result<Vec<(i64, SessionPlan)>, ArchiveError> {
    rows(conn, session, i64::MAX, "ASC", Rows::Forwarded)
}

/// Which rows [`rows`] reads.
#[derive(Clone, Copy, PartialEq)]
enum Rows {
    /// The states requests were forwarded under.
    Forwarded,
    /// Those and the states mode `observe` projected.
    WithObserved,
}

/// The rows of `session` stored with an exchange up to `exchange`, in `order` of storing.
fn rows(
    conn: &Db,
    session: &str,
    exchange: i64,
    order: &str,
    which: Rows,
) -> Result<Vec<(i64, SessionPlan)>, ArchiveError> {
    if !conn.has_table("plans")? {
        return Ok(Vec::new());
    }
    let items = match conn.has_table("plan_items")? {
        true => "(SELECT i.items FROM plan_items i WHERE i.exchange = p.exchange)",
        false => "NULL",
    };
    let formats = match which {
        Rows::Forwarded => format!("{FORMAT}"),
        Rows::WithObserved => format!("{FORMAT}, {OBSERVED}"),
    };
    let sql = format!(
        "SELECT p.exchange, e.path, p.format, p.epoch, p.advanced_at, p.saturated, p.raw_hashes, p.prefix_blobs,
                p.prefix_seen, {items}
         FROM plans p JOIN exchanges e ON e.id = p.exchange AND e.session = p.session
         WHERE p.session = ?1 AND p.exchange <= ?2 AND p.format IN ({formats}) ORDER BY p.id {order}"
    );
    let mut out = Vec::new();
    for row in conn.query_all(&sql, params![session, exchange])? {
        let (exchange, path, format): (i64, String, i64) = (row.get(0)?, row.get(1)?, row.get(2)?);
        let (epoch, advanced_at, saturated): (i64, i64, bool) = (row.get(3)?, row.get(4)?, row.get(5)?);
        let packed =
            Packed { raw_hashes: row.get(6)?, prefix_blobs: row.get(7)?, prefix_seen: row.get(8)?, items: row.get(9)? };
        let frozen = frozen(conn, exchange, &path, packed)?;
        let plan = SessionPlan {
            epoch: epoch as u64,
            advanced_at_len: advanced_at as usize,
            saturated,
            frozen,
            observed: format == OBSERVED,
        };
        out.push((exchange, plan));
    }
    Ok(out)
}

/// The state in force when exchange `exchange` was forwarded, among a session's [`history`]: the
/// latest stored at or before it (`None`: the session had no stored state yet).
pub fn in_force(history: &[(i64, SessionPlan)], exchange: i64) -> Option<&SessionPlan> {
    history.iter().rev().find(|(at, _)| *at <= exchange).map(|(_, plan)| plan)
}

/// What a request was forwarded as, read from its plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Forwarding {
    /// The forwarded conversation (neutral messages).
    pub messages: Vec<String>,
    /// What happened to each raw message; `None` when the plan does not hold it (an archive
    /// written before plans held their items).
    pub steps: Option<Vec<Step>>,
}

/// The forwarding of a request of `raw` messages under `frozen`, its session's frozen prefix when
/// it was forwarded: the prefix, then the raw messages after those it covers. A request forwarded
/// as sent, or one the prefix does not describe (its messages do not start with those the prefix
/// covers), forwarded each message as sent.
pub fn forwarding(raw: &[&str], frozen: Option<&FrozenPlan>) -> Forwarding {
    let frozen = frozen
        .filter(|f| f.raw_hashes.len() <= raw.len() && message_hashes(&raw[..f.raw_hashes.len()]) == f.raw_hashes);
    let Some(frozen) = frozen else {
        return Forwarding {
            messages: raw.iter().map(|m| (*m).to_owned()).collect(),
            steps: Some(steps(&[], raw.len(), 0)),
        };
    };
    let covered = frozen.raw_hashes.len();
    let mut messages = frozen.prefix.clone();
    messages.extend(raw[covered..].iter().map(|m| (*m).to_owned()));
    let steps = frozen.plan.as_deref().map(|plan| steps(plan, raw.len(), frozen.prefix.len()));
    Forwarding { messages, steps }
}

/// What a process catching up on a session reads of it ([`read_catch_up`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredCatchUp {
    /// The session's archived requests.
    pub requests: u64,
    /// The raw head of its last request that was compacted ([`crate::exchange::BudgetReport::raw_head`]):
    /// `None` when none was, or when a pare that did not store heads compacted it.
    pub head: Option<RawHead>,
    /// Whether the last request with a summary said its head: `false` when it was compacted by a
    /// pare that did not store heads (the catch-up cannot know the head; `head` is `None`).
    pub head_known: bool,
    /// The latest stored plan; `None` when it is the one the caller holds.
    pub plan: Option<StoredPlan>,
}

/// The latest plan of a session as [`read_catch_up`] found it: the prefix messages the agent sent
/// as they are are named by their index in the request catching up (which starts with the raw
/// messages the prefix covers), so that its body is not read back.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredPlan {
    /// The request it was stored with (0: none is stored; the session's state is the empty one).
    pub seq: u64,
    epoch: u64,
    advanced_at_len: usize,
    saturated: bool,
    frozen: Option<StoredFrozen>,
}

#[derive(Debug, Clone, PartialEq)]
struct StoredFrozen {
    raw_hashes: Vec<u128>,
    prefix: Vec<Entry>,
    prefix_seen: Vec<u64>,
    plan: Option<Vec<Fate>>,
}

/// One message of a stored frozen prefix.
#[derive(Debug, Clone, PartialEq)]
enum Entry {
    /// Raw message `i` of the request catching up.
    Raw(usize),
    Text(String),
}

impl StoredPlan {
    /// The plan, its kept messages taken from `raw`: the request catching up, whose [`message_hashes`]
    /// [`read_catch_up`] was given.
    pub fn resolve(self, raw: &[&str]) -> SessionPlan {
        let frozen = self.frozen.map(|f| FrozenPlan {
            raw_hashes: f.raw_hashes,
            prefix: f
                .prefix
                .into_iter()
                .map(|entry| match entry {
                    Entry::Raw(i) => raw[i].to_owned(),
                    Entry::Text(text) => text,
                })
                .collect(),
            prefix_seen: f.prefix_seen,
            plan: f.plan,
        });
        // A catch-up reads only plans epoch and eager modes forwarded (an observed plan's prefix is
        // left unread, see `read_catch_up`).
        SessionPlan {
            epoch: self.epoch,
            advanced_at_len: self.advanced_at_len,
            saturated: self.saturated,
            frozen,
            observed: false,
        }
    }
}

/// What `session` holds that a process catching up on it needs, in one statement (and one more for
/// the rewritten messages of a plan it does not hold yet): its request count, the raw head of its
/// last compacted request, and its latest plan unless that is the one stored with request
/// `known_plan` (0: none stored). `hashes` are the [`message_hashes`] of the request catching up:
/// a prefix message kept as sent is that request's message when it starts with the messages the
/// prefix covers; otherwise it is read from the plan's own request (the request edited earlier
/// messages: its epoch starts afresh). `None`: the archive holds no such session.
pub fn read_catch_up(
    conn: &Db,
    session: &str,
    known_plan: Option<u64>,
    hashes: &[u128],
) -> Result<Option<StoredCatchUp>, ArchiveError> {
    let known = known_plan.map_or(-1, |seq| seq as i64);
    let row = conn.query_opt(
        "SELECT s.n_requests, e.summary, coalesce(pe.seq, 0), p.exchange, pe.path, p.format, p.epoch, p.advanced_at,
                p.saturated,
                CASE WHEN coalesce(pe.seq, 0) = ?2 THEN NULL ELSE p.raw_hashes END,
                CASE WHEN coalesce(pe.seq, 0) = ?2 THEN NULL ELSE p.prefix_blobs END,
                CASE WHEN coalesce(pe.seq, 0) = ?2 THEN NULL ELSE p.prefix_seen END,
                CASE WHEN coalesce(pe.seq, 0) = ?2 THEN NULL ELSE i.items END
         FROM sessions s
         LEFT JOIN exchanges e ON e.id = (SELECT x.id FROM exchanges x WHERE x.session = s.id
                                          AND x.summary IS NOT NULL ORDER BY x.seq DESC LIMIT 1)
         LEFT JOIN plans p ON p.id = (SELECT max(q.id) FROM plans q WHERE q.session = s.id)
         LEFT JOIN exchanges pe ON pe.id = p.exchange
         LEFT JOIN plan_items i ON i.exchange = p.exchange
         WHERE s.id = ?1",
        params![session, known],
    )?;
    let Some(row) = row else { return Ok(None) };
    let requests: i64 = row.get(0)?;
    let summary: Option<String> = row.get(1)?;
    let head = summary
        .as_deref()
        .map(|json| serde_json::from_str::<SummaryHead>(json).ok().and_then(|s| s.report).and_then(|r| r.raw_head));
    let seq: i64 = row.get(2)?;
    let plan = match (seq == known, row.get::<Option<i64>>(3)?) {
        (true, _) => None,
        (false, None) => Some(StoredPlan { seq: 0, epoch: 0, advanced_at_len: 0, saturated: false, frozen: None }),
        (false, Some(exchange)) => {
            let (path, format): (String, i64) = (row.get(4)?, row.get(5)?);
            let (epoch, advanced_at, saturated): (i64, i64, bool) = (row.get(6)?, row.get(7)?, row.get(8)?);
            let packed = Packed {
                raw_hashes: row.get(9)?,
                prefix_blobs: row.get(10)?,
                prefix_seen: row.get(11)?,
                items: row.get(12)?,
            };
            // A row of another layout is not read: as if none were stored.
            let frozen = match format == FORMAT {
                true => stored_frozen(conn, exchange, &path, packed, hashes)?,
                false => None,
            };
            Some(StoredPlan {
                seq: seq as u64,
                epoch: epoch as u64,
                advanced_at_len: advanced_at as usize,
                saturated,
                frozen,
            })
        }
    };
    Ok(Some(StoredCatchUp {
        requests: requests.max(0) as u64,
        head: head.flatten(),
        head_known: head.is_none_or(|h| h.is_some()),
        plan,
    }))
}

/// The one field of an archived summary a catch-up reads.
#[derive(serde::Deserialize)]
struct SummaryHead {
    report: Option<ReportHead>,
}

#[derive(serde::Deserialize)]
struct ReportHead {
    raw_head: Option<RawHead>,
}

/// The frozen prefix of a plan row for a request whose messages hash to `hashes`; its rewritten
/// messages read in one statement.
fn stored_frozen(
    conn: &Db,
    exchange: i64,
    path: &str,
    packed: Packed,
    hashes: &[u128],
) -> Result<Option<StoredFrozen>, ArchiveError> {
    let (Some(raw_hashes), Some(prefix_blobs)) = (&packed.raw_hashes, &packed.prefix_blobs) else {
        return Ok(None);
    };
    let corrupt = |why| ArchiveError::CorruptPlan { exchange, why };
    let covered = unpack_u128(raw_hashes).ok_or_else(|| corrupt("raw hashes"))?;
    if !hashes.starts_with(&covered) {
        // The request does not hold the messages kept as sent: read them from the plan's request.
        let frozen = frozen(conn, exchange, path, packed)?;
        return Ok(frozen.map(|f| StoredFrozen {
            raw_hashes: f.raw_hashes,
            prefix: f.prefix.into_iter().map(Entry::Text).collect(),
            prefix_seen: f.prefix_seen,
            plan: f.plan,
        }));
    }
    let ids = unpack_u64(prefix_blobs).ok_or_else(|| corrupt("prefix blob ids"))?;
    let prefix_seen =
        unpack_u64(packed.prefix_seen.as_deref().unwrap_or_default()).ok_or_else(|| corrupt("prefix arrival times"))?;
    let plan = match &packed.items {
        Some(items) => Some(unpack_fates(items, ids.len(), covered.len()).ok_or_else(|| corrupt("raw message fates"))?),
        None => None,
    };
    let rewritten: Vec<i64> = ids.iter().map(|&id| id as i64).filter(|&id| id >= 0).collect();
    let texts = read_texts(conn, &rewritten)?;
    let mut prefix = Vec::with_capacity(ids.len());
    for id in ids {
        let entry = match id as i64 {
            id if id < 0 => {
                let idx = (-id - 1) as usize;
                if idx >= covered.len() {
                    return Err(corrupt("a kept message that is not its request's"));
                }
                Entry::Raw(idx)
            }
            id => Entry::Text(texts.get(&id).cloned().ok_or(ArchiveError::MissingBlob(id))?),
        };
        prefix.push(entry);
    }
    Ok(Some(StoredFrozen { raw_hashes: covered, prefix, prefix_seen, plan }))
}

/// The blobs `ids` as UTF-8 texts (prefix messages), in one statement.
fn read_texts(conn: &Db, ids: &[i64]) -> Result<HashMap<i64, String>, ArchiveError> {
    let mut texts = HashMap::with_capacity(ids.len());
    if ids.is_empty() {
        return Ok(texts);
    }
    let list = conn.list_param(ids);
    let rows = conn.query_all(
        &format!("SELECT id, sha256, codec, raw_len, data FROM blobs WHERE {}", conn.in_list("id", 1)),
        params![&list],
    )?;
    for row in rows {
        let id: i64 = row.get(0)?;
        let stored = super::store::StoredBlob {
            sha256: row.get(1)?,
            codec: row.get(2)?,
            raw_len: row.get(3)?,
            data: row.get(4)?,
        };
        let bytes = super::store::decode_blob(id, &stored)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| ArchiveError::CorruptBlob { id, why: "a prefix message that is not UTF-8".into() })?;
        texts.insert(id, text);
    }
    Ok(texts)
}

/// A row's packed columns.
struct Packed {
    raw_hashes: Option<Vec<u8>>,
    prefix_blobs: Option<Vec<u8>>,
    prefix_seen: Option<Vec<u8>>,
    items: Option<Vec<u8>>,
}

/// The frozen prefix a row of `exchange` (a request to `path`) describes.
fn frozen(conn: &Db, exchange: i64, path: &str, packed: Packed) -> Result<Option<FrozenPlan>, ArchiveError> {
    let (Some(raw_hashes), Some(prefix_blobs)) = (packed.raw_hashes, packed.prefix_blobs) else {
        return Ok(None);
    };
    let corrupt = |why| ArchiveError::CorruptPlan { exchange, why };
    let raw_hashes = unpack_u128(&raw_hashes).ok_or_else(|| corrupt("raw hashes"))?;
    let ids = unpack_u64(&prefix_blobs).ok_or_else(|| corrupt("prefix blob ids"))?;
    let prefix_seen =
        unpack_u64(packed.prefix_seen.as_deref().unwrap_or_default()).ok_or_else(|| corrupt("prefix arrival times"))?;
    let plan = match packed.items {
        Some(items) => {
            Some(unpack_fates(&items, ids.len(), raw_hashes.len()).ok_or_else(|| corrupt("raw message fates"))?)
        }
        None => None,
    };
    let raw_body = match ids.iter().any(|&id| (id as i64) < 0) {
        true => read::body_bytes(conn, exchange, BodyKind::Raw)?,
        false => Vec::new(),
    };
    let wire = Wire::of_path(path).unwrap_or_default();
    let raw = match raw_body.is_empty() {
        true => None,
        false => Some(crate::wire::parse(wire, &raw_body).map_err(|_| corrupt("its request does not parse"))?),
    };
    let raw_messages = raw.as_ref().map(|body| body.messages()).unwrap_or_default();
    let mut prefix = Vec::with_capacity(ids.len());
    for id in ids {
        let message = match id as i64 {
            id if id < 0 => {
                let idx = (-id - 1) as usize;
                // The message must be the one the row hashed, or the state is not this one.
                let same = raw_hashes
                    .get(idx)
                    .is_some_and(|hash| raw_messages.get(idx).is_some_and(|m| message_hashes(&[m])[0] == *hash));
                if !same {
                    return Err(corrupt("a kept message that is not its request's"));
                }
                raw_messages[idx].to_owned()
            }
            id => String::from_utf8(super::store::read_blob(conn, id)?)
                .map_err(|_| corrupt("a prefix message that is not UTF-8"))?,
        };
        prefix.push(message);
    }
    Ok(Some(FrozenPlan { raw_hashes, prefix, prefix_seen, plan }))
}

/// A fate in 8 bytes: the prefix entry in the low 32 bits, the rules' bits in the next 24, the kind
/// in the top 2.
fn pack_fates(fates: &[Fate]) -> Vec<u8> {
    let packed: Vec<u64> = fates
        .iter()
        .map(|fate| {
            let (kind, at, rules) = match *fate {
                Fate::Kept { at } => (0u64, at, RuleSet::default()),
                Fate::Rewritten { at, rules } => (1, at, rules),
                Fate::Elided { at } => (2, at, RuleSet::default()),
                Fate::Dropped { rules } => (3, 0, rules),
            };
            kind << 62 | u64::from(rules.bits()) << 32 | at as u32 as u64
        })
        .collect();
    pack_u64(&packed)
}

/// [`pack_fates`] read back: `None` unless there is one fate per raw message, each naming one of
/// the `n_prefix` entries and known rules, in order.
fn unpack_fates(bytes: &[u8], n_prefix: usize, n_raw: usize) -> Option<Vec<Fate>> {
    let fates: Vec<Fate> = unpack_u64(bytes)?
        .into_iter()
        .map(|v| {
            let at = (v & 0xffff_ffff) as usize;
            let rules = RuleSet::from_bits(((v >> 32) & 0xff_ffff) as u32)?;
            match v >> 62 {
                0 => Some(Fate::Kept { at }),
                1 => Some(Fate::Rewritten { at, rules }),
                2 => Some(Fate::Elided { at }),
                _ => Some(Fate::Dropped { rules }),
            }
        })
        .collect::<Option<_>>()?;
    let ats: Vec<usize> = fates.iter().filter_map(Fate::at).collect();
    let ordered = ats.windows(2).all(|w| w[0] <= w[1]) && ats.last().is_none_or(|&at| at < n_prefix);
    (fates.len() == n_raw && ordered).then_some(fates)
}

fn pack_u128(values: &[u128]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(crate) fn pack_u64(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn unpack_u128(bytes: &[u8]) -> Option<Vec<u128>> {
    let chunks = bytes.chunks_exact(16);
    chunks
        .remainder()
        .is_empty()
        .then(|| chunks.map(|c| u128::from_le_bytes(c.try_into().expect("16 bytes"))).collect())
}

pub(crate) fn unpack_u64(bytes: &[u8]) -> Option<Vec<u64>> {
    let chunks = bytes.chunks_exact(8);
    chunks.remainder().is_empty().then(|| chunks.map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::store;
    use crate::compact::report::RuleId;

    fn exchange(conn: &Db, session: &str) -> i64 {
        conn.insert_id(
            "INSERT INTO exchanges (session, seq, chain_idx, at_ms, method, path, headers, raw_sha256, raw_len,
                raw_template, prev_hash, hash)
             VALUES (?1, (SELECT count(*) + 1 FROM exchanges WHERE session = ?1), 0, 0, 'POST', '/v1/responses', '{}',
                x'00', 0, x'00', x'00', x'00')",
            params![session],
        )
        .unwrap()
    }

    fn put_plan(conn: &Db, exchange: i64, session: &str, plan: &SessionPlan) {
        put(conn, exchange, session, plan, |bytes| Ok(store::put_blob(conn, &store::sha256(bytes), bytes)?)).unwrap();
    }

    #[test]
    fn a_stored_plan_reads_back_as_it_was_and_the_latest_wins() {
        let dir = tempfile::tempdir().unwrap();
        let conn = store::open_rw(dir.path()).unwrap();
        assert_eq!(latest(&conn, "s").unwrap(), None);
        let frozen = FrozenPlan {
            raw_hashes: vec![1, u128::MAX, 7 << 100],
            prefix: vec![r#"{"role":"system","content":"é"}"#.into(), "[tool: ls → ok]".into()],
            prefix_seen: vec![],
            plan: Some(vec![Fate::Kept { at: 0 }, Fate::Elided { at: 1 }, Fate::Elided { at: 1 }]),
        };
        let first = SessionPlan {
            epoch: 1,
            advanced_at_len: 3,
            saturated: true,
            frozen: Some(frozen.clone()),
            ..SessionPlan::default()
        };
        let x1 = exchange(&conn, "s");
        put_plan(&conn, x1, "s", &first);
        assert_eq!(latest(&conn, "s").unwrap(), Some((x1, first.clone())));
        let rules: RuleSet = [RuleId::Truncate, RuleId::TierFacts].into_iter().collect();
        let fates = vec![Fate::Kept { at: 0 }, Fate::Dropped { rules }, Fate::Rewritten { at: 1, rules }];
        let timed = FrozenPlan { prefix_seen: vec![5, 6], plan: Some(fates), ..frozen };
        let second = SessionPlan {
            epoch: 2,
            advanced_at_len: 9,
            saturated: false,
            frozen: Some(timed),
            ..SessionPlan::default()
        };
        let x2 = exchange(&conn, "s");
        put_plan(&conn, x2, "s", &second);
        let x3 = exchange(&conn, "other");
        put_plan(&conn, x3, "other", &SessionPlan::default());
        assert_eq!(latest(&conn, "s").unwrap(), Some((x2, second.clone())));
        assert_eq!(history(&conn, "s").unwrap(), [(x1, first.clone()), (x2, second.clone())]);
        let history = history(&conn, "s").unwrap();
        assert_eq!(in_force(&history, x1 - 1), None);
        assert_eq!(in_force(&history, x1), Some(&first));
        assert_eq!(in_force(&history, x2 - 1), Some(&first));
        assert_eq!(in_force(&history, x3), Some(&second));
        for at in [x1 - 1, x1, x2 - 1, x2, x3] {
            let read = latest_at(&conn, "s", at).unwrap().map(|(_, plan)| plan);
            assert_eq!(read.as_ref(), in_force(&history, at), "exchange {at}");
        }
        assert_eq!(latest(&conn, "other").unwrap(), Some((x3, SessionPlan::default())));
        // The prefix messages are blobs shared by the two rows.
        let n_blobs: i64 = conn.query_one("SELECT count(*) FROM blobs", params![]).unwrap().get(0).unwrap();
        assert_eq!(n_blobs, 2);
    }

    /// Deleting a session deletes its plans.
    #[test]
    fn a_deleted_session_leaves_no_plan() {
        let dir = tempfile::tempdir().unwrap();
        let conn = store::open_rw(dir.path()).unwrap();
        let x = exchange(&conn, "s");
        put_plan(&conn, x, "s", &SessionPlan { epoch: 2, ..SessionPlan::default() });
        crate::archive::retention::delete_session(dir.path(), "s").unwrap();
        let n: i64 = conn.query_one("SELECT count(*) FROM plans", params![]).unwrap().get(0).unwrap();
        assert_eq!(n, 0);
    }

    /// A row whose exchange is gone (a deleted session whose id came back) is not read.
    #[test]
    fn a_plan_without_its_exchange_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let conn = store::open_rw(dir.path()).unwrap();
        let x = exchange(&conn, "s");
        put_plan(&conn, x, "s", &SessionPlan { epoch: 4, ..SessionPlan::default() });
        conn.execute("DELETE FROM exchanges", params![]).unwrap();
        assert_eq!(latest(&conn, "s").unwrap(), None);
    }

    /// A prefix message the epoch kept as sent is stored as a reference to the exchange's raw
    /// request, not as a blob of its own, and reads back as the message; a reference whose message
    /// is not the one hashed (the row does not describe its exchange) is refused.
    #[test]
    fn kept_messages_are_references_into_the_exchanges_request() {
        use crate::archive::{Archive, ExchangeRecord};
        use crate::config::Durability;
        let dir = tempfile::tempdir().unwrap();
        let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, std::time::Duration::ZERO);
        let messages = [
            r#"{"role":"system","content":"you are an agent"}"#,
            r#"{"role":"user","content":"go"}"#,
            r#"{"role":"tool","tool_call_id":"c1","content":"a long output"}"#,
            r#"{"role":"user","content":"next"}"#,
        ];
        let body = |messages: &[&str]| format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","));
        let frozen = FrozenPlan {
            raw_hashes: message_hashes(&messages[..3]),
            prefix: vec![messages[0].into(), messages[1].into(), "[tool: output]".into()],
            prefix_seen: vec![],
            plan: None,
        };
        let plan = SessionPlan {
            epoch: 1,
            advanced_at_len: 4,
            saturated: false,
            frozen: Some(frozen),
            ..SessionPlan::default()
        };
        let ticket = archive.record_exchange(ExchangeRecord::unchanged("s", 1, body(&messages).into()));
        archive.record_plan(ticket, plan.clone());
        let other = [r#"{"role":"system","content":"another agent"}"#, messages[1], messages[2]];
        let ticket = archive.record_exchange(ExchangeRecord::unchanged("t", 2, body(&other).into()));
        archive.record_plan(ticket, plan.clone());
        archive.flush().unwrap();

        let conn = store::open_ro(dir.path()).unwrap();
        let (_, read) = latest(&conn, "s").unwrap().unwrap();
        assert_eq!(read, plan);
        let packed: Vec<u8> =
            conn.query_one("SELECT prefix_blobs FROM plans LIMIT 1", params![]).unwrap().get(0).unwrap();
        let ids: Vec<i64> = unpack_u64(&packed).unwrap().into_iter().map(|id| id as i64).collect();
        assert_eq!(&ids[..2], [-1, -2]);
        assert!(ids[2] > 0, "{ids:?}");
        let err = latest(&conn, "t").unwrap_err();
        assert!(err.to_string().contains("not its request's"), "{err}");
        archive.close();
    }

    /// A catch-up reads what `latest` reads, in one statement: the kept messages from the request
    /// catching up when it starts with those the prefix covers, else from the plan's own request;
    /// nothing of the plan when the caller holds it; the raw head of the last request with a
    /// summary; the empty plan when none is stored.
    #[test]
    fn a_catch_up_reads_the_latest_plan_and_the_last_head() {
        use crate::archive::{Archive, ExchangeRecord};
        use crate::config::Durability;
        use crate::exchange::{BudgetReport, CompactionSummary};
        let dir = tempfile::tempdir().unwrap();
        let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, std::time::Duration::ZERO);
        let messages = [
            r#"{"role":"system","content":"you are an agent"}"#,
            r#"{"role":"user","content":"go"}"#,
            r#"{"role":"tool","tool_call_id":"c1","content":"a long output"}"#,
            r#"{"role":"user","content":"next"}"#,
            r#"{"role":"tool","tool_call_id":"c2","content":"more"}"#,
        ];
        let body = |messages: &[&str]| format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","));
        let rules: RuleSet = [RuleId::Truncate].into_iter().collect();
        let frozen = FrozenPlan {
            raw_hashes: message_hashes(&messages[..3]),
            prefix: vec![messages[0].into(), messages[1].into(), "[tool: output]".into()],
            prefix_seen: vec![],
            plan: Some(vec![Fate::Kept { at: 0 }, Fate::Kept { at: 1 }, Fate::Rewritten { at: 2, rules }]),
        };
        let plan =
            SessionPlan { epoch: 1, advanced_at_len: 4, saturated: false, frozen: Some(frozen), observed: false };
        let head = |n: u64| CompactionSummary {
            report: Some(BudgetReport {
                raw_head: Some(RawHead { messages: n, digest: n.into() }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let first =
            ExchangeRecord { summary: Some(head(4)), ..ExchangeRecord::unchanged("s", 1, body(&messages[..4]).into()) };
        let ticket = archive.record_exchange(first);
        archive.record_plan(ticket, plan.clone());
        // A request compaction did not run on (no summary) leaves the head where it was.
        archive.record_exchange(ExchangeRecord::unchanged("s", 2, body(&messages).into()));
        archive.record_exchange(ExchangeRecord {
            summary: Some(head(4)),
            ..ExchangeRecord::unchanged("u", 3, body(&messages[..4]).into())
        });
        archive.flush().unwrap();

        let conn = store::open_ro(dir.path()).unwrap();
        let hashes = message_hashes(&messages);
        let read = read_catch_up(&conn, "s", None, &hashes).unwrap().unwrap();
        assert_eq!((read.requests, read.head, read.head_known), (2, Some(RawHead { messages: 4, digest: 4 }), true));
        let stored = read.plan.unwrap();
        assert_eq!(stored.seq, 1);
        assert!(matches!(&stored.frozen.as_ref().unwrap().prefix[..], [Entry::Raw(0), Entry::Raw(1), Entry::Text(_)]));
        assert_eq!(stored.resolve(&messages), plan);
        // Known: the plan is not read again.
        assert_eq!(read_catch_up(&conn, "s", Some(1), &hashes).unwrap().unwrap().plan, None);
        // A request that edited an earlier message: the kept ones come from the plan's request.
        let edited = [messages[0], r#"{"role":"user","content":"went"}"#, messages[2]];
        let read = read_catch_up(&conn, "s", Some(0), &message_hashes(&edited)).unwrap().unwrap();
        assert_eq!(read.plan.unwrap().resolve(&edited), plan);
        // No plan stored: the empty state.
        let read = read_catch_up(&conn, "u", None, &hashes).unwrap().unwrap();
        assert_eq!(read.plan.map(|p| (p.seq, p.resolve(&messages))), Some((0, SessionPlan::default())));
        assert_eq!(read_catch_up(&conn, "u", Some(0), &hashes).unwrap().unwrap().plan, None);
        assert_eq!(read_catch_up(&conn, "nobody", None, &hashes).unwrap(), None);
        archive.close();
    }

    /// Fates read back only as a plan of the row's shape: one per raw message, entries in order
    /// and among the prefix's, rules this pare knows.
    #[test]
    fn fates_round_trip_and_refuse_what_does_not_fit_the_row() {
        let rules: RuleSet = RuleId::ALL.into_iter().collect();
        let fates = [
            Fate::Kept { at: 0 },
            Fate::Rewritten { at: 1, rules },
            Fate::Dropped { rules },
            Fate::Elided { at: 2 },
            Fate::Elided { at: 2 },
        ];
        let packed = pack_fates(&fates);
        assert_eq!(packed.len(), 8 * fates.len());
        assert_eq!(unpack_fates(&packed, 3, 5).unwrap(), fates);
        assert_eq!(unpack_fates(&packed, 2, 5), None, "an entry past the prefix");
        assert_eq!(unpack_fates(&packed, 3, 4), None, "one fate per raw message");
        let backwards = pack_fates(&[Fate::Kept { at: 1 }, Fate::Kept { at: 0 }]);
        assert_eq!(unpack_fates(&backwards, 2, 2), None, "entries in order");
        let unknown_rule = pack_u64(&[1 << 62 | 1 << 55]);
        assert_eq!(unpack_fates(&unknown_rule, 1, 1), None);
    }

    /// A request is forwarded as its plan's prefix, then its raw messages after those the prefix
    /// covers; one whose messages the prefix does not describe was forwarded as sent.
    #[test]
    fn forwarding_is_the_prefix_then_the_raw_messages_after_it() {
        let raw = [
            r#"{"role":"user","content":"go"}"#,
            r#"{"role":"tool","content":"long"}"#,
            r#"{"role":"user","content":"on"}"#,
        ];
        let rules: RuleSet = [RuleId::Truncate].into_iter().collect();
        let frozen = FrozenPlan {
            raw_hashes: message_hashes(&raw[..2]),
            prefix: vec![raw[0].into(), r#"{"role":"tool","content":"lo"}"#.into()],
            prefix_seen: vec![],
            plan: Some(vec![Fate::Kept { at: 0 }, Fate::Rewritten { at: 1, rules }]),
        };
        let out = forwarding(&raw, Some(&frozen));
        assert_eq!(out.messages, [raw[0], r#"{"role":"tool","content":"lo"}"#, raw[2]]);
        let steps = out.steps.unwrap();
        assert_eq!(steps[1], Step::Edited { raw: 1, fwd: 1, rules });
        assert_eq!(steps[2], Step::Kept { raw: 2, fwd: 2 });
        let other = [raw[0], r#"{"role":"tool","content":"edited"}"#, raw[2]];
        let out = forwarding(&other, Some(&frozen));
        assert_eq!(out.messages, other);
        assert!(out.steps.unwrap().iter().all(|s| matches!(s, Step::Kept { .. })));
        let unknown = FrozenPlan { plan: None, ..frozen };
        assert_eq!(forwarding(&raw, Some(&unknown)).steps, None);
    }

    #[test]
    fn packed_columns_round_trip_and_refuse_a_cut_one() {
        let hashes = [0u128, 1, u128::MAX];
        assert_eq!(unpack_u128(&pack_u128(&hashes)).unwrap(), hashes);
        assert_eq!(unpack_u64(&pack_u64(&[3, u64::MAX])).unwrap(), [3, u64::MAX]);
        assert_eq!(unpack_u128(&pack_u128(&hashes)[..47]), None);
        assert_eq!(unpack_u64(&[0; 9]), None);
    }
}
