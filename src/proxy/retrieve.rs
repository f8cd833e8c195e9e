//! Getting hidden content back: `GET /_pare/retrieve/{id}` (the text a marker's `pare:` id names,
//! exactly as the agent sent it, with `?lines=A-B` and `?grep=REGEX` for selective reads), and the
//! gateway contract LiteLLM's Headroom guardrail calls: `POST /v1/compress` (chat messages in,
//! compacted messages out) and `GET /v1/retrieve/{hash}` (`{"original_content": …}`).
//!
//! Every read goes through the archive's query layer ([`crate::archive::content`]); the proxy only
//! maps its answers to HTTP. An id the archive does not know yet may name a content the writer has
//! not committed: when exchanges wait for the writer, the lookup waits for their commit (never
//! hurrying it) and asks again before it answers 404.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue, X_CONTENT_TYPE_OPTIONS};
use http::request::Parts;
use http::{Response, StatusCode};
use serde_json::{Value, json};

use super::error::json_response;
use super::gateway::GatewayEngine;
use super::limits::Share;
use super::paths::{COMPRESS_PATH, GATEWAY_RETRIEVE_PREFIX, RETRIEVE_PREFIX};
use super::state::Proxy;
use crate::archive::Archive;
use crate::archive::content::{Content, ContentError, Selection, SelectionError};
use crate::archive::query::ArchiveReader;

/// The fewest hex digits of an id that read content: a shorter prefix (2³² values at 8 digits) is
/// found by probing a large archive at random within seconds.
pub const MIN_READ_ID_HEX: usize = 12;

/// Retrievals that `grep` at once; the others wait their turn (asynchronously).
pub const MAX_GREPS: usize = 1;

/// Why a retrieval has no content to give.
#[derive(Debug, thiserror::Error)]
pub enum RetrieveError {
    #[error("archiving is off (archive.enabled: false): pare keeps no content to retrieve")]
    NoArchive,
    #[error(transparent)]
    Content(#[from] ContentError),
    #[error(transparent)]
    Selection(#[from] SelectionError),
    #[error(
        "pare holds {limit} bytes of requests and retrieved contents already (server.max_buffered_bytes); retry in a moment"
    )]
    Busy { limit: u64 },
    #[error("the selection failed: {0}")]
    Failed(String),
}

impl RetrieveError {
    pub fn status(&self) -> StatusCode {
        match self {
            RetrieveError::NoArchive | RetrieveError::Content(ContentError::Unknown(_)) => StatusCode::NOT_FOUND,
            RetrieveError::Content(ContentError::BadId(_) | ContentError::Ambiguous { .. })
            | RetrieveError::Selection(_) => StatusCode::BAD_REQUEST,
            RetrieveError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RetrieveError::Content(ContentError::Archive(_)) | RetrieveError::Failed(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

/// The content `id` names, from the archive: read on the blocking pool; an unknown id is asked
/// again once the writer is done with the exchanges handed to it before (it may name a content
/// they store), waiting for the commit the writer makes anyway: a miss never forces one.
pub async fn content(proxy: &Proxy, id: &str) -> Result<Content, RetrieveError> {
    let archive = proxy.pipeline.archive().ok_or(RetrieveError::NoArchive)?;
    if crate::archive::content::parse_id(id)?.len() < MIN_READ_ID_HEX {
        return Err(ContentError::BadId(format!("{id} (give at least {MIN_READ_ID_HEX} hex digits)")).into());
    }
    match read(archive, id).await {
        Err(RetrieveError::Content(ContentError::Unknown(digits))) => {
            if archive.settled().await {
                read(archive, id).await
            } else {
                Err(RetrieveError::Content(ContentError::Unknown(digits)))
            }
        }
        other => other,
    }
}

async fn read(archive: &Arc<Archive>, id: &str) -> Result<Content, RetrieveError> {
    let (location, id) = (archive.location().clone(), id.to_owned());
    tokio::task::spawn_blocking(move || {
        let reader = ArchiveReader::open(&location).map_err(ContentError::from)?;
        Ok(reader.content(&id)?)
    })
    .await
    .unwrap_or_else(|_| Err(RetrieveError::Content(ContentError::Unknown("(the lookup panicked)".into()))))
}

/// The content `id` names, its bytes held in `share` (the request budget,
/// `server.max_buffered_bytes`) for as long as the caller holds the share.
pub async fn charged(proxy: &Proxy, id: &str, share: &mut Share) -> Result<Content, RetrieveError> {
    let content = content(proxy, id).await?;
    if !share.grow(content.text.len() as u64) {
        return Err(RetrieveError::Busy { limit: share.budget_limit() });
    }
    Ok(content)
}

/// The selected part of the content `id` names: what the HTTP endpoint and the MCP tool answer.
/// Its bytes are held in `share` (what the content weighed while it was selected from, then what
/// the selection kept). A `grep` runs on the blocking pool, [`MAX_GREPS`] at once.
pub async fn select(
    proxy: &Proxy,
    id: &str,
    lines: Option<&str>,
    grep: Option<&str>,
    share: &mut Share,
) -> Result<String, RetrieveError> {
    let selection = Selection::parse(lines, grep)?;
    if selection == Selection::default() {
        return Ok(charged(proxy, id, share).await?.text);
    }
    let _turn = if selection.greps() { proxy.greps.acquire().await.ok() } else { None };
    let content = charged(proxy, id, share).await?;
    let weight = content.text.len() as u64;
    let selected = if selection.greps() {
        tokio::task::spawn_blocking(move || selection.apply(&content.text).into_owned())
            .await
            .map_err(|e| RetrieveError::Failed(e.to_string()))?
    } else {
        selection.apply(&content.text).into_owned()
    };
    share.shrink(weight.saturating_sub(selected.len() as u64));
    Ok(selected)
}

/// `GET /_pare/retrieve/{id}?lines=A-B&grep=REGEX`.
pub async fn get(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    let id = parts.uri.path().strip_prefix(RETRIEVE_PREFIX).unwrap_or_default();
    let query = query_pairs(parts.uri.query());
    let param = |name: &str| query.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str());
    let mut share = proxy.buffers.share();
    let response = match select(proxy, id, param("lines"), param("grep"), &mut share).await {
        Ok(text) => {
            let mut response = Response::new(Bytes::from(text));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
            response
        }
        Err(err) => error_response(&err),
    };
    private(response)
}

/// Stored content is never sniffed into another type by a browser, nor kept by a cache.
fn private(mut response: Response<Bytes>) -> Response<Bytes> {
    let headers = response.headers_mut();
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// An error as pare's other endpoints answer one (`{"error": {"message", "type"}}`; a busy pare
/// says when to retry).
fn error_response(err: &RetrieveError) -> Response<Bytes> {
    let kind = if err.status().is_client_error() { "invalid_request_error" } else { "pare_error" };
    let mut response = json_response(err.status(), &json!({"error": {"message": err.to_string(), "type": kind}}));
    if let RetrieveError::Busy { .. } = err {
        response.headers_mut().insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// `a=1&b=x%20y` → decoded pairs.
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query.map(crate::ui::form_urlencoded_pairs).unwrap_or_default()
}

/// `GET /v1/retrieve/{hash}`: `{"hash", "original_content", "original_chars"}`, 404 when unknown.
/// Headroom's optional `query` (a search within the content) is not read: the whole content comes back.
pub async fn gateway_get(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    let hash = parts.uri.path().strip_prefix(GATEWAY_RETRIEVE_PREFIX).unwrap_or_default();
    let mut share = proxy.buffers.share();
    private(match charged(proxy, hash, &mut share).await {
        Ok(content) => json_response(
            StatusCode::OK,
            &json!({
                "hash": hash,
                "original_content": content.text,
                "original_chars": content.text.chars().count(),
            }),
        ),
        Err(err) => error_response(&err),
    })
}

/// `POST /v1/compress` with `{"messages": [...], "model"?, "config"?}` (LiteLLM's Headroom guardrail):
/// the messages compacted by the rules (no token target, so no elision, and the rule that drops
/// consecutive assistant messages off: the answer has exactly as many messages, in the same order,
/// since the guardrail matches them by position), answered as `{"messages", "tokens_before",
/// "tokens_after", "tokens_saved", "compression_ratio", "ccr_hashes"}`, `ccr_hashes` being the hex
/// digits of the content ids the compacted messages name (what the guardrail's retrieve tool takes).
/// The call is archived as an exchange of the session its messages belong to, so that
/// `GET /v1/retrieve/{hash}` resolves those ids; `config` is not read.
pub async fn gateway_compress(proxy: &Proxy, parts: &Parts, body: Bytes) -> Response<Bytes> {
    let bad = |message: String| {
        json_response(StatusCode::BAD_REQUEST, &json!({"error": {"message": message, "type": "invalid_request_error"}}))
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => return bad(format!("request body is not JSON: {e}")),
    };
    let Some(messages) = request.get("messages").and_then(Value::as_array) else {
        return bad("request body has no \"messages\" array".into());
    };
    // The chat request the messages stand for: the model when given, and nothing else.
    let mut chat = serde_json::Map::new();
    if let Some(model) = request.get("model").filter(|m| m.is_string()) {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(messages.clone()));
    let raw = Bytes::from(serde_json::to_vec(&chat).expect("a json value serializes"));
    let gateway = match proxy.gateway.get_or_init(|| GatewayEngine::new(&proxy.config).map(Arc::new)) {
        Ok(gateway) => Arc::clone(gateway),
        Err(why) => return bad(format!("the rule pack cannot compact: {why}")),
    };
    let compacted = {
        let raw = raw.clone();
        tokio::task::spawn_blocking(move || gateway.compact_keeping_positions(&raw)).await
    };
    let compacted = match compacted {
        Ok(Ok(compacted)) => compacted,
        Ok(Err(why)) => return bad(format!("request body's messages are not chat messages pare reads: {why}")),
        Err(_) => return bad("compacting the messages failed".into()),
    };
    if let Some(archive) = proxy.pipeline.archive() {
        let raw_messages: Vec<String> = messages.iter().map(Value::to_string).collect();
        let raw_refs: Vec<&str> = raw_messages.iter().map(String::as_str).collect();
        let hashes = crate::neutral::message_hashes(&raw_refs);
        let assignment = proxy.pipeline.sessions().assign_hashed(&parts.headers, Some((&raw_refs, &hashes)));
        let record = crate::archive::ExchangeRecord {
            path: COMPRESS_PATH.into(),
            model: request.get("model").and_then(Value::as_str).map(str::to_owned),
            forwarded: Some(Bytes::from(compacted.forwarded)),
            key_req: assignment.key_req,
            ..crate::archive::ExchangeRecord::unchanged(assignment.session, crate::archive::now_ms(), raw)
        };
        archive.record_exchange(record);
    }
    let (before, after) = (compacted.tokens_before, compacted.tokens_after);
    json_response(
        StatusCode::OK,
        &json!({
            "messages": compacted.messages,
            "tokens_before": before,
            "tokens_after": after,
            "tokens_saved": before.saturating_sub(after),
            "compression_ratio": if before > 0 { after as f64 / before as f64 } else { 1.0 },
            "ccr_hashes": compacted.ids,
        }),
    )
}
