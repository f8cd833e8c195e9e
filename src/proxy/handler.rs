//! One exchange: read the request (bounded), hand chat completions to the [`crate::pipeline::Pipeline`], forward to
//! the upstream, and stream its answer back. Anything that fails here becomes an OpenAI-shaped error
//! naming who failed; a panic becomes a 500 instead of a dropped connection.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

use super::access::AccessLog;
use super::body::{BoxError, Completion, ObservedBody};
use super::error::{Dialect, ProxyError, cause_chain};
use super::guard::{self, Admission, Keys, Need, Peer};
use super::limits::{self, Share};
use super::state::{Proxy, VIA_HEADER};
use super::upstream;
use super::{endpoints, paths};
use crate::exchange::{ResponseSink, StreamEnd};
use crate::wire::Wire;

/// The body type of every response pare sends.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Answer one request. Never fails and never panics: errors and panics become error responses.
pub async fn handle<B>(proxy: Arc<Proxy>, request: Request<B>) -> Response<ProxyBody>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let dialect = Dialect::of(&path, request.headers());
    match AssertUnwindSafe(exchange(&proxy, request, started, dialect)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => {
            let what = panic_message(panic.as_ref());
            tracing::error!(panic = %what, %method, %path, "request handling panicked");
            let access = AccessLog::new(method, &path, started);
            fail(dialect, ProxyError::Internal { cause: format!("request handling panicked: {what}") }, access, None)
        }
    }
}

async fn exchange<B>(proxy: &Proxy, request: Request<B>, started: Instant, dialect: Dialect) -> Response<ProxyBody>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let path = parts.uri.path();

    let header_bytes = head_size(&parts.headers);
    if header_bytes > proxy.config.server.max_header_bytes {
        let err = ProxyError::HeadersTooLarge { size: header_bytes, limit: proxy.config.server.max_header_bytes };
        return fail(dialect, err, AccessLog::new(parts.method.clone(), path, started), None);
    }

    if let Err(refusal) = proxy.guard.check(&parts) {
        return fail(dialect, refusal.into(), AccessLog::new(parts.method.clone(), path, started), None);
    }

    let local = guard::is_local(parts.extensions.get::<Peer>().map(|peer| peer.0), &parts.headers);
    if let Some(login) = proxy.keys.login(&parts).await {
        return match login {
            Ok(response) => response.map(full),
            Err(err) => fail(dialect, err, AccessLog::new(parts.method.clone(), path, started), None),
        };
    }
    let admission = proxy.keys.admit(&parts, local);
    if let Err(err) = proxy.keys.pace(admission).await {
        return fail(dialect, err, AccessLog::new(parts.method.clone(), path, started), None);
    }
    let health_details = proxy.keys.health_details(admission, local);
    if matches!(admission, Admission::Missing | Admission::Wrong) && Keys::need(path) != Need::Nothing {
        return fail(dialect, ProxyError::Unauthorized, AccessLog::new(parts.method.clone(), path, started), None);
    }

    if path == paths::PARE_PREFIX || path.starts_with("/_pare/") || paths::is_gateway(path) {
        // What pare reports includes every exchange that ended before this request.
        proxy.finishing.settled().await;
    }
    if path == crate::ui::PREFIX || path.starts_with("/_pare/ui/") {
        if let Some(ui) = &proxy.ui {
            let response = crate::ui::respond(ui.clone(), &parts).await;
            super::access::pare_endpoint(&parts.method, path, response.status().as_u16(), started);
            return response;
        }
    }
    if path == paths::PARE_PREFIX || path.starts_with("/_pare/") || paths::is_gateway(path) {
        // The endpoints that read a body (MCP, the gateway's compress) read it as every request is
        // read, and hold it in the request budget until they have answered; the gateway's compress
        // holds its compaction's working set too, from before it starts.
        let mut body_bytes = Bytes::new();
        let mut share = proxy.buffers.share();
        if endpoints::takes_body(&parts.method, path) {
            let stall = Duration::from_secs(proxy.config.server.body_read_timeout_secs.max(1));
            match read_body(body, &parts.headers, proxy.config.server.max_body, stall, &mut share).await {
                Ok(read) => body_bytes = read,
                Err(err) => return fail(dialect, err, AccessLog::new(parts.method.clone(), path, started), None),
            }
        }
        if endpoints::compacts(&parts.method, path) && !limits::charge_working_set(&mut share, &body_bytes) {
            let err = ProxyError::Busy { limit: proxy.buffers.limit() };
            return fail(dialect, err, AccessLog::new(parts.method.clone(), path, started), None);
        }
        let response = endpoints::handle(proxy, &parts, body_bytes, health_details).await;
        drop(share);
        super::access::pare_endpoint(&parts.method, path, response.status().as_u16(), started);
        return response.map(full);
    }

    let mut access = AccessLog::new(parts.method.clone(), path, started).with_metrics(proxy.metrics.clone());

    // pare compacts HTTP requests only: a WebSocket upgrade (Codex's Responses transport) is refused
    // with 426, on which Codex falls back to HTTP at once, for the session, without a retry.
    if asks_for_websocket(&parts.headers) {
        return fail(dialect, ProxyError::WebSocket { path: path.to_owned() }, access, None);
    }

    if came_back(&parts.headers, &proxy.via) {
        return fail(dialect, ProxyError::Loop { url: proxy.upstream.base.display().to_owned() }, access, None);
    }

    let mut share = proxy.buffers.share();
    let stall = Duration::from_secs(proxy.config.server.body_read_timeout_secs.max(1));
    let raw = match read_body(body, &parts.headers, proxy.config.server.max_body, stall, &mut share).await {
        Ok(raw) => raw,
        Err(err) => return fail(dialect, err, access, None),
    };
    let body_read = Instant::now();

    // A request pare compacts: a JSON `POST` to a path of a wire format it reads, its body readable
    // (plain, or compressed in an encoding pare decodes when the config lets it).
    let mut wire = Wire::of_path(path).filter(|_| parts.method == Method::POST && is_json_ish(&parts.headers));
    let mut raw = raw;
    let mut forward_headers = None;
    if wire.is_some() && parts.headers.contains_key(header::CONTENT_ENCODING) {
        let decoded = {
            let (headers, raw) = (parts.headers.clone(), raw.clone());
            let (enabled, limit) = (proxy.config.compaction.decode_request_bodies, proxy.config.server.max_body);
            // Decoding is CPU work of up to server.max_body bytes: off the threads that serve
            // connections, and at most `decoders` at once, so that a burst of large compressed
            // bodies leaves the other cores to everything else.
            let _permit = proxy.decoders.acquire().await;
            tokio::task::spawn_blocking(move || decode_body(&headers, &raw, enabled, limit))
                .await
                .unwrap_or(Err("decoding the body failed"))
        };
        if let Ok(decoded) = &decoded
            && !share.grow(decoded.len() as u64)
        {
            return fail(dialect, ProxyError::Busy { limit: proxy.buffers.limit() }, access, None);
        }
        match decoded {
            Ok(decoded) => {
                raw = decoded;
                let mut headers = parts.headers.clone();
                headers.remove(header::CONTENT_ENCODING);
                forward_headers = Some(headers);
            }
            Err(why) => {
                access.skipped = Some(format!("compressed body forwarded as sent, not archived: {why}"));
                wire = None;
            }
        }
    }
    let intercepted = wire.is_some();
    let mut sink: Option<Box<dyn ResponseSink>> = None;
    let mut late_summary = None;
    let forward = if let Some(wire) = wire {
        // A Gemini `?key=` is the `x-goog-api-key` it stands for: the session tracker binds a
        // session to it (the archive never stores it, as it never stores the header).
        let with_query_key = query_key(parts.uri.query()).map(|key| {
            let mut headers = parts.headers.clone();
            headers.append("x-goog-api-key", key);
            headers
        });
        let headers = with_query_key.as_ref().unwrap_or(&parts.headers);
        // Compaction's working set is held in the budget from before it starts to its end (the
        // new messages' late count included): a body that does not fit beside the others gets 503
        // before anything of it is archived.
        if !limits::charge_working_set(&mut share, &raw) {
            return fail(dialect, ProxyError::Busy { limit: proxy.buffers.limit() }, access, None);
        }
        let prepared = proxy.pipeline.prepare_at(wire, parts.method.as_str(), path, headers, raw).await;
        access.summary = prepared.summary;
        access.session = prepared.session;
        access.model = prepared.model;
        access.skipped = prepared.skipped;
        late_summary = prepared.late_summary;
        sink = prepared.sink;
        prepared.body
    } else {
        raw
    };

    let url = proxy.upstream.base.map(path, parts.uri.query());
    let mut headers =
        upstream::request_headers(forward_headers.as_ref().unwrap_or(&parts.headers), proxy.upstream.api_key());
    headers.append(VIA_HEADER, proxy.via.clone());
    headers.remove(crate::pipeline::BYPASS_HEADER);
    let send_body = (!forward.is_empty() || had_body(&parts.headers)).then_some(forward);
    let dispatched = Instant::now();
    access.pare = dispatched - body_read;

    let sent = proxy.upstream.send(parts.method.clone(), &url, headers, send_body).await;
    let head_received = Instant::now();
    // The new messages were counted while the upstream worked: the headers and the log line carry
    // the exact counts.
    if let Some(late) = late_summary
        && let Ok(summary) = late.await
    {
        access.summary = Some(summary);
    }
    // The request went out whole (or failed) and its compaction is over: its bytes are no longer
    // held for it.
    drop(share);
    let response = match sent {
        Ok(response) => response,
        Err(err) => return fail(dialect, err, access, sink),
    };
    access.upstream = Some(head_received - dispatched);
    access.status = response.status().as_u16();

    let status = response.status();
    let mut headers = upstream::response_headers(response.headers());
    if let Some(sink) = sink.as_mut() {
        sink.head(status.as_u16(), &headers);
    }
    if intercepted {
        add_pare_headers(&mut headers, &access);
    }
    let upstream_body = reqwest::Body::from(response);
    access.pare += head_received.elapsed();
    let completion = Completion::new(sink, access).deferred_to(Arc::clone(&proxy.finishing));
    let body = ObservedBody::new(upstream_body, completion);
    let mut out = Response::new(body.boxed_unsync());
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// The value of a `key` query parameter (a Gemini API key), as a header value.
fn query_key(query: Option<&str>) -> Option<HeaderValue> {
    let pairs = crate::ui::form_urlencoded_pairs(query?);
    pairs.into_iter().find(|(name, _)| name == "key").and_then(|(_, key)| HeaderValue::from_str(&key).ok())
}

/// Read the whole request body, refusing more than `limit` bytes (early from `Content-Length`, and
/// while reading for bodies that do not declare their length), a body that sends nothing for
/// `stall`, and bytes that `share` cannot hold within the global buffer budget.
async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    limit: u64,
    stall: Duration,
    share: &mut Share,
) -> Result<Bytes, ProxyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if let Some(size) = content_length(headers)
        && size > limit
    {
        return Err(ProxyError::BodyTooLarge { size, limit });
    }
    let busy = |share: &Share| ProxyError::Busy { limit: share.budget_limit() };
    tokio::pin!(body);
    let deadline = tokio::time::sleep(stall);
    tokio::pin!(deadline);
    let (mut chunks, mut total) = (Vec::new(), 0u64);
    loop {
        let frame = tokio::select! {
            biased;
            frame = body.frame() => frame,
            () = &mut deadline => return Err(ProxyError::BodyStalled { secs: stall.as_secs() }),
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|err| ProxyError::ClientBody { cause: cause_chain(&*err.into()) })?;
        let Ok(data) = frame.into_data() else { continue };
        if data.is_empty() {
            continue;
        }
        total += data.len() as u64;
        if total > limit {
            return Err(ProxyError::BodyTooLargeStreamed { limit });
        }
        if !share.grow(data.len() as u64) {
            return Err(busy(share));
        }
        chunks.push(data);
        deadline.as_mut().reset(tokio::time::Instant::now() + stall);
    }
    Ok(limits::join(chunks, usize::try_from(total).unwrap_or(usize::MAX)))
}

/// Whether the request asks to switch the connection to WebSocket (`Upgrade: websocket`, any case,
/// possibly among other protocols).
fn asks_for_websocket(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::UPGRADE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|protocol| protocol.trim().split('/').next().is_some_and(|name| name.eq_ignore_ascii_case("websocket")))
}

/// Whether this pare's id is among the request's [`VIA_HEADER`] values.
fn came_back(headers: &HeaderMap, via: &HeaderValue) -> bool {
    headers
        .get_all(VIA_HEADER)
        .iter()
        .any(|value| value.to_str().is_ok_and(|text| text.split(',').any(|id| id.trim().as_bytes() == via.as_bytes())))
}

/// A request body sent with `content-encoding: zstd` or `gzip`, decoded (at most `limit` bytes).
/// `Err` says why it is passed through as it is: decoding is off, another encoding, a corrupt or
/// over-limit body.
fn decode_body(headers: &HeaderMap, raw: &Bytes, enabled: bool, limit: u64) -> Result<Bytes, &'static str> {
    use std::io::Read;
    if !enabled {
        return Err("compaction.decode_request_bodies is false");
    }
    let encoding = headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()).unwrap_or("");
    let reader: Box<dyn Read + '_> = match encoding.trim().to_ascii_lowercase().as_str() {
        "zstd" => Box::new(zstd::stream::read::Decoder::new(&raw[..]).map_err(|_| "corrupt zstd body")?),
        "gzip" | "x-gzip" => Box::new(flate2::read::GzDecoder::new(&raw[..])),
        _ => return Err("an encoding pare does not decode"),
    };
    let mut decoded = Vec::new();
    reader.take(limit.saturating_add(1)).read_to_end(&mut decoded).map_err(|_| "corrupt compressed body")?;
    if decoded.len() as u64 > limit {
        return Err("decoded body over server.max_body");
    }
    Ok(Bytes::from(decoded))
}

/// The size of the headers as sent on the wire (`name: value\r\n` each).
fn head_size(headers: &HeaderMap) -> usize {
    headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 4).sum()
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

fn had_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::CONTENT_LENGTH) || headers.contains_key(header::TRANSFER_ENCODING)
}

/// A chat body pare may parse: declared JSON, or no content type at all (some clients omit it).
fn is_json_ish(headers: &HeaderMap) -> bool {
    match headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
        None => true,
        Some(content_type) => content_type.to_ascii_lowercase().contains("json"),
    }
}

fn add_pare_headers(headers: &mut HeaderMap, access: &AccessLog) {
    if let Some(summary) = &access.summary {
        headers.insert("x-pare-tokens-raw", HeaderValue::from(summary.tokens_raw));
        headers.insert("x-pare-tokens-forwarded", HeaderValue::from(summary.tokens_forwarded));
        headers.insert("x-pare-epoch", HeaderValue::from(summary.epoch));
        if let Some(report) = &summary.report {
            headers.insert("x-pare-window", HeaderValue::from(report.window));
            if let Some(source) = report.window_source {
                headers.insert("x-pare-window-source", HeaderValue::from_static(source.name()));
            }
        }
        if summary.over_window {
            headers.insert("x-pare-over-window", HeaderValue::from_static("true"));
        }
    }
    if let Some(value) = access.session.as_deref().and_then(|s| HeaderValue::from_str(s).ok()) {
        headers.insert("x-pare-session", value);
    }
}

/// Answer with pare's own error in the client's `dialect`, finishing the sink and logging the exchange.
fn fail(
    dialect: Dialect,
    err: ProxyError,
    mut access: AccessLog,
    sink: Option<Box<dyn ResponseSink>>,
) -> Response<ProxyBody> {
    tracing::warn!(error = %err, culprit = ?err.culprit(), method = %access.method, path = %access.path, "request failed");
    access.status = err.status().as_u16();
    let end = StreamEnd::NoResponse(err.to_string());
    if let Some(sink) = sink {
        sink.finish(end.clone());
    }
    access.emit(&end);
    err.to_response_in(dialect).map(full)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "unknown panic".to_owned()
    }
}

fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use http_body::Frame;

    use super::*;
    use crate::proxy::limits::BufferBudget;

    const STALL: Duration = Duration::from_secs(30);

    fn share(limit: u64) -> Share {
        BufferBudget::new(limit).share()
    }

    #[tokio::test]
    async fn declared_length_over_the_limit_is_refused_before_reading() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2048"));
        let body = Full::new(Bytes::from_static(b"x"));
        let err = read_body(body, &headers, 1024, STALL, &mut share(1 << 20)).await.unwrap_err();
        assert_eq!(err, ProxyError::BodyTooLarge { size: 2048, limit: 1024 });
    }

    #[tokio::test]
    async fn undeclared_length_over_the_limit_is_refused_while_reading() {
        let body = Full::new(Bytes::from(vec![b'x'; 1025]));
        let err = read_body(body, &HeaderMap::new(), 1024, STALL, &mut share(1 << 20)).await.unwrap_err();
        assert_eq!(err, ProxyError::BodyTooLargeStreamed { limit: 1024 });
        let body = Full::new(Bytes::from(vec![b'x'; 1024]));
        let ok = read_body(body, &HeaderMap::new(), 1024, STALL, &mut share(1 << 20)).await.unwrap();
        assert_eq!(ok.len(), 1024);
    }

    /// Regression: a body that stalled after its first bytes held its memory for as long as the
    /// client kept the connection open.
    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_sending_gets_408_after_the_stall_timeout() {
        let first = futures_util::stream::iter([Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"{\"mo")))]);
        let stalled = first.chain(futures_util::stream::pending());
        let body = http_body_util::StreamBody::new(stalled);
        let started = tokio::time::Instant::now();
        let err = read_body(body, &HeaderMap::new(), 1024, STALL, &mut share(1 << 20)).await.unwrap_err();
        assert_eq!(err, ProxyError::BodyStalled { secs: 30 });
        assert_eq!(err.status().as_u16(), 408);
        assert_eq!(started.elapsed(), STALL);
    }

    /// Bodies being read share one budget: a body that does not fit beside the others gets 503
    /// with retry-after, and what a finished exchange held is given back.
    #[tokio::test]
    async fn bodies_over_the_global_buffer_budget_get_503() {
        let budget = BufferBudget::new(1500);
        let mut holding = budget.share();
        let body = Full::new(Bytes::from(vec![b'x'; 1000]));
        read_body(body, &HeaderMap::new(), 1024, STALL, &mut holding).await.unwrap();
        let mut second = budget.share();
        let body = Full::new(Bytes::from(vec![b'x'; 1000]));
        let err = read_body(body, &HeaderMap::new(), 1024, STALL, &mut second).await.unwrap_err();
        assert_eq!(err, ProxyError::Busy { limit: 1500 });
        let response = err.to_response();
        assert_eq!(response.status().as_u16(), 503);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        drop((holding, second));
        assert_eq!(budget.held(), 0);
        let body = Full::new(Bytes::from(vec![b'x'; 1000]));
        read_body(body, &HeaderMap::new(), 1024, STALL, &mut budget.share()).await.unwrap();
    }

    #[test]
    fn a_request_naming_this_pare_in_via_came_back() {
        let me = HeaderValue::from_static("01JDXAMPLE");
        let mut headers = HeaderMap::new();
        assert!(!came_back(&headers, &me));
        headers.append(VIA_HEADER, HeaderValue::from_static("01OTHER"));
        assert!(!came_back(&headers, &me), "another pare on the way is no loop");
        headers.append(VIA_HEADER, HeaderValue::from_static("01THIRD, 01JDXAMPLE"));
        assert!(came_back(&headers, &me));
    }

    #[test]
    fn zstd_and_gzip_bodies_are_decoded_within_the_limit() {
        use std::io::Write;
        let body = br#"{"model":"m","input":"hello"}"#;
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("zstd"));
        let zstd = Bytes::from(zstd::encode_all(&body[..], 3).unwrap());
        assert_eq!(decode_body(&headers, &zstd, true, 1024).unwrap(), &body[..]);
        assert!(decode_body(&headers, &zstd, false, 1024).is_err());
        assert_eq!(decode_body(&headers, &zstd, true, 10), Err("decoded body over server.max_body"));
        assert!(decode_body(&headers, &Bytes::from_static(b"not zstd"), true, 1024).is_err());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(body).unwrap();
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert_eq!(decode_body(&headers, &Bytes::from(gz.finish().unwrap()), true, 1024).unwrap(), &body[..]);
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert!(decode_body(&headers, &Bytes::from_static(body), true, 1024).is_err());
    }

    #[test]
    fn websocket_upgrades_are_recognized_in_any_case_and_among_others() {
        let mut headers = HeaderMap::new();
        assert!(!asks_for_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        assert!(!asks_for_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("WebSocket"));
        assert!(asks_for_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("h2c, websocket/13"));
        assert!(asks_for_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websockets"));
        assert!(!asks_for_websocket(&headers));
    }

    #[test]
    fn json_ish_content_types() {
        let mut headers = HeaderMap::new();
        assert!(is_json_ish(&headers));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
        assert!(is_json_ish(&headers));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("multipart/form-data; boundary=x"));
        assert!(!is_json_ish(&headers));
    }
}
