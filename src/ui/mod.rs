//! The audit UI under `/_pare/ui/`: server-rendered HTML over the archive, read-only. Sessions (paged,
//! filtered by model and date), one session's requests with their token bars and epochs, one request's
//! raw and forwarded messages side by side, downloads of the exact bodies and SFT/DPO exports.
//!
//! Routing and reading live here, the markup in `pages.rs`, the response bodies both servers
//! send in `server.rs` (`pare ui`'s own server is `crate::proxy::ui_server`). Every page opens the store read-only
//! for the time of one request; nothing here writes to the archive.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use crate::archive::ArchiveError;
use crate::archive::export::{SftFormat, export_dpo, export_sft};
use crate::archive::query::{ArchiveReader, ExchangeInfo, SessionFilter, costs};
use crate::archive::read::BodyKind;
use crate::archive::verify::verify;
use crate::budget::price::Prices;

mod pages;
mod server;

pub use server::{UiBody, respond};

/// Where every route lives.
pub const PREFIX: &str = "/_pare/ui";

/// Sessions per index page.
pub const PAGE_SIZE: i64 = 50;

/// The UI over one archive (a directory or a PostgreSQL URL).
pub struct Ui {
    location: crate::archive::Location,
    /// Verify results of sessions opened so far, by (id, requests): the index shows them without
    /// hashing anything; a session that grew is verified again when opened.
    verified: Mutex<HashMap<String, (i64, bool)>>,
    /// Each model's price, for the cost of sessions and requests.
    prices: Arc<Prices>,
}

/// What a route answers: a status, a content type, extra headers and the body.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: Payload,
}

/// Writes an export to the response body as it is produced (on the blocking pool).
pub type ExportWriter = Box<dyn FnOnce(&mut dyn Write) -> anyhow::Result<()> + Send>;

/// A body known up front, or an export written as it is produced.
pub enum Payload {
    Bytes(Vec<u8>),
    Export(ExportWriter),
}

impl Reply {
    fn html(status: u16, markup: maud::Markup) -> Reply {
        Reply {
            status,
            content_type: "text/html; charset=utf-8",
            headers: Vec::new(),
            body: Payload::Bytes(markup.into_string().into_bytes()),
        }
    }

    fn not_found(what: &str) -> Reply {
        Reply::html(404, pages::error_page("Not found", what))
    }

    fn attachment(content_type: &'static str, file_name: String, body: Payload) -> Reply {
        let disposition = format!("attachment; filename=\"{file_name}\"");
        Reply { status: 200, content_type, headers: vec![("content-disposition", disposition)], body }
    }
}

/// The query string's filter, as the index and the exports read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pub model: Option<String>,
    /// `YYYY-MM-DD` or RFC 3339, as `--since` takes it.
    pub since: Option<String>,
    pub session: Option<String>,
    pub page: i64,
    pub format: Option<String>,
}

impl Query {
    pub fn parse(query: Option<&str>) -> Query {
        let mut out = Query { page: 1, ..Query::default() };
        let pairs = query.map(form_urlencoded_pairs).unwrap_or_default();
        for (key, value) in pairs {
            let value = value.trim().to_owned();
            let set = (!value.is_empty()).then_some(value.clone());
            match key.as_str() {
                "model" => out.model = set,
                "since" => out.since = set,
                "session" => out.session = set,
                "format" => out.format = set,
                "page" => out.page = value.parse().unwrap_or(1).max(1),
                _ => {}
            }
        }
        out
    }

    /// This filter as a query string (for links that keep it), with `page` when not the first.
    pub fn to_query(&self, page: i64) -> String {
        let mut pairs: Vec<(&str, String)> = Vec::new();
        for (key, value) in [("model", &self.model), ("since", &self.since), ("session", &self.session)] {
            if let Some(value) = value {
                pairs.push((key, value.clone()));
            }
        }
        if page > 1 {
            pairs.push(("page", page.to_string()));
        }
        pairs.iter().map(|(k, v)| format!("{k}={}", percent_encode(v))).collect::<Vec<_>>().join("&")
    }

    fn filter(&self) -> Result<SessionFilter, String> {
        let since_ms = match &self.since {
            Some(since) => Some(crate::archive::time::parse_since(since).map_err(|e| format!("since={e}"))?),
            None => None,
        };
        Ok(SessionFilter { since_ms, model: self.model.clone(), session: self.session.clone() })
    }
}

/// `a=1&b=x%20y` → pairs, `+` as a space.
pub(crate) fn form_urlencoded_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut idx = 0;
    while idx < bytes.len() {
        let escaped = (bytes[idx] == b'%' && idx + 2 < bytes.len())
            .then(|| Some(hex(bytes[idx + 1])? * 16 + hex(bytes[idx + 2])?))
            .flatten();
        match (bytes[idx], escaped) {
            (_, Some(b)) => {
                out.push(b);
                idx += 2;
            }
            (b'+', None) => out.push(b' '),
            (b, None) => out.push(b),
        }
        idx += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encode everything but unreserved characters (RFC 3986).
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Ui {
    /// The UI over the archive at `location`.
    pub fn new(location: impl Into<crate::archive::Location>) -> Ui {
        Ui { location: location.into(), verified: Mutex::new(HashMap::new()), prices: Arc::new(Prices::builtin()) }
    }

    /// Price sessions and requests with `prices` (the configuration's `models:` prices over the
    /// built-in table) instead of the built-in table alone.
    pub fn with_prices(mut self, prices: Arc<Prices>) -> Ui {
        self.prices = prices;
        self
    }

    /// Answer one request; `path` starts with [`PREFIX`]. Blocking (SQLite): async callers run it
    /// on the blocking pool.
    pub fn route(&self, method: &str, path: &str, query: Option<&str>) -> Reply {
        if method != "GET" && method != "HEAD" {
            return Reply::html(405, pages::error_page("Method not allowed", "the audit UI only reads"));
        }
        let rest = path.strip_prefix(PREFIX).unwrap_or(path).trim_end_matches('/');
        let decoded: Vec<String> = rest.split('/').filter(|p| !p.is_empty()).map(percent_decode).collect();
        let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
        let query = Query::parse(query);
        let result = match parts.as_slice() {
            [] => self.index(&query),
            ["session", id] => self.session(id),
            ["session", id, "request", n] => self.with_seq(n, |seq| self.request(id, seq)),
            ["session", id, "request", n, kind @ ("raw" | "forwarded")] => {
                self.with_seq(n, |seq| self.download(id, seq, kind))
            }
            ["export", kind @ ("sft" | "dpo")] => self.export(kind, &query),
            _ => Ok(Reply::not_found(&format!("no page at {path}"))),
        };
        result.unwrap_or_else(|err| match err {
            ArchiveError::NoSession(id) => Reply::not_found(&format!("no session {id} in the archive")),
            ArchiveError::NoRequest { session, seq } => {
                Reply::not_found(&format!("session {session} has no request {seq}"))
            }
            ArchiveError::NoStore(location) => {
                Reply::not_found(&format!("no archive at {location} (nothing recorded yet)"))
            }
            other => Reply::html(500, pages::error_page("Cannot read the archive", &other.to_string())),
        })
    }

    fn with_seq(&self, n: &str, f: impl FnOnce(i64) -> Result<Reply, ArchiveError>) -> Result<Reply, ArchiveError> {
        match n.parse::<i64>() {
            Ok(seq) if seq >= 1 => f(seq),
            _ => Ok(Reply::not_found(&format!("{n} is not a request number"))),
        }
    }

    fn reader(&self) -> Result<ArchiveReader, ArchiveError> {
        ArchiveReader::open(&self.location)
    }

    fn index(&self, query: &Query) -> Result<Reply, ArchiveError> {
        let filter = match query.filter() {
            Ok(filter) => filter,
            Err(why) => return Ok(Reply::html(400, pages::error_page("Bad filter", &why))),
        };
        let reader = self.reader()?;
        let page = reader.session_page(&filter, (query.page - 1) * PAGE_SIZE, PAGE_SIZE)?;
        // Each listed session's exchanges, read once for its figures and its cost.
        let mut figures = Vec::with_capacity(page.sessions.len());
        let mut session_costs = HashMap::with_capacity(page.sessions.len());
        for s in &page.sessions {
            let exchanges = reader.exchanges(&s.info.id)?;
            figures.push(reader.figures(&exchanges)?);
            session_costs.insert(s.info.id.clone(), costs(&exchanges, &self.prices).1);
        }
        let verified = self.verified.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let costs = session_costs;
        Ok(Reply::html(200, pages::index(&self.location.to_string(), query, &page, &figures, &verified, &costs)))
    }

    fn session(&self, id: &str) -> Result<Reply, ArchiveError> {
        let reader = self.reader()?;
        let info = reader.session(id)?;
        let exchanges = reader.exchanges(id)?;
        let answers = exchanges.iter().map(|e| reader.response(id, e.seq)).collect::<Result<Vec<_>, _>>()?;
        let report = verify(reader.conn(), Some(id))?;
        self.verified.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_owned(), (info.n_requests, report.ok()));
        let figures = reader.figures(&exchanges)?;
        let costs = costs(&exchanges, &self.prices);
        Ok(Reply::html(200, pages::session(&info, &exchanges, &answers, &report, &figures, &costs)))
    }

    fn request(&self, id: &str, seq: i64) -> Result<Reply, ArchiveError> {
        let reader = self.reader()?;
        let info = reader.session(id)?;
        let exchanges = reader.exchanges(id)?;
        let Some(exchange) = exchanges.iter().find(|e| e.seq == seq) else {
            return Err(ArchiveError::NoRequest { session: id.to_owned(), seq });
        };
        // Between epochs the forwarded prefix is the one compacted when the epoch started.
        let started = |e: &&ExchangeInfo| e.summary.as_ref().is_some_and(|s| s.epoch_started);
        let epoch_started_at = exchanges
            .iter()
            .filter(|e| e.seq <= seq)
            .filter(started)
            .map(|e| e.seq)
            .next_back()
            .filter(|&start| start != seq);
        let raw = reader.body(id, seq, BodyKind::Raw)?;
        // Only the state this request was forwarded under is read, not the session's whole history.
        let plan = crate::archive::plan::latest_at(reader.conn(), id, exchange.id)?;
        let frozen = plan.as_ref().and_then(|(_, plan)| plan.frozen.as_ref());
        let answer = reader.response(id, seq)?;
        let view = pages::RequestView { info: &info, exchange, raw: &raw, frozen, epoch_started_at };
        Ok(Reply::html(200, pages::request(&view, answer.as_ref())))
    }

    fn download(&self, id: &str, seq: i64, kind: &str) -> Result<Reply, ArchiveError> {
        let reader = self.reader()?;
        let body_kind = if kind == "raw" { BodyKind::Raw } else { BodyKind::Forwarded };
        let bytes = reader.body(id, seq, body_kind)?;
        let name = format!("{}-{seq}-{kind}.json", file_safe(id));
        Ok(Reply::attachment("application/json", name, Payload::Bytes(bytes)))
    }

    fn export(&self, kind: &str, query: &Query) -> Result<Reply, ArchiveError> {
        let filter = match query.filter() {
            Ok(filter) => filter,
            Err(why) => return Ok(Reply::html(400, pages::error_page("Bad filter", &why))),
        };
        let reader = self.reader()?;
        if let Some(id) = &filter.session {
            reader.session(id)?;
        }
        let format = match query.format.as_deref() {
            Some("sharegpt") => SftFormat::ShareGpt,
            _ => SftFormat::OpenAi,
        };
        let scope = filter.session.as_deref().map(file_safe).unwrap_or_else(|| "sessions".into());
        let name = match (kind, format) {
            ("dpo", _) => format!("pare-dpo-{scope}.jsonl"),
            (_, SftFormat::ShareGpt) => format!("pare-sft-sharegpt-{scope}.jsonl"),
            _ => format!("pare-sft-{scope}.jsonl"),
        };
        let dpo = kind == "dpo";
        let write = move |out: &mut dyn Write| -> anyhow::Result<()> {
            let mut out = out;
            if dpo {
                export_dpo(&reader, &filter, &mut out)?;
            } else {
                export_sft(&reader, &filter, format, &mut out)?;
            }
            Ok(())
        };
        Ok(Reply::attachment("application/x-ndjson", name, Payload::Export(Box::new(write))))
    }
}

/// An id as part of a file name (ids are ULIDs or header-given `A-Z a-z 0-9 . _ : -`).
fn file_safe(id: &str) -> String {
    id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// A body's conversation as neutral messages (JSON text), read by the adapter of the exchange's
/// path, as `pare sessions show` reads it; empty when the body is not a request pare reads.
fn messages_of(path: &str, body: &[u8]) -> Vec<String> {
    let wire = crate::wire::Wire::of_path(path).unwrap_or_default();
    crate::wire::parse(wire, body)
        .map(|parsed| parsed.messages().into_iter().map(str::to_owned).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_round_trip() {
        let q = Query::parse(Some("model=qwen+3%2F14b&since=2026-11-01&page=3&x=1"));
        assert_eq!(q.model.as_deref(), Some("qwen 3/14b"));
        assert_eq!(q.since.as_deref(), Some("2026-11-01"));
        assert_eq!(q.page, 3);
        assert_eq!(Query::parse(Some(&q.to_query(3))), q);
        assert_eq!(Query::parse(Some("page=-4&model=")).page, 1);
        assert_eq!(Query::parse(Some("model=")).model, None);
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%3Cscript%3E"), "<script>");
    }
}
