//! Getting hidden content back: `GET /_pare/retrieve/{id}` (the text a marker's `pare:` id names,
//! exactly as the agent sent it, with `?lines=A-B` and `?grep=REGEX` for selective reads), and the
//! gateway contract LiteLLM's Headroom guardrail calls: `POST /v1/compress` (chat messages in,
//! compacted messages out) and `GET /v1/retrieve/{hash}` (`{"original_content": …}`).
//!
//! Every read goes through the archive's query layer ([`crate::archive::content`]); the proxy only
//! maps its answers to HTTP. An id the archive does not know yet may name a content the writer has
//! not committed: the lookup waits for the writer once and asks again before it answers 404.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};
use serde_json::{Value, json};

use super::error::json_response;
use super::state::Proxy;
use crate::archive::Archive;
use crate::archive::content::{Content, ContentError, Selection, SelectionError};
use crate::archive::query::ArchiveReader;
use crate::compact::markers::content_texts;

/// Where `GET /_pare/retrieve/{id}` is served.
pub const RETRIEVE_PREFIX: &str = "/_pare/retrieve/";
/// The gateway's compression endpoint (LiteLLM's Headroom guardrail posts chat messages here).
pub const COMPRESS_PATH: &str = "/v1/compress";
/// The gateway's retrieval endpoint (`GET /v1/retrieve/{hash}`).
pub const GATEWAY_RETRIEVE_PREFIX: &str = "/v1/retrieve/";

/// How many hex digits the gateway's hashes have: the Headroom guardrail recognises a marker's hash by
/// `hash=` and exactly 24 of them.
const GATEWAY_HASH_HEX: usize = 24;

/// Why a retrieval has no content to give.
#[derive(Debug, thiserror::Error)]
pub enum RetrieveError {
    #[error("archiving is off (archive.enabled: false): pare keeps no content to retrieve")]
    NoArchive,
    #[error(transparent)]
    Content(#[from] ContentError),
    #[error(transparent)]
    Selection(#[from] SelectionError),
}

impl RetrieveError {
    pub fn status(&self) -> StatusCode {
        match self {
            RetrieveError::NoArchive | RetrieveError::Content(ContentError::Unknown(_)) => StatusCode::NOT_FOUND,
            RetrieveError::Content(ContentError::BadId(_) | ContentError::Ambiguous { .. })
            | RetrieveError::Selection(_) => StatusCode::BAD_REQUEST,
            RetrieveError::Content(ContentError::Archive(_)) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// The content `id` names, from the archive: read on the blocking pool; an unknown id is asked
/// again once the writer has committed what it holds.
pub async fn content(proxy: &Proxy, id: &str) -> Result<Content, RetrieveError> {
    let archive = proxy.pipeline.archive().ok_or(RetrieveError::NoArchive)?;
    crate::archive::content::parse_id(id)?;
    match read(archive, id).await {
        Err(RetrieveError::Content(ContentError::Unknown(_))) => {
            let _ = archive.flush_async().await;
            read(archive, id).await
        }
        other => other,
    }
}

async fn read(archive: &Arc<Archive>, id: &str) -> Result<Content, RetrieveError> {
    let (dir, id) = (archive.dir().to_owned(), id.to_owned());
    tokio::task::spawn_blocking(move || {
        let reader = ArchiveReader::open(&dir).map_err(ContentError::from)?;
        Ok(reader.content(&id)?)
    })
    .await
    .unwrap_or_else(|_| Err(RetrieveError::Content(ContentError::Unknown("(the lookup panicked)".into()))))
}

/// The selected part of the content `id` names: what the HTTP endpoint and the MCP tool answer.
pub async fn select(proxy: &Proxy, id: &str, lines: Option<&str>, grep: Option<&str>) -> Result<String, RetrieveError> {
    let selection = Selection::parse(lines, grep)?;
    let content = content(proxy, id).await?;
    Ok(selection.apply(&content.text).into_owned())
}

/// `GET /_pare/retrieve/{id}?lines=A-B&grep=REGEX`.
pub async fn get(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    let id = parts.uri.path().strip_prefix(RETRIEVE_PREFIX).unwrap_or_default();
    let query = query_pairs(parts.uri.query());
    let param = |name: &str| query.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str());
    match select(proxy, id, param("lines"), param("grep")).await {
        Ok(text) => {
            let mut response = Response::new(Bytes::from(text));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
            response
        }
        Err(err) => error_response(&err),
    }
}

/// An error as pare's other endpoints answer one (`{"error": {"message", "type"}}`).
fn error_response(err: &RetrieveError) -> Response<Bytes> {
    let kind = if err.status().is_client_error() { "invalid_request_error" } else { "pare_error" };
    json_response(err.status(), &json!({"error": {"message": err.to_string(), "type": kind}}))
}

/// `a=1&b=x%20y` → decoded pairs.
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query.map(crate::ui::form_urlencoded_pairs).unwrap_or_default()
}

/// `GET /v1/retrieve/{hash}`: `{"hash", "original_content", "original_chars"}`, 404 when unknown.
/// Headroom's optional `query` (a search within the content) is not read: the whole content comes back.
pub async fn gateway_get(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    let hash = parts.uri.path().strip_prefix(GATEWAY_RETRIEVE_PREFIX).unwrap_or_default();
    match content(proxy, hash).await {
        Ok(content) => json_response(
            StatusCode::OK,
            &json!({
                "hash": hash,
                "original_content": content.text,
                "original_chars": content.text.chars().count(),
            }),
        ),
        Err(err) => error_response(&err),
    }
}

/// `POST /v1/compress` with `{"messages": [...], "model": "…"}`: the messages compacted as a chat
/// request to `model` would be (same session tracking, archive record and budget), answered as
/// `{"messages", "tokens_before", "tokens_after", "compression_ratio"}`. Each content id in the
/// compacted messages is followed by `hash=` and 24 hex digits of the same SHA-256, the form the
/// guardrail looks for before it offers the model its retrieve tool.
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
    let headers = gateway_headers(&parts.headers);
    let prepared = proxy.pipeline.prepare_chat_at("POST", COMPRESS_PATH, &headers, raw.clone()).await;
    let forwarded: Value = serde_json::from_slice(&prepared.body).unwrap_or_else(|_| Value::Object(chat.clone()));
    let mut out_messages = forwarded.get("messages").cloned().unwrap_or_else(|| Value::Array(messages.clone()));
    add_gateway_hashes(&mut out_messages, messages);
    let (before, after) = match &prepared.summary {
        Some(summary) => (summary.tokens_raw, summary.tokens_forwarded),
        None => (0, 0),
    };
    let ratio = if before > 0 { after as f64 / before as f64 } else { 1.0 };
    // pare answered this request itself: no upstream answer follows.
    if let Some(sink) = prepared.sink {
        sink.finish(crate::exchange::StreamEnd::NoResponse("pare answered a gateway compress call itself".into()));
    }
    json_response(
        StatusCode::OK,
        &json!({
            "messages": out_messages,
            "tokens_before": before,
            "tokens_after": after,
            "compression_ratio": ratio,
        }),
    )
}

/// The headers the pipeline reads for a gateway call: the caller's, without its body's length and
/// encoding (the chat body pare builds is neither).
fn gateway_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = headers.clone();
    out.remove(http::header::CONTENT_LENGTH);
    out.remove(http::header::CONTENT_ENCODING);
    out
}

/// Follow each content id (`pare:` + 12 hex) in the compacted `messages` with ` hash=` and the first
/// [`GATEWAY_HASH_HEX`] hex digits of the SHA-256 of the text it names, read from the `raw` messages.
fn add_gateway_hashes(messages: &mut Value, raw: &[Value]) {
    let mut full: Vec<(String, String)> = Vec::new();
    for message in raw {
        let Ok(message) = serde_json::from_value::<crate::neutral::Message>(message.clone()) else { continue };
        for text in content_texts(&message) {
            let hex = crate::archive::store::hex(&crate::archive::store::sha256(text.as_bytes()));
            full.push((hex[..crate::compact::markers::CONTENT_ID_HEX].to_owned(), hex[..GATEWAY_HASH_HEX].to_owned()));
        }
    }
    rewrite_strings(messages, &|text| {
        // Most strings name no content.
        crate::compact::markers::content_ids_in(text).next()?;
        let mut out = String::with_capacity(text.len() + 64);
        let mut rest = text;
        while let Some(id) = crate::compact::markers::content_ids_in(rest).next() {
            let end = id.as_ptr() as usize - rest.as_ptr() as usize + id.len();
            out.push_str(&rest[..end]);
            if let Some((_, hash)) = full.iter().find(|(short, _)| short == id) {
                out.push_str(" hash=");
                out.push_str(hash);
            }
            rest = &rest[end..];
        }
        out.push_str(rest);
        Some(out)
    });
}

/// Replace every string in `value` that `rewrite` changes.
fn rewrite_strings(value: &mut Value, rewrite: &dyn Fn(&str) -> Option<String>) {
    match value {
        Value::String(text) => {
            if let Some(new) = rewrite(text) {
                *text = new;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| rewrite_strings(item, rewrite)),
        Value::Object(map) => map.values_mut().for_each(|item| rewrite_strings(item, rewrite)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::markers::content_id;

    #[test]
    fn gateway_hashes_follow_each_id_they_resolve() {
        let output = "line one\nline two";
        let id = content_id(output);
        let raw = vec![json!({"role": "tool", "tool_call_id": "c1", "content": output})];
        let mut messages = json!([{"role": "tool", "tool_call_id": "c1", "content": format!("[tool: x → ok; {id}]")}]);
        add_gateway_hashes(&mut messages, &raw);
        let full = crate::archive::store::hex(&crate::archive::store::sha256(output.as_bytes()));
        assert_eq!(messages[0]["content"], format!("[tool: x → ok; {id} hash={}]", &full[..24]));
        // An id no raw text has is left as it is.
        let mut other = json!(["see pare:0123456789ab"]);
        add_gateway_hashes(&mut other, &raw);
        assert_eq!(other[0], "see pare:0123456789ab");
    }
}
