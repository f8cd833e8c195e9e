//! What bad or extreme input gets (MISSION.md, "What a bad input gets"): each case goes
//! through the real pipeline — sessions, tiktoken counting, epochs, the default rule pack, the archive —
//! and must be answered, forwarded as specified, never panic, and be archived byte for byte.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use pare::archive::query::ArchiveReader;
use pare::archive::read::BodyKind;
use pare::compact::validate::{Skeleton, check};
use pare::config::Config;
use pare::pipeline::Pipeline;
use serde_json::{Value, json};

use crate::support::client;
use crate::support::pare::{Pare, config_for, start_with_pipeline};
use crate::support::stub::Stub;

/// pare with the pipeline `serve` builds (archive on, a small window so that epochs fire).
async fn real_pare(stub: &Stub, archive_dir: &std::path::Path) -> Pare {
    let mut config: Config = config_for(stub);
    config.archive.enabled = true;
    config.archive.dir = Some(archive_dir.to_owned());
    config.budget.detect_window = false;
    config.budget.default_context_window = 8192;
    config.budget.output_reserve = 1024;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(config.clone()).expect("pipeline"));
    start_with_pipeline(config, pipeline).await
}

/// Send `body` as a chat request of session `session`; return what the stub received. The answer must
/// be the upstream's (the stub answers 400 to a body it cannot read or without a string `model`, as
/// OpenAI does), never an error of pare's own.
async fn send(pare: &Pare, stub: &Stub, session: &str, body: Vec<u8>) -> Vec<u8> {
    let before = stub.requests().len();
    let readable = serde_json::from_slice::<Value>(&body).is_ok_and(|v| v["model"].is_string());
    // 10 000 messages and a 5 MB output take seconds in a debug build next to the rest of the suite:
    // allow more than the default client's 30 s.
    let response = client()
        .post(pare.url("/v1/chat/completions"))
        .timeout(std::time::Duration::from_secs(300))
        .header("content-type", "application/json")
        .header("x-pare-session", session)
        .body(body)
        .send()
        .await
        .expect("pare answers");
    let status = response.status();
    let answer = response.bytes().await.expect("response body");
    assert_eq!(status, if readable { 200 } else { 400 }, "session {session}: {}", String::from_utf8_lossy(&answer));
    assert!(!String::from_utf8_lossy(&answer).contains("\"pare:"), "session {session}: pare answered itself");
    let requests = stub.requests();
    assert_eq!(requests.len(), before + 1, "session {session}: exactly one forwarded request");
    requests[before].body.to_vec()
}

/// The raw body pare archived for the only request of `session`.
async fn archived_raw(pare: &Pare, session: &str) -> Vec<u8> {
    let archive = pare.pipeline.archive().expect("archive on").clone();
    archive.flush_async().await.expect("flush");
    let reader = ArchiveReader::open(archive.location()).expect("open archive");
    let exchanges = reader.exchanges(session).expect("exchanges");
    assert_eq!(exchanges.len(), 1, "session {session}");
    reader.body(session, exchanges[0].seq, BodyKind::Raw).expect("raw body")
}

fn messages_of(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("forwarded body is JSON");
    v["messages"].as_array().expect("messages").clone()
}

fn assert_valid_pairing(messages: &[Value]) {
    let skeletons: Vec<Option<Skeleton>> = messages.iter().map(|m| Skeleton::of(&m.to_string())).collect();
    check(&skeletons).expect("forwarded messages keep tool pairing valid");
}

/// A coding-agent conversation: system, task, then `n_turns` read_file turns with `output` each.
fn conversation(n_turns: usize, output: impl Fn(usize) -> String) -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in src/lib.rs."}),
    ];
    for i in 0..n_turns {
        let id = format!("call_{i}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "read_file", "arguments": json!({"path": format!("src/m{i}.rs")}).to_string()}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output(i)}));
    }
    messages
}

fn body_of(messages: Vec<Value>) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "bad-input", "messages": messages})).unwrap()
}

#[tokio::test]
async fn bad_and_extreme_inputs_are_answered_forwarded_and_archived() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let pare = real_pare(&stub, dir.path()).await;

    // Not JSON at all, and not UTF-8: forwarded byte for byte.
    let invalid_utf8 = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec();
    assert_eq!(send(&pare, &stub, "utf8", invalid_utf8.clone()).await, invalid_utf8);

    // Nesting deeper than the parser allows (serde_json stops at 128): forwarded unchanged, no overflow.
    let depth = 100_000;
    let deep = format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":{}1{}}}]}}",
        "[".repeat(depth),
        "]".repeat(depth)
    )
    .into_bytes();
    assert_eq!(send(&pare, &stub, "deep", deep.clone()).await, deep);

    // An agent that itself breaks tool pairing (an orphan tool result): forwarded unchanged.
    let mut orphan =
        conversation(12, |i| format!("{{\"output\": \"{}\", \"exit_code\": 0, \"error\": null}}", "x".repeat(900 + i)));
    orphan.insert(3, json!({"role": "tool", "tool_call_id": "nobody_called_me", "content": "stray"}));
    let orphan = body_of(orphan);
    assert_eq!(send(&pare, &stub, "orphan", orphan.clone()).await, orphan);

    // A number past f64's range is valid JSON that serde_json will not read as a value: the message
    // holding it cannot be read, so the request goes out as sent, even one long enough to compact.
    let long = conversation(30, |i| (0..40).map(|j| format!("{i}:{j} ok\n")).collect());
    let control = body_of(long.clone());
    let forwarded = send(&pare, &stub, "big-number-control", control.clone()).await;
    assert!(forwarded.len() < control.len(), "the same session without the number is compacted");
    let mut big_number = long;
    big_number[2]["seed"] = json!("__BIG__");
    let big_number = String::from_utf8(body_of(big_number)).unwrap().replace("\"__BIG__\"", "1e999").into_bytes();
    assert!(serde_json::from_slice::<Value>(&big_number).is_err(), "serde_json reads 1e999 after all");
    assert!(send(&pare, &stub, "big-number", big_number.clone()).await == big_number, "not forwarded as sent");

    // Unknown roles and `null` wherever it can be: answered, forwarded as valid JSON, nothing invented.
    let odd = serde_json::to_vec(&json!({"model": null, "stream": null, "tools": null, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "critic", "content": null, "name": null},
        {"role": "user", "content": null, "tool_calls": null, "tool_call_id": null},
        {"role": "assistant", "content": null, "reasoning_content": null},
        {"role": "user", "content": [{"type": "text", "text": null}, null]},
    ]}))
    .unwrap();
    let forwarded = send(&pare, &stub, "nulls", odd.clone()).await;
    assert_eq!(messages_of(&forwarded).len(), 5);

    // 10 000 messages: answered within the window, valid, user messages intact.
    let many = conversation(4_999, |i| format!("line {i}\nok"));
    let forwarded = messages_of(&send(&pare, &stub, "many", body_of(many.clone())).await);
    assert_valid_pairing(&forwarded);
    assert!(forwarded.len() < many.len(), "10 000 messages over an 8k window must be compacted");
    assert_eq!(forwarded.iter().filter(|m| m["role"] == "user").count(), 1);

    // A single 5 MB tool output early in a session: compacted, the result stays valid.
    let huge = conversation(8, |i| if i == 0 { "y\n".repeat(2_500_000) } else { "ok".into() });
    let huge_body = body_of(huge);
    let forwarded_bytes = send(&pare, &stub, "huge", huge_body.clone()).await;
    assert!(forwarded_bytes.len() < huge_body.len() / 100, "the 5 MB output is not forwarded whole");
    assert_valid_pairing(&messages_of(&forwarded_bytes));

    // Base64 images in content arrays: counted by estimate, forwarded unmangled.
    let image = format!("data:image/png;base64,{}", "iVBORw0KGgo".repeat(20_000));
    let mut with_images = conversation(2, |_| "ok".into());
    with_images.push(json!({"role": "user", "content": [
        {"type": "text", "text": "What is in this screenshot?"},
        {"type": "image_url", "image_url": {"url": image, "detail": "high"}},
    ]}));
    let forwarded = messages_of(&send(&pare, &stub, "image", body_of(with_images.clone())).await);
    assert_eq!(forwarded.last(), with_images.last(), "the image message is byte-identical in meaning");

    // Nothing panicked, nothing failed open, and every raw body is in the archive exactly as sent.
    assert_eq!(pare.pipeline.stats.fail_open.load(Ordering::Relaxed), 0);
    assert_eq!(archived_raw(&pare, "utf8").await, invalid_utf8);
    assert_eq!(archived_raw(&pare, "deep").await, deep);
    assert_eq!(archived_raw(&pare, "orphan").await, orphan);
    assert_eq!(archived_raw(&pare, "big-number").await, big_number);
    assert_eq!(archived_raw(&pare, "nulls").await, odd);
    assert_eq!(archived_raw(&pare, "huge").await, huge_body);
}

/// A stream the client abandons: the upstream request is cancelled and the archive keeps what arrived,
/// marked partial.
#[tokio::test]
async fn a_stream_the_client_abandons_is_archived_as_partial() {
    use crate::support::stub::{self, Recorded, Reply, Step};
    let stub = Stub::start(|_: &Recorded| {
        Reply::sse(vec![
            Step::Send(stub::chunk_event("stub-model", json!({"content": "first words"}), None)),
            Step::Hold,
        ])
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pare = real_pare(&stub, dir.path()).await;
    let body = serde_json::to_vec(&json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "tell me a long story"}]}))
    .unwrap();
    let client = client();
    let mut response = client
        .post(pare.url("/v1/chat/completions"))
        .header("x-pare-session", "abandoned")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    let chunk = crate::support::within("the first chunk", response.chunk()).await.unwrap().expect("a chunk");
    assert!(String::from_utf8_lossy(&chunk).contains("first words"));
    drop(response);
    drop(client);
    stub.wait_cancelled(1).await;

    // The sink finishes when the proxy drops the body; its record is committed after.
    let answer = archived_answer(&pare, "abandoned").await;
    assert!(answer.partial, "{answer:?}");
    assert!(answer.stream);
    assert!(String::from_utf8_lossy(&answer.body).contains("first words"), "what arrived is kept");
    assert_eq!(archived_raw(&pare, "abandoned").await, body);
}

/// Regression: a compressed body whose decoded size is over `server.max_body` was forwarded still
/// compressed and not archived, and the access line did not say why. It says so now (`skipped`).
#[test]
fn a_compressed_body_over_the_decode_cap_says_why_in_the_access_line() {
    use std::io::{Read, Write};

    // An upstream that answers every request with a small JSON completion.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut socket in upstream.incoming().take(4).flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && socket.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
            let length: usize = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse().ok()))
                .unwrap_or(0);
            let mut body = vec![0u8; length];
            let _ = socket.read_exact(&mut body);
            let answer = r#"{"id":"x","object":"chat.completion","choices":[]}"#;
            let _ = write!(
                socket,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pare.yaml");
    std::fs::write(&config, "server:\n  max_body: 4096\nbudget:\n  detect_window: false\n").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["serve", "--config", config.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")])
        .arg("--upstream")
        .arg(format!("http://{upstream_addr}"))
        .arg("--archive")
        .arg(dir.path().join("archive"))
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start pare serve");
    let mut stderr = crate::support::StderrLines::follow(&mut child);
    let listening = stderr.wait_for("pare listening");
    let mut answered = false;
    if listening {
        // 64 KiB of JSON once decoded, a few hundred bytes compressed.
        let filler = "a".repeat(64 * 1024);
        let json = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{filler}"}}]}}"#);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(json.as_bytes()).unwrap();
        let body = gz.finish().unwrap();
        assert!(body.len() < 4096);
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            stream,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .unwrap();
        stream.write_all(&body).unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        answered = stderr.wait_for("total_ms=");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let seen = stderr.seen;
    assert!(listening && answered, "{seen:#?}");
    let access = seen.iter().find(|l| l.contains("total_ms=")).unwrap();
    assert!(
        access.contains("compressed body forwarded as sent, not archived: decoded body over server.max_body"),
        "{access}"
    );
}

/// The archived answer of session `session`'s first exchange, once it is committed (at most 10 s:
/// a sink finishes, and its record is queued, when the proxy drops the answer's body).
async fn archived_answer(pare: &Pare, session: &str) -> pare::archive::query::ResponseInfo {
    let archive = pare.pipeline.archive().expect("archive on").clone();
    for _ in 0..500 {
        archive.flush_async().await.expect("flush");
        let reader = ArchiveReader::open(archive.location()).expect("open archive");
        if let Some(exchange) = reader.exchanges(session).expect("exchanges").first()
            && let Some(answer) = reader.response(session, exchange.seq).expect("response")
        {
            return answer;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the answer of {session} is recorded within 10 s")
}

/// What a hostile upstream streams — a tool call at index `u64::MAX`, a line that goes on for 40 MiB
/// — reaches the client unchanged; pare archives the first answer with its call and skips the
/// endless line's event, and serves the next request. (Each once aborted pare or grew it without
/// bound: a vector grown to the index, a line buffered whole.)
#[tokio::test]
async fn hostile_streams_pass_unchanged_and_leave_pare_serving() {
    use bytes::Bytes;

    use crate::support::stub::{self, Recorded, Reply, Step};
    let call =
        json!({"index": u64::MAX, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let huge_index =
        stub::sse_event(&json!({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}));
    let endless = Bytes::from(vec![b'x'; 40 << 20]);
    let sent = huge_index.clone();
    let stub = Stub::start(move |request: &Recorded| {
        let steps = if request.json()["messages"][0]["content"] == "endless" {
            vec![
                Step::Send(Bytes::from_static(b"data: ")),
                Step::Send(endless.clone()),
                Step::Send(Bytes::from_static(b"\n\n")),
            ]
        } else {
            vec![Step::Send(sent.clone())]
        };
        Reply::sse(steps.into_iter().chain([Step::Send(stub::sse_done())]).collect())
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pare = real_pare(&stub, dir.path()).await;
    let ask = |session: &'static str, content: &'static str| {
        let body = serde_json::to_vec(
            &json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": content}]}),
        );
        client().post(pare.url("/v1/chat/completions")).header("x-pare-session", session).body(body.unwrap()).send()
    };

    let streamed = ask("index", "call").await.unwrap().bytes().await.unwrap();
    assert_eq!(streamed, [huge_index.clone(), stub::sse_done()].concat());
    let answer = archived_answer(&pare, "index").await;
    assert_eq!(answer.assembled.unwrap()["message"]["tool_calls"][0]["id"], "call_1");

    let streamed = ask("endless", "endless").await.unwrap().bytes().await.unwrap();
    assert_eq!(streamed.len(), 6 + (40 << 20) + 2 + stub::sse_done().len(), "the whole stream reaches the client");
    let answer = archived_answer(&pare, "endless").await;
    assert!(!answer.partial && answer.end_reason == "complete", "the [DONE] after it ends the answer: {answer:?}");

    let response = ask("after", "call").await.unwrap();
    assert_eq!(response.status(), 200);
}
