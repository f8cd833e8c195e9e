//! Overhead of pare as a proxy, measured side by side against a direct call to the same zero-delay
//! stub upstream (not a timed test: numbers are printed, never asserted).
//!
//! `cargo bench --bench proxy` runs pare as a separate release process (`pare serve`) and reports:
//! added latency p50/p99 for a small and an ~850 KB chat body and the same conversation as a Responses
//! body (direct and through-pare requests interleaved, concurrency 1), streaming time-to-first-byte added, pare's CPU time per small request
//! (from `/proc/<pid>/stat`), and its resident memory idle and after the run (`/proc/<pid>/status`).
//!
//! `cargo bench --bench proxy -- load [SECONDS] [CLIENTS]` runs the load test instead: CLIENTS
//! concurrent streaming clients (default 200) for SECONDS (default 60) through pare, then the same
//! load direct, reporting errors, latency percentiles and pare's peak RSS.
//!
//! Without `--bench` (as under `cargo test --all-targets`) a few iterations run as a smoke check and
//! print no figures.
//! `PARE_BENCH_SERVE_ARGS` adds arguments to `pare serve` (e.g. `--mode off`, `--config FILE`) to
//! separate the proxy's own cost from the engine's and the archive's.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};

type StubBody = UnsyncBoxBody<Bytes, std::convert::Infallible>;

/// Whether figures are printed: only under `cargo bench` (which passes `--bench`). Under `cargo test
/// --all-targets` the bench is a debug build run as a smoke check, and its timings mean nothing.
static FIGURES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

macro_rules! figures {
    ($($arg:tt)*) => {
        if FIGURES.load(Ordering::Relaxed) {
            println!($($arg)*);
        }
    };
}

const SMALL_ANSWER: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

fn sse_chunks() -> Vec<Bytes> {
    let mut chunks = Vec::new();
    for piece in ["Hello", " from", " the", " bench", " stub."] {
        let event = json!({"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",
            "choices":[{"index":0,"delta":{"content":piece},"finish_reason":null}]});
        chunks.push(Bytes::from(format!("data: {event}\n\n")));
    }
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    chunks
}

/// The zero-delay upstream: reads the whole request, answers at once.
async fn stub_serve(request: Request<Incoming>) -> Result<Response<StubBody>, std::convert::Infallible> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let streamed = body.windows(13).any(|w| w == b"\"stream\":true");
    let mut response = if parts.uri.path().ends_with("/chat/completions") && streamed {
        let frames = sse_chunks().into_iter().map(|c| Ok(Frame::data(c)));
        let mut response = Response::new(StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync());
        response.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
        response
    } else {
        let mut response = Response::new(Full::new(Bytes::from_static(SMALL_ANSWER.as_bytes())).boxed_unsync());
        response.headers_mut().insert("content-type", "application/json".parse().unwrap());
        response
    };
    *response.status_mut() = http::StatusCode::OK;
    Ok(response)
}

async fn start_stub() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let builder = auto::Builder::new(TokioExecutor::new());
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let connection = builder.serve_connection(TokioIo::new(stream), service_fn(stub_serve)).into_owned();
            tokio::spawn(connection);
        }
    });
    addr
}

/// `pare serve` as its own process (the binary cargo built for this profile).
struct PareProcess {
    child: Child,
    addr: SocketAddr,
    _archive: tempfile::TempDir,
}

impl PareProcess {
    fn start(upstream: SocketAddr) -> PareProcess {
        let archive = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_pare"))
            .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json", "--upstream"])
            .arg(format!("http://{upstream}/v1"))
            .arg("--archive")
            .arg(archive.path())
            .args(std::env::var("PARE_BENCH_SERVE_ARGS").unwrap_or_default().split_whitespace())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pare");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("pare exited before listening").unwrap();
            let event: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            if event["message"] == "pare listening" {
                break event["addr"].as_str().unwrap().parse().unwrap();
            }
        };
        // Keep draining the log so pare never blocks on a full pipe (the log line is part of its cost).
        std::thread::spawn(move || for _ in lines.by_ref() {});
        PareProcess { child, addr, _archive: archive }
    }

    /// User + system CPU time so far.
    fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after_comm.split(' ').collect();
        // Fields 14 and 15 of stat (utime, stime) are at 11 and 12 once pid and comm are cut off.
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
    }

    /// Resident set size in KiB (`VmRSS`) and its peak (`VmHWM`).
    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

impl Drop for PareProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn small_body() -> Bytes {
    Bytes::from(
        json!({"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},
            {"role":"user","content":"Say ok."}],"temperature":0})
        .to_string(),
    )
}

/// A deterministic agent-shaped request of about 850 KB: a system prompt, a task, and many tool
/// call/result pairs whose outputs look like file reads and command output.
fn large_body() -> Bytes {
    const WORDS: [&str; 16] = [
        "fn", "let", "config", "request", "session", "archive", "return", "match", "error", "stream", "tokens",
        "upstream", "message", "=>", "{", "}",
    ];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut messages = vec![
        json!({"role":"system","content":"You are a coding agent. ".repeat(400)}),
        json!({"role":"user","content":"Refactor the proxy module and run the tests."}),
    ];
    let mut size = 0;
    let mut i = 0;
    while size < 850_000 {
        let mut output = String::new();
        for line in 0..60 {
            output.push_str(&format!("{line:4} "));
            for _ in 0..10 {
                output.push_str(WORDS[next() % WORDS.len()]);
                output.push(' ');
            }
            output.push('\n');
        }
        let id = format!("call_{i}");
        let path = format!("src/module_{i}.rs");
        messages.push(json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function",
            "function":{"name":"read_file","arguments":json!({"path":path}).to_string()}}]}));
        let result = json!({"output": output, "exit_code": 0, "error": null}).to_string();
        size += result.len() + 200;
        messages.push(json!({"role":"tool","tool_call_id":id,"content":result}));
        i += 1;
    }
    Bytes::from(json!({"model":"bench","messages":messages,"stream":false}).to_string())
}

fn stream_body() -> Bytes {
    Bytes::from(
        json!({"model":"bench","stream":true,"stream_options":{"include_usage":true},
            "messages":[{"role":"user","content":"Say hello."}]})
        .to_string(),
    )
}

async fn post(client: &reqwest::Client, addr: SocketAddr, body: &Bytes) -> Duration {
    post_to(client, addr, "/v1/chat/completions", body).await
}

async fn post_to(client: &reqwest::Client, addr: SocketAddr, path: &str, body: &Bytes) -> Duration {
    let started = Instant::now();
    let response = client
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    response.bytes().await.expect("body");
    started.elapsed()
}

/// Time to the first body chunk of a streamed answer (the rest is read but not timed).
async fn first_byte(client: &reqwest::Client, addr: SocketAddr, body: &Bytes) -> Duration {
    let started = Instant::now();
    let mut response = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("request");
    response.chunk().await.expect("chunk").expect("a first chunk");
    let elapsed = started.elapsed();
    while response.chunk().await.expect("chunk").is_some() {}
    elapsed
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

struct Pairs {
    direct: Vec<f64>,
    pare: Vec<f64>,
}

impl Pairs {
    fn report(&self, name: &str) {
        let mut direct = self.direct.clone();
        let mut pare = self.pare.clone();
        let mut added: Vec<f64> = self.pare.iter().zip(&self.direct).map(|(p, d)| p - d).collect();
        for v in [&mut direct, &mut pare, &mut added] {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        }
        figures!(
            "{name:<24} n={:<5} direct p50 {:>9.1} µs p99 {:>9.1} µs | pare p50 {:>9.1} µs p99 {:>9.1} µs | \
             added p50 {:>8.1} µs p99 {:>8.1} µs (median of paired differences {:>8.1} µs)",
            direct.len(),
            percentile(&direct, 0.5),
            percentile(&direct, 0.99),
            percentile(&pare, 0.5),
            percentile(&pare, 0.99),
            percentile(&pare, 0.5) - percentile(&direct, 0.5),
            percentile(&pare, 0.99) - percentile(&direct, 0.99),
            percentile(&added, 0.5),
        );
    }
}

/// Direct and through-pare requests interleaved (order alternating), concurrency 1.
async fn interleaved<F, Fut>(n: usize, stub: SocketAddr, pare: SocketAddr, mut one: F) -> Pairs
where
    F: FnMut(SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let mut pairs = Pairs { direct: Vec::with_capacity(n), pare: Vec::with_capacity(n) };
    for i in 0..n {
        let (d, p) = if i % 2 == 0 {
            let d = one(stub).await;
            (d, one(pare).await)
        } else {
            let p = one(pare).await;
            (one(stub).await, p)
        };
        pairs.direct.push(d.as_secs_f64() * 1e6);
        pairs.pare.push(p.as_secs_f64() * 1e6);
    }
    pairs
}

fn client() -> reqwest::Client {
    pare::outbound::install_crypto_provider();
    reqwest::Client::builder().no_proxy().tcp_nodelay(true).timeout(Duration::from_secs(60)).build().unwrap()
}

async fn overhead(full: bool) {
    let stub = start_stub().await;
    let pare = PareProcess::start(stub);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (idle_rss, _) = pare.rss_kib();
    let client = client();
    let (n_small, n_large, n_stream, n_cpu) = if full { (3000, 200, 1000, 5000) } else { (20, 3, 10, 20) };
    let small = small_body();
    let large = large_body();
    let stream = stream_body();

    // Warm up both paths (connection pools, page faults).
    interleaved(if full { 200 } else { 2 }, stub, pare.addr, |a| post(&client, a, &small)).await;

    figures!("pare overhead (concurrency 1, zero-delay stub, direct and through-pare interleaved)");
    figures!("large body: {} bytes", large.len());
    interleaved(n_small, stub, pare.addr, |a| post(&client, a, &small)).await.report("small chat");
    interleaved(n_large, stub, pare.addr, |a| post(&client, a, &large)).await.report("850 KB chat");
    // The same conversation as Responses API input items (instructions, function_call /
    // function_call_output pairs), through the Responses adapter.
    let large_responses = Bytes::from(
        pare::wire::convert::chat_to_responses(&serde_json::from_slice(&large).unwrap()).unwrap().to_string(),
    );
    interleaved(n_large, stub, pare.addr, |a| post_to(&client, a, "/v1/responses", &large_responses))
        .await
        .report("850 KB Responses");
    interleaved(n_large, stub, pare.addr, |a| post_to(&client, a, "/v1/embeddings", &large))
        .await
        .report("850 KB, not a chat");
    interleaved(n_stream, stub, pare.addr, |a| first_byte(&client, a, &stream)).await.report("stream first byte");

    // The pipeline's share of the large-body overhead, in process (parse + identity compaction).
    let pipeline = pare::pipeline::Pipeline::identity(Arc::new(pare::config::Config::default()));
    let mut prepare: Vec<f64> = Vec::new();
    for _ in 0..n_large {
        let started = Instant::now();
        let prepared = pipeline.prepare_chat(&http::HeaderMap::new(), large.clone()).await;
        prepare.push(started.elapsed().as_secs_f64() * 1e6);
        assert_eq!(prepared.body.len(), large.len());
    }
    prepare.sort_by(|a, b| a.partial_cmp(b).unwrap());
    figures!(
        "prepare_chat on the 850 KB body (in process): p50 {:.1} µs p99 {:.1} µs",
        percentile(&prepare, 0.5),
        percentile(&prepare, 0.99)
    );

    let cpu_before = pare.cpu();
    let started = Instant::now();
    for _ in 0..n_cpu {
        post(&client, pare.addr, &small).await;
    }
    let wall = started.elapsed();
    let cpu = pare.cpu() - cpu_before;
    let (rss, peak) = pare.rss_kib();
    figures!(
        "pare cpu per small request: {:.1} µs ({} requests, {:.3} s cpu in {:.3} s wall; clock tick {:.0} Hz)",
        cpu.as_secs_f64() * 1e6 / n_cpu as f64,
        n_cpu,
        cpu.as_secs_f64(),
        wall.as_secs_f64(),
        clock_ticks_per_second()
    );
    figures!(
        "pare rss: idle {:.1} MiB, after the run {:.1} MiB, peak {:.1} MiB",
        idle_rss as f64 / 1024.0,
        rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
}

/// Many concurrent streaming clients for a fixed time; returns (latencies µs, errors).
async fn load_run(addr: SocketAddr, clients: usize, duration: Duration) -> (Vec<f64>, u64) {
    let client = client();
    let body = stream_body();
    let errors = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let client = client.clone();
        let body = body.clone();
        let errors = errors.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                let started = Instant::now();
                let result = async {
                    let mut response = client
                        .post(format!("http://{addr}/v1/chat/completions"))
                        .body(body.clone())
                        .send()
                        .await?
                        .error_for_status()?;
                    let mut n_bytes = 0;
                    while let Some(chunk) = response.chunk().await? {
                        n_bytes += chunk.len();
                    }
                    Ok::<usize, reqwest::Error>(n_bytes)
                }
                .await;
                match result {
                    Ok(n) if n > 0 => latencies.push(started.elapsed().as_secs_f64() * 1e6),
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    all.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (all, errors.load(Ordering::Relaxed))
}

async fn load(seconds: u64, clients: usize) {
    let stub = start_stub().await;
    let pare = PareProcess::start(stub);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (idle, _) = pare.rss_kib();
    let duration = Duration::from_secs(seconds);
    figures!("load: {clients} concurrent streaming clients, {seconds} s each run, loopback");
    let sampler = {
        let pid = pare.child.id();
        tokio::spawn(async move {
            let mut max_rss = 0u64;
            for _ in 0..(seconds * 10 + 50) {
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    && let Some(v) =
                        status.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1))
                {
                    max_rss = max_rss.max(v.parse().unwrap_or(0));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            max_rss
        })
    };
    for (name, addr) in [("through pare", pare.addr), ("direct", stub)] {
        let (latencies, errors) = load_run(addr, clients, duration).await;
        figures!(
            "{name:<13} requests {:>7} errors {errors} rate {:>8.0}/s latency p50 {:>8.0} µs p90 {:>8.0} µs p99 {:>8.0} µs max {:>8.0} µs",
            latencies.len(),
            latencies.len() as f64 / seconds as f64,
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.9),
            percentile(&latencies, 0.99),
            latencies.last().copied().unwrap_or(0.0),
        );
    }
    sampler.abort();
    let (rss, peak) = pare.rss_kib();
    figures!(
        "pare rss: idle {:.1} MiB, after {:.1} MiB, peak (VmHWM) {:.1} MiB",
        idle as f64 / 1024.0,
        rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let full = args.iter().any(|a| a == "--bench");
    if !full {
        FIGURES.store(false, Ordering::Relaxed);
        println!("proxy bench: smoke run in test mode, no figures (they come from `cargo bench --bench proxy`)");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    if let Some(idx) = args.iter().position(|a| a == "load") {
        let seconds = args.get(idx + 1).and_then(|s| s.parse().ok()).unwrap_or(60);
        let clients = args.get(idx + 2).and_then(|s| s.parse().ok()).unwrap_or(200);
        let (seconds, clients) = if full { (seconds, clients) } else { (1, 4) };
        runtime.block_on(load(seconds, clients));
    } else {
        runtime.block_on(overhead(full));
    }
}
