//! The raw archive: exact recovery, dedup, hash chain and tampering, sessions through the pipeline,
//! secrets, export, crash and disk-failure behaviour.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use pare::archive::query::{ArchiveReader, SessionFilter};
use pare::archive::read::BodyKind;
use pare::archive::verify::verify;
use pare::archive::{Archive, ExchangeRecord, Location, ResponseRecord, store};
use pare::config::{Config, Durability};
use pare::pipeline::{CompactionSummary, Pipeline, StreamEnd};
use pare::wire::ChatBody;
use serde_json::{Value, json};

fn start(dir: &Path) -> Arc<Archive> {
    Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(20))
}

fn exchange(session: &str, raw: &[u8], forwarded: Option<&[u8]>) -> ExchangeRecord {
    ExchangeRecord {
        session: session.into(),
        at_ms: 1_700_000_000_000,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("m".into()),
        headers: vec![("user-agent".into(), "test".into())],
        raw: Bytes::copy_from_slice(raw),
        raw_spans: None,
        forwarded: forwarded.map(Bytes::copy_from_slice),
        forwarded_spans: None,
        summary: Some(CompactionSummary { tokens_raw: 100, tokens_forwarded: 60, ..Default::default() }),
        late_summary: None,
        skipped: None,
        key_req: Some(7),
        expect_requests: None,
        lists: Default::default(),
    }
}

/// [`exchange`] with the spans of the raw and forwarded bodies that the proxy's parse and the
/// compactor's writing give (the writer then does not parse them again).
fn with_spans(mut record: ExchangeRecord) -> ExchangeRecord {
    fn spans(body: &Bytes) -> Option<pare::wire::Spans> {
        ChatBody::parse(body).ok().and_then(|parsed| parsed.split.spans_in(body))
    }
    record.raw_spans = spans(&record.raw);
    record.forwarded_spans = record.forwarded.as_ref().and_then(spans);
    record
}

fn response(body: &[u8]) -> ResponseRecord {
    ResponseRecord {
        at_ms: 1_700_000_000_500,
        status: Some(200),
        headers: vec![("content-type".into(), "application/json".into())],
        stream: false,
        end: StreamEnd::Complete,
        body: body.to_vec(),
        truncated: None,
        assembled: None,
        key_ext: None,
    }
}

/// A growing agent session: request k holds the system prompt, the task, and k tool steps.
fn growing_session(n: usize, pretty: bool) -> Vec<Vec<u8>> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. ".repeat(40)}),
        json!({"role": "user", "content": "Fix the failing test in src/lib.rs"}),
    ];
    let tools = json!([{"type": "function", "function": {"name": "bash", "description": "run a command".repeat(20), "parameters": {"type": "object"}}}]);
    let mut out = Vec::new();
    for k in 0..n {
        let body = json!({"model": "m", "messages": messages, "tools": tools, "stream": false});
        out.push(if pretty { serde_json::to_vec_pretty(&body).unwrap() } else { serde_json::to_vec(&body).unwrap() });
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{k}"), "type": "function", "function": {"name": "bash", "arguments": format!("{{\"command\": \"cat file_{k}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{k}"), "content": format!("fn f{k}() {{}}\n").repeat(30 + k)}));
    }
    out
}

/// Records that arrive within `flush_interval` of each other share one transaction rather than one
/// commit each; a flush still returns as soon as what came before it is in.
#[test]
fn records_arriving_together_share_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_secs(30));
    let bodies = growing_session(20, false);
    for (k, body) in bodies.iter().enumerate() {
        let ticket = archive.record_exchange(exchange("together", body, None));
        archive.record_response(ticket, response(format!("{{\"answer\":{k}}}").as_bytes()));
        // The writer is woken by each record: give it time to commit alone if it still would.
        std::thread::sleep(Duration::from_millis(2));
    }
    let started = std::time::Instant::now();
    archive.flush().unwrap();
    assert!(started.elapsed() < Duration::from_secs(15), "the flush waited for the 30 s interval");
    let health = archive.health();
    assert_eq!(health.committed_records, 40);
    assert_eq!(health.commits, 1, "{health:?}");
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert_eq!(reader.exchanges("together").unwrap().len(), 20);
}

/// A strict request does not wait for the group to fill: its exchange ends the gathering, even when
/// a buffered record opened the group.
#[test]
fn a_strict_record_is_committed_without_waiting_for_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Strict, Duration::from_secs(30));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let bodies = growing_session(2, false);
    let first = archive.record_exchange(exchange("strict", &bodies[0], None));
    archive.record_response(first, response(b"{\"answer\":0}"));
    let started = std::time::Instant::now();
    let (_, committed) =
        runtime.block_on(archive.record_exchange_committed(exchange("strict", &bodies[1], None), None));
    committed.unwrap();
    assert!(started.elapsed() < Duration::from_secs(15), "the strict record waited for the 30 s interval");
    assert_eq!(archive.health().committed_records, 3);
}

/// A body of `n` assistant/tool pairs with tiny outputs: 2n + 1 messages, each its own blob.
fn many_tiny_outputs(n: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "user", "content": "go"})];
    for k in 0..n {
        let call = format!("call_{k}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": call, "type": "function",
            "function": {"name": "bash", "arguments": format!("{{\"command\":\"cat f{k}\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": call, "content": "ok"}));
    }
    serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap()
}

/// Regression: a body of many tiny tool outputs (each message a blob of its own) kept the writer
/// in one transaction for seconds, and held the whole queue meanwhile: the sessions that came
/// after it waited for room and for that commit (a new session waited 10–20 s behind 120,000
/// outputs). The writer stores such a body's blobs in slices of their own and writes what other
/// sessions queued meanwhile between them, and a record larger than half the queue holds half of
/// it: a new session is committed long before the big body is, which still comes back whole.
#[test]
fn a_body_of_many_tiny_outputs_does_not_hold_up_the_next_session() {
    let dir = tempfile::tempdir().unwrap();
    // The big body (2.3 MB) is larger than the whole queue.
    let archive = Archive::launch(
        Location::Dir(dir.path().to_owned()),
        Durability::Strict,
        Duration::from_millis(20),
        None,
        1 << 20,
        Duration::from_secs(10),
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let big = many_tiny_outputs(20_000);
    assert!(big.len() > 2 << 20);
    archive.record_exchange(exchange("big", &big, None));
    // The writer has taken the big record and works on it.
    let taken = std::time::Instant::now();
    while archive.health().queue_depth > 0 && taken.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let small = growing_session(1, false);
    let (_, committed) = runtime.block_on(archive.record_exchange_committed(exchange("next", &small[0], None), None));
    let waited = started.elapsed();
    committed.unwrap();
    // A buffered record of another session, then what reading that session back waits for.
    let started = std::time::Instant::now();
    archive.record_exchange(exchange("after", &small[0], None));
    archive.flush_session("after").unwrap();
    let flushed = started.elapsed();
    let big_pending = archive.health().committed_records < 3;
    archive.flush().unwrap();
    assert!(waited < Duration::from_secs(2), "the next session waited {waited:?} for the big body's commit");
    assert!(flushed < Duration::from_secs(2), "flushing another session waited {flushed:?} for the big body");
    assert!(big_pending, "the big body was committed before the next session: the test measured nothing");
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert!(reader.body("big", 1, BodyKind::Raw).unwrap() == big, "the big body does not come back whole");
    assert!(verify(reader.conn(), None).unwrap().ok());
}

#[test]
fn raw_and_forwarded_bodies_come_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let archive = start(dir.path());
    let bodies = growing_session(40, false);
    let pretty = growing_session(5, true);
    let odd: Vec<&[u8]> = vec![b"not json {", b"{\"model\":\"m\"}", b"", b"{ \"messages\" : [ ] }"];
    for (k, body) in bodies.iter().enumerate() {
        // Forward a "compacted" body every third request: the raw body with its first message dropped.
        let forwarded = (k % 3 == 0).then(|| {
            let mut v: Value = serde_json::from_slice(body).unwrap();
            v["messages"].as_array_mut().unwrap().remove(1);
            serde_json::to_vec(&v).unwrap()
        });
        // Every other raw body with the proxy's spans: both ways of splitting store the same pieces.
        let record = exchange("s1", body, forwarded.as_deref());
        let record = if k % 2 == 0 { with_spans(record) } else { record };
        assert_eq!(record.raw_spans.is_some(), k % 2 == 0);
        let ticket = archive.record_exchange(record);
        archive.record_response(ticket, response(format!("{{\"answer\":{k}}}").as_bytes()));
    }
    for body in &pretty {
        archive.record_exchange(with_spans(exchange("s2", body, None)));
    }
    for body in &odd {
        archive.record_exchange(with_spans(exchange("s3", body, None)));
    }
    archive.flush().unwrap();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    for (k, body) in bodies.iter().enumerate() {
        let seq = k as i64 + 1;
        assert!(reader.body("s1", seq, BodyKind::Raw).unwrap() == *body, "raw body {seq} differs");
        let forwarded = reader.body("s1", seq, BodyKind::Forwarded).unwrap();
        if k % 3 == 0 {
            assert!(forwarded != *body);
            assert_eq!(
                serde_json::from_slice::<Value>(&forwarded).unwrap()["messages"].as_array().unwrap().len(),
                serde_json::from_slice::<Value>(body).unwrap()["messages"].as_array().unwrap().len() - 1
            );
        } else {
            assert!(forwarded == *body, "forwarded body {seq} differs");
        }
        let answer = reader.response("s1", seq).unwrap().unwrap();
        assert_eq!(answer.body, format!("{{\"answer\":{k}}}").as_bytes());
    }
    for (k, body) in pretty.iter().enumerate() {
        assert!(reader.body("s2", k as i64 + 1, BodyKind::Raw).unwrap() == *body, "pretty body {k} differs");
    }
    for (k, body) in odd.iter().enumerate() {
        assert_eq!(&reader.body("s3", k as i64 + 1, BodyKind::Raw).unwrap(), body);
    }
    let last = reader.last_bodies("s1").unwrap().unwrap();
    let (last_raw, last_fwd) = (last.raw, last.forwarded);
    assert!(last_raw == *bodies.last().unwrap());
    assert!(last_fwd == reader.body("s1", 40, BodyKind::Forwarded).unwrap() && last_fwd != last_raw);
    let report = verify(reader.conn(), None).unwrap();
    assert!(report.ok(), "{:?}", report.problems);
    assert_eq!(report.exchanges, 40 + 5 + 4);
    assert_eq!(report.responses, 40);
    let sessions = reader.sessions(&SessionFilter::default()).unwrap();
    let s1 = sessions.iter().find(|s| s.id == "s1").unwrap();
    assert_eq!((s1.n_requests, s1.tokens_raw, s1.tokens_forwarded), (40, 4000, 2400));
}

/// The default configuration archiving into `dir`, with a 6,000-token window (1,000 for the answer),
/// so that a growing session compacts.
fn small_window_archived_at(dir: &Path) -> Config {
    let mut config = Config::default();
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config.budget.default_context_window = 6000;
    config.budget.output_reserve = 1000;
    config.budget.detect_window = false;
    config
}

/// The proxy forwards a request that appends before counting its new messages; the archived
/// summaries still hold the exact counts: each one what replaying the session counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summaries_counted_after_forwarding_are_archived_exact() {
    use pare::budget::replay::replay_session;
    let dir = tempfile::tempdir().unwrap();
    let config = Arc::new(small_window_archived_at(dir.path()));
    let pipeline = Pipeline::from_config(Arc::clone(&config)).unwrap();
    let bodies = growing_session(30, false);
    let (mut session, mut deferred) = (String::new(), 0);
    for body in &bodies {
        let prepared = pipeline
            .prepare_at(
                pare::wire::Wire::Chat,
                "POST",
                "/v1/chat/completions",
                &HeaderMap::new(),
                Bytes::copy_from_slice(body),
            )
            .await;
        deferred += usize::from(prepared.late_summary.is_some());
        session = prepared.session.unwrap();
    }
    assert!(deferred > 10, "most requests append and are counted late, got {deferred}");
    pipeline.archive().unwrap().flush().unwrap();
    let archived: Vec<Option<CompactionSummary>> =
        ArchiveReader::open(dir.path()).unwrap().exchanges(&session).unwrap().into_iter().map(|e| e.summary).collect();
    let compactor =
        pare::budget::SessionCompactor::new(&config, Arc::new(pare::compact::Engine::default_pack())).unwrap();
    let lines: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    let replayed = replay_session(&compactor, pare::wire::Wire::Chat, "replay", &lines, None);
    assert_eq!(archived.len(), replayed.len());
    for (k, (got, want)) in archived.iter().zip(&replayed).enumerate() {
        assert_eq!(*got, want.summary, "request {}", k + 1);
    }
}

/// Through the pipeline `pare serve` builds, a session that compacts: every forwarded body the archive
/// stores — split along the spans the compactor wrote it with, not parsed again — comes back as the
/// bytes that were forwarded, and every raw body as the bytes that were sent.
#[tokio::test]
async fn compacted_bodies_are_archived_as_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = small_window_archived_at(dir.path());
    config.archive.flush_interval_ms = 10;
    config.compaction.mode = pare::config::Mode::Eager;
    let pipeline = Pipeline::from_config(Arc::new(config)).unwrap();
    let bodies = growing_session(30, false);
    let mut forwarded = Vec::new();
    for body in &bodies {
        let prepared = pipeline.prepare_chat(&HeaderMap::new(), Bytes::copy_from_slice(body)).await;
        forwarded.push((prepared.session.unwrap(), prepared.body));
    }
    pipeline.archive().unwrap().flush().unwrap();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let session = &forwarded[0].0;
    assert!(forwarded.iter().all(|(s, _)| s == session), "one conversation, one session");
    let mut compacted = 0;
    for (k, ((_, sent), raw)) in forwarded.iter().zip(&bodies).enumerate() {
        let seq = k as i64 + 1;
        assert!(reader.body(session, seq, BodyKind::Raw).unwrap() == *raw, "raw body {seq} differs");
        assert!(reader.body(session, seq, BodyKind::Forwarded).unwrap() == *sent, "forwarded body {seq} differs");
        compacted += usize::from(sent.as_ref() != raw.as_slice());
    }
    assert!(compacted >= 10, "only {compacted} of {} requests were compacted", bodies.len());
    assert!(verify(reader.conn(), None).unwrap().ok());

    // The same exchanges recorded without spans (the writer parses every body): the same pieces,
    // so the same templates over the same blobs. The elision markers' id lists, which the
    // compactor derived, come with each record as they came from the proxy.
    let lists: std::sync::Arc<[String]> = {
        let conn = store::open_ro(dir.path()).unwrap();
        let mut ids = conn.as_sqlite().unwrap().prepare("SELECT id FROM blobs").unwrap();
        let ids: Vec<i64> = ids.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
        let texts =
            ids.into_iter().map(|id| String::from_utf8(store::read_blob(&conn, id).unwrap()).unwrap_or_default());
        texts.filter(|text| text.starts_with("content ids of the ")).collect()
    };
    assert!(!lists.is_empty(), "the session's elision markers named id lists");
    let parsed_dir = tempfile::tempdir().unwrap();
    let parsed = start(parsed_dir.path());
    for ((_, sent), raw) in forwarded.iter().zip(&bodies) {
        let record = exchange(session, raw, (sent.as_ref() != raw.as_slice()).then_some(sent.as_ref()));
        parsed.record_exchange(ExchangeRecord { lists: lists.clone(), ..record });
    }
    parsed.close();
    let stored = |dir: &Path| {
        let conn = store::open_ro(dir).unwrap();
        let mut templates =
            conn.as_sqlite().unwrap().prepare("SELECT raw_template, fwd_template FROM exchanges ORDER BY id").unwrap();
        let templates: Vec<(Vec<u8>, Option<Vec<u8>>)> =
            templates.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect();
        let mut blobs = conn.as_sqlite().unwrap().prepare("SELECT sha256 FROM blobs").unwrap();
        let mut blobs: Vec<Vec<u8>> = blobs.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
        blobs.sort_unstable();
        (templates, blobs)
    };
    assert!(stored(dir.path()) == stored(parsed_dir.path()), "the spans split the bodies differently");
}

#[test]
fn storage_grows_linearly_with_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let archive = start(dir.path());
    let bodies = growing_session(120, false);
    for body in &bodies {
        archive.record_exchange(with_spans(exchange("s", body, None)));
    }
    archive.close();
    let conn = store::open_ro(dir.path()).unwrap();
    let stored: i64 = conn
        .as_sqlite()
        .unwrap()
        .query_row(
            "SELECT (SELECT sum(length(data)) FROM blobs) + (SELECT sum(length(raw_template)) FROM exchanges)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let final_size = bodies.last().unwrap().len() as i64;
    let total_raw: i64 = bodies.iter().map(|b| b.len() as i64).sum();
    assert!(total_raw > 40 * final_size, "the fixture must be quadratic to mean anything");
    assert!(stored * 2 < final_size * 3, "stored {stored} bytes for a final transcript of {final_size}");
}

fn tamper_and_verify(edit: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let archive = start(dir.path());
    for (k, body) in growing_session(6, false).iter().enumerate() {
        let ticket = archive.record_exchange(exchange("victim", body, None));
        archive.record_response(ticket, response(format!("answer {k}").as_bytes()));
    }
    archive.record_exchange(exchange("bystander", b"{\"messages\":[]}", None));
    archive.close();
    let conn = pare::archive::Db::sqlite(rusqlite::Connection::open(dir.path().join(store::DB_FILE)).unwrap());
    assert!(verify(&conn, None).unwrap().ok());
    conn.execute_batch(edit).unwrap();
    let report = verify(&conn, None).unwrap();
    assert!(report.problems.iter().all(|p| p.session.as_deref() != Some("bystander")));
    report.problems.iter().map(|p| p.to_string()).collect()
}

#[test]
fn tampering_is_detected_with_a_clear_report() {
    let altered_blob = tamper_and_verify(
        "UPDATE blobs SET data = CAST('{\"role\":\"user\",\"content\":\"Fix nothing\"}' AS BLOB), codec = 0, raw_len = 41
         WHERE id = (SELECT min(id) + 1 FROM blobs)",
    );
    assert!(altered_blob.iter().any(|p| p.contains("does not match its SHA-256")), "{altered_blob:?}");

    let altered_field =
        tamper_and_verify("UPDATE exchanges SET path = '/v1/other' WHERE seq = 3 AND session = 'victim'");
    assert_eq!(
        altered_field,
        vec!["session victim request 3: request record was altered: its hash does not match its fields"]
    );

    let removed = tamper_and_verify("DELETE FROM responses WHERE session = 'victim' AND chain_idx = 5");
    assert!(removed.iter().any(|p| p.contains("removed")), "{removed:?}");

    let removed_last = tamper_and_verify(
        "DELETE FROM responses WHERE session = 'victim' AND chain_idx = 11;
         UPDATE sessions SET n_records = 11 WHERE id = 'victim'",
    );
    assert!(removed_last.iter().any(|p| p.contains("head")), "{removed_last:?}");

    let reordered = tamper_and_verify(
        "UPDATE exchanges SET at_ms = at_ms + 1 WHERE session = 'victim' AND seq = 2;
         UPDATE exchanges SET seq = -1 WHERE session = 'victim' AND seq = 2;
         UPDATE exchanges SET seq = 2 WHERE session = 'victim' AND seq = 3;
         UPDATE exchanges SET seq = 3 WHERE session = 'victim' AND seq = -1;",
    );
    assert!(!reordered.is_empty());
}

#[test]
fn secrets_never_reach_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.archive.dir = Some(dir.path().to_owned());
    config.archive.redact_headers = vec!["x-custom-secret".into()];
    let config = Arc::new(config);
    let archive = Archive::open(&config.archive);
    let pipeline = Pipeline::identity(Arc::clone(&config)).with_archive(Arc::clone(&archive));
    let mut headers = HeaderMap::new();
    headers.insert("authorization", "Bearer sk-test-SECRET".parse().unwrap());
    headers.insert("api-key", "sk-test-SECRET".parse().unwrap());
    headers.insert("x-api-key", "sk-test-SECRET".parse().unwrap());
    headers.insert("cookie", "session=sk-test-SECRET".parse().unwrap());
    headers.insert("proxy-authorization", "Basic sk-test-SECRET".parse().unwrap());
    headers.insert("x-pare-token", "sk-test-SECRET".parse().unwrap());
    headers.insert("x-custom-secret", "sk-test-SECRET".parse().unwrap());
    // Regression: generic credential headers were stored (their names only end in a credential word).
    headers.insert("x-custom-key", "sk-test-SECRET".parse().unwrap());
    headers.insert("x-portkey-virtual-key", "sk-test-SECRET".parse().unwrap());
    headers.insert("user-agent", "agent/1.0".parse().unwrap());
    let body = Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let prepared = runtime.block_on(pipeline.prepare_chat(&headers, body.clone()));
    let mut sink = prepared.sink.unwrap();
    let mut response_headers = HeaderMap::new();
    response_headers.insert("set-cookie", "sk-test-SECRET".parse().unwrap());
    response_headers.insert("content-type", "application/json".parse().unwrap());
    sink.head(200, &response_headers);
    sink.chunk(&Bytes::from_static(
        br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#,
    ));
    sink.finish(StreamEnd::Complete);
    archive.close();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if bytes.windows(b"SECRET".len()).any(|w| w == b"SECRET") {
            found.push(path);
        }
    }
    assert!(found.is_empty(), "secret found in {found:?}");
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let session = prepared.session.unwrap();
    assert_eq!(reader.body(&session, 1, BodyKind::Raw).unwrap(), body);
    let headers: String = reader
        .conn()
        .as_sqlite()
        .unwrap()
        .query_row("SELECT headers FROM exchanges WHERE session = ?1", [&session], |r| r.get(0))
        .unwrap();
    assert_eq!(headers, r#"{"user-agent":"agent/1.0"}"#);
}

/// Regression: a client that sent its own body under another's `x-pare-session` reset that
/// session's compaction and landed in its records (audit, training export). Another credential
/// under the same name gets a session of its own, named after a hash of its credential.
#[tokio::test]
async fn a_session_header_under_another_credential_starts_its_own_session() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.archive.dir = Some(dir.path().to_owned());
    let config = Arc::new(config);
    let archive = Archive::open(&config.archive);
    let pipeline = Pipeline::identity(Arc::clone(&config)).with_archive(Arc::clone(&archive));
    let request = |key: &str, text: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("x-pare-session", "shared".parse().unwrap());
        headers.insert("x-api-key", key.parse().unwrap());
        let body = json!({"model": "m", "messages": [{"role": "user", "content": text}]});
        (headers, Bytes::from(serde_json::to_vec(&body).unwrap()))
    };
    let mut sessions = Vec::new();
    for (key, text) in [("sk-owner", "mine"), ("sk-intruder", "theirs"), ("sk-owner", "mine again")] {
        let (headers, body) = request(key, text);
        let prepared = pipeline.prepare_chat(&headers, body).await;
        prepared.sink.unwrap().finish(StreamEnd::NoResponse("not sent".into()));
        sessions.push(prepared.session.unwrap());
    }
    assert_eq!((sessions[0].as_str(), sessions[2].as_str()), ("shared", "shared"));
    assert!(sessions[1].starts_with("shared-") && sessions[1].len() == "shared-".len() + 12, "{}", sessions[1]);
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let stored: Vec<(String, i64)> =
        reader.sessions(&SessionFilter::default()).unwrap().into_iter().map(|s| (s.id, s.n_requests)).collect();
    assert!(stored.contains(&("shared".to_owned(), 2)), "{stored:?}");
    assert!(stored.contains(&(sessions[1].clone(), 1)), "{stored:?}");
}

/// A conversation driven through the pipeline the way the proxy drives it.
struct Agent {
    messages: Vec<Value>,
}

impl Agent {
    fn new(system: &str, task: &str) -> Agent {
        Agent { messages: vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": task})] }
    }

    fn body(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(&json!({"model": "m", "stream": true, "messages": self.messages})).unwrap())
    }

    /// Send the current request, answer it with a streamed tool call, and append call + result.
    async fn step(&mut self, pipeline: &Pipeline, tag: &str, k: usize) -> (String, Bytes) {
        let body = self.body();
        let prepared = pipeline.prepare_chat(&HeaderMap::new(), body.clone()).await;
        let call_id = format!("call_{tag}_{k}");
        let mut sink = prepared.sink.expect("a sink for every chat request");
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "text/event-stream".parse().unwrap());
        sink.head(200, &headers);
        let args = serde_json::to_string(&json!({"command": format!("ls {k}")})).unwrap();
        let first = json!({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": "bash", "arguments": ""}}]}}]});
        let second = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}, "finish_reason": "tool_calls"}]});
        sink.chunk(&Bytes::from(format!("data: {first}\n\n")));
        sink.chunk(&Bytes::from(format!("data: {second}\n\ndata: [DONE]\n\n")));
        sink.finish(StreamEnd::Complete);
        self.messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "bash", "arguments": args}}]}));
        self.messages
            .push(json!({"role": "tool", "tool_call_id": call_id, "content": format!("output of step {k} for {tag}")}));
        (prepared.session.unwrap(), body)
    }
}

fn pipeline_with_archive(dir: &Path, durability: Durability) -> (Pipeline, Arc<Archive>) {
    let mut config = Config::default();
    config.archive.dir = Some(dir.to_owned());
    config.archive.durability = durability;
    config.archive.flush_interval_ms = 20;
    let config = Arc::new(config);
    let archive = Archive::open(&config.archive);
    (Pipeline::identity(Arc::clone(&config)).with_archive(Arc::clone(&archive)), archive)
}

#[tokio::test]
async fn strict_mode_commits_before_forwarding_and_sessions_follow_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let (pipeline, archive) = pipeline_with_archive(dir.path(), Durability::Strict);
    let mut agent = Agent::new("sys", "task");
    let mut sent = Vec::new();
    for k in 0..4 {
        let (session, body) = agent.step(&pipeline, "a", k).await;
        // Strict: the raw record is readable as soon as prepare_chat returned, without a flush.
        let reader = ArchiveReader::open(dir.path()).unwrap();
        assert!(reader.body(&session, k as i64 + 1, BodyKind::Raw).unwrap() == body);
        sent.push((session, body));
    }
    assert!(sent.iter().all(|(s, _)| *s == sent[0].0), "one conversation, one session");
    archive.flush().unwrap();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let answer = reader.response(&sent[0].0, 2).unwrap().unwrap();
    assert_eq!(answer.assembled.unwrap()["message"]["tool_calls"][0]["id"], "call_a_1");
    assert!(!answer.partial);
    assert!(verify(reader.conn(), None).unwrap().ok());

    // A restarted pare (new tracker, same archive) keeps the conversation in its session.
    drop(pipeline);
    archive.close();
    let (pipeline, archive) = pipeline_with_archive(dir.path(), Durability::Buffered);
    let (session, _) = agent.step(&pipeline, "a", 4).await;
    assert_eq!(session, sent[0].0);
    archive.close();
}

/// Build an archive from `tests/fixtures/archive/crafted_sessions.json`: each session has a transcript,
/// and each exchange sends its first `prefix` messages and gets `answer` (a transcript index, a literal
/// message, or null for no answer).
fn crafted_archive(dir: &Path) {
    let fixture: Value =
        serde_json::from_str(include_str!("../fixtures/archive/crafted_sessions.json")).expect("fixture is JSON");
    let archive = start(dir);
    for session in fixture.as_array().unwrap() {
        let id = session["id"].as_str().unwrap();
        let transcript = session["transcript"].as_array().unwrap();
        for ex in session["exchanges"].as_array().unwrap() {
            let n = ex["prefix"].as_u64().unwrap() as usize;
            let mut messages: Vec<Value> = transcript[..n].to_vec();
            if ex["strip_tool_names"] == json!(true) {
                for m in &mut messages {
                    if m["role"] == "tool" {
                        m.as_object_mut().unwrap().remove("name");
                    }
                }
            }
            let mut body = json!({"model": "crafted", "messages": messages});
            if let Some(tools) = session.get("tools") {
                body["tools"] = tools.clone();
            }
            let raw = serde_json::to_vec(&body).unwrap();
            let mut record = exchange(id, &raw, None);
            record.summary = None;
            let ticket = archive.record_exchange(record);
            let answer = match &ex["answer"] {
                Value::Number(i) => Some(transcript[i.as_u64().unwrap() as usize].clone()),
                Value::Null => None,
                literal => Some(literal.clone()),
            };
            if let Some(answer) = answer {
                let body = json!({"choices": [{"index": 0, "message": answer, "finish_reason": "stop"}]});
                let mut resp = response(&serde_json::to_vec(&body).unwrap());
                resp.assembled = Some(json!({"message": answer, "finish_reason": "stop"}));
                archive.record_response(ticket, resp);
            }
        }
    }
    archive.close();
}

/// Compare with a golden file; `PARE_BLESS=1` rewrites it.
fn check_golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/archive/golden").join(name);
    if std::env::var_os("PARE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("golden {}: {e}", path.display()));
    assert_eq!(actual, expected, "export differs from {}", path.display());
}

fn export_to_string(dir: &Path, f: impl FnOnce(&ArchiveReader, &mut Vec<u8>)) -> String {
    let reader = ArchiveReader::open(dir).unwrap();
    let mut out = Vec::new();
    f(&reader, &mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn dpo_pairs_mined_from_crafted_sessions_are_exactly_the_expected_ones() {
    use pare::archive::export::export_dpo;
    let dir = tempfile::tempdir().unwrap();
    crafted_archive(dir.path());
    let out = export_to_string(dir.path(), |r, out| {
        let stats = export_dpo(r, &SessionFilter::default(), out).unwrap();
        // Why the sessions gave no pair of a kind: the unanswered one none at all, each answered
        // one no branch or no retry but the one that gave it; the branch of the last request was
        // never continued (its answer ends the session), so which answer is chosen is unknown.
        let tally = stats.dpo;
        assert_eq!((tally.unanswered, tally.no_branch, tally.no_retry, tally.ambiguous_branches), (1, 1, 1, 1));
        assert!(tally.reasons().starts_with("1 session(s) without an answered request"), "{}", tally.reasons());
    });
    let rows: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let summary: Vec<(String, String, Value, Value)> = rows
        .iter()
        .map(|r| {
            let p = &r["provenance"];
            (
                p["session"].as_str().unwrap().into(),
                p["mined"].as_str().unwrap().into(),
                p["request"].clone(),
                p["chosen_request"].clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("branchy".into(), "branch".into(), json!(1), json!(2)),
            ("retrying".into(), "retry".into(), json!(1), json!(2)),
        ]
    );
    check_golden("dpo.jsonl", &out);
    // Filters: one session only.
    let only = export_to_string(dir.path(), |r, out| {
        let filter = SessionFilter { session: Some("retrying".into()), ..SessionFilter::default() };
        export_dpo(r, &filter, out).unwrap();
    });
    assert_eq!(only.lines().count(), 1);
}

/// `pare export dpo` that finds no pair says why, each reason counted.
#[test]
fn an_export_without_pairs_says_why() {
    let dir = tempfile::tempdir().unwrap();
    crafted_archive(dir.path());
    let archive = dir.path().to_str().unwrap();
    let out = pare_cli(&["export", "dpo", "--session", "unanswered", "--archive", archive]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("exported 0 preference pair(s) from 1 session(s): 1 session(s) without an answered request"),
        "{stderr}"
    );
    let out = pare_cli(&["export", "dpo", "--since", "2999-01-01", "--archive", archive]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("from 0 session(s): no session matches"));
    // A session with pairs says nothing more.
    let out = pare_cli(&["export", "dpo", "--session", "retrying", "--archive", archive]);
    assert!(
        String::from_utf8_lossy(&out.stderr).trim_end().ends_with("exported 1 preference pair(s) from 1 session(s)")
    );
}

#[test]
fn sft_export_in_both_formats_matches_the_golden_files() {
    use pare::archive::export::{SftFormat, export_sft};
    let dir = tempfile::tempdir().unwrap();
    crafted_archive(dir.path());
    for (format, name) in [(SftFormat::OpenAi, "sft_openai.jsonl"), (SftFormat::ShareGpt, "sft_sharegpt.jsonl")] {
        let out = export_to_string(dir.path(), |r, out| {
            let stats = export_sft(r, &SessionFilter::default(), format, out).unwrap();
            assert_eq!((stats.sessions, stats.rows), (3, 2), "the unanswered session gives no conversation");
        });
        check_golden(name, &out);
    }
}

/// The archive the Python `datasets` test exports from (`tests/e2e/test_export_datasets.py`) is the
/// crafted one, committed under `tests/fixtures/archive/crafted/`; `PARE_BLESS=1` rebuilds it. This test
/// keeps it current: it must verify and export exactly the golden files.
#[test]
fn committed_e2e_archive_verifies_and_exports_the_goldens() {
    use pare::archive::export::export_dpo;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/archive/crafted");
    if std::env::var_os("PARE_BLESS").is_some() {
        let dir = tempfile::tempdir().unwrap();
        crafted_archive(dir.path());
        let conn = rusqlite::Connection::open(dir.path().join(store::DB_FILE)).unwrap();
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE; VACUUM;").unwrap();
        drop(conn);
        std::fs::create_dir_all(&fixture).unwrap();
        std::fs::copy(dir.path().join(store::DB_FILE), fixture.join(store::DB_FILE)).unwrap();
    }
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(fixture.join(store::DB_FILE), copy.path().join(store::DB_FILE)).unwrap();
    let reader = ArchiveReader::open(copy.path()).unwrap();
    assert!(verify(reader.conn(), None).unwrap().ok());
    let out = export_to_string(copy.path(), |r, out| {
        export_dpo(r, &SessionFilter::default(), out).unwrap();
    });
    check_golden("dpo.jsonl", &out);
}

/// The child half of `kill_9_loses_nothing_acknowledged_and_corrupts_nothing`: writes a bounded load
/// (strict records in three sessions, buffered ones in a fourth) and prints `ACK session seq sha256` for
/// each strict record once its commit is confirmed.
fn crash_child(dir: &Path) {
    use std::io::Write;
    let strict = Archive::start(dir.to_owned(), Durability::Strict, Duration::from_millis(20));
    let buffered = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(20));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let bodies = growing_session(60, false);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut stdout = std::io::stdout().lock();
    for (k, body) in bodies.iter().cycle().take(3_000).enumerate() {
        if std::time::Instant::now() > deadline {
            break;
        }
        let session = format!("strict-{}", k % 3);
        let (_, committed) = runtime.block_on(strict.record_exchange_committed(exchange(&session, body, None), None));
        committed.unwrap();
        writeln!(stdout, "ACK {session} {} {}", k / 3 + 1, store::hex(&store::sha256(body))).unwrap();
        stdout.flush().unwrap();
        buffered.record_exchange(exchange("buffered", body, None));
    }
}

/// kill -9 of a process writing the archive: earlier records are intact (verify passes) and every
/// strict record acknowledged before the kill is there, byte for byte. The writer is a child process
/// running this same test binary in "child" mode (the proxy is not needed to exercise the writer, and
/// killing a real process is the only honest way to test a crash).
#[test]
fn kill_9_loses_nothing_acknowledged_and_corrupts_nothing() {
    use std::io::BufRead;
    if let Some(dir) = std::env::var_os("PARE_ARCHIVE_CRASH_CHILD") {
        crash_child(Path::new(&dir));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["archive::kill_9_loses_nothing_acknowledged_and_corrupts_nothing", "--exact", "--nocapture"])
        .env("PARE_ARCHIVE_CRASH_CHILD", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut acked: Vec<(String, i64, String)> = Vec::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        let Some(rest) = line.strip_prefix("ACK ") else { continue };
        let parts: Vec<&str> = rest.split(' ').collect();
        acked.push((parts[0].to_string(), parts[1].parse().unwrap(), parts[2].to_string()));
        if acked.len() == 150 {
            child.kill().unwrap(); // SIGKILL
            break;
        }
    }
    child.wait().unwrap();
    assert_eq!(acked.len(), 150, "the child stopped before the kill");
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let report = verify(reader.conn(), None).unwrap();
    assert!(report.ok(), "{:?}", report.problems);
    for (session, seq, sha) in &acked {
        let body = reader.body(session, *seq, BodyKind::Raw).unwrap();
        assert_eq!(store::hex(&store::sha256(&body)), *sha, "{session} request {seq}");
    }
    // The archive keeps working after the crash: a new writer appends to the same chains.
    let archive = start(dir.path());
    archive.record_exchange(exchange("strict-0", b"{\"messages\":[]}", None));
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert!(verify(reader.conn(), None).unwrap().ok());
}

#[test]
fn two_hundred_concurrent_sessions_with_identical_openings_stay_separate_and_ordered() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    let (pipeline, archive) = pipeline_with_archive(dir.path(), Durability::Buffered);
    let pipeline = Arc::new(pipeline);
    const AGENTS: usize = 200;
    const STEPS: usize = 5;
    let sent: Vec<Vec<Bytes>> = runtime.block_on(async {
        let mut tasks = Vec::new();
        for a in 0..AGENTS {
            let pipeline = Arc::clone(&pipeline);
            tasks.push(tokio::spawn(async move {
                // Agents 2i and 2i+1 share their system prompt, first message and first answer.
                let opening = a / 2;
                let mut agent = Agent::new("You are a coding agent.", &format!("task {opening}"));
                let mut bodies = Vec::new();
                for k in 0..STEPS {
                    let tag = if k == 0 { format!("opening{opening}") } else { format!("agent{a}") };
                    let (_, body) = agent.step(&pipeline, &tag, k).await;
                    // The tool result of step 0 differs between the two agents of a pair.
                    if k == 0 {
                        let last = agent.messages.last_mut().unwrap();
                        last["content"] = json!(format!("output for agent {a}"));
                    }
                    bodies.push(body);
                    tokio::task::yield_now().await;
                }
                bodies
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.push(t.await.unwrap());
        }
        all
    });
    archive.flush().unwrap();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let sessions = reader.sessions(&SessionFilter::default()).unwrap();
    assert_eq!(sessions.len(), AGENTS, "one session per agent");
    let mut matched = [false; AGENTS];
    for s in &sessions {
        let bodies: Vec<Vec<u8>> =
            (1..=s.n_requests).map(|seq| reader.body(&s.id, seq, BodyKind::Raw).unwrap()).collect();
        let agent = sent
            .iter()
            .enumerate()
            .position(|(a, b)| !matched[a] && b.iter().map(|x| x.to_vec()).collect::<Vec<_>>() == bodies);
        let agent =
            agent.unwrap_or_else(|| panic!("session {} is not exactly one agent's conversation in order", s.id));
        matched[agent] = true;
    }
    assert!(matched.iter().all(|m| *m));
    assert!(verify(reader.conn(), None).unwrap().ok());
    archive.close();
}

#[test]
fn an_archive_that_cannot_be_opened_keeps_the_pipeline_working_and_counts_losses() {
    let parent = tempfile::tempdir().unwrap();
    let not_a_dir = parent.path().join("archive");
    std::fs::write(&not_a_dir, b"a file where the archive directory should be").unwrap();
    let (pipeline, archive) = pipeline_with_archive(&not_a_dir, Durability::Strict);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let body = Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
    let prepared = runtime.block_on(pipeline.prepare_chat(&HeaderMap::new(), body.clone()));
    assert_eq!(prepared.body, body, "the request is still forwarded");
    prepared.sink.unwrap().finish(StreamEnd::NoResponse("upstream down".into()));
    archive.flush().unwrap();
    let health = archive.health();
    assert!(!health.writable);
    assert!(health.lost_records >= 2, "{health:?}");
    assert!(health.last_error.as_deref().unwrap().contains("archive"), "{health:?}");
    assert_eq!(pipeline.stats.strict_unconfirmed.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// `pare serve` listens once the archive has started: a reader opened right then (`pare sessions
/// list`, the pipeline rebuilding its sessions) finds an empty archive, never a store whose schema is
/// still being written.
#[test]
fn a_reader_opened_as_the_archive_starts_finds_it_empty() {
    for _ in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let archive = start(dir.path());
        let reader = ArchiveReader::open(dir.path()).expect("the store exists once the archive has started");
        assert_eq!(reader.sessions(&SessionFilter::default()).unwrap(), vec![]);
        archive.close();
    }
    // A store that cannot be opened is said so as soon as the archive has started; pare still starts.
    let parent = tempfile::tempdir().unwrap();
    let not_a_dir = parent.path().join("archive");
    std::fs::write(&not_a_dir, b"a file where the archive directory should be").unwrap();
    let archive = start(&not_a_dir);
    let health = archive.health();
    assert!(!health.writable && health.last_error.is_some(), "{health:?}");
    archive.close();
}

/// A store file whose schema is not there yet (a writer that is creating it) reads as no archive.
#[test]
fn a_store_without_its_schema_is_no_archive() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(store::DB_FILE), b"").unwrap();
    let err = ArchiveReader::open(dir.path()).err().expect("no archive to read");
    assert!(matches!(err, pare::archive::ArchiveError::NoStore(_)), "{err}");
    assert!(err.to_string().starts_with("no archive at "), "{err}");
}

/// A full archive (its size quota reached) loses the records that do not fit, counted and reported,
/// keeps every earlier one intact, and is writable again once space is freed (an old session
/// deleted while pare runs).
#[test]
fn a_full_archive_keeps_earlier_records_and_reports_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let archive =
        Archive::start_limited(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(5), Some(128 * 1024));
    let noise = |tag: &str, n: usize| -> String {
        (0..n).map(|i| store::hex(&store::sha256(format!("{tag}-{i}").as_bytes()))).collect::<Vec<_>>().join(" ")
    };
    let old = json!({"model": "m", "messages": [{"role": "user", "content": noise("old", 400)}]});
    archive.record_exchange(exchange("old", &serde_json::to_vec(&old).unwrap(), None));
    archive.flush().unwrap();
    let bodies = growing_session(200, false);
    let mut recorded = 0;
    for (k, body) in bodies.iter().enumerate() {
        // Distinct content per request, so the store must grow.
        let mut v: Value = serde_json::from_slice(body).unwrap();
        v["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": noise(&k.to_string(), 40)}));
        archive.record_exchange(exchange("s", &serde_json::to_vec(&v).unwrap(), None));
        archive.flush().unwrap();
        if archive.health().lost_records > 0 {
            break;
        }
        recorded += 1;
    }
    let health = archive.health();
    assert!(health.lost_records > 0 && !health.writable, "the quota was never reached: {health:?}");
    assert!(health.last_error.as_deref().unwrap().contains("full"), "{health:?}");
    let lost = health.lost_records;
    // Another large record is lost too.
    archive.record_exchange(exchange("s", noise("big", 400).as_bytes(), None));
    archive.flush().unwrap();
    assert_eq!(archive.health().lost_records, lost + 1);
    // Deleting the old session frees its pages: the next record fits and the archive says so.
    pare::archive::retention::delete_session(dir.path(), "old").unwrap();
    archive.record_exchange(exchange("s", b"{}", None));
    archive.flush().unwrap();
    assert!(archive.health().writable, "{:?}", archive.health());
    recorded += 1;
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert!(recorded > 1);
    assert_eq!(reader.session("s").unwrap().n_requests, recorded);
    assert!(verify(reader.conn(), None).unwrap().ok());
}

/// Log lines captured from every task of a current-thread runtime.
#[derive(Clone, Default)]
struct CapturedLogs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn pare_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().expect("run pare")
}

/// Exchanges through the real proxy (stub upstream, real pipeline from the configuration) land in the
/// archive: `sessions show --raw` reproduces the exact request bytes, `--forwarded` what the stub
/// received, answers are assembled, a conversation stays in one session, and the agent's key leaves no
/// trace in the store, the logs or an export.
#[tokio::test(flavor = "current_thread")]
async fn exchanges_through_the_proxy_land_in_the_archive() {
    use crate::support::pare::{config_for, start_with_pipeline};
    use crate::support::stub::{ANSWER, Stub};
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.archive.flush_interval_ms = 10;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    let pare = start_with_pipeline(Arc::clone(&config), Arc::clone(&pipeline)).await;
    let client = crate::support::client();

    // Request 1: pretty-printed JSON (whitespace must survive), not streamed.
    let first = "{\n  \"model\": \"stub-model\",\n  \"messages\": [\n    {\"role\": \"system\", \"content\": \"Be brief.\"},\n    {\"role\": \"user\", \"content\": \"Say hello.\"}\n  ]\n}\n";
    // Request 2 extends request 1 + its answer, streamed.
    let second = serde_json::to_string(&json!({
        "model": "stub-model",
        "stream": true,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "Again, streamed."},
        ],
    }))
    .unwrap();
    let mut sent = Vec::new();
    for body in [first.to_string(), second] {
        let response = client
            .post(pare.url("/v1/chat/completions"))
            .header("authorization", "Bearer sk-test-SECRET")
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
        sent.push(body);
    }
    pare.shutdown().await.unwrap();
    pipeline.archive().unwrap().close_async().await;

    let archive_dir = dir.path().to_str().unwrap();
    let listed = pare_cli(&["sessions", "list", "--json", "--archive", archive_dir]);
    let sessions: Vec<Value> =
        String::from_utf8(listed.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(sessions.len(), 1, "one conversation, one session: {sessions:?}");
    let id = sessions[0]["id"].as_str().unwrap();
    assert_eq!(sessions[0]["requests"], 2);
    // The stub also sees pare's context-window probes; keep the chat requests.
    let received: Vec<_> =
        stub.requests().into_iter().filter(|r| r.path_only().ends_with("/chat/completions")).collect();
    assert_eq!(received.len(), 2);
    for (n, body) in sent.iter().enumerate() {
        let seq = (n + 1).to_string();
        let raw = pare_cli(&["sessions", "show", id, "--raw", "--request", &seq, "--archive", archive_dir]);
        assert!(raw.status.success());
        assert!(raw.stdout == body.as_bytes(), "raw request {seq} is not byte-identical");
        let fwd = pare_cli(&["sessions", "show", id, "--forwarded", "--request", &seq, "--archive", archive_dir]);
        assert!(fwd.stdout == received[n].body, "forwarded request {seq} is not what the stub received");
    }
    let reader = ArchiveReader::open(dir.path()).unwrap();
    for seq in [1, 2] {
        let answer = reader.response(id, seq).unwrap().unwrap();
        assert_eq!(answer.assembled.unwrap()["message"]["content"], ANSWER);
        assert!(!answer.partial);
        assert_eq!(answer.stream, seq == 2);
    }
    let verified = pare_cli(&["sessions", "verify", "--archive", archive_dir]);
    assert!(verified.status.success(), "{}", String::from_utf8_lossy(&verified.stdout));

    // The secret: nowhere in the store files, the logs, or an export.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        assert!(!bytes.windows(6).any(|w| w == b"SECRET"), "secret in the store");
    }
    assert!(!logs.0.lock().unwrap().is_empty(), "the log capture works");
    assert!(!String::from_utf8_lossy(&logs.0.lock().unwrap()).contains("SECRET"), "secret in the logs");
    for args in [["export", "sft"], ["export", "dpo"]] {
        let out = pare_cli(&[args[0], args[1], "--archive", archive_dir]);
        assert!(out.status.success());
        assert!(!String::from_utf8_lossy(&out.stdout).contains("SECRET"));
    }
}

/// Regression: Hermes Agent resuming a session (`captured_requests_chat` in the corpus) re-sends old
/// tool messages without their `name` key; the session must not split there. The fixture is that
/// session with tool schemas dropped and long strings shortened (consistently across requests).
#[test]
fn hermes_resume_without_tool_names_stays_in_one_session() {
    use pare::session::{Assigned, SessionTracker};
    use pare::wire::ChatBody;
    let requests: Vec<&str> = include_str!("../fixtures/archive/hermes_resume.jsonl").lines().collect();
    let tracker = SessionTracker::new(&Config::default().archive);
    let mut hows = Vec::new();
    let mut sessions = Vec::new();
    for (k, line) in requests.iter().enumerate() {
        let body = ChatBody::parse(line.as_bytes()).unwrap();
        let assignment = tracker.assign(&HeaderMap::new(), Some(body.messages()));
        // The answer to request k is the assistant message request k+1 carries at that position.
        if let Some(next) = requests.get(k + 1) {
            let next: Value = serde_json::from_str(next).unwrap();
            let answer = &next["messages"][body.messages().len()];
            assert_eq!(answer["role"], "assistant");
            tracker.answered(&assignment.session, assignment.key_req, answer);
        }
        hows.push(assignment.how);
        sessions.push(assignment.session);
    }
    assert_eq!(requests.len(), 6);
    assert!(sessions.iter().all(|s| *s == sessions[0]), "{hows:?}");
    assert_eq!(hows[0], Assigned::New);
    assert!(hows[1..].iter().all(|h| *h == Assigned::Extends), "{hows:?}");
}

/// `pare eval --archive`: the sessions of an archive are read back as their raw requests, in order,
/// and evaluate as the same bodies read from a session file do.
#[test]
fn eval_replays_the_raw_sessions_of_an_archive() {
    use pare::budget::{CompactEngine, SessionCompactor};
    use pare::eval::corpus::{Requests, SessionInput, from_archive};
    use pare::eval::strategy::Strategy;
    use pare::eval::{EvalInput, evaluate_sessions};

    let dir = tempfile::tempdir().unwrap();
    let archive = start(dir.path());
    let bodies = growing_session(12, false);
    for body in &bodies {
        // What pare forwarded is archived too; eval must read the raw side.
        archive.record_exchange(with_spans(exchange("agent-1", body, Some(b"{\"messages\":[]}"))));
    }
    archive.record_exchange(exchange("agent-2", &bodies[0], None));
    archive.close();

    let sessions = from_archive(dir.path()).unwrap();
    let ids: Vec<&str> = sessions.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["agent-1", "agent-2"]);
    let Requests::Bodies(read) = &sessions[0].requests else { panic!("an archive's sessions are bodies") };
    assert_eq!(read, &bodies);

    let config = Config::from_yaml("compaction:\n  mode: eager\n").unwrap();
    let engine = Arc::new(pare::compact::Engine::from_config(&config).unwrap());
    let compactor = SessionCompactor::new(&config, engine.clone() as Arc<dyn CompactEngine>).unwrap();
    let report =
        evaluate_sessions(&sessions, Strategy::Pare, &compactor, engine.as_ref(), 8_192, EvalInput::default()).unwrap();
    let direct = SessionInput { source: "archive".into(), id: "agent-1".into(), requests: Requests::Bodies(bodies) };
    let expected =
        evaluate_sessions(&[direct], Strategy::Pare, &compactor, engine.as_ref(), 8_192, EvalInput::default()).unwrap();
    assert_eq!(report.sessions[0].metrics, expected.sessions[0].metrics);
    assert_eq!(report.sessions[0].metrics.requests, 12);
    assert!(report.sessions[0].metrics.saved() > 0.0, "eager collapses the outputs older than the tail");
    assert_eq!(report.total.sessions, 2);
    assert_eq!(report.sources.keys().collect::<Vec<_>>(), ["archive"]);
}

/// An archive whose writer gathers records for a minute before it commits (unless someone waits for
/// a commit) and whose queue holds 1 MiB: two 400 KB records fill it.
fn slow_archive_with_a_small_queue(dir: &Path) -> Arc<Archive> {
    let config = pare::config::ArchiveConfig {
        dir: Some(dir.to_owned()),
        flush_interval_ms: 60_000,
        max_queue_bytes: 1024 * 1024,
        ..Default::default()
    };
    Archive::open(&config)
}

fn big_record(k: usize) -> ExchangeRecord {
    exchange("s", format!("{{\"k\":{k},\"pad\":\"{}\"}}", "x".repeat(400 * 1024)).as_bytes(), None)
}

/// A record that does not fit in the queue waits for the writer to make room, and is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_makes_the_request_wait_for_the_writer_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let archive = slow_archive_with_a_small_queue(dir.path());
    archive.queue_exchange(big_record(1)).await;
    archive.queue_exchange(big_record(2)).await;
    let third = tokio::spawn({
        let archive = Arc::clone(&archive);
        async move { archive.queue_exchange(big_record(3)).await }
    });
    // The writer holds both records for a minute: the third waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!third.is_finished(), "the third record must wait for room");
    assert_eq!(archive.health().queue_waits, 1);
    // A flush makes the writer commit what it holds, which gives their room back.
    archive.flush_async().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), third).await.expect("room was made").unwrap();
    archive.flush_async().await.unwrap();
    let health = archive.health();
    assert_eq!((health.committed_records, health.lost_records, health.queue_bytes), (3, 0, 0), "{health:?}");
    archive.close_async().await;
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert_eq!(reader.session("s").unwrap().n_requests, 3);
    assert!(reader.body("s", 3, BodyKind::Raw).unwrap().starts_with(b"{\"k\":3,"));
}

/// A writer that frees no room for `QUEUE_WAIT` (a stalled disk): the waiting record is dropped,
/// counted and logged, the archive reports it; the next records that do not fit are dropped without
/// waiting until the writer moves again; then records are queued and stored as before.
#[tokio::test(start_paused = true)]
async fn a_stalled_writer_costs_one_bounded_wait_then_records_are_counted_lost() {
    let dir = tempfile::tempdir().unwrap();
    let archive = slow_archive_with_a_small_queue(dir.path());
    archive.queue_exchange(big_record(1)).await;
    archive.queue_exchange(big_record(2)).await;
    let started = tokio::time::Instant::now();
    archive.queue_exchange(big_record(3)).await;
    assert_eq!(started.elapsed(), pare::archive::QUEUE_WAIT, "waited for room, then gave up");
    let health = archive.health();
    assert_eq!((health.lost_records, health.queue_waits, health.writable), (1, 1, false), "{health:?}");
    assert!(health.last_error.as_deref().unwrap().contains("queue full"), "{health:?}");
    let started = tokio::time::Instant::now();
    archive.queue_exchange(big_record(4)).await;
    assert_eq!(started.elapsed(), Duration::ZERO, "no second wait while the writer is stalled");
    assert_eq!(archive.health().lost_records, 2);
    // The writer commits (a flush is urgent): room again, and the archive recovers.
    archive.flush().unwrap();
    archive.queue_exchange(big_record(5)).await;
    archive.flush().unwrap();
    let health = archive.health();
    assert_eq!((health.committed_records, health.lost_records, health.writable), (3, 2, true), "{health:?}");
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert!(reader.body("s", 3, BodyKind::Raw).unwrap().starts_with(b"{\"k\":5,"));
    assert!(verify(reader.conn(), None).unwrap().ok());
}

/// Consecutive bodies with the same messages but other separators between them (an agent that
/// re-serializes its history) come back byte for byte: a delta shares a message only with its separator.
#[test]
fn a_body_that_only_changes_its_separators_comes_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let archive = start(dir.path());
    let bodies: [&[u8]; 3] = [
        br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}"#,
        br#"{"model":"m","messages":[{"role":"system","content":"s"}, {"role":"user","content":"u"}, {"role":"assistant","content":"a"}]}"#,
        br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"assistant","content":"a"}]}"#,
    ];
    for body in bodies {
        archive.record_exchange(with_spans(exchange("s", body, None)));
    }
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    for (k, body) in bodies.iter().enumerate() {
        assert_eq!(reader.body("s", k as i64 + 1, BodyKind::Raw).unwrap(), *body, "request {}", k + 1);
    }
    assert!(verify(reader.conn(), None).unwrap().ok());
}
