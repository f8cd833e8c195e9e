//! A scripted stub upstream speaking the real OpenAI wire format: `/v1/models`, chat completions as
//! JSON or as SSE (`data: {...}\n\n` chunks ending with `data: [DONE]`), scripted statuses, delays,
//! gates the test opens, stalls and mid-body aborts. It records every request it receives and counts
//! the exchanges a client abandoned (connection closed before the reply ended), so tests can observe
//! cancellation instead of guessing at it.
//!
//! ```ignore
//! let stub = Stub::start(Stub::openai).await;                // the default OpenAI-like script
//! let stub = Stub::start(|req: &Recorded| Reply::status(429, json!({"error": {}}))).await;
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type StubBody = UnsyncBoxBody<Bytes, BoxError>;

/// One request as the stub received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    /// Path and query, exactly as received.
    pub path: String,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Recorded {
    /// The body as JSON (`Value::Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn path_only(&self) -> &str {
        self.path.split('?').next().unwrap_or(&self.path)
    }
}

/// One step of a streamed reply.
#[derive(Clone)]
pub enum Step {
    /// Send these bytes as one body chunk.
    Send(Bytes),
    /// Wait this long (ends early if the client goes away).
    Sleep(Duration),
    /// Wait until the test calls `notify_one` on this gate (a permit stored before the wait counts).
    Gate(Arc<Notify>),
    /// Wait until the client goes away (bounded by [`HOLD_LIMIT`]).
    Hold,
    /// Fail the body: the connection is cut mid-response.
    Abort,
}

/// Longest a [`Step::Hold`] or [`Reply::Stall`] waits before giving up.
pub const HOLD_LIMIT: Duration = Duration::from_secs(30);

/// What the stub answers.
pub enum Reply {
    /// A complete body with a status and headers.
    Full { status: u16, headers: Vec<(String, String)>, body: Bytes },
    /// A body sent step by step.
    Stream { status: u16, headers: Vec<(String, String)>, steps: Vec<Step> },
    /// Never answer (until the client goes away or [`HOLD_LIMIT`] passes).
    Stall,
}

impl Reply {
    pub fn json(status: u16, value: Value) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from(serde_json::to_vec(&value).unwrap()),
        }
    }

    /// An OpenAI-shaped error body.
    pub fn error(status: u16, message: &str) -> Reply {
        Reply::json(status, json!({"error": {"message": message, "type": "invalid_request_error", "code": null}}))
    }

    /// An SSE stream from pre-built steps.
    pub fn sse(steps: Vec<Step>) -> Reply {
        Reply::Stream {
            status: 200,
            headers: vec![
                ("content-type".into(), "text/event-stream".into()),
                ("cache-control".into(), "no-cache".into()),
            ],
            steps,
        }
    }
}

/// `data: {json}\n\n`.
pub fn sse_event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {}\n\n", serde_json::to_string(value).unwrap()))
}

/// `data: [DONE]\n\n`.
pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// One streamed chat chunk carrying `delta`.
pub fn chunk_event(model: &str, delta: Value, finish_reason: Option<&str>) -> Bytes {
    sse_event(&json!({
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }))
}

/// The usage chunk sent last when `stream_options.include_usage` is set.
pub fn usage_event(model: &str) -> Bytes {
    sse_event(&json!({
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
    }))
}

/// The text the default script answers with.
pub const ANSWER: &str = "Hello from the stub.";

/// A non-streamed chat completion with `content`.
pub fn completion(model: &str, content: &str) -> Value {
    json!({
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
    })
}

/// The steps of a streamed answer with `content`, split into words, ending with `[DONE]`.
pub fn stream_steps(model: &str, content: &str, include_usage: bool) -> Vec<Step> {
    let mut steps = vec![Step::Send(chunk_event(model, json!({"role": "assistant", "content": ""}), None))];
    for (i, word) in content.split(' ').enumerate() {
        let piece = if i == 0 { word.to_owned() } else { format!(" {word}") };
        steps.push(Step::Send(chunk_event(model, json!({"content": piece}), None)));
    }
    steps.push(Step::Send(chunk_event(model, json!({}), Some("stop"))));
    if include_usage {
        steps.push(Step::Send(usage_event(model)));
    }
    steps.push(Step::Send(sse_done()));
    steps
}

struct State {
    script: Box<dyn Fn(&Recorded) -> Reply + Send + Sync>,
    requests: Mutex<Vec<Recorded>>,
    received: Notify,
    n_cancelled: AtomicUsize,
    cancelled: Notify,
}

/// A running stub; stops when dropped.
pub struct Stub {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Stub {
    /// Start a stub on `127.0.0.1:0` answering with `script`.
    pub async fn start<S>(script: S) -> Stub
    where
        S: Fn(&Recorded) -> Reply + Send + Sync + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind stub");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            script: Box::new(script),
            requests: Mutex::new(Vec::new()),
            received: Notify::new(),
            n_cancelled: AtomicUsize::new(0),
            cancelled: Notify::new(),
        });
        let serving = state.clone();
        let task = tokio::spawn(async move {
            let builder = auto::Builder::new(TokioExecutor::new());
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = serving.clone();
                let service = service_fn(move |request| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(serve(state, request).await) }
                });
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                tokio::spawn(connection);
            }
        });
        Stub { addr, state, task }
    }

    /// The default script: an OpenAI-like server.
    pub fn openai(request: &Recorded) -> Reply {
        openai_reply(request)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    /// The only request received (fails the test otherwise).
    pub fn single(&self) -> Recorded {
        let requests = self.requests();
        assert_eq!(
            requests.len(),
            1,
            "expected one request, got {:?}",
            requests.iter().map(|r| &r.path).collect::<Vec<_>>()
        );
        requests.into_iter().next().unwrap()
    }

    /// Exchanges abandoned by the client before the reply ended.
    pub fn n_cancelled(&self) -> usize {
        self.state.n_cancelled.load(Ordering::SeqCst)
    }

    /// Wait until at least `n` exchanges were abandoned by the client.
    pub async fn wait_cancelled(&self, n: usize) {
        super::within("the stub to observe a cancelled exchange", async {
            loop {
                let notified = self.state.cancelled.notified();
                if self.n_cancelled() >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }

    /// Wait until at least `n` requests were received.
    pub async fn wait_requests(&self, n: usize) {
        super::within("the stub to receive a request", async {
            loop {
                let notified = self.state.received.notified();
                if self.state.requests.lock().unwrap().len() >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }
}

/// Counts an exchange as cancelled unless disarmed before it is dropped.
struct CancelGuard {
    state: Arc<State>,
    armed: bool,
}

impl CancelGuard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.state.n_cancelled.fetch_add(1, Ordering::SeqCst);
            self.state.cancelled.notify_waiters();
        }
    }
}

async fn serve(state: Arc<State>, request: Request<Incoming>) -> Response<StubBody> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let recorded = Recorded {
        method: parts.method,
        path: parts.uri.path_and_query().map(|p| p.as_str().to_owned()).unwrap_or_else(|| parts.uri.path().to_owned()),
        version: parts.version,
        headers: parts.headers,
        body,
    };
    let reply = (state.script)(&recorded);
    state.requests.lock().unwrap().push(recorded);
    state.received.notify_waiters();

    match reply {
        Reply::Full { status, headers, body } => {
            build(status, &headers, Full::new(body).map_err(|never| match never {}).boxed_unsync())
        }
        Reply::Stall => {
            let guard = CancelGuard { state: state.clone(), armed: true };
            tokio::time::sleep(HOLD_LIMIT).await;
            guard.disarm();
            build(503, &[], Full::new(Bytes::from_static(b"stalled")).map_err(|never| match never {}).boxed_unsync())
        }
        Reply::Stream { status, headers, steps } => {
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            tokio::spawn(play(state.clone(), steps, tx));
            let stream =
                futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
            build(status, &headers, StreamBody::new(stream).boxed_unsync())
        }
    }
}

/// Play the steps of a streamed reply into the body channel, noticing when the client goes away.
async fn play(state: Arc<State>, steps: Vec<Step>, tx: mpsc::Sender<Result<Frame<Bytes>, BoxError>>) {
    let guard = CancelGuard { state, armed: true };
    for step in steps {
        let gone = match step {
            Step::Send(bytes) => tx.send(Ok(Frame::data(bytes))).await.is_err(),
            Step::Sleep(duration) => tokio::select! {
                () = tokio::time::sleep(duration) => false,
                () = tx.closed() => true,
            },
            Step::Gate(gate) => tokio::select! {
                () = gate.notified() => false,
                () = tx.closed() => true,
            },
            Step::Hold => tokio::select! {
                () = tokio::time::sleep(HOLD_LIMIT) => false,
                () = tx.closed() => true,
            },
            Step::Abort => {
                let _ = tx.send(Err("stub aborts the body".into())).await;
                guard.disarm();
                return;
            }
        };
        if gone {
            return;
        }
    }
    guard.disarm();
}

fn build(status: u16, headers: &[(String, String)], body: StubBody) -> Response<StubBody> {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    for (name, value) in headers {
        response
            .headers_mut()
            .append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
    }
    response
}

/// The probes Hermes and other clients send to guess the server kind; a plain OpenAI server 404s.
pub const PROBES: [&str; 5] = ["/api/v1/models", "/api/tags", "/v1/props", "/props", "/version"];

fn openai_reply(request: &Recorded) -> Reply {
    let path = request.path_only();
    match (&request.method, path) {
        (&Method::GET, "/v1/models") => Reply::json(
            200,
            json!({"object": "list", "data": [{"id": "stub-model", "object": "model", "created": 1_700_000_000, "owned_by": "stub"}]}),
        ),
        (&Method::POST, p) if p.ends_with("/chat/completions") => {
            let body = request.json();
            let Some(model) = body.get("model").and_then(Value::as_str) else {
                return Reply::error(400, "we could not parse the JSON body of your request");
            };
            if body.get("stream").and_then(Value::as_bool) == Some(true) {
                let include_usage =
                    body.pointer("/stream_options/include_usage").and_then(Value::as_bool) == Some(true);
                Reply::sse(stream_steps(model, ANSWER, include_usage))
            } else {
                Reply::json(200, completion(model, ANSWER))
            }
        }
        _ => Reply::error(404, &format!("no route for {path}")),
    }
}
