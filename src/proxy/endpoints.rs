//! pare's own endpoints under `/_pare/` (never forwarded upstream): `GET /_pare/health` (is the
//! upstream reachable, is the archive writable?) and `GET /_pare/metrics` (Prometheus, OpenMetrics text).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};

use super::error::{ProxyError, json_response};
use super::handler::Proxy;
use super::metrics;

/// Longest the health check waits for a TCP connection to the upstream.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn handle(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    match (&parts.method, parts.uri.path()) {
        (&Method::GET | &Method::HEAD, "/_pare/health") => health(proxy).await,
        (&Method::GET, "/_pare/metrics") => scrape(proxy),
        _ => ProxyError::NotFound { path: parts.uri.path().to_owned() }.to_response(),
    }
}

/// Always 200 while pare itself runs (a down upstream is no reason to restart pare); `status`
/// says `degraded` when the upstream does not accept TCP connections or the archive cannot write.
async fn health(proxy: &Proxy) -> Response<Bytes> {
    let started = Instant::now();
    let timeout = proxy.upstream.connect_timeout().min(PROBE_TIMEOUT);
    let probe = match proxy.upstream.base.authority() {
        Some((host, port)) => {
            let connect = tokio::net::TcpStream::connect((host.as_str(), port));
            match tokio::time::timeout(timeout, connect).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no connection within {} ms", timeout.as_millis())),
            }
        }
        None => Err("the upstream url has no host".to_owned()),
    };
    let url = proxy.upstream.base.display();
    let upstream = match &probe {
        Ok(()) => serde_json::json!({
            "url": url,
            "reachable": true,
            "connect_ms": started.elapsed().as_secs_f64() * 1e3,
        }),
        Err(error) => serde_json::json!({ "url": url, "reachable": false, "error": error }),
    };
    let archive = proxy.pipeline.archive().map(|archive| archive.health());
    let archive_ok = archive.as_ref().is_none_or(|health| health.writable);
    let mut body = serde_json::json!({
        "status": if probe.is_ok() && archive_ok { "ok" } else { "degraded" },
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
