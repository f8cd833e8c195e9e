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

use super::guard::{Guard, token_matches};
use super::limits::{self, Activity, ConnectionTimeouts, Tracked};
use super::upstream::PARE_TOKEN_HEADER;
use crate::config::Config;
use crate::ui::{PREFIX, Ui, UiBody, respond};

/// Serve the UI alone (`pare ui`) until `shutdown` resolves, with the proxy's connection limits
/// (header and idle timeouts from accept) and its `Host`/`Origin` guard. With
/// `server.auth_token`, every request must carry it in `x-pare-token`, as pare serve's own
/// endpoints do.
pub async fn run<F: Future<Output = ()>>(listener: TcpListener, ui: Arc<Ui>, config: &Config, shutdown: F) {
    let builder = super::server::connection_builder(config);
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
        && !token_matches(parts.headers.get(PARE_TOKEN_HEADER), token)
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
