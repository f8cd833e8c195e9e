//! `verify`: recompute every stored body's SHA-256 from its blobs and template, check every blob's
//! content against its address, and walk each session's hash chain, so that any altered, removed or
//! reordered record is reported.
//!
//! Consecutive bodies of a session share long prefixes of identical segments (the same blobs in the
//! same order), so the SHA-256 of a body resumes from the hash state after the prefix it shares with
//! the previous body instead of rehashing it: every byte of every body is still covered, since each
//! blob's own content is checked against its hash when first read. This keeps `verify` linear in the
//! size of the archive rather than in the (quadratic) size of the raw traffic.

use std::collections::HashMap;
use std::fmt;

use super::db::{Db, params};
use sha2::{Digest, Sha256};

use super::body::{self, Item, Segment};
use super::chain::{self, ExchangeFields, ResponseFields};
use super::read::{self, BodyKind};
use super::{ArchiveError, store};

/// One problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyProblem {
    pub session: Option<String>,
    /// Request sequence number, when the problem is in one exchange or its response.
    pub seq: Option<i64>,
    pub what: String,
}

impl fmt::Display for VerifyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.session, self.seq) {
            (Some(s), Some(n)) => write!(f, "session {s} request {n}: {}", self.what),
            (Some(s), None) => write!(f, "session {s}: {}", self.what),
            _ => write!(f, "archive: {}", self.what),
        }
    }
}

/// What `verify` checked and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub sessions: u64,
    pub exchanges: u64,
    pub responses: u64,
    /// Bodies whose SHA-256 was recomputed (raw, forwarded and responses).
    pub bodies: u64,
    /// Bytes those bodies amount to.
    pub body_bytes: u64,
    pub problems: Vec<VerifyProblem>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// SHA-256 over segment lists, resuming from the state after the prefix shared with the previous list.
#[derive(Default)]
struct ResumingHasher {
    segments: Vec<Segment>,
    states: Vec<(Sha256, u64)>,
}

impl ResumingHasher {
    fn hash(&mut self, segments: Vec<Segment>, blobs: &BlobCache) -> ([u8; 32], u64) {
        let shared = self.segments.iter().zip(&segments).take_while(|(a, b)| a == b).count();
        self.states.truncate(shared);
        let (mut state, mut len) = self.states.last().cloned().unwrap_or_else(|| (Sha256::new(), 0));
        for seg in &segments[shared..] {
            let bytes: &[u8] = match seg {
                Segment::Lit(b) => b,
                Segment::Blob(id) => blobs.get(*id),
            };
            state.update(bytes);
            len += bytes.len() as u64;
            self.states.push((state.clone(), len));
        }
        self.segments = segments;
        (state.finalize().into(), len)
    }
}

/// Blob contents read during one session's check, each verified against its hash once.
#[derive(Default)]
struct BlobCache {
    contents: HashMap<i64, Vec<u8>>,
}

impl BlobCache {
    fn load(&mut self, conn: &Db, id: i64, problems: &mut Vec<String>) {
        if self.contents.contains_key(&id) {
            return;
        }
        let content = match store::get_blob(conn, id).and_then(|b| {
            let content = store::decode_blob(id, &b)?;
            Ok((b.sha256, content))
        }) {
            Ok((hash, content)) => {
                if store::sha256(&content)[..] != hash[..] {
                    problems.push(format!("blob {id} does not match its SHA-256 (content altered)"));
                }
                content
            }
            Err(e) => {
                problems.push(e.to_string());
                Vec::new()
            }
        };
        self.contents.insert(id, content);
    }

    fn get(&self, id: i64) -> &[u8] {
        self.contents.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }
}

/// Verify one session, or the whole archive when `session` is `None`.
pub fn verify(conn: &Db, session: Option<&str>) -> Result<VerifyReport, ArchiveError> {
    let mut report = VerifyReport::default();
    let ids: Vec<String> = match session {
        Some(id) => {
            let known: i64 = conn
                .query_one(
                    "SELECT (SELECT count(*) FROM sessions WHERE id = ?1) + (SELECT count(*) FROM exchanges WHERE session = ?1)",
                    params![id],
                )?
                .get(0)?;
            if known == 0 {
                return Err(ArchiveError::NoSession(id.to_owned()));
            }
            vec![id.to_owned()]
        }
        None => {
            let rows =
                conn.query_all("SELECT id FROM sessions UNION SELECT session FROM exchanges ORDER BY 1", params![])?;
            rows.iter().map(|r| r.get(0)).collect::<Result<_, _>>()?
        }
    };
    for id in &ids {
        verify_session(conn, id, &mut report)?;
    }
    if session.is_none() {
        let orphans: i64 = conn
            .query_one("SELECT count(*) FROM responses WHERE exchange NOT IN (SELECT id FROM exchanges)", params![])?
            .get(0)?;
        if orphans > 0 {
            report.problems.push(VerifyProblem {
                session: None,
                seq: None,
                what: format!("{orphans} response(s) whose request was removed"),
            });
        }
    }
    Ok(report)
}

struct ExchangeRow {
    id: i64,
    seq: i64,
    chain_idx: i64,
    at_ms: i64,
    method: String,
    path: String,
    model: Option<String>,
    headers: String,
    raw_sha256: Vec<u8>,
    raw_len: i64,
    raw_template: Vec<u8>,
    fwd_sha256: Option<Vec<u8>>,
    fwd_len: Option<i64>,
    fwd_template: Option<Vec<u8>>,
    summary: Option<String>,
    skipped: Option<String>,
    key_req: Option<i64>,
    prev_hash: Vec<u8>,
    hash: Vec<u8>,
}

struct ResponseRow {
    seq: Option<i64>,
    chain_idx: i64,
    at_ms: i64,
    status: Option<i64>,
    headers: String,
    stream: bool,
    partial: bool,
    end_reason: String,
    body_blob: Option<i64>,
    body_sha256: Vec<u8>,
    body_len: i64,
    assembled: Option<String>,
    key_ext: Option<i64>,
    prev_hash: Vec<u8>,
    hash: Vec<u8>,
}

enum Record<'a> {
    Exchange(&'a ExchangeRow),
    Response(&'a ResponseRow),
}

fn verify_session(conn: &Db, session: &str, report: &mut VerifyReport) -> Result<(), ArchiveError> {
    report.sessions += 1;
    let mut problems: Vec<VerifyProblem> = Vec::new();
    let problem = |seq: Option<i64>, what: String| VerifyProblem { session: Some(session.to_owned()), seq, what };

    let head: Option<(i64, i64, Vec<u8>)> = conn
        .query_opt("SELECT n_requests, n_records, head_hash FROM sessions WHERE id = ?1", params![session])?
        .map(|r| Ok::<_, super::db::DbError>((r.get(0)?, r.get(1)?, r.get(2)?)))
        .transpose()?;
    let exchanges: Vec<ExchangeRow> = conn
        .query_all(
            "SELECT id, seq, chain_idx, at_ms, method, path, model, headers, raw_sha256, raw_len, raw_template,
                    fwd_sha256, fwd_len, fwd_template, summary, skipped, key_req, prev_hash, hash
             FROM exchanges WHERE session = ?1 ORDER BY seq",
            params![session],
        )?
        .iter()
        .map(|r| {
            Ok(ExchangeRow {
                id: r.get(0)?,
                seq: r.get(1)?,
                chain_idx: r.get(2)?,
                at_ms: r.get(3)?,
                method: r.get(4)?,
                path: r.get(5)?,
                model: r.get(6)?,
                headers: r.get(7)?,
                raw_sha256: r.get(8)?,
                raw_len: r.get(9)?,
                raw_template: r.get(10)?,
                fwd_sha256: r.get(11)?,
                fwd_len: r.get(12)?,
                fwd_template: r.get(13)?,
                summary: r.get(14)?,
                skipped: r.get(15)?,
                key_req: r.get(16)?,
                prev_hash: r.get(17)?,
                hash: r.get(18)?,
            })
        })
        .collect::<Result<_, super::db::DbError>>()?;
    let responses: Vec<ResponseRow> = conn
        .query_all(
            "SELECT e.seq, r.chain_idx, r.at_ms, r.status, r.headers, r.stream, r.partial, r.end_reason, r.body_blob,
                    r.body_sha256, r.body_len, r.assembled, r.key_ext, r.prev_hash, r.hash
             FROM responses r LEFT JOIN exchanges e ON e.id = r.exchange WHERE r.session = ?1",
            params![session],
        )?
        .iter()
        .map(|r| {
            Ok(ResponseRow {
                seq: r.get(0)?,
                chain_idx: r.get(1)?,
                at_ms: r.get(2)?,
                status: r.get(3)?,
                headers: r.get(4)?,
                stream: r.get(5)?,
                partial: r.get(6)?,
                end_reason: r.get(7)?,
                body_blob: r.get(8)?,
                body_sha256: r.get(9)?,
                body_len: r.get(10)?,
                assembled: r.get(11)?,
                key_ext: r.get(12)?,
                prev_hash: r.get(13)?,
                hash: r.get(14)?,
            })
        })
        .collect::<Result<_, super::db::DbError>>()?;
    report.exchanges += exchanges.len() as u64;
    report.responses += responses.len() as u64;

    // 1. The chain: positions 0..n, each linked to the previous, each hash recomputed.
    let mut records: Vec<(i64, Record<'_>)> = exchanges.iter().map(|e| (e.chain_idx, Record::Exchange(e))).collect();
    records.extend(responses.iter().map(|r| (r.chain_idx, Record::Response(r))));
    records.sort_by_key(|(idx, _)| *idx);
    let mut prev: Vec<u8> = chain::GENESIS.to_vec();
    for (position, (idx, record)) in records.iter().enumerate() {
        let (seq, what) = match record {
            Record::Exchange(e) => (Some(e.seq), "request"),
            Record::Response(r) => (r.seq, "response"),
        };
        if *idx != position as i64 {
            problems.push(problem(
                seq,
                format!("{what} is at chain position {idx}, expected {position}: a record was removed or reordered"),
            ));
        }
        let (stored_prev, stored_hash, recomputed) = match record {
            Record::Exchange(e) => (&e.prev_hash, &e.hash, exchange_hash(session, e)),
            Record::Response(r) => (&r.prev_hash, &r.hash, response_hash(session, r)),
        };
        if stored_prev[..] != prev[..] {
            problems.push(problem(
                seq,
                format!("{what} does not link to the record before it: the chain was broken (record removed, reordered or rewritten)"),
            ));
        }
        if recomputed[..] != stored_hash[..] {
            problems.push(problem(seq, format!("{what} record was altered: its hash does not match its fields")));
        }
        prev = stored_hash.clone();
    }
    match head {
        None => problems.push(problem(None, "session row is missing (records without a session)".into())),
        Some((n_requests, n_records, head_hash)) => {
            if n_records != records.len() as i64 {
                problems.push(problem(
                    None,
                    format!(
                        "session has {} records, its head says {n_records}: records were removed or added",
                        records.len()
                    ),
                ));
            }
            if n_requests != exchanges.len() as i64 {
                problems.push(problem(
                    None,
                    format!("session has {} requests, its head says {n_requests}", exchanges.len()),
                ));
            }
            if head_hash[..] != prev[..] {
                problems.push(problem(
                    None,
                    "the last record is not the session's head: trailing records were removed or the head was altered"
                        .into(),
                ));
            }
        }
    }
    for (idx, e) in exchanges.iter().enumerate() {
        if e.seq != idx as i64 + 1 {
            problems.push(problem(Some(e.seq), format!("request numbers jump from {idx} to {}", e.seq)));
            break;
        }
    }

    // 2. Bodies: recompute every raw and forwarded body's SHA-256 from blobs and templates.
    let mut blobs = BlobCache::default();
    let mut blob_problems = Vec::new();
    let mut last_items: HashMap<(i64, bool), Vec<Item>> = HashMap::new();
    let mut raw_hasher = ResumingHasher::default();
    let mut fwd_hasher = ResumingHasher::default();
    for e in &exchanges {
        let raw = check_body(
            conn,
            e,
            &e.raw_template,
            BodyKind::Raw,
            &mut last_items,
            &mut blobs,
            &mut blob_problems,
            &mut raw_hasher,
        );
        match raw {
            Ok((hash, len)) => {
                report.bodies += 1;
                report.body_bytes += len;
                if hash[..] != e.raw_sha256[..] || len as i64 != e.raw_len {
                    problems.push(problem(
                        Some(e.seq),
                        format!(
                            "raw body does not match its SHA-256 (stored {}, recomputed {}, {len} bytes)",
                            short(&e.raw_sha256),
                            short(&hash)
                        ),
                    ));
                }
            }
            Err(err) => problems.push(problem(Some(e.seq), format!("raw body cannot be rebuilt: {err}"))),
        }
        if let (Some(template), Some(expected)) = (&e.fwd_template, &e.fwd_sha256) {
            match check_body(
                conn,
                e,
                template,
                BodyKind::Forwarded,
                &mut last_items,
                &mut blobs,
                &mut blob_problems,
                &mut fwd_hasher,
            ) {
                Ok((hash, len)) => {
                    report.bodies += 1;
                    report.body_bytes += len;
                    if hash[..] != expected[..] || Some(len as i64) != e.fwd_len {
                        problems.push(problem(Some(e.seq), "forwarded body does not match its SHA-256".into()));
                    }
                }
                Err(err) => problems.push(problem(Some(e.seq), format!("forwarded body cannot be rebuilt: {err}"))),
            }
        } else if let Some(items) = last_items.get(&(e.id, false)).cloned() {
            last_items.insert((e.id, true), items);
        }
        last_items.retain(|(id, _), _| *id == e.id);
        for p in blob_problems.drain(..) {
            problems.push(problem(Some(e.seq), p));
        }
    }
    for r in &responses {
        if let Some(blob) = r.body_blob {
            blobs.load(conn, blob, &mut blob_problems);
        }
        let body = r.body_blob.map(|b| blobs.get(b)).unwrap_or(&[]);
        report.bodies += 1;
        report.body_bytes += body.len() as u64;
        if store::sha256(body)[..] != r.body_sha256[..] || body.len() as i64 != r.body_len {
            problems.push(problem(r.seq, "response body does not match its SHA-256".into()));
        }
        for p in blob_problems.drain(..) {
            problems.push(problem(r.seq, p));
        }
    }
    report.problems.extend(problems);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_body(
    conn: &Db,
    e: &ExchangeRow,
    template: &[u8],
    kind: BodyKind,
    last_items: &mut HashMap<(i64, bool), Vec<Item>>,
    blobs: &mut BlobCache,
    blob_problems: &mut Vec<String>,
    hasher: &mut ResumingHasher,
) -> Result<([u8; 32], u64), ArchiveError> {
    let fwd = kind == BodyKind::Forwarded;
    let parts = body::decode(template).map_err(|err| ArchiveError::CorruptTemplate { exchange: e.id, why: err.0 })?;
    let items = match body::messages_part(&parts) {
        None => Vec::new(),
        Some(m) if m.base == 0 => read::apply_delta(&[], &parts).unwrap_or_default(),
        Some(m) => match last_items.get(&(m.base, fwd)) {
            Some(base) => read::apply_delta(base, &parts).ok_or(ArchiveError::CorruptTemplate {
                exchange: e.id,
                why: "delta shares more messages than its base has",
            })?,
            None => read::resolve_items(conn, e.id, kind)?,
        },
    };
    let segments = body::flatten(&parts, &items);
    for seg in &segments {
        if let Segment::Blob(id) = seg {
            blobs.load(conn, *id, blob_problems);
        }
    }
    last_items.insert((e.id, fwd), items);
    Ok(hasher.hash(segments, blobs))
}

fn exchange_hash(session: &str, e: &ExchangeRow) -> [u8; 32] {
    chain::exchange_hash(
        &e.prev_hash,
        &ExchangeFields {
            session,
            seq: e.seq,
            chain_idx: e.chain_idx,
            at_ms: e.at_ms,
            method: &e.method,
            path: &e.path,
            model: e.model.as_deref(),
            headers: &e.headers,
            raw_sha256: &e.raw_sha256,
            raw_len: e.raw_len,
            fwd_sha256: e.fwd_sha256.as_deref(),
            fwd_len: e.fwd_len,
            summary: e.summary.as_deref(),
            skipped: e.skipped.as_deref(),
            key_req: e.key_req,
        },
    )
}

fn response_hash(session: &str, r: &ResponseRow) -> [u8; 32] {
    chain::response_hash(
        &r.prev_hash,
        &ResponseFields {
            session,
            seq: r.seq.unwrap_or(-1),
            chain_idx: r.chain_idx,
            at_ms: r.at_ms,
            status: r.status,
            headers: &r.headers,
            stream: r.stream,
            partial: r.partial,
            end_reason: &r.end_reason,
            body_sha256: &r.body_sha256,
            body_len: r.body_len,
            assembled: r.assembled.as_deref(),
            key_ext: r.key_ext,
        },
    )
}

fn short(hash: &[u8]) -> String {
    store::hex(&hash[..hash.len().min(8)])
}

/// Count rows the way `sessions verify` reports them, for a one-line summary.
pub fn summary_line(report: &VerifyReport) -> String {
    let n = |x: u64| crate::compact::markers::group_digits(x as usize);
    format!(
        "{} session(s), {} request(s), {} response(s), {} bodies ({} bytes) checked: {}",
        n(report.sessions),
        n(report.exchanges),
        n(report.responses),
        n(report.bodies),
        n(report.body_bytes),
        if report.ok() { "OK".to_string() } else { format!("{} problem(s)", report.problems.len()) }
    )
}
