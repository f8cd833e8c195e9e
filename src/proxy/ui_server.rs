//! `pare ui`: the audit UI served alone over an archive, with the proxy's connection limits and guard.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::guard::{Admission, Guard, Keys};
use super::limits::{self, Activity, ConnectionTimeouts, Tracked};
use super::token::OwnerToken;
use crate::config::Config;
use crate::ui::{PREFIX, Ui, UiBody, respond};

/// Serve the UI alone (`pare ui`) until `shutdown` resolves, with the proxy's connection limits
/// (header and idle timeouts from accept) and its `Host`/`Origin` guard. Every request must carry
/// the owner token, as pare serve's own endpoints do: in `x-pare-token`, or in the cookie that
/// opening the URL with `?token=` sets.
pub async fn run<F: Future<Output = ()>>(
    listener: TcpListener,
    ui: Arc<Ui>,
    config: &Config,
    owner: &OwnerToken,
    shutdown: F,
) {
    let builder = super::server::connection_builder(config);
    let guard = Arc::new(Guard::new(&config.server.allowed_hosts, &config.server.allowed_origins));
    let port = listener.local_addr().map_or(0, |addr| addr.port());
    let token = Arc::new(Keys::new(&owner.token, true, port));
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
                let response = standalone(ui, &guard, &token, request).await;
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

async fn standalone(ui: Arc<Ui>, guard: &Guard, keys: &Keys, request: Request<Incoming>) -> Response<UiBody> {
    let (parts, _) = request.into_parts();
    let plain = |status: StatusCode, text: String| {
        let mut response = Response::new(Full::new(Bytes::from(text)).map_err(|n| match n {}).boxed_unsync());
        *response.status_mut() = status;
        response
    };
    if let Err(refusal) = guard.check(&parts) {
        return plain(StatusCode::FORBIDDEN, format!("{refusal}\n"));
    }
    let refused = |err: super::ProxyError| plain(err.status(), format!("{err}\n"));
    if let Some(login) = keys.login(&parts).await {
        return match login {
            Ok(response) => response.map(|bytes| Full::new(bytes).map_err(|n| match n {}).boxed_unsync()),
            Err(err) => refused(err),
        };
    }
    let path = parts.uri.path();
    if path == "/" {
        let mut response = plain(StatusCode::SEE_OTHER, String::new());
        response.headers_mut().insert(header::LOCATION, HeaderValue::from_static("/_pare/ui/"));
        return response;
    }
    let admission = keys.admit(&parts, false);
    if let Err(err) = keys.pace(admission).await {
        return refused(err);
    }
    if admission != Admission::Token {
        return refused(super::ProxyError::Unauthorized);
    }
    if path == PREFIX || path.starts_with("/_pare/ui/") {
        let started = std::time::Instant::now();
        let response = respond(ui, &parts).await;
        super::access::pare_endpoint(&parts.method, path, response.status().as_u16(), started);
        return response;
    }
    plain(StatusCode::NOT_FOUND, "not found: the audit UI is at /_pare/ui/\n".into())
}
