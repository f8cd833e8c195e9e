//! pare's own endpoints under `/_pare/` (never forwarded upstream): `GET /_pare/health` (is the
//! upstream reachable, is the archive writable?), `GET /_pare/metrics` (Prometheus, OpenMetrics text),
//! `GET /_pare/retrieve/{id}` and the MCP server at `/_pare/mcp` ([`super::retrieve`],
//! [`super::mcp`]); and the gateway endpoints `POST /v1/compress`, `GET /v1/retrieve/{hash}`.
//!
//! Health is the one endpoint answered without a token; without it (but to a local caller when
//! `server.auth_token` is unset) it says only whether pare is ok, not where its upstream and
//! archive are (`super::guard::Keys`). Its
//! upstream probe is one TCP connection at most every [`super::upstream::PROBE_TTL`], however often it is asked.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};

use super::error::{ProxyError, json_response, method_not_allowed};
use super::state::Proxy;
use super::{mcp, metrics, paths, retrieve};

/// Longest the health check waits for a TCP connection to the upstream.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the endpoint at `path` reads the request's body.
pub fn takes_body(method: &Method, path: &str) -> bool {
    *method == Method::POST && (path == paths::MCP_PATH || path == paths::COMPRESS_PATH)
}

/// Whether the endpoint at `path` compacts the body it reads (the gateway's compress): its
/// working set is charged to the request budget before it starts.
pub fn compacts(method: &Method, path: &str) -> bool {
    *method == Method::POST && path == paths::COMPRESS_PATH
}

/// Answer a request to one of pare's endpoints; `body` is read only for those that take one
/// ([`takes_body`]), empty otherwise; `health_details`: health may say where the upstream and the
/// archive are.
pub async fn handle(proxy: &Proxy, parts: &Parts, body: Bytes, health_details: bool) -> Response<Bytes> {
    let path = parts.uri.path();
    if path.starts_with(paths::RETRIEVE_PREFIX) {
        return match parts.method {
            Method::GET => retrieve::get(proxy, parts).await,
            _ => method_not_allowed("GET"),
        };
    }
    if path.starts_with(paths::GATEWAY_RETRIEVE_PREFIX) {
        return match parts.method {
            Method::GET => retrieve::gateway_get(proxy, parts).await,
            _ => method_not_allowed("GET"),
        };
    }
    if path == paths::COMPRESS_PATH {
        return match parts.method {
            Method::POST => retrieve::gateway_compress(proxy, parts, body).await,
            _ => method_not_allowed("POST"),
        };
    }
    if path == paths::MCP_PATH {
        return mcp::handle(proxy, parts, body).await;
    }
    match (&parts.method, path) {
        (&Method::GET | &Method::HEAD, paths::HEALTH_PATH) => health(proxy, health_details).await,
        (&Method::GET, paths::METRICS_PATH) => scrape(proxy),
        _ => ProxyError::NotFound { path: parts.uri.path().to_owned() }.to_response(),
    }
}

/// Always 200 while pare itself runs (a down upstream is no reason to restart pare); `status`
/// says `degraded` when the upstream does not accept TCP connections or the archive cannot write.
/// The details (upstream URL, archive path, memory) only for an `authorized` caller.
async fn health(proxy: &Proxy, authorized: bool) -> Response<Bytes> {
    let timeout = proxy.upstream.connect_timeout().min(PROBE_TIMEOUT);
    let probe = proxy.probe.run(proxy.upstream.base.authority(), timeout).await;
    let archive = proxy.pipeline.archive().map(|archive| archive.health());
    let archive_ok = archive.as_ref().is_none_or(|health| health.writable);
    let status = if probe.is_ok() && archive_ok { "ok" } else { "degraded" };
    if !authorized {
        return json_response(
            StatusCode::OK,
            &serde_json::json!({ "status": status, "version": env!("CARGO_PKG_VERSION") }),
        );
    }
    let url = proxy.upstream.base.display();
    let upstream = match &probe {
        Ok(connect_ms) => serde_json::json!({ "url": url, "reachable": true, "connect_ms": connect_ms }),
        Err(error) => serde_json::json!({ "url": url, "reachable": false, "error": error }),
    };
    let mut body = serde_json::json!({
        "status": status,
        "version": env!("CARGO_PKG_VERSION"),
        "upstream": upstream,
        "memory": proxy.pipeline.memory(),
    });
    if let Some(health) = archive {
        body["archive"] = serde_json::to_value(&health).unwrap_or(serde_json::Value::Null);
    }
    json_response(StatusCode::OK, &body)
}

fn scrape(proxy: &Proxy) -> Response<Bytes> {
    match proxy.metrics.encode() {
        Ok(text) => {
            let mut response = Response::new(Bytes::from(text));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(metrics::CONTENT_TYPE));
            response
        }
        Err(_) => ProxyError::Internal { cause: "cannot encode the metrics".into() }.to_response(),
    }
}
