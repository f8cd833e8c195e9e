//! The audit side of the archive: list sessions, read exchanges and their exact bodies, the last
//! (raw, forwarded) pair of a session for rebuilding compaction state, and deleting a session.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;
use serde_json::Value;

use super::read::{self, BodyKind};
use super::{ArchiveError, store};
use crate::exchange::CompactionSummary;
use crate::session::StoredKey;

/// One session as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SessionInfo {
    pub id: String,
    pub started_ms: i64,
    pub last_ms: i64,
    pub n_requests: i64,
    pub model: Option<String>,
    /// Σ tokens of the raw requests, as counted by compaction (0 when compaction was off).
    pub tokens_raw: i64,
    /// Σ tokens of the forwarded requests.
    pub tokens_forwarded: i64,
    /// The wire format of the session's last request (`chat`, `responses`), from its path; `None`
    /// for a path pare does not compact.
    pub wire: Option<&'static str>,
}

/// Which sessions to list or export.
#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    /// Only sessions active at or after this time (ms since the epoch).
    pub since_ms: Option<i64>,
    /// Only sessions whose model contains this text.
    pub model: Option<String>,
    /// Only this session.
    pub session: Option<String>,
}

/// One exchange's metadata.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExchangeInfo {
    /// Row id (the order of arrival across sessions).
    pub id: i64,
    pub seq: i64,
    pub at_ms: i64,
    pub method: String,
    pub path: String,
    pub model: Option<String>,
    pub raw_len: i64,
    /// `None`: forwarded unchanged.
    pub fwd_len: Option<i64>,
    /// Unreadable summaries read as `None`.
    pub summary: Option<CompactionSummary>,
    pub skipped: Option<String>,
}

/// The stored answer of one exchange.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseInfo {
    pub status: Option<i64>,
    pub stream: bool,
    pub partial: bool,
    pub end_reason: String,
    #[serde(skip)]
    pub body: Vec<u8>,
    /// `{"message", "finish_reason", "usage", "model"}`.
    pub assembled: Option<Value>,
}

/// One session as the audit UI lists it: [`SessionInfo`] and what its exchanges say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SessionOverview {
    pub info: SessionInfo,
    /// Its epoch number after its last request (0: never compacted).
    pub epochs: i64,
    /// Answers whose body was cut short.
    pub partial: i64,
}

/// A page of [`SessionOverview`]s and how many sessions match in all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SessionPage {
    pub sessions: Vec<SessionOverview>,
    pub total: i64,
}

/// The last request of a session, raw and forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastBodies {
    pub seq: i64,
    pub raw: Vec<u8>,
    pub forwarded: Vec<u8>,
}

/// What deleting a session removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteReport {
    pub exchanges: usize,
    pub responses: usize,
    pub blobs_freed: usize,
}

/// Read access to an archive directory.
pub struct ArchiveReader {
    conn: Connection,
}

fn session_info(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionInfo> {
    Ok(SessionInfo {
        id: r.get(0)?,
        started_ms: r.get(1)?,
        last_ms: r.get(2)?,
        n_requests: r.get(3)?,
        model: r.get(4)?,
        tokens_raw: r.get(5)?,
        tokens_forwarded: r.get(6)?,
        wire: r.get::<_, Option<String>>(7)?.and_then(|path| crate::wire::Wire::of_path(&path)).map(|w| w.name()),
    })
}

const SESSION_COLUMNS: &str = "id, started_ms, last_ms, n_requests, model, tokens_raw, tokens_forwarded,
    (SELECT path FROM exchanges WHERE exchanges.session = sessions.id ORDER BY seq DESC LIMIT 1)";

impl ArchiveReader {
    /// Open the store in `dir` read-only.
    pub fn open(dir: &Path) -> Result<ArchiveReader, ArchiveError> {
        Ok(ArchiveReader { conn: store::open_ro(dir)? })
    }

    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Sessions matching `filter`, oldest first.
    pub fn sessions(&self, filter: &SessionFilter) -> Result<Vec<SessionInfo>, ArchiveError> {
        let mut stmt = self.conn.prepare(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions
             WHERE (?1 IS NULL OR last_ms >= ?1) AND (?2 IS NULL OR instr(coalesce(model, ''), ?2) > 0)
               AND (?3 IS NULL OR id = ?3)
             ORDER BY started_ms, id"
        ))?;
        let rows = stmt.query_map(params![filter.since_ms, filter.model, filter.session], session_info)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Sessions matching `filter`, most recently active first (ties by id, so pages are stable),
    /// `limit` of them from `offset` on. Reads only the sessions of the page and, for each, its last
    /// exchange and its partial answers (indexed lookups): fast on any number of sessions.
    pub fn session_page(&self, filter: &SessionFilter, offset: i64, limit: i64) -> Result<SessionPage, ArchiveError> {
        const WHERE: &str = "(?1 IS NULL OR last_ms >= ?1) AND (?2 IS NULL OR instr(coalesce(model, ''), ?2) > 0)
               AND (?3 IS NULL OR id = ?3)";
        let total = self.conn.query_row(
            &format!("SELECT count(*) FROM sessions WHERE {WHERE}"),
            params![filter.since_ms, filter.model, filter.session],
            |r| r.get(0),
        )?;
        let mut stmt = self.conn.prepare(&format!(
            "SELECT {SESSION_COLUMNS},
               (SELECT json_extract(summary, '$.epoch') FROM exchanges e WHERE e.session = sessions.id
                  ORDER BY seq DESC LIMIT 1) AS epochs,
               (SELECT count(*) FROM responses r WHERE r.session = sessions.id AND r.partial = 1) AS n_partial
             FROM sessions WHERE {WHERE}
             ORDER BY last_ms DESC, id DESC LIMIT ?4 OFFSET ?5"
        ))?;
        let rows = stmt.query_map(params![filter.since_ms, filter.model, filter.session, limit, offset], |r| {
            Ok(SessionOverview {
                info: session_info(r)?,
                epochs: r.get::<_, Option<i64>>("epochs")?.unwrap_or(0),
                partial: r.get("n_partial")?,
            })
        })?;
        Ok(SessionPage { sessions: rows.collect::<Result<_, _>>()?, total })
    }

    pub fn session(&self, id: &str) -> Result<SessionInfo, ArchiveError> {
        self.conn
            .query_row(&format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?1"), [id], session_info)
            .optional()?
            .ok_or_else(|| ArchiveError::NoSession(id.to_owned()))
    }

    /// A session's exchanges in order.
    pub fn exchanges(&self, session: &str) -> Result<Vec<ExchangeInfo>, ArchiveError> {
        let mut stmt = self.conn.prepare(
            "SELECT id, seq, at_ms, method, path, model, raw_len, fwd_len, summary, skipped
             FROM exchanges WHERE session = ?1 ORDER BY seq",
        )?;
        let rows = stmt.query_map([session], |r| {
            let summary: Option<String> = r.get(8)?;
            Ok(ExchangeInfo {
                id: r.get(0)?,
                seq: r.get(1)?,
                at_ms: r.get(2)?,
                method: r.get(3)?,
                path: r.get(4)?,
                model: r.get(5)?,
                raw_len: r.get(6)?,
                fwd_len: r.get(7)?,
                summary: summary.and_then(|s| serde_json::from_str(&s).ok()),
                skipped: r.get(9)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn exchange_id(&self, session: &str, seq: i64) -> Result<i64, ArchiveError> {
        self.conn
            .query_row("SELECT id FROM exchanges WHERE session = ?1 AND seq = ?2", params![session, seq], |r| r.get(0))
            .optional()?
            .ok_or_else(|| ArchiveError::NoRequest { session: session.to_owned(), seq })
    }

    /// The exact bytes of request `seq` (1-based) of a session.
    pub fn body(&self, session: &str, seq: i64, kind: BodyKind) -> Result<Vec<u8>, ArchiveError> {
        let id = self.exchange_id(session, seq)?;
        read::body_bytes(&self.conn, id, kind)
    }

    /// The stored answer to request `seq`, if one was recorded.
    pub fn response(&self, session: &str, seq: i64) -> Result<Option<ResponseInfo>, ArchiveError> {
        let id = self.exchange_id(session, seq)?;
        let row = self
            .conn
            .query_row(
                "SELECT status, stream, partial, end_reason, body_blob, assembled FROM responses WHERE exchange = ?1",
                [id],
                |r| {
                    let assembled: Option<String> = r.get(5)?;
                    let info = ResponseInfo {
                        status: r.get(0)?,
                        stream: r.get(1)?,
                        partial: r.get(2)?,
                        end_reason: r.get(3)?,
                        body: Vec::new(),
                        assembled: assembled.and_then(|a| serde_json::from_str(&a).ok()),
                    };
                    Ok((info, r.get::<_, Option<i64>>(4)?))
                },
            )
            .optional()?;
        let Some((mut info, blob)) = row else {
            return Ok(None);
        };
        if let Some(blob) = blob {
            info.body = store::read_blob(&self.conn, blob)?;
        }
        Ok(Some(info))
    }

    /// The last request of a session as (raw body, forwarded body): what the compaction state of a
    /// live session is rebuilt from after a restart.
    pub fn last_bodies(&self, session: &str) -> Result<Option<LastBodies>, ArchiveError> {
        let last: Option<i64> = self
            .conn
            .query_row("SELECT max(seq) FROM exchanges WHERE session = ?1", [session], |r| r.get(0))
            .optional()?
            .flatten();
        let Some(seq) = last else { return Ok(None) };
        Ok(Some(LastBodies {
            seq,
            raw: self.body(session, seq, BodyKind::Raw)?,
            forwarded: self.body(session, seq, BodyKind::Forwarded)?,
        }))
    }

    /// The `limit` most recently active sessions (oldest first) with their requests' and answers'
    /// session keys in the order of their records: what [`crate::session::SessionTracker::seed`]
    /// takes at start.
    pub fn recent_session_keys(&self, limit: usize) -> Result<Vec<(String, Vec<StoredKey>)>, ArchiveError> {
        let mut stmt = self.conn.prepare("SELECT id FROM sessions ORDER BY last_ms DESC LIMIT ?1")?;
        let ids: Vec<String> = stmt.query_map([limit as i64], |r| r.get(0))?.collect::<Result<_, _>>()?;
        let mut keys = self.conn.prepare(
            "SELECT key, answer FROM (
                 SELECT chain_idx, key_req AS key, 0 AS answer FROM exchanges WHERE session = ?1 AND key_req IS NOT NULL
                 UNION ALL
                 SELECT chain_idx, key_ext, 1 FROM responses WHERE session = ?1 AND key_ext IS NOT NULL)
             ORDER BY chain_idx",
        )?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids.into_iter().rev() {
            let ks: Vec<StoredKey> = keys
                .query_map([&id], |r| {
                    let key = r.get::<_, i64>(0)? as u64;
                    Ok(if r.get::<_, bool>(1)? { StoredKey::Answer(key) } else { StoredKey::Request(key) })
                })?
                .collect::<Result<_, _>>()?;
            out.push((id, ks));
        }
        Ok(out)
    }
}

/// Delete a session and everything recorded for it, freeing blobs no other session uses.
/// Meant for sessions that are no longer live (a running `pare serve` keeps its chain head in memory).
pub fn delete_session(dir: &Path, session: &str) -> Result<DeleteReport, ArchiveError> {
    let mut conn = store::open_rw(dir)?;
    let tx = conn.transaction()?;
    let exists: bool =
        tx.query_row("SELECT count(*) FROM sessions WHERE id = ?1", [session], |r| r.get::<_, i64>(0))? > 0;
    let n_exchanges: i64 =
        tx.query_row("SELECT count(*) FROM exchanges WHERE session = ?1", [session], |r| r.get(0))?;
    if !exists && n_exchanges == 0 {
        return Err(ArchiveError::NoSession(session.to_owned()));
    }
    tx.execute("DELETE FROM plans WHERE session = ?1", [session])?;
    let responses = tx.execute("DELETE FROM responses WHERE session = ?1", [session])?;
    let exchanges = tx.execute("DELETE FROM exchanges WHERE session = ?1", [session])?;
    tx.execute("DELETE FROM sessions WHERE id = ?1", [session])?;
    tx.execute_batch("CREATE TEMP TABLE IF NOT EXISTS freed (id INTEGER PRIMARY KEY); DELETE FROM temp.freed;")?;
    tx.execute("INSERT INTO temp.freed SELECT blob FROM session_blobs WHERE session = ?1", [session])?;
    tx.execute("DELETE FROM session_blobs WHERE session = ?1", [session])?;
    let blobs_freed = tx.execute(
        "DELETE FROM blobs WHERE id IN (SELECT id FROM temp.freed)
           AND NOT EXISTS (SELECT 1 FROM session_blobs s WHERE s.blob = blobs.id)",
        [],
    )?;
    tx.execute("DELETE FROM temp.freed", [])?;
    tx.commit()?;
    Ok(DeleteReport { exchanges, responses, blobs_freed })
}
