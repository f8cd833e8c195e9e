//! HTTP for the audit UI: turning a [`Reply`] into a response (exports streamed from the blocking
//! pool as they are written), and the small server `pare ui` runs over an archive alone.

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::{ExportWriter, PREFIX, Payload, Reply, Ui};
use crate::config::Config;
use crate::proxy::body::BoxError;
use crate::proxy::guard::Guard;
use crate::proxy::limits::{self, Activity, ConnectionTimeouts, Tracked};

/// The body of a UI response (the proxy's body type).
pub type UiBody = UnsyncBoxBody<Bytes, BoxError>;

/// Pages may use inline styles and nothing else: no script runs, whatever a message contains.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Answer one UI request (its path starts with [`PREFIX`]).
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

/// Serve the UI alone (`pare ui`) until `shutdown` resolves, with the proxy's connection limits
/// (header and idle timeouts from accept) and its `Host`/`Origin` guard. With
/// `server.auth_token`, every request must carry it in `x-pare-token`, as pare serve's own
/// endpoints do.
pub async fn run<F: Future<Output = ()>>(listener: TcpListener, ui: Arc<Ui>, config: &Config, shutdown: F) {
    let builder = crate::proxy::server::connection_builder(config);
    let guard = Arc::new(Guard::new(&config.server.allowed_hosts, &config.server.allowed_origins));
    let token = config.server.auth_token.clone().filter(|t| !t.trim().is_empty());
    let timeouts = ConnectionTimeouts::from_config(&config.server);
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (ui, token, guard) = (ui.clone(), token.clone(), guard.clone());
        let activity = Activity::new();
        let requests = activity.clone();
        let service = service_fn(move |request: Request<Incoming>| {
            let (ui, token, guard) = (ui.clone(), token.clone(), guard.clone());
            let in_flight = requests.begin();
            async move {
                let response = standalone(ui, &guard, token.as_deref(), request).await;
                Ok::<_, Infallible>(response.map(|body| Tracked::new(body, in_flight)))
            }
        });
        let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
        let connection: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(connection);
        tokio::spawn(async move {
            if let Some(Err(err)) = limits::watch(connection, activity, timeouts).await {
                tracing::debug!(error = %err, "connection ended with an error");
            }
        });
    }
}

async fn standalone(ui: Arc<Ui>, guard: &Guard, token: Option<&str>, request: Request<Incoming>) -> Response<UiBody> {
    let (parts, _) = request.into_parts();
    let plain = |status: StatusCode, text: String| {
        let mut response = Response::new(Full::new(Bytes::from(text)).map_err(|n| match n {}).boxed_unsync());
        *response.status_mut() = status;
        response
    };
    if let Err(refusal) = guard.check(&parts) {
        return plain(StatusCode::FORBIDDEN, format!("{refusal}\n"));
    }
    if let Some(token) = token
        && !crate::proxy::token_matches(parts.headers.get(crate::proxy::PARE_TOKEN_HEADER), token)
    {
        return plain(StatusCode::UNAUTHORIZED, "missing or wrong x-pare-token\n".into());
    }
    let path = parts.uri.path();
    if path == PREFIX || path.starts_with("/_pare/ui/") {
        return respond(ui, &parts).await;
    }
    if path == "/" {
        let mut response = plain(StatusCode::SEE_OTHER, String::new());
        response.headers_mut().insert(header::LOCATION, HeaderValue::from_static("/_pare/ui/"));
        return response;
    }
    plain(StatusCode::NOT_FOUND, "not found: the audit UI is at /_pare/ui/\n".into())
}
