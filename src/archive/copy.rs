//! `pare archive copy FROM TO`: every session of one archive into another, between any two
//! backends (SQLite ↔ PostgreSQL), then checked.
//!
//! A session is copied in one transaction of the target: its blobs (content-addressed: a blob the
//! target holds already is shared, not copied twice), its exchanges, answers, usage rows, plans (with their items) and
//! the contents its markers name, and its `sessions` row. Row ids differ between stores, so the
//! references a copy carries are renumbered: the blob ids and delta bases inside body templates,
//! answer bodies, and plans' prefix blobs. Nothing the hash chain covers changes (request numbers,
//! chain positions, hashes, every field), so the copy's chain and bodies verify as the source's.
//!
//! A session the target already holds records of is refused before anything is written. After the
//! copy, the target is verified and each session's request count, chain length and head hash are
//! compared with the source's ([`CopyReport::mismatches`]).

use std::collections::HashMap;

use super::body::{self, Part};
use super::db::{Db, DbError, Row, params};
use super::verify::{VerifyReport, verify};
use super::{ArchiveError, Location, store};

/// What a copy did and what its check found.
#[derive(Debug, Default)]
pub struct CopyReport {
    pub sessions: u64,
    pub exchanges: u64,
    pub responses: u64,
    pub blobs_copied: u64,
    /// `verify` of the target, over the copied sessions.
    pub verify: VerifyReport,
    /// Sessions whose counts or chain head differ between source and target.
    pub mismatches: Vec<String>,
}

impl CopyReport {
    pub fn ok(&self) -> bool {
        self.verify.ok() && self.mismatches.is_empty()
    }
}

/// Why a copy was refused before it wrote anything.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the target already holds session(s) {0}: a copy never merges into a session (delete them first)")]
    Occupied(String),
    #[error("source and target are the same archive ({0})")]
    SameArchive(String),
    #[error(transparent)]
    Archive(#[from] ArchiveError),
}

impl From<DbError> for CopyError {
    fn from(e: DbError) -> CopyError {
        CopyError::Archive(ArchiveError::Database(e))
    }
}

/// A session's request count, chain length and head hash, as its `sessions` row states them.
type Head = (i64, i64, Vec<u8>);

fn heads(db: &Db) -> Result<HashMap<String, Head>, DbError> {
    db.query_all("SELECT id, n_requests, n_records, head_hash FROM sessions", params![])?
        .iter()
        .map(|r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?))))
        .collect()
}

/// Copy every session of `from` into `to`, then verify the target and compare it with the source.
pub fn copy(from: &Location, to: &Location) -> Result<CopyReport, CopyError> {
    if from.to_string() == to.to_string() {
        return Err(CopyError::SameArchive(from.to_string()));
    }
    let src = store::open_location_ro(from)?;
    let dst = store::open_location_rw(to)?;
    let sessions: Vec<String> = src
        .query_all("SELECT id FROM sessions UNION SELECT session FROM exchanges ORDER BY 1", params![])?
        .iter()
        .map(|r| r.get(0))
        .collect::<Result<_, _>>()?;
    let mut occupied = Vec::new();
    for session in &sessions {
        let n: i64 = dst
            .query_one(
                "SELECT (SELECT count(*) FROM exchanges WHERE session = ?1)
                      + (SELECT count(*) FROM sessions WHERE id = ?1 AND n_records > 0)",
                params![session],
            )?
            .get(0)?;
        if n > 0 {
            occupied.push(format!("{session:?}"));
        }
    }
    if !occupied.is_empty() {
        return Err(CopyError::Occupied(occupied.join(", ")));
    }
    let mut report = CopyReport::default();
    for session in &sessions {
        dst.begin()?;
        match copy_session(&src, &dst, session, &mut report) {
            Ok(()) => dst.commit()?,
            Err(e) => {
                let _ = dst.rollback();
                return Err(e.into());
            }
        }
        report.sessions += 1;
    }
    let (src_heads, dst_heads) = (heads(&src)?, heads(&dst)?);
    for session in &sessions {
        let verified = verify(&dst, Some(session))?;
        report.verify.sessions += verified.sessions;
        report.verify.exchanges += verified.exchanges;
        report.verify.responses += verified.responses;
        report.verify.bodies += verified.bodies;
        report.verify.body_bytes += verified.body_bytes;
        report.verify.problems.extend(verified.problems);
        let (a, b) = (src_heads.get(session), dst_heads.get(session));
        if a != b {
            let show = |h: Option<&Head>| match h {
                Some((n_requests, n_records, head)) => {
                    format!("{n_requests} requests, {n_records} records, head {}", &super::store::hex(head)[..16])
                }
                None => "no session row".to_owned(),
            };
            report.mismatches.push(format!("session {session:?}: source {}, target {}", show(a), show(b)));
        }
    }
    Ok(report)
}

fn copy_session(src: &Db, dst: &Db, session: &str, report: &mut CopyReport) -> Result<(), ArchiveError> {
    // Blobs first: every blob a session's records name is one of its `session_blobs`.
    let mut blob_ids: HashMap<i64, i64> = HashMap::new();
    let blob_rows =
        src.query_all("SELECT blob FROM session_blobs WHERE session = ?1 ORDER BY blob", params![session])?;
    for row in &blob_rows {
        let old: i64 = row.get(0)?;
        let stored = store::get_blob(src, old)?;
        let known = dst.query_opt("SELECT id FROM blobs WHERE sha256 = ?1", params![&stored.sha256])?.is_some();
        let new = store::put_stored_blob(dst, &stored)?;
        if !known {
            report.blobs_copied += 1;
        }
        dst.execute("INSERT OR IGNORE INTO session_blobs (session, blob) VALUES (?1, ?2)", params![session, new])?;
        blob_ids.insert(old, new);
    }
    let blob =
        |old: i64| -> Result<i64, ArchiveError> { blob_ids.get(&old).copied().ok_or(ArchiveError::MissingBlob(old)) };

    let mut exchange_ids: HashMap<i64, i64> = HashMap::new();
    let exchanges = src.query_all(
        "SELECT id, seq, chain_idx, at_ms, method, path, model, headers, raw_sha256, raw_len, raw_template,
                fwd_sha256, fwd_len, fwd_template, summary, skipped, key_req, prev_hash, hash
         FROM exchanges WHERE session = ?1 ORDER BY seq",
        params![session],
    )?;
    for row in &exchanges {
        let old: i64 = row.get(0)?;
        let raw_template = renumber_template(old, &row.get::<Vec<u8>>(10)?, &blob, &exchange_ids)?;
        let fwd_template =
            row.get::<Option<Vec<u8>>>(13)?.map(|t| renumber_template(old, &t, &blob, &exchange_ids)).transpose()?;
        let v = row.values();
        let new = dst.insert_id(
            "INSERT INTO exchanges (session, seq, chain_idx, at_ms, method, path, model, headers, raw_sha256, raw_len,
                raw_template, fwd_sha256, fwd_len, fwd_template, summary, skipped, key_req, prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
            params![
                session,
                &v[1],
                &v[2],
                &v[3],
                &v[4],
                &v[5],
                &v[6],
                &v[7],
                &v[8],
                &v[9],
                &raw_template,
                &v[11],
                &v[12],
                fwd_template.as_ref(),
                &v[14],
                &v[15],
                &v[16],
                &v[17],
                &v[18]
            ],
        )?;
        exchange_ids.insert(old, new);
        report.exchanges += 1;
    }
    let exchange = |old: i64| -> Result<i64, ArchiveError> {
        exchange_ids.get(&old).copied().ok_or(ArchiveError::MissingExchange(old))
    };

    let responses = src.query_all(
        "SELECT exchange, chain_idx, at_ms, status, headers, stream, partial, end_reason, body_blob, body_sha256,
                body_len, assembled, key_ext, prev_hash, hash
         FROM responses WHERE session = ?1 ORDER BY chain_idx",
        params![session],
    )?;
    for row in &responses {
        let v = row.values();
        let body_blob = row.get::<Option<i64>>(8)?.map(blob).transpose()?;
        dst.execute(
            "INSERT INTO responses (exchange, session, chain_idx, at_ms, status, headers, stream, partial, end_reason,
                body_blob, body_sha256, body_len, assembled, key_ext, prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
            params![
                exchange(row.get(0)?)?,
                session,
                &v[1],
                &v[2],
                &v[3],
                &v[4],
                &v[5],
                &v[6],
                &v[7],
                body_blob,
                &v[9],
                &v[10],
                &v[11],
                &v[12],
                &v[13],
                &v[14]
            ],
        )?;
        report.responses += 1;
    }

    if src.has_table("response_usage")? {
        for row in &src.query_all(
            "SELECT exchange, prompt, cached, cache_write, output FROM response_usage WHERE session = ?1",
            params![session],
        )? {
            let v = row.values();
            dst.execute(
                "INSERT INTO response_usage (exchange, session, prompt, cached, cache_write, output)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![exchange(row.get(0)?)?, session, &v[1], &v[2], &v[3], &v[4]],
            )?;
        }
    }

    if src.has_table("plans")? {
        for row in &src.query_all(
            "SELECT exchange, format, epoch, advanced_at, saturated, raw_hashes, prefix_blobs, prefix_seen
             FROM plans WHERE session = ?1 ORDER BY id",
            params![session],
        )? {
            let Ok(new_exchange) = exchange(row.get(0)?) else {
                // A plan whose exchange is gone is never read (`plan::latest`); it is not copied.
                continue;
            };
            let prefix_blobs =
                row.get::<Option<Vec<u8>>>(6)?.map(|packed| renumber_prefix(&packed, &blob)).transpose()?;
            let v = row.values();
            dst.execute(
                "INSERT INTO plans (exchange, session, format, epoch, advanced_at, saturated, raw_hashes, prefix_blobs,
                    prefix_seen)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![new_exchange, session, &v[1], &v[2], &v[3], &v[4], &v[5], prefix_blobs.as_ref(), &v[7]],
            )?;
        }
    }

    if src.has_table("plan_items")? {
        for row in &src.query_all("SELECT exchange, items FROM plan_items WHERE session = ?1", params![session])? {
            let Ok(new_exchange) = exchange(row.get(0)?) else { continue };
            dst.execute(
                "INSERT INTO plan_items (exchange, session, items) VALUES (?1, ?2, ?3)",
                params![new_exchange, session, &row.values()[1]],
            )?;
        }
    }

    if src.has_table("contents")? {
        for row in &src.query_all(
            "SELECT DISTINCT c.sha256 FROM contents c JOIN blobs b ON b.sha256 = c.sha256
               JOIN session_blobs s ON s.blob = b.id WHERE s.session = ?1",
            params![session],
        )? {
            dst.execute("INSERT OR IGNORE INTO contents (sha256) VALUES (?1)", params![&row.values()[0]])?;
        }
    }

    if let Some(row) = src.query_opt(
        "SELECT started_ms, last_ms, n_requests, n_records, head_hash, model, tokens_raw, tokens_forwarded
         FROM sessions WHERE id = ?1",
        params![session],
    )? {
        let v: &Row = &row;
        let v = v.values();
        // A row without records (a compare-and-set that wrote nothing) may exist in the target.
        dst.execute("DELETE FROM sessions WHERE id = ?1", params![session])?;
        dst.execute(
            "INSERT INTO sessions (id, started_ms, last_ms, n_requests, n_records, head_hash, model, tokens_raw,
                tokens_forwarded)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![session, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]],
        )?;
    }
    Ok(())
}

/// A body template with its blob ids and delta base renumbered for the target.
fn renumber_template(
    exchange: i64,
    template: &[u8],
    blob: &impl Fn(i64) -> Result<i64, ArchiveError>,
    exchange_ids: &HashMap<i64, i64>,
) -> Result<Vec<u8>, ArchiveError> {
    let mut parts = body::decode(template).map_err(|e| ArchiveError::CorruptTemplate { exchange, why: e.0 })?;
    for part in &mut parts {
        match part {
            Part::Lit(_) => {}
            Part::Blob(id) => *id = blob(*id)?,
            Part::Messages(m) => {
                if m.base != 0 {
                    m.base = *exchange_ids.get(&m.base).ok_or(ArchiveError::CorruptTemplate {
                        exchange,
                        why: "delta base is not an earlier exchange of its session",
                    })?;
                }
                for item in &mut m.new {
                    item.blob = blob(item.blob)?;
                }
            }
        }
    }
    Ok(body::encode(&parts))
}

/// A plan's packed prefix references with their blob ids renumbered (references into the
/// exchange's own request, negative, stay).
fn renumber_prefix(packed: &[u8], blob: &impl Fn(i64) -> Result<i64, ArchiveError>) -> Result<Vec<u8>, ArchiveError> {
    let ids =
        super::plan::unpack_u64(packed).ok_or(ArchiveError::CorruptPlan { exchange: 0, why: "prefix blob ids" })?;
    let renumbered = ids
        .into_iter()
        .map(|id| match id as i64 {
            reference if reference < 0 => Ok(id),
            old => blob(old).map(|new| new as u64),
        })
        .collect::<Result<Vec<u64>, ArchiveError>>()?;
    Ok(super::plan::pack_u64(&renumbered))
}
