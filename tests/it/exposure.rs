//! Who may talk to pare, and for how long: the `Host`/`Origin` guard (DNS rebinding, cross-site
//! requests), connections bounded from accept, request bytes bounded across connections, loops
//! back to pare, and what the unauthenticated health check shows.

use std::sync::Arc;
use std::time::Duration;

use pare::archive::query::{ArchiveReader, SessionFilter};
use pare::config::Config;
use pare::pipeline::Pipeline;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::pare::{self as pare_support, config_for};
use crate::support::stub::Stub;
use crate::support::{TOKEN, bare_client, client, json as json_body, raw, within};

const CHAT_BODY: &str = r#"{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}"#;

fn archived(config: &Config, dir: &std::path::Path) -> (Arc<Config>, Arc<Pipeline>) {
    let mut config = config.clone();
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    let config = Arc::new(config);
    let archive = pare::archive::Archive::open(&config.archive);
    (config.clone(), Arc::new(Pipeline::identity(config).with_archive(archive)))
}

fn chat_head(host: &str, extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\nHost: {host}\nContent-Length: {}\nConnection: close{extra}",
        CHAT_BODY.len()
    )
}

/// Send one legitimate chat request and wait until the archive committed it, so that whatever was
/// refused before it would have been committed too.
async fn archive_settles_on_one_session(pare: &pare_support::Pare, dir: &std::path::Path) {
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let archive = pare.pipeline.archive().expect("archive on");
    within("the archive to commit the exchange", async {
        while archive.health().committed_records < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let sessions = ArchiveReader::open(dir).unwrap().sessions(&SessionFilter::default()).unwrap();
    assert_eq!(sessions.len(), 1, "only the legitimate request is archived");
}

/// Regression (DNS rebinding): pare never checked `Host`, so a page that rebound its name to
/// 127.0.0.1 read every UI page, every raw body and the SFT export, and reached the upstream.
#[tokio::test]
async fn a_rebound_host_name_is_refused_for_every_path() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    let host = format!("attacker.example:{}", pare.addr.port());
    for path in ["/_pare/ui/", "/_pare/ui/export/sft", "/_pare/health", "/_pare/metrics", "/v1/models"] {
        let response =
            raw::exchange(pare.addr, &format!("GET {path} HTTP/1.1\nHost: {host}\nConnection: close"), b"").await;
        assert_eq!(response.status, 403, "{path}");
        let body: Value = serde_json::from_slice(&response.body).unwrap();
        assert_eq!(body["error"]["code"], "host_not_allowed", "{path}");
    }
    let response = raw::exchange(pare.addr, &chat_head(&host, ""), CHAT_BODY.as_bytes()).await;
    assert_eq!(response.status, 403);
    assert!(stub.requests().is_empty(), "nothing reached the upstream");
    archive_settles_on_one_session(&pare, dir.path()).await;
    // The names pare answers to still work, and a configured one joins them.
    for host in ["localhost", "127.0.0.1", "[::1]"] {
        let response =
            raw::exchange(pare.addr, &format!("GET /v1/models HTTP/1.1\nHost: {host}\nConnection: close"), b"").await;
        assert_eq!(response.status, 200, "{host}");
    }
}

#[tokio::test]
async fn allowed_hosts_adds_a_name() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.allowed_hosts = vec!["pare.internal".into()];
    let pare = pare_support::start(config).await;
    let ok =
        raw::exchange(pare.addr, "GET /v1/models HTTP/1.1\nHost: pare.internal:8787\nConnection: close", b"").await;
    assert_eq!(ok.status, 200);
    let refused =
        raw::exchange(pare.addr, "GET /v1/models HTTP/1.1\nHost: other.internal\nConnection: close", b"").await;
    assert_eq!(refused.status, 403);
}

/// Regression: a browser's "simple" POST from any site (no JSON content type, or none at all)
/// was taken as a chat request, archived, and exported as a training row.
#[tokio::test]
async fn a_cross_site_post_is_refused_and_not_archived() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    for extra in [
        "\nOrigin: https://attacker.example",
        "\nOrigin: https://attacker.example\nContent-Type: text/plain",
        "\nOrigin: null",
    ] {
        let response = raw::exchange(pare.addr, &chat_head("127.0.0.1", extra), CHAT_BODY.as_bytes()).await;
        assert_eq!(response.status, 403, "{extra}");
        let body: Value = serde_json::from_slice(&response.body).unwrap();
        assert_eq!(body["error"]["code"], "origin_not_allowed");
    }
    assert!(stub.requests().is_empty());
    archive_settles_on_one_session(&pare, dir.path()).await;
    // A page served from this machine may call pare.
    let local =
        raw::exchange(pare.addr, &chat_head("127.0.0.1", "\nOrigin: http://localhost:3000"), CHAT_BODY.as_bytes())
            .await;
    assert_eq!(local.status, 200);
}

/// Read until pare closes the connection; fails the test if it stays open past the wait.
async fn closed_by_pare(mut stream: TcpStream) {
    let mut rest = Vec::new();
    within("pare to close the connection", stream.read_to_end(&mut rest)).await.expect("read until closed");
}

/// Regression: the header timeout started only once a connection was known to be HTTP/1, so
/// connections that sent nothing, part of the HTTP/2 preface, or the preface and SETTINGS stayed
/// open forever (1,100 of them exhausted a 1,024-descriptor limit).
#[tokio::test]
async fn connections_that_never_send_a_request_are_closed() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.header_read_timeout_secs = 1;
    let pare = pare_support::start(config).await;
    let silent = TcpStream::connect(pare.addr).await.unwrap();
    let mut partial = TcpStream::connect(pare.addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let mut settings = TcpStream::connect(pare.addr).await.unwrap();
    settings.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
    settings.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    tokio::join!(closed_by_pare(silent), closed_by_pare(partial), closed_by_pare(settings));
    assert!(stub.requests().is_empty());
}

#[tokio::test]
async fn a_keep_alive_connection_idle_past_the_idle_timeout_is_closed() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.idle_timeout_secs = 1;
    let pare = pare_support::start(config).await;
    // No `Connection: close`: the exchange returns once pare closes the idle connection.
    let response = raw::exchange(pare.addr, "GET /v1/models HTTP/1.1\nHost: localhost", b"").await;
    assert_eq!(response.status, 200);
    assert_eq!(stub.requests().len(), 1);
}

/// Regression: a request body that stopped arriving held its bytes for as long as the client kept
/// the connection open (10 such connections held 329 MB).
#[tokio::test]
async fn a_stalled_body_gets_408() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.body_read_timeout_secs = 1;
    let pare = pare_support::start(config).await;
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"model\":";
    let mut stream = TcpStream::connect(pare.addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    within("pare to answer the stalled body", stream.read_to_end(&mut response)).await.unwrap();
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_body_timeout"), "{text}");
    assert!(stub.requests().is_empty());
}

/// Request bytes are capped across connections: a body that does not fit beside a stalled one
/// gets 503 with retry-after, and once the stalled one is gone its bytes are free again.
#[tokio::test]
async fn request_bytes_over_the_global_budget_get_503_until_freed() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.max_buffered_bytes = 64 * 1024;
    let pare = pare_support::start(config).await;
    let mut stalled = TcpStream::connect(pare.addr).await.unwrap();
    let part = vec![b' '; 40 * 1024];
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 60000\r\n\r\n";
    stalled.write_all(head.as_bytes()).await.unwrap();
    stalled.write_all(&part).await.unwrap();
    let big = format!("{{\"model\":\"stub-model\",\"pad\":\"{}\",\"messages\":[]}}", "x".repeat(40 * 1024));
    let busy = within("the busy answer", async {
        loop {
            let response = client().post(pare.url("/v1/chat/completions")).body(big.clone()).send().await.unwrap();
            // Until the stalled body's bytes are read, the request may still fit.
            if response.status() == 503 {
                return response;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(busy.headers()["retry-after"], "1");
    assert_eq!(json_body(busy).await["error"]["code"], "pare_busy");
    drop(stalled);
    within("the stalled body's bytes to be freed", async {
        loop {
            let response = client().post(pare.url("/v1/chat/completions")).body(big.clone()).send().await.unwrap();
            if response.status() == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Regression: an upstream that led back to pare looped until descriptors ran out (5,258 requests
/// in 20 s). Two pares pointed at each other answer 508 at once.
#[tokio::test]
async fn a_request_that_comes_back_to_pare_gets_508() {
    let a_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let b_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (a_addr, b_addr) = (a_listener.local_addr().unwrap(), b_listener.local_addr().unwrap());
    let mut servers = Vec::new();
    for (listener, upstream) in [(a_listener, b_addr), (b_listener, a_addr)] {
        let mut config = Config::default();
        config.upstream.url = format!("http://{upstream}/v1");
        config.archive.enabled = false;
        let config = Arc::new(config);
        let pipeline = Arc::new(Pipeline::identity(config.clone()));
        servers.push(tokio::spawn(pare::proxy::run(listener, config, pipeline, std::future::pending())));
    }
    let response = client().post(format!("http://{a_addr}/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 508);
    assert_eq!(json_body(response).await["error"]["code"], "upstream_loop");
    for server in servers {
        server.abort();
    }
}

#[tokio::test]
async fn an_upstream_that_is_pare_itself_is_refused_at_start() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut config = Config::default();
    config.upstream.url = format!("http://localhost:{port}");
    config.archive.enabled = false;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::identity(config.clone()));
    let err = pare::proxy::run(listener, config, pipeline, std::future::pending()).await.unwrap_err();
    assert!(matches!(err, pare::proxy::ServeError::UpstreamIsSelf { .. }), "{err}");
    assert!(err.to_string().contains(&format!("localhost:{port}")), "{err}");
}

/// Regression: the unauthenticated health check showed the upstream URL and the archive path, and
/// opened a TCP connection to the upstream on every call.
#[tokio::test]
async fn health_without_the_token_says_only_ok_and_probes_the_upstream_once() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    let acceptor = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = upstream.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(stream);
        }
    });
    let mut config = Config::default();
    config.upstream.url = format!("http://{upstream_addr}");
    config.archive.enabled = false;
    config.server.auth_token = Some("s3cret-s3cret-s3cret".into());
    let pare = pare_support::start(config).await;
    for _ in 0..5 {
        let health = json_body(bare_client().get(pare.url("/_pare/health")).send().await.unwrap()).await;
        assert_eq!(health["status"], "ok");
        let keys: Vec<&str> = health.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["status", "version"], "{health}");
    }
    let full =
        client().get(pare.url("/_pare/health")).header("x-pare-token", "s3cret-s3cret-s3cret").send().await.unwrap();
    let full = json_body(full).await;
    assert_eq!(full["upstream"]["url"], format!("http://{upstream_addr}"));
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1, "one probe answers checks within its ttl");
    acceptor.abort();
}

/// `pare ui` has the same guard and connection limits as `pare serve`.
#[tokio::test]
async fn pare_ui_refuses_a_rebound_host_and_closes_silent_connections() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config.clone(), pipeline).await;
    archive_settles_on_one_session(&pare, dir.path()).await;
    let mut config = (*config).clone();
    config.server.header_read_timeout_secs = 1;
    let ui = Arc::new(pare::ui::Ui::new(dir.path().to_owned()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let owner = pare::proxy::token::OwnerToken::for_ui(&config, Some(dir.path())).unwrap();
    let server = tokio::spawn(async move {
        pare::proxy::ui_server::run(listener, ui, &config, &owner, std::future::pending()).await
    });
    let refused = raw::exchange(addr, "GET /_pare/ui/ HTTP/1.1\nHost: attacker.example\nConnection: close", b"").await;
    assert_eq!(refused.status, 403);
    assert!(String::from_utf8_lossy(&refused.body).contains("server.allowed_hosts"));
    let anonymous = raw::exchange(addr, "GET /_pare/ui/ HTTP/1.1\nHost: localhost\nConnection: close", b"").await;
    assert_eq!(anonymous.status, 401, "pare ui needs the owner token too");
    let head = format!("GET /_pare/ui/ HTTP/1.1\nHost: localhost\nx-pare-token: {TOKEN}\nConnection: close");
    let page = raw::exchange(addr, &head, b"").await;
    assert_eq!(page.status, 200);
    closed_by_pare(TcpStream::connect(addr).await.unwrap()).await;
    server.abort();
}

/// Regression: without `server.auth_token` (the default) every user of the machine read the audit
/// UI, any stored content and the gateway. Now they need the owner token; the agent-facing paths
/// and a local scrape of the metrics do not.
#[tokio::test]
async fn a_second_local_user_without_the_owner_token_reads_nothing() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    archive_settles_on_one_session(&pare, dir.path()).await;
    let mcp = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let compress = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let reads = [
        ("GET", "/_pare/ui/", ""),
        ("GET", "/_pare/ui/export/sft", ""),
        ("GET", "/_pare/retrieve/pare:0123456789ab", ""),
        ("POST", "/_pare/mcp", mcp),
        ("POST", "/v1/compress", compress),
        ("GET", "/v1/retrieve/0123456789ab", ""),
    ];
    for (method, path, body) in reads {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let request = |client: reqwest::Client| {
            client.request(method.clone(), pare.url(path)).header("content-type", "application/json").body(body)
        };
        let refused = request(bare_client()).send().await.unwrap();
        assert_eq!(refused.status(), 401, "{path}");
        let message = json_body(refused).await["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains("wrong pare token"), "{path}: {message}");
        let allowed = request(client()).send().await.unwrap();
        assert_ne!(allowed.status(), 401, "{path} with the token");
    }
    let bearer = bare_client().post(pare.url("/v1/compress")).bearer_auth(TOKEN).body(compress).send().await.unwrap();
    assert_eq!(bearer.status(), 200, "the gateway takes the token as a bearer key");
    let agent = bare_client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(agent.status(), 200, "the agent-facing paths need no token");
    assert_eq!(bare_client().get(pare.url("/_pare/metrics")).send().await.unwrap().status(), 200);
    let health = json_body(bare_client().get(pare.url("/_pare/health")).send().await.unwrap()).await;
    assert!(health.get("upstream").is_some(), "a local caller sees health's details: {health}");
}

/// Regression: behind a load balancer on the same host every request came from loopback, so the
/// fleet recipe served the UI and every stored prompt to anyone who reached the balancer.
#[tokio::test]
async fn a_forwarded_request_is_never_local() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&stub);
    config.server.allowed_hosts = vec!["pare.example".into()];
    let (config, pipeline) = archived(&config, dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    for forwarded in ["X-Forwarded-For: 203.0.113.7", "X-Real-IP: 203.0.113.7", "Forwarded: for=203.0.113.7"] {
        for path in ["/_pare/ui/", "/_pare/metrics"] {
            let head = format!("GET {path} HTTP/1.1\nHost: pare.example\n{forwarded}\nConnection: close");
            assert_eq!(raw::exchange(pare.addr, &head, b"").await.status, 401, "{path} {forwarded}");
        }
        let head = format!("GET /_pare/health HTTP/1.1\nHost: pare.example\n{forwarded}\nConnection: close");
        let health: Value = serde_json::from_slice(&raw::exchange(pare.addr, &head, b"").await.body).unwrap();
        assert!(health.get("upstream").is_none(), "{forwarded}: {health}");
    }
    let head = format!(
        "GET /_pare/ui/ HTTP/1.1\nHost: pare.example\nX-Forwarded-For: 203.0.113.7\nx-pare-token: {TOKEN}\nConnection: close"
    );
    assert_eq!(raw::exchange(pare.addr, &head, b"").await.status, 200);
}

/// The URL pare prints at start (`/_pare/ui/?token=…`) sets an HttpOnly, SameSite=Strict cookie for
/// `/_pare` and sends the browser to the page without the token; the cookie then reads the UI.
#[tokio::test]
async fn the_ui_url_with_the_token_sets_a_cookie() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    let login = bare_client().get(pare.url(&format!("/_pare/ui/?page=2&token={TOKEN}"))).send().await.unwrap();
    assert_eq!(login.status(), 303);
    assert_eq!(login.headers()["location"], "/_pare/ui/?page=2");
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    let name = format!("pare_token_{}={TOKEN}", pare.addr.port());
    assert_eq!(cookie, format!("{name}; Path=/_pare; HttpOnly; SameSite=Strict"));
    let page = bare_client().get(pare.url("/_pare/ui/")).header("cookie", &name).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let wrong = bare_client().get(pare.url("/_pare/ui/?token=not-the-owner-token")).send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());
    // The cookie is for pare's own pages, not the gateway.
    let gateway =
        bare_client().get(pare.url("/v1/retrieve/0123456789ab")).header("cookie", &name).send().await.unwrap();
    assert_eq!(gateway.status(), 401);
}

/// Regression: wrong tokens were answered at once, as fast as a client could guess. They now take
/// turns of `proxy::token::FAILURE_PAUSE`, while the right token is answered without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_are_answered_one_pause_at_a_time() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let started = std::time::Instant::now();
    let guesses: Vec<_> = (0..5)
        .map(|n| {
            let url = pare.url("/_pare/retrieve/pare:0123456789ab");
            tokio::spawn(async move {
                bare_client().get(url).header("x-pare-token", format!("guess-{n}-0123456789abc")).send().await.unwrap()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let right = client().get(pare.url("/_pare/retrieve/pare:0123456789ab")).send().await.unwrap();
    let right_after = started.elapsed();
    assert_ne!(right.status(), 401);
    for guess in guesses {
        assert_eq!(guess.await.unwrap().status(), 401);
    }
    let all = started.elapsed();
    let pause = pare::proxy::token::FAILURE_PAUSE;
    assert!(all >= pause * 5, "five wrong tokens answered in {all:?}");
    assert!(right_after < all, "the right token waited for the guesses: {right_after:?} of {all:?}");
}
