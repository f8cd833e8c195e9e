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

use std::collections::HashMap;

use super::ArchiveError;
use super::db::{Db, params};
use super::read::{self, BodyKind};
use crate::budget::epoch::{FrozenPlan, SessionPlan};
use crate::neutral::message_hashes;
use crate::wire::Wire;

/// Layout of a row's packed columns; rows of another layout are not read.
pub const FORMAT: i64 = 1;

/// Store `plan` as the state `session` is in after `exchange` (the request whose compaction left
/// it); `blob_id` stores one rewritten prefix message and returns its blob id.
pub(crate) fn put(
    conn: &Db,
    exchange: i64,
    session: &str,
    plan: &SessionPlan,
    mut blob_id: impl FnMut(&[u8]) -> Result<i64, ArchiveError>,
) -> Result<(), ArchiveError> {
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
            FORMAT,
            plan.epoch as i64,
            plan.advanced_at_len as i64,
            plan.saturated,
            raw_hashes.as_ref(),
            prefix_blobs.as_ref(),
            prefix_seen.as_ref()
        ],
    )?;
    Ok(())
}

/// The state `session` was last stored in, with the id of the exchange that left it; `None` when
/// none is stored (a session that never changed its state, an archive written before plans were
/// stored, a row of another [`FORMAT`]).
pub fn latest(conn: &Db, session: &str) -> Result<Option<(i64, SessionPlan)>, ArchiveError> {
    if !conn.has_table("plans")? {
        return Ok(None);
    }
    let Some(row) = conn.query_opt(
        "SELECT p.exchange, e.path, p.format, p.epoch, p.advanced_at, p.saturated, p.raw_hashes, p.prefix_blobs,
                p.prefix_seen
         FROM plans p JOIN exchanges e ON e.id = p.exchange AND e.session = p.session
         WHERE p.session = ?1 ORDER BY p.id DESC LIMIT 1",
        params![session],
    )?
    else {
        return Ok(None);
    };
    let (exchange, path, format): (i64, String, i64) = (row.get(0)?, row.get(1)?, row.get(2)?);
    let (epoch, advanced_at, saturated): (i64, i64, bool) = (row.get(3)?, row.get(4)?, row.get(5)?);
    let raw_hashes: Option<Vec<u8>> = row.get(6)?;
    let prefix_blobs: Option<Vec<u8>> = row.get(7)?;
    let prefix_seen: Option<Vec<u8>> = row.get(8)?;
    if format != FORMAT {
        return Ok(None);
    }
    let frozen = match (raw_hashes, prefix_blobs) {
        (Some(raw_hashes), Some(prefix_blobs)) => {
            let corrupt = |why| ArchiveError::CorruptPlan { exchange, why };
            let raw_hashes = unpack_u128(&raw_hashes).ok_or_else(|| corrupt("raw hashes"))?;
            let ids = unpack_u64(&prefix_blobs).ok_or_else(|| corrupt("prefix blob ids"))?;
            let prefix_seen = unpack_u64(prefix_seen.as_deref().unwrap_or_default())
                .ok_or_else(|| corrupt("prefix arrival times"))?;
            let raw_body = match ids.iter().any(|&id| (id as i64) < 0) {
                true => read::body_bytes(conn, exchange, BodyKind::Raw)?,
                false => Vec::new(),
            };
            let wire = Wire::of_path(&path).unwrap_or_default();
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
                        let same = raw_hashes.get(idx).is_some_and(|hash| {
                            raw_messages.get(idx).is_some_and(|m| message_hashes(&[m])[0] == *hash)
                        });
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
            Some(FrozenPlan { raw_hashes, prefix, prefix_seen })
        }
        _ => None,
    };
    let plan = SessionPlan { epoch: epoch as u64, advanced_at_len: advanced_at as usize, saturated, frozen };
    Ok(Some((exchange, plan)))
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
        };
        let first = SessionPlan { epoch: 1, advanced_at_len: 3, saturated: true, frozen: Some(frozen.clone()) };
        let x1 = exchange(&conn, "s");
        put_plan(&conn, x1, "s", &first);
        assert_eq!(latest(&conn, "s").unwrap(), Some((x1, first.clone())));
        let timed = FrozenPlan { prefix_seen: vec![5, 6], ..frozen };
        let second = SessionPlan { epoch: 2, advanced_at_len: 9, saturated: false, frozen: Some(timed) };
        let x2 = exchange(&conn, "s");
        put_plan(&conn, x2, "s", &second);
        let x3 = exchange(&conn, "other");
        put_plan(&conn, x3, "other", &SessionPlan::default());
        assert_eq!(latest(&conn, "s").unwrap(), Some((x2, second)));
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
        crate::archive::query::delete_session(dir.path(), "s").unwrap();
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
        };
        let plan = SessionPlan { epoch: 1, advanced_at_len: 4, saturated: false, frozen: Some(frozen) };
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

    #[test]
    fn packed_columns_round_trip_and_refuse_a_cut_one() {
        let hashes = [0u128, 1, u128::MAX];
        assert_eq!(unpack_u128(&pack_u128(&hashes)).unwrap(), hashes);
        assert_eq!(unpack_u64(&pack_u64(&[3, u64::MAX])).unwrap(), [3, u64::MAX]);
        assert_eq!(unpack_u128(&pack_u128(&hashes)[..47]), None);
        assert_eq!(unpack_u64(&[0; 9]), None);
    }
}
