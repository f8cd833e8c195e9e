//! Retention: delete whole sessions last active before a cutoff (`pare archive prune --before
//! DATE`, and `archive.retain_days` in `pare serve`), on either backend, and reclaim their space.
//!
//! A session goes with everything recorded for it and the blobs no other session links
//! ([`delete_session`]'s deletion, many sessions per transaction): every chain left is
//! whole, so `pare sessions verify` passes after a prune.
//!
//! Writers cache blob ids (a message seen before is not looked up again), so a prune must not free
//! a blob a writer is about to reuse from its cache. Each prune transaction first moves the
//! archive's prune generation (`meta.prune_generation`); each write transaction first reads it
//! (on PostgreSQL `FOR SHARE`, so that a write and a prune serialize on that row; SQLite's write
//! lock serializes them anyway), and a writer that sees it moved forgets its blob caches. A write
//! that started before the prune has its blob links committed before the prune decides which blobs
//! are unlinked.
//!
//! Space: `pare archive prune` then vacuums (SQLite: `VACUUM`, the file shrinks; PostgreSQL:
//! `VACUUM` of the archive's tables, the space is reused, not returned to the system). Retention in
//! `pare serve` does not vacuum (it would hold the writer up): freed pages are reused by later
//! records.

use std::sync::mpsc;
use std::time::Duration;

use super::db::{Db, Dialect, params};
use super::store::{self, PRUNE_GENERATION};
use super::{ArchiveError, Location};

/// Sessions deleted per transaction.
const SESSIONS_PER_TRANSACTION: i64 = 256;

/// How often `archive.retain_days` prunes while pare serves (and once at start).
pub const RETENTION_EVERY: Duration = Duration::from_secs(3600);

/// What a prune did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PruneReport {
    pub sessions: usize,
    pub exchanges: usize,
    pub responses: usize,
    pub blobs_freed: usize,
    /// The store's size before and after (SQLite: its pages; PostgreSQL: the database's size).
    pub bytes_before: i64,
    pub bytes_after: i64,
    /// Why vacuuming failed, when it did (the sessions are deleted all the same).
    pub vacuum_error: Option<String>,
}

/// Whether a prune vacuums the store afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaim {
    /// Vacuum (the CLI): SQLite's file shrinks.
    Vacuum,
    /// Leave the freed space for later records (a serving pare: vacuuming would hold its writer).
    Reuse,
}

/// Delete every session whose last activity is before `before_ms` (milliseconds since the epoch).
pub fn prune(location: &Location, before_ms: i64, reclaim: Reclaim) -> Result<PruneReport, ArchiveError> {
    let conn = store::open_location_rw(location)?;
    let mut report = PruneReport { bytes_before: store_bytes(&conn)?, ..PruneReport::default() };
    let old_sql = "SELECT id FROM sessions WHERE last_ms < ?1 ORDER BY last_ms LIMIT ?2";
    while conn.query_opt(old_sql, params![before_ms, 1i64])?.is_some() {
        conn.begin()?;
        let deleted = (|| -> Result<usize, ArchiveError> {
            advance_generation(&conn)?;
            // Chosen inside the transaction: a session a writer appended to meanwhile stays.
            let ids: Vec<String> = conn
                .query_all(old_sql, params![before_ms, SESSIONS_PER_TRANSACTION])?
                .iter()
                .map(|row| row.get(0))
                .collect::<Result<_, _>>()?;
            for id in &ids {
                let deleted = delete_in_transaction(&conn, id)?;
                report.sessions += 1;
                report.exchanges += deleted.exchanges;
                report.responses += deleted.responses;
                report.blobs_freed += deleted.blobs_freed;
            }
            // The contents markers name live in blobs: those whose blob went are no longer stored.
            conn.execute(
                "DELETE FROM contents WHERE NOT EXISTS (SELECT 1 FROM blobs WHERE blobs.sha256 = contents.sha256)",
                params![],
            )?;
            Ok(ids.len())
        })();
        match deleted {
            Ok(n) => {
                conn.commit()?;
                if (n as i64) < SESSIONS_PER_TRANSACTION {
                    break;
                }
            }
            Err(e) => {
                let _ = conn.rollback();
                return Err(e);
            }
        }
    }
    if reclaim == Reclaim::Vacuum && report.sessions > 0 {
        report.vacuum_error = vacuum(&conn).err().map(|e| e.to_string());
    }
    report.bytes_after = store_bytes(&conn)?;
    Ok(report)
}

/// Move the prune generation on (locking its row until the transaction ends): first in every
/// transaction that frees blobs (a prune, `pare sessions delete`).
pub(crate) fn advance_generation(conn: &Db) -> Result<(), ArchiveError> {
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?1, '1')
         ON CONFLICT (key) DO UPDATE SET value = CAST(CAST(meta.value AS BIGINT) + 1 AS TEXT)",
        params![PRUNE_GENERATION],
    )?;
    Ok(())
}

/// Begin a write transaction and read the prune generation (PostgreSQL: share-locked until the
/// transaction ends, so that a prune waits for the write and the write for a prune), in one round
/// trip.
pub(crate) fn begin_reading_generation(conn: &Db) -> Result<i64, ArchiveError> {
    let lock = match conn.dialect() {
        Dialect::Sqlite => "",
        Dialect::Postgres => " FOR SHARE",
    };
    let value = conn.begin_then(&format!("SELECT value FROM meta WHERE key = '{PRUNE_GENERATION}'{lock}"))?;
    Ok(value.and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// The store's size in bytes.
fn store_bytes(conn: &Db) -> Result<i64, ArchiveError> {
    let sql = match conn.dialect() {
        Dialect::Sqlite => "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        Dialect::Postgres => "SELECT pg_database_size(current_database())",
    };
    Ok(conn.query_one(sql, params![])?.get(0)?)
}

fn vacuum(conn: &Db) -> Result<(), ArchiveError> {
    match conn.dialect() {
        Dialect::Sqlite => {
            conn.execute_batch("VACUUM")?;
            conn.query_all("PRAGMA wal_checkpoint(TRUNCATE)", params![])?;
        }
        Dialect::Postgres => conn.execute_batch(
            "VACUUM (ANALYZE) blobs, session_blobs, sessions, exchanges, responses, response_usage, plans, \
             plan_items, contents",
        )?,
    }
    Ok(())
}

/// `archive.retain_days` while pare serves: a thread that prunes sessions older than `days` at
/// start and every [`RETENTION_EVERY`], until `stop` is dropped.
pub(crate) fn spawn(location: Location, days: u64, stop: mpsc::Receiver<()>) -> std::io::Result<()> {
    let keep_ms = i64::try_from(days.saturating_mul(86_400_000)).unwrap_or(i64::MAX);
    std::thread::Builder::new().name("pare-retention".into()).spawn(move || {
        loop {
            let before_ms = super::now_ms().saturating_sub(keep_ms);
            match prune(&location, before_ms, Reclaim::Reuse) {
                Ok(report) if report.sessions > 0 => tracing::info!(archive = %location, days,
                    sessions = report.sessions, requests = report.exchanges, blobs_freed = report.blobs_freed,
                    "archive.retain_days: deleted the sessions last active before the cutoff"),
                Ok(_) => {}
                Err(e) => tracing::warn!(archive = %location, error = %e, "archive.retain_days: the prune failed"),
            }
            if !matches!(stop.recv_timeout(RETENTION_EVERY), Err(mpsc::RecvTimeoutError::Timeout)) {
                break;
            }
        }
    })?;
    Ok(())
}

/// What deleting a session removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteReport {
    pub exchanges: usize,
    pub responses: usize,
    pub blobs_freed: usize,
}

/// Delete a session and everything recorded for it, freeing blobs no other session uses.
/// Meant for sessions that are no longer live (a running `pare serve` keeps its chain head in memory).
pub fn delete_session(location: impl Into<Location>, session: &str) -> Result<DeleteReport, ArchiveError> {
    let conn = store::open_location_rw(&location.into())?;
    conn.begin()?;
    // A running writer that cached the id of a blob freed here stores it again.
    let deleted = advance_generation(&conn).and_then(|()| delete_in_transaction(&conn, session));
    match deleted {
        Ok(report) => {
            conn.commit()?;
            Ok(report)
        }
        Err(e) => {
            let _ = conn.rollback();
            Err(e)
        }
    }
}

pub(crate) fn delete_in_transaction(conn: &Db, session: &str) -> Result<DeleteReport, ArchiveError> {
    let count = |sql: &str| -> Result<i64, ArchiveError> { Ok(conn.query_one(sql, params![session])?.get(0)?) };
    let exists = count("SELECT count(*) FROM sessions WHERE id = ?1")? > 0;
    let n_exchanges = count("SELECT count(*) FROM exchanges WHERE session = ?1")?;
    if !exists && n_exchanges == 0 {
        return Err(ArchiveError::NoSession(session.to_owned()));
    }
    conn.execute("DELETE FROM response_usage WHERE session = ?1", params![session])?;
    conn.execute("DELETE FROM plans WHERE session = ?1", params![session])?;
    conn.execute("DELETE FROM plan_items WHERE session = ?1", params![session])?;
    let responses = conn.execute("DELETE FROM responses WHERE session = ?1", params![session])?;
    let exchanges = conn.execute("DELETE FROM exchanges WHERE session = ?1", params![session])?;
    conn.execute("DELETE FROM sessions WHERE id = ?1", params![session])?;
    let blobs_freed = conn.execute(
        "DELETE FROM blobs WHERE id IN (SELECT blob FROM session_blobs WHERE session = ?1)
           AND NOT EXISTS (SELECT 1 FROM session_blobs s WHERE s.blob = blobs.id AND s.session <> ?1)",
        params![session],
    )?;
    conn.execute("DELETE FROM session_blobs WHERE session = ?1", params![session])?;
    Ok(DeleteReport { exchanges, responses, blobs_freed })
}
