//! HTTP for the audit UI: turning a [`Reply`] into a response (exports streamed from the blocking
//! pool as they are written). Both servers send these: `pare serve` under `/_pare/ui/` and `pare ui`
//! (`crate::proxy::ui_server`).

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;

use super::{ExportWriter, Payload, Reply, Ui};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a UI response (the proxy's body type).
pub type UiBody = UnsyncBoxBody<Bytes, BoxError>;

/// Pages may use inline styles and nothing else: no script runs, whatever a message contains.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Answer one UI request (its path starts with [`super::PREFIX`]).
pub async fn respond(ui: Arc<Ui>, parts: &Parts) -> Response<UiBody> {
    let method = parts.method.as_str().to_owned();
    let path = parts.uri.path().to_owned();
    let query = parts.uri.query().map(str::to_owned);
    let head_only = parts.method == http::Method::HEAD;
    let reply = tokio::task::spawn_blocking(move || ui.route(&method, &path, query.as_deref())).await;
    let reply = reply.unwrap_or_else(|err| Reply {
        status: 500,
        content_type: "text/plain; charset=utf-8",
        headers: Vec::new(),
        body: Payload::Bytes(format!("the audit UI failed: {err}").into_bytes()),
    });
    into_response(reply, head_only)
}

fn into_response(reply: Reply, head_only: bool) -> Response<UiBody> {
    let body = match reply.body {
        _ if head_only => Empty::new().map_err(|never| match never {}).boxed_unsync(),
        Payload::Bytes(bytes) => Full::new(Bytes::from(bytes)).map_err(|never| match never {}).boxed_unsync(),
        Payload::Export(write) => streamed(write),
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    for (name, value) in reply.headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    response
}

/// Chunks of this size travel from the export's thread to the connection.
const CHUNK: usize = 64 * 1024;

/// Buffers what an export writes and hands it over in chunks; fails once the client is gone.
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<Result<Bytes, BoxError>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::take(&mut self.buf));
        self.tx.blocking_send(Ok(chunk)).map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

/// Run an export on the blocking pool; its output is the response body as it is written.
fn streamed(write: ExportWriter) -> UiBody {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter { tx: tx.clone(), buf: Vec::new() };
        let result = write(&mut writer).and_then(|()| Ok(writer.flush()?));
        if let Err(err) = result {
            tracing::warn!(error = %format!("{err:#}"), "export from the audit UI failed");
            let _ = tx.blocking_send(Err(format!("{err:#}").into()));
        }
    });
    let frames =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|item| (item.map(Frame::data), rx)) },
        );
    StreamBody::new(frames).boxed_unsync()
}
