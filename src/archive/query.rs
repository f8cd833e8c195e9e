//! The audit side of the archive: list sessions, read exchanges and their exact bodies, the last
//! (raw, forwarded) pair of a session for rebuilding compaction state, and deleting a session; what
//! the upstream reported it billed, per answer and per session ([`UpstreamUsage`]), and what pare's
//! compaction saved net of the cache misses its epochs caused ([`Savings`]); what each request and
//! session cost in money with pare and without it ([`costs`]).

use serde::Serialize;
use serde_json::Value;

use super::body::Part;
use super::db::{Db, DbError, Dialect, Row, params};
use super::prefill::MissSource;
use super::read::{self, BodyKind};
use super::{ArchiveError, Location, store};
use crate::budget::cost::{self, RequestCost, SessionCost};
use crate::budget::price::Prices;
use crate::exchange::CompactionSummary;
use crate::exchange::Usage;
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
    /// What the upstream reported it billed for the session's answers.
    pub upstream: UpstreamUsage,
}

/// The upstream's own figures summed over a session's answers ([`Usage`] per answer). A sum is
/// `None` when no answer reported that figure: "not reported", never 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UpstreamUsage {
    /// Answers that reported any figure.
    pub n_reported: i64,
    pub prompt: Option<i64>,
    pub cached: Option<i64>,
    pub cache_write: Option<i64>,
    pub output: Option<i64>,
    /// Σ prompt over the answers that reported a cached figure: the base of [`UpstreamUsage::hit_rate`]
    /// (an answer that reported a prompt but no cache figure says nothing about hits).
    pub prompt_with_cached: Option<i64>,
}

impl UpstreamUsage {
    /// The session's upstream cache hits for people: "68.3 % of 12,000", or what was not reported.
    pub fn cache_hits(&self) -> String {
        use crate::compact::markers::group_signed as n;
        match (self.hit_rate(), self.prompt) {
            (Some(rate), _) => format!("{:.1} % of {}", 100.0 * rate, n(self.prompt_with_cached.unwrap_or(0))),
            (None, Some(prompt)) => format!("not reported (prompt {})", n(prompt)),
            (None, None) => "not reported".to_owned(),
        }
    }

    /// Share of the prompt tokens the upstream read from its cache, over the answers that reported both.
    pub fn hit_rate(&self) -> Option<f64> {
        match (self.cached, self.prompt_with_cached) {
            (Some(cached), Some(prompt)) if prompt > 0 => Some(cached as f64 / prompt as f64),
            _ => None,
        }
    }
}

/// The cache misses one epoch caused ([`Savings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EpochMiss {
    pub seq: i64,
    /// Prompt tokens billed uncached beyond what the agent added since the previous request.
    pub tokens: u64,
    pub source: MissSource,
}

/// What pare saved a session in uncached prompt tokens, net of the cache misses its epochs caused:
///
/// `net = Σ_k (R_k − F_k) − Σ_{k epoch} max(0, U_k − N_k)`
///
/// - `R_k`, `F_k`: request k's prompt as the agent sent it and as pare forwarded it (pare's count);
///   what pare removed is priced as uncached input (an upper bound where the upstream would have
///   read those tokens from its cache).
/// - over the requests where pare started an epoch (rewrote the forwarded prefix, so the upstream's
///   cached prefix stopped matching), `U_k` is the prompt tokens computed afresh, and `N_k =
///   max(0, R_k − R_{k−1})` the tokens the agent added since its previous request, which an append
///   would have sent uncached anyway.
/// - `U_k` is [`super::prefill::uncached_with_pare`]: the upstream's figure (prompt − cached) when
///   its answer reported both ([`MissSource::Provider`]), else pare's estimate from the request's
///   summary ([`MissSource::Estimate`]); for a request archived without one, `F_k − S_k`, `S_k` the
///   part of `F_k` in the prefix it shares with the previous forwarded request (unchanged top-level
///   values and messages, by bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Savings {
    /// Σ (R_k − F_k) over the requests pare counted.
    pub removed: u64,
    /// The epochs' misses, request by request.
    pub epochs: Vec<EpochMiss>,
}

impl Savings {
    /// Σ of the epochs' misses.
    pub fn misses(&self) -> u64 {
        self.epochs.iter().map(|e| e.tokens).sum()
    }

    /// `removed − misses` (negative: the epochs cost more than compaction saved).
    pub fn net(&self) -> i64 {
        self.removed as i64 - self.misses() as i64
    }

    /// Which figures the misses came from: `provider`, `estimate`, `provider + estimate`, or `none`
    /// when pare started no epoch.
    pub fn source(&self) -> &'static str {
        let provider = self.epochs.iter().any(|e| e.source == MissSource::Provider);
        let estimate = self.epochs.iter().any(|e| e.source == MissSource::Estimate);
        match (provider, estimate) {
            (true, true) => "provider + estimate",
            (true, false) => "provider",
            (false, true) => "estimate",
            (false, false) => "none",
        }
    }
}

/// What the UI index and `pare sessions list` show of a session beyond [`SessionInfo`], read from
/// its exchanges ([`ArchiveReader::figures`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SessionFigures {
    /// Its epoch number after its last request (0: never compacted).
    pub epochs: u64,
    pub savings: Savings,
    pub prefill: super::prefill::SessionPrefill,
}

/// The cost of each of a session's `exchanges` with pare and without it ([`crate::budget::cost`]),
/// and the session's sums. An exchange pare did not compact (no summary) has no cost and is not
/// counted; one of a model with no price has none and is counted unpriced.
pub fn costs(exchanges: &[ExchangeInfo], prices: &Prices) -> (Vec<Option<RequestCost>>, SessionCost) {
    let mut session = SessionCost::default();
    let mut previous: Option<&CompactionSummary> = None;
    let per_request = exchanges
        .iter()
        .map(|e| {
            let summary = e.summary.as_ref()?;
            let (forwarded, raw) = cost::prompts(previous, summary);
            previous = Some(summary);
            let price = e.model.as_deref().and_then(|model| prices.of(model));
            let cost = price.map(|p| cost::request_cost(&p.price, e.usage.as_ref(), forwarded, raw));
            session.add(cost.as_ref());
            cost
        })
        .collect();
    (per_request, session)
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
    /// What the upstream reported it billed for the answer; `None`: no answer, or nothing reported.
    pub usage: Option<Usage>,
}

impl ExchangeInfo {
    /// Its uncached prefill with and without pare (`None`: not estimated).
    pub fn prefill(&self) -> Option<super::prefill::RequestPrefill> {
        super::prefill::RequestPrefill::of(self.seq, self.usage.as_ref(), self.summary.as_ref())
    }
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

/// Read access to an archive.
pub struct ArchiveReader {
    conn: Db,
}

fn session_info(r: &Row) -> Result<SessionInfo, DbError> {
    Ok(SessionInfo {
        id: r.get(0)?,
        started_ms: r.get(1)?,
        last_ms: r.get(2)?,
        n_requests: r.get(3)?,
        model: r.get(4)?,
        tokens_raw: r.get(5)?,
        tokens_forwarded: r.get(6)?,
        wire: r.get::<Option<String>>(7)?.and_then(|path| crate::wire::Wire::of_path(&path)).map(|w| w.name()),
        upstream: UpstreamUsage {
            n_reported: r.get(8)?,
            prompt: r.get(9)?,
            cached: r.get(10)?,
            cache_write: r.get(11)?,
            output: r.get(12)?,
            prompt_with_cached: r.get(13)?,
        },
    })
}

/// The columns [`session_info`] reads, the upstream's sums each an indexed lookup of the session's
/// answers (`sum` is NULL when no answer reported the figure; cast, as PostgreSQL sums integers
/// into numerics).
const SESSION_COLUMNS: &str = "id, started_ms, last_ms, n_requests, model, tokens_raw, tokens_forwarded,
    (SELECT path FROM exchanges WHERE exchanges.session = sessions.id ORDER BY seq DESC LIMIT 1),
    (SELECT count(*) FROM response_usage u WHERE u.session = sessions.id),
    (SELECT CAST(sum(prompt) AS BIGINT) FROM response_usage u WHERE u.session = sessions.id),
    (SELECT CAST(sum(cached) AS BIGINT) FROM response_usage u WHERE u.session = sessions.id),
    (SELECT CAST(sum(cache_write) AS BIGINT) FROM response_usage u WHERE u.session = sessions.id),
    (SELECT CAST(sum(output) AS BIGINT) FROM response_usage u WHERE u.session = sessions.id),
    (SELECT CAST(sum(prompt) AS BIGINT) FROM response_usage u WHERE u.session = sessions.id AND u.cached IS NOT NULL)";

/// Which sessions a [`SessionFilter`] keeps, over its parameters ?1 (since), ?2 (model), ?3 (id).
const FILTER: &str = "(CAST(?1 AS BIGINT) IS NULL OR last_ms >= ?1)
    AND (CAST(?2 AS TEXT) IS NULL OR instr(coalesce(model, ''), ?2) > 0)
    AND (CAST(?3 AS TEXT) IS NULL OR id = ?3)";

/// The usage table of a SQLite archive written before it existed reads as empty: a temporary table
/// of the same name stands in for it (a read-only connection may create those).
fn ensure_usage_table(conn: &Db) -> Result<(), DbError> {
    if conn.dialect() == Dialect::Postgres {
        return Ok(());
    }
    if !conn.has_table("response_usage")? {
        conn.execute_batch(
            "CREATE TEMP TABLE IF NOT EXISTS response_usage (exchange INTEGER PRIMARY KEY, session TEXT NOT NULL,
                prompt INTEGER, cached INTEGER, cache_write INTEGER, output INTEGER)",
        )?;
    }
    Ok(())
}

/// A stored count as pare's unsigned figure (negative counts are not stored; read as 0).
fn figure(n: Option<i64>) -> Option<u64> {
    n.map(|n| u64::try_from(n).unwrap_or(0))
}

impl ArchiveReader {
    /// Open the store at `location` (a directory or a PostgreSQL URL) for reading.
    pub fn open(location: impl Into<Location>) -> Result<ArchiveReader, ArchiveError> {
        let conn = store::open_location_ro(&location.into())?;
        ensure_usage_table(&conn)?;
        Ok(ArchiveReader { conn })
    }

    pub fn conn(&self) -> &Db {
        &self.conn
    }

    /// Sessions matching `filter`, oldest first.
    pub fn sessions(&self, filter: &SessionFilter) -> Result<Vec<SessionInfo>, ArchiveError> {
        let rows = self.conn.query_all(
            &format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE {FILTER} ORDER BY started_ms, id"),
            params![filter.since_ms, filter.model.as_deref(), filter.session.as_deref()],
        )?;
        Ok(rows.iter().map(session_info).collect::<Result<_, _>>()?)
    }

    /// Sessions matching `filter`, most recently active first (ties by id, so pages are stable),
    /// `limit` of them from `offset` on. Reads only the sessions of the page and, for each, its last
    /// exchange and its partial answers (indexed lookups): fast on any number of sessions.
    pub fn session_page(&self, filter: &SessionFilter, offset: i64, limit: i64) -> Result<SessionPage, ArchiveError> {
        let filter_params = params![filter.since_ms, filter.model.as_deref(), filter.session.as_deref()];
        let total =
            self.conn.query_one(&format!("SELECT count(*) FROM sessions WHERE {FILTER}"), filter_params)?.get(0)?;
        let rows = self.conn.query_all(
            &format!(
                "SELECT {SESSION_COLUMNS},
                   (SELECT {} FROM exchanges e WHERE e.session = sessions.id
                      ORDER BY seq DESC LIMIT 1) AS epochs,
                   (SELECT count(*) FROM responses r WHERE r.session = sessions.id AND r.partial = 1) AS n_partial
                 FROM sessions WHERE {FILTER}
                 ORDER BY last_ms DESC, id DESC LIMIT ?4 OFFSET ?5",
                self.conn.json_int("summary", "epoch")
            ),
            params![filter.since_ms, filter.model.as_deref(), filter.session.as_deref(), limit, offset],
        )?;
        let sessions = rows
            .iter()
            .map(|r| {
                Ok(SessionOverview {
                    info: session_info(r)?,
                    epochs: r.get::<Option<i64>>(14)?.unwrap_or(0),
                    partial: r.get(15)?,
                })
            })
            .collect::<Result<_, DbError>>()?;
        Ok(SessionPage { sessions, total })
    }

    pub fn session(&self, id: &str) -> Result<SessionInfo, ArchiveError> {
        let row = self
            .conn
            .query_opt(&format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?1"), params![id])?
            .ok_or_else(|| ArchiveError::NoSession(id.to_owned()))?;
        Ok(session_info(&row)?)
    }

    /// The number of requests the archive holds of `session` (`None`: a session it does not know).
    pub fn session_requests(&self, session: &str) -> Result<Option<i64>, ArchiveError> {
        let row = self.conn.query_opt("SELECT n_requests FROM sessions WHERE id = ?1", params![session])?;
        Ok(row.map(|r| r.get(0)).transpose()?)
    }

    /// A session's exchanges in order.
    pub fn exchanges(&self, session: &str) -> Result<Vec<ExchangeInfo>, ArchiveError> {
        let rows = self.conn.query_all(
            "SELECT id, seq, at_ms, method, path, model, raw_len, fwd_len, summary, skipped,
                    u.exchange, u.prompt, u.cached, u.cache_write, u.output
             FROM exchanges LEFT JOIN response_usage u ON u.exchange = exchanges.id
             WHERE exchanges.session = ?1 ORDER BY seq",
            params![session],
        )?;
        let rows = rows.iter().map(|r| {
            let summary: Option<String> = r.get(8)?;
            let usage = r.get::<Option<i64>>(10)?.map(|_| -> Result<Usage, DbError> {
                Ok(Usage {
                    prompt: figure(r.get(11)?),
                    cached: figure(r.get(12)?),
                    cache_write: figure(r.get(13)?),
                    output: figure(r.get(14)?),
                })
            });
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
                usage: usage.transpose()?,
            })
        });
        Ok(rows.collect::<Result<_, DbError>>()?)
    }

    fn exchange_id(&self, session: &str, seq: i64) -> Result<i64, ArchiveError> {
        let row = self
            .conn
            .query_opt("SELECT id FROM exchanges WHERE session = ?1 AND seq = ?2", params![session, seq])?
            .ok_or_else(|| ArchiveError::NoRequest { session: session.to_owned(), seq })?;
        Ok(row.get(0)?)
    }

    /// The exact bytes of request `seq` (1-based) of a session.
    pub fn body(&self, session: &str, seq: i64, kind: BodyKind) -> Result<Vec<u8>, ArchiveError> {
        let id = self.exchange_id(session, seq)?;
        read::body_bytes(&self.conn, id, kind)
    }

    /// The stored answer to request `seq`, if one was recorded.
    pub fn response(&self, session: &str, seq: i64) -> Result<Option<ResponseInfo>, ArchiveError> {
        let id = self.exchange_id(session, seq)?;
        let Some(r) = self.conn.query_opt(
            "SELECT status, stream, partial, end_reason, body_blob, assembled FROM responses WHERE exchange = ?1",
            params![id],
        )?
        else {
            return Ok(None);
        };
        let assembled: Option<String> = r.get(5)?;
        let mut info = ResponseInfo {
            status: r.get(0)?,
            stream: r.get(1)?,
            partial: r.get(2)?,
            end_reason: r.get(3)?,
            body: Vec::new(),
            assembled: assembled.and_then(|a| serde_json::from_str(&a).ok()),
        };
        let blob: Option<i64> = r.get(4)?;
        if let Some(blob) = blob {
            info.body = store::read_blob(&self.conn, blob)?;
        }
        Ok(Some(info))
    }

    /// The last request of a session as (raw body, forwarded body): what the compaction state of a
    /// live session is rebuilt from after a restart.
    pub fn last_bodies(&self, session: &str) -> Result<Option<LastBodies>, ArchiveError> {
        let last: Option<i64> =
            self.conn.query_one("SELECT max(seq) FROM exchanges WHERE session = ?1", params![session])?.get(0)?;
        let Some(seq) = last else { return Ok(None) };
        Ok(Some(LastBodies {
            seq,
            raw: self.body(session, seq, BodyKind::Raw)?,
            forwarded: self.body(session, seq, BodyKind::Forwarded)?,
        }))
    }

    /// What pare saved session `exchanges` net of its epochs' cache misses ([`Savings`]); `exchanges`
    /// as [`ArchiveReader::exchanges`] gives them. Reads the forwarded templates of each epoch request
    /// whose answer reported no cache figure, and of the request before it (no body is decompressed).
    pub fn savings(&self, exchanges: &[ExchangeInfo]) -> Result<Savings, ArchiveError> {
        let mut savings = Savings::default();
        for (k, e) in exchanges.iter().enumerate() {
            let Some(summary) = &e.summary else { continue };
            savings.removed += summary.tokens_raw.saturating_sub(summary.tokens_forwarded);
            let previous = k.checked_sub(1).map(|p| &exchanges[p]);
            let Some(previous) = previous.filter(|_| summary.epoch_started) else { continue };
            let added = previous.summary.as_ref().map_or(0, |p| summary.tokens_raw.saturating_sub(p.tokens_raw));
            let (uncached, source) = match super::prefill::uncached_with_pare(e.usage.as_ref(), Some(summary)) {
                Some(known) => known,
                None => {
                    let shared = self.shared_prefix_share(previous.id, e.id)?;
                    let kept = (summary.tokens_forwarded as f64 * shared).round() as u64;
                    (summary.tokens_forwarded.saturating_sub(kept), MissSource::Estimate)
                }
            };
            savings.epochs.push(EpochMiss { seq: e.seq, tokens: uncached.saturating_sub(added), source });
        }
        Ok(savings)
    }

    /// A session's epochs, attributable savings and uncached prefill, from its exchanges as
    /// [`ArchiveReader::exchanges`] gives them.
    pub fn figures(&self, exchanges: &[ExchangeInfo]) -> Result<SessionFigures, ArchiveError> {
        Ok(SessionFigures {
            epochs: exchanges.iter().rev().find_map(|e| e.summary.as_ref()).map_or(0, |s| s.epoch),
            savings: self.savings(exchanges)?,
            prefill: super::prefill::SessionPrefill::of(
                exchanges.iter().map(|e| (e.seq, e.usage.as_ref(), e.summary.as_ref())),
            ),
        })
    }

    /// The share (by bytes, 0..=1) of exchange `current`'s forwarded body that a prompt cache holding
    /// exchange `previous`'s could reuse: its top-level values stored as blobs that both bodies share,
    /// then the longest common prefix of their message lists. Small literal fields are left out.
    fn shared_prefix_share(&self, previous: i64, current: i64) -> Result<f64, ArchiveError> {
        let blobs_of = |parts: &[Part]| -> Vec<i64> {
            parts.iter().filter_map(|p| if let Part::Blob(id) = p { Some(*id) } else { None }).collect()
        };
        let before = read::template(&self.conn, previous, BodyKind::Forwarded)?;
        let now = read::template(&self.conn, current, BodyKind::Forwarded)?;
        let (blobs_before, blobs_now) = (blobs_of(&before), blobs_of(&now));
        let items_before = read::resolve_items(&self.conn, previous, BodyKind::Forwarded)?;
        let items_now = read::resolve_items(&self.conn, current, BodyKind::Forwarded)?;
        let n_common = items_before.iter().zip(&items_now).take_while(|(a, b)| a.blob == b.blob).count();
        let bytes = |id: i64| -> Result<u64, ArchiveError> {
            let n: Option<i64> = self
                .conn
                .query_opt("SELECT raw_len FROM blobs WHERE id = ?1", params![id])?
                .map(|r| r.get(0))
                .transpose()?;
            Ok(n.map_or(0, |n| n.max(0) as u64))
        };
        let (mut shared, mut total) = (0u64, 0u64);
        for id in &blobs_now {
            let n = bytes(*id)?;
            total += n;
            if blobs_before.contains(id) {
                shared += n;
            }
        }
        for (idx, item) in items_now.iter().enumerate() {
            let n = bytes(item.blob)?;
            total += n;
            if idx < n_common {
                shared += n;
            }
        }
        Ok(if total == 0 { 0.0 } else { shared as f64 / total as f64 })
    }

    /// The `limit` most recently active sessions (oldest first) with their requests' and answers'
    /// session keys in the order of their records: what [`crate::session::SessionTracker::seed`]
    /// takes at start.
    pub fn recent_session_keys(&self, limit: usize) -> Result<Vec<(String, Vec<StoredKey>)>, ArchiveError> {
        let rows =
            self.conn.query_all("SELECT id FROM sessions ORDER BY last_ms DESC LIMIT ?1", params![limit as i64])?;
        let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids.into_iter().rev() {
            let keys = self.stored_keys(&id)?;
            out.push((id, keys));
        }
        Ok(out)
    }

    /// The sessions that stored any of `keys` as a request key or an answer key, most recently
    /// active first, at most `limit` of them, each with its stored keys as
    /// [`ArchiveReader::recent_session_keys`] gives them. One indexed query finds the sessions,
    /// whatever the number of keys.
    pub fn sessions_with_keys(
        &self,
        keys: &[u64],
        limit: usize,
    ) -> Result<Vec<(String, Vec<StoredKey>)>, ArchiveError> {
        if keys.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let list = self.conn.list_param(&keys.iter().map(|k| *k as i64).collect::<Vec<_>>());
        let rows = self.conn.query_all(
            &format!(
                "SELECT id FROM sessions WHERE id IN (
                     SELECT session FROM exchanges WHERE {}
                     UNION SELECT session FROM responses WHERE {})
                 ORDER BY last_ms DESC, id DESC LIMIT ?2",
                self.conn.in_list("key_req", 1),
                self.conn.in_list("key_ext", 1)
            ),
            params![&list, limit as i64],
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let id: String = row.get(0)?;
            let keys = self.stored_keys(&id)?;
            out.push((id, keys));
        }
        Ok(out)
    }

    /// A session's request and answer keys in the order of their records.
    fn stored_keys(&self, session: &str) -> Result<Vec<StoredKey>, ArchiveError> {
        let rows = self.conn.query_all(
            "SELECT key, answer FROM (
                 SELECT chain_idx, key_req AS key, 0 AS answer FROM exchanges WHERE session = ?1 AND key_req IS NOT NULL
                 UNION ALL
                 SELECT chain_idx, key_ext, 1 FROM responses WHERE session = ?1 AND key_ext IS NOT NULL) AS k
             ORDER BY chain_idx",
            params![session],
        )?;
        let keys = rows
            .iter()
            .map(|r| {
                let key = r.get::<i64>(0)? as u64;
                Ok(if r.get::<bool>(1)? { StoredKey::Answer(key) } else { StoredKey::Request(key) })
            })
            .collect::<Result<_, DbError>>()?;
        Ok(keys)
    }
}
