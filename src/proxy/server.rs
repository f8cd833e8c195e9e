//! The listening side: accept connections (HTTP/1.1 and h2c), serve each with the request handler,
//! and on shutdown stop accepting and let in-flight exchanges finish within the grace period.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use prometheus_client::registry::Registry;

use http::HeaderValue;

use super::guard::{Guard, Keys, Peer};
use super::handler;
use super::limits::{self, Activity, BufferBudget, ConnectionTimeouts, Tracked};
use super::metrics::Metrics;
use super::state::Proxy;
use super::token::OwnerToken;
use super::upstream::{Upstream, UpstreamError};
use crate::config::Config;
use crate::pipeline::Pipeline;

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(
        "listen address {addr} is not loopback; set server.allow_non_loopback and server.auth_token to expose pare"
    )]
    NotLoopback { addr: SocketAddr },
    #[error("server.allow_non_loopback needs server.auth_token: pare forwards the agent's credentials")]
    MissingToken,
    #[error("listen address {addr:?} is not host:port ({cause})")]
    BadListen { addr: String, cause: String },
    #[error(transparent)]
    Token(#[from] super::token::TokenError),
    #[error("upstream {url} is pare itself (it resolves to {addr}, where pare listens): set the model server's URL")]
    UpstreamIsSelf { url: String, addr: SocketAddr },
}

/// Bind the listening socket for `server.listen` (or an override), refusing a non-loopback address
/// unless the configuration explicitly allows it with an inbound token.
pub async fn bind(addr: &str, config: &Config) -> Result<TcpListener, ServeError> {
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| ServeError::BadListen { addr: addr.to_owned(), cause: e.to_string() })?
        .collect();
    for candidate in &resolved {
        check_exposure(*candidate, config)?;
    }
    TcpListener::bind(resolved.as_slice()).await.map_err(|source| ServeError::Bind { addr: addr.to_owned(), source })
}

/// Loopback is always fine; anything else needs `server.allow_non_loopback` and `server.auth_token`.
pub fn check_exposure(addr: SocketAddr, config: &Config) -> Result<(), ServeError> {
    if addr.ip().is_loopback() {
        return Ok(());
    }
    if !config.server.allow_non_loopback {
        return Err(ServeError::NotLoopback { addr });
    }
    if config.server.auth_token.as_deref().is_none_or(str::is_empty) {
        return Err(ServeError::MissingToken);
    }
    Ok(())
}

/// Serve on `listener` until `shutdown` resolves, then drain in-flight exchanges for at most
/// `server.shutdown_grace_secs` and return.
pub async fn run<F>(
    listener: TcpListener,
    config: Arc<Config>,
    pipeline: Arc<Pipeline>,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()>,
{
    run_with_registry(listener, config, pipeline, Registry::default(), shutdown).await
}

/// [`run`], with metrics other parts of pare registered in `registry` served on `/_pare/metrics`
/// next to the proxy's own.
pub async fn run_with_registry<F>(
    listener: TcpListener,
    config: Arc<Config>,
    pipeline: Arc<Pipeline>,
    registry: Registry,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()>,
{
    let upstream = Upstream::new(&config.upstream)?;
    if let Ok(local) = listener.local_addr() {
        refuse_self_upstream(&upstream, local).await?;
    }
    let grace = Duration::from_secs(config.server.shutdown_grace_secs);
    let builder = connection_builder(&config);
    let metrics = Arc::new(Metrics::new(registry, pipeline.clone()));
    let ui = pipeline.archive().map(|archive| {
        Arc::new(crate::ui::Ui::new(archive.location().clone()).with_prices(Arc::clone(pipeline.prices())))
    });
    let guard = Guard::new(&config.server.allowed_hosts, &config.server.allowed_origins);
    let owner = OwnerToken::for_serve(&config, pipeline.archive().map(|archive| archive.location()))?;
    let local_addr = listener.local_addr().ok();
    let keys = Keys::new(&owner.token, config.server.auth_token.is_some(), local_addr.map_or(0, |addr| addr.port()));
    let buffers = BufferBudget::new(config.server.max_buffered_bytes);
    let timeouts = ConnectionTimeouts::from_config(&config.server);
    let via = HeaderValue::from_str(&ulid::Ulid::generate().to_string()).expect("a ulid is a header value");
    let proxy = Arc::new(Proxy {
        config,
        pipeline,
        upstream,
        metrics,
        ui,
        finishing: Arc::default(),
        guard,
        keys,
        buffers,
        via,
        decoders: tokio::sync::Semaphore::new(crate::config::default_worker_threads()),
        greps: tokio::sync::Semaphore::new(super::retrieve::MAX_GREPS),
        probe: Default::default(),
        gateway: Default::default(),
    });
    let graceful = GracefulShutdown::new();
    if let Ok(addr) = listener.local_addr() {
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        let compaction = &proxy.config.compaction;
        tracing::info!(
            %addr,
            upstream = %proxy.upstream.base.display(),
            workers,
            mode = format!("{:?}", compaction.mode).to_lowercase(),
            pack = %compaction.pack,
            windows = proxy.pipeline.window_sources().as_deref().unwrap_or("none (compaction off)"),
            archive = %proxy.pipeline.archive().map_or_else(|| "off".to_owned(), |a| a.location().to_string()),
            "pare listening"
        );
        announce(&owner, addr);
    }

    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Usually out of file descriptors: back off briefly instead of spinning.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let proxy = proxy.clone();
                let activity = Activity::new();
                let requests = activity.clone();
                let service = service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(Peer(peer));
                    let proxy = proxy.clone();
                    let in_flight = requests.begin();
                    async move {
                        let response = handler::handle(proxy, request).await;
                        Ok::<_, Infallible>(response.map(|body| Tracked::new(body, in_flight)))
                    }
                });
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                // Boxed as a `dyn Future + Send`: proving the connection `Send` inside `watch`
                // trips rustc's higher-ranked inference on hyper's error type.
                let connection: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(graceful.watch(connection));
                tokio::spawn(async move {
                    match limits::watch(connection, activity, timeouts).await {
                        Some(Err(err)) => tracing::debug!(%peer, error = %err, "connection ended with an error"),
                        Some(Ok(())) => {}
                        None => tracing::debug!(%peer, "closed a connection without a request in flight"),
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(connections = graceful.count(), grace_secs = grace.as_secs(), "shutting down; draining connections");
    let deadline = tokio::time::Instant::now() + grace;
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections drained"),
        () = tokio::time::sleep_until(deadline) => tracing::warn!("grace period over; closing the remaining connections"),
    }
    // The exchanges that ended are recorded before the caller closes the archive.
    if tokio::time::timeout_at(deadline, proxy.finishing.settled()).await.is_err() {
        tracing::warn!("grace period over; exchanges still being recorded");
    }
    Ok(())
}

/// Say once, at start, where the audit UI is: its URL with the token pare made or read (opening
/// it sets the cookie), else without (a configured token is the user's to type).
fn announce(owner: &OwnerToken, addr: SocketAddr) {
    let shown = if addr.ip().is_unspecified() { SocketAddr::new([127, 0, 0, 1].into(), addr.port()) } else { addr };
    match owner.file() {
        Some(file) => tracing::info!(
            url = %owner.ui_url(shown),
            token_file = %file.display(),
            "the audit UI, pare's endpoints and the gateway need the owner token: open this URL, or send the file's token in x-pare-token"
        ),
        None => {
            tracing::info!(url = %owner.ui_url(shown), "the audit UI, pare's endpoints and the gateway need the owner token")
        }
    }
}

/// Refuse an upstream that resolves to the address pare listens on (its port on a loopback or
/// the listening IP): every request would come back to pare until descriptors run out. Loops
/// through another hop are caught per request ([`super::state::VIA_HEADER`]).
async fn refuse_self_upstream(upstream: &Upstream, local: SocketAddr) -> Result<(), ServeError> {
    let Some((host, port)) = upstream.base.authority() else { return Ok(()) };
    if port != local.port() {
        return Ok(());
    }
    let Ok(resolved) = tokio::net::lookup_host((host.as_str(), port)).await else { return Ok(()) };
    for addr in resolved {
        let same = addr.ip() == local.ip()
            || (local.ip().is_unspecified() && (addr.ip().is_loopback() || addr.ip().is_unspecified()))
            || (addr.ip().is_unspecified() && local.ip().is_loopback());
        if same {
            return Err(ServeError::UpstreamIsSelf { url: upstream.base.display().to_owned(), addr });
        }
    }
    Ok(())
}

/// The HTTP/1.1 and HTTP/2 server settings every pare listener uses (the proxy and `pare ui`).
pub fn connection_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let header_timeout = Duration::from_secs(config.server.header_read_timeout_secs.max(1));
    let mut http1 = builder.http1();
    // hyper's read buffer (~400 KB) bounds a head's memory; the handler enforces
    // server.max_header_bytes with an OpenAI-shaped 431. Shrinking the buffer would slow large bodies.
    http1.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    // hyper keeps up to 100 headers on the stack; any other limit moves them to the heap.
    if config.server.max_headers != 100 {
        http1.max_headers(config.server.max_headers);
    }
    let header_list = u32::try_from(config.server.max_header_bytes).unwrap_or(u32::MAX);
    builder.http2().timer(TokioTimer::new()).max_header_list_size(header_list);
    builder
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_loopback_needs_both_the_flag_and_a_token() {
        let mut config = Config::default();
        let public: SocketAddr = "0.0.0.0:8787".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8787".parse().unwrap();
        let local6: SocketAddr = "[::1]:8787".parse().unwrap();
        assert!(check_exposure(local, &config).is_ok());
        assert!(check_exposure(local6, &config).is_ok());
        assert!(matches!(check_exposure(public, &config), Err(ServeError::NotLoopback { .. })));
        config.server.allow_non_loopback = true;
        assert!(matches!(check_exposure(public, &config), Err(ServeError::MissingToken)));
        config.server.auth_token = Some("s3cret-s3cret-s3cret".into());
        assert!(check_exposure(public, &config).is_ok());
    }
}
