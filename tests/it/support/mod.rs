//! Shared test machinery: a scripted stub upstream ([`stub`]), pare running in-process
//! ([`pare`]) and a raw HTTP/1.1 client for header-level checks ([`raw`]).

#![allow(dead_code)]

pub mod pare;
pub mod raw;
pub mod stub;

use std::time::Duration;

/// How long a test waits for an event before failing (never a sleep used as an assertion).
pub const WAIT: Duration = Duration::from_secs(10);

/// The owner token of the pare [`pare::config_for`] configures (`server.owner_token`).
pub const TOKEN: &str = "it-owner-token-0123456789";

/// An HTTP client for talking to pare: no system proxy, no redirects, no pooling surprises; it
/// sends [`TOKEN`] in `x-pare-token` unless a request names another.
pub fn client() -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("x-pare-token", reqwest::header::HeaderValue::from_static(TOKEN));
    builder().default_headers(headers).build().expect("test client")
}

/// [`client`] without a token: a caller that does not hold it.
pub fn bare_client() -> reqwest::Client {
    builder().build().expect("test client")
}

fn builder() -> reqwest::ClientBuilder {
    ::pare::outbound::install_crypto_provider();
    reqwest::Client::builder().no_proxy().redirect(reqwest::redirect::Policy::none()).timeout(Duration::from_secs(30))
}

/// Await `future`, failing the test after [`WAIT`].
pub async fn within<F: std::future::Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(WAIT, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// A response body parsed as JSON (reqwest's `json` feature is off in this crate).
pub async fn json(response: reqwest::Response) -> serde_json::Value {
    let bytes = response.bytes().await.expect("response body");
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("not json ({e}): {}", String::from_utf8_lossy(&bytes)))
}

/// How [`coding_session`] names its calls.
pub struct CodingAgent {
    pub model: &'static str,
    pub tool: &'static str,
    /// Call ids are this prefix and the turn's number.
    pub id_prefix: &'static str,
    /// The `reasoning_content` of turn k's assistant message, when the agent reasons.
    pub reasoning: Option<fn(usize) -> String>,
}

/// A coding-agent-like chat session: system, user, then `n_turns` tool steps each with an output of
/// about `words` tokens. Request k holds everything before the k-th assistant message.
pub fn coding_session(agent: &CodingAgent, n_turns: usize, words: usize) -> Vec<serde_json::Value> {
    use serde_json::json;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in src/lib.rs."}),
    ];
    let mut requests = Vec::new();
    for k in 0..n_turns {
        requests.push(json!({"model": agent.model, "messages": messages.clone(), "stream": true}));
        let id = format!("{}{k}", agent.id_prefix);
        let call = json!({"id": id, "type": "function",
            "function": {"name": agent.tool, "arguments": format!("{{\"command\":\"cat file_{k}.txt\"}}")}});
        let mut assistant = json!({"role": "assistant", "content": null});
        if let Some(reasoning) = agent.reasoning {
            assistant["reasoning_content"] = json!(reasoning(k));
        }
        assistant["tool_calls"] = json!([call]);
        messages.push(assistant);
        let output: String = (0..words).map(|w| format!("w{k}x{w} ")).collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
    }
    requests
}

/// The stderr lines of a child process as they arrive (a thread reads them), and those seen so far.
pub struct StderrLines {
    lines: std::sync::mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl StderrLines {
    /// Follow `child`'s piped stderr.
    pub fn follow(child: &mut std::process::Child) -> StderrLines {
        use std::io::BufRead;
        let stderr = child.stderr.take().expect("stderr piped");
        let (tx, lines) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        StderrLines { lines, seen: Vec::new() }
    }

    /// Read lines until one contains `needle` (true) or 20 s have passed (false).
    pub fn wait_for(&mut self, needle: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                let found = line.contains(needle);
                self.seen.push(line);
                if found {
                    return true;
                }
            }
        }
        false
    }
}
