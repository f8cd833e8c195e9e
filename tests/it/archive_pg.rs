//! The archive on PostgreSQL as on SQLite: every operation on both backends, two writers of one
//! session keeping one hash chain, compare-and-set exchanges, records waiting for a stopped
//! database, concurrent migrations, and `pare archive copy` between the backends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pare::archive::copy::{CopyError, copy};
use pare::archive::query::{ArchiveReader, SessionFilter};
use pare::archive::read::BodyKind;
use pare::archive::verify::verify;
use pare::archive::{Archive, ArchiveError, ExchangeRecord, Location, ResponseRecord, store};
use pare::budget::compactor::{FrozenPlan, SessionPlan};
use pare::config::Durability;
use pare::pipeline::{CompactionSummary, StreamEnd};
use pare::session::StoredKey;
use serde_json::json;

use crate::pg_server::{self, PgServer};

fn postgres() -> Location {
    Location::parse(&pg_server::database(), None).unwrap()
}

/// Run `body` against a fresh SQLite archive and a fresh PostgreSQL one.
fn each_backend(body: impl Fn(&Location)) {
    let dir = tempfile::tempdir().unwrap();
    body(&Location::Dir(dir.path().to_owned()));
    body(&postgres());
}

fn start(location: &Location) -> Arc<Archive> {
    Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5))
}

/// Request `k` of a growing agent session: the system prompt, the task and `k` tool steps.
fn body(k: usize) -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. ".repeat(30)}),
        json!({"role": "user", "content": "Fix the failing test"}),
    ];
    for step in 0..k {
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{step}"), "type": "function", "function": {"name": "bash", "arguments": format!("{{\"command\":\"cat f{step}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{step}"), "content": format!("fn f{step}() {{}}\n").repeat(20 + step)}));
    }
    serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap()
}

fn exchange(session: &str, k: usize) -> ExchangeRecord {
    let raw = body(k);
    // Every other request is forwarded changed (its last tool output cut).
    let forwarded = (k % 2 == 1).then(|| {
        let mut value: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        let messages = value["messages"].as_array_mut().unwrap();
        *messages.last_mut().unwrap() =
            json!({"role": "tool", "tool_call_id": format!("c{}", k - 1), "content": "[cut]"});
        Bytes::from(serde_json::to_vec(&value).unwrap())
    });
    ExchangeRecord {
        session: session.into(),
        at_ms: 1_700_000_000_000 + k as i64,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("m".into()),
        headers: vec![("user-agent".into(), "test".into())],
        raw: Bytes::from(raw),
        raw_spans: None,
        forwarded,
        forwarded_spans: None,
        summary: Some(CompactionSummary { tokens_raw: 100 + k as u64, tokens_forwarded: 60, ..Default::default() }),
        late_summary: None,
        skipped: None,
        key_req: Some(1000 + k as u64),
        expect_requests: None,
        lists: Default::default(),
    }
}

fn response(k: usize) -> ResponseRecord {
    let answer = json!({"message": {"role": "assistant", "content": format!("answer {k}")}, "finish_reason": "stop",
        "usage": {"prompt_tokens": 100 + k, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 40}}});
    ResponseRecord {
        at_ms: 1_700_000_000_500 + k as i64,
        status: Some(200),
        headers: vec![("content-type".into(), "application/json".into())],
        stream: false,
        end: StreamEnd::Complete,
        body: format!("{{\"answer\":{k}}}").into_bytes(),
        truncated: None,
        assembled: Some(answer),
        key_ext: Some(2000 + k as u64),
    }
}

fn plan(epoch: u64) -> SessionPlan {
    let frozen = FrozenPlan {
        raw_hashes: vec![1, 2],
        prefix: vec![r#"{"role":"system","content":"s"}"#.into(), "[tool: cut]".into()],
        prefix_seen: vec![],
        plan: Some(vec![
            pare::compact::Fate::Kept { at: 0 },
            pare::compact::Fate::Rewritten {
                at: 1,
                rules: [pare::compact::report::RuleId::Truncate].into_iter().collect(),
            },
        ]),
    };
    SessionPlan { epoch, advanced_at_len: 2, saturated: false, frozen: Some(frozen), ..SessionPlan::default() }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Everything a reader says about an archive, to compare two backends.
fn describe(location: &Location) -> String {
    let reader = ArchiveReader::open(location).unwrap();
    let mut out = String::new();
    for info in reader.sessions(&SessionFilter::default()).unwrap() {
        out += &format!("{info:?}\n");
        for e in reader.exchanges(&info.id).unwrap() {
            let raw = reader.body(&info.id, e.seq, BodyKind::Raw).unwrap();
            let fwd = reader.body(&info.id, e.seq, BodyKind::Forwarded).unwrap();
            let answer = reader.response(&info.id, e.seq).unwrap();
            out += &format!(
                "{} {} {:?} {:?} raw {} fwd {} answer {:?}\n",
                e.seq,
                e.path,
                e.summary,
                e.usage,
                pare::archive::store::hex(&store::sha256(&raw)),
                pare::archive::store::hex(&store::sha256(&fwd)),
                answer.map(|a| (a.status, String::from_utf8(a.body).unwrap(), a.assembled))
            );
        }
        out += &format!("{:?}\n", pare::archive::plan::latest(reader.conn(), &info.id).unwrap().map(|(_, plan)| plan));
    }
    out += &format!("{:?}\n", reader.session_page(&SessionFilter::default(), 0, 10).unwrap());
    out
}

/// Every reader and writer operation gives the same answers on PostgreSQL as on SQLite: bodies
/// byte for byte, answers, usage, plans, pages, keys, verify and delete.
#[test]
fn every_archive_operation_answers_alike_on_both_backends() {
    let descriptions = std::sync::Mutex::new(Vec::new());
    each_backend(|location| {
        let archive = start(location);
        let rt = runtime();
        for k in 0..6 {
            let plan = (k == 3).then(|| plan(1));
            let (ticket, seq) = rt.block_on(archive.record_exchange_committed(exchange("s", k), plan));
            assert_eq!(seq.unwrap(), k as i64 + 1);
            archive.record_response(ticket, response(k));
        }
        archive.record_exchange(exchange("other", 0));
        archive.flush().unwrap();
        let reader = ArchiveReader::open(location).unwrap();
        let report = verify(reader.conn(), None).unwrap();
        assert!(report.ok(), "{location}: {:?}", report.problems);
        assert_eq!((report.exchanges, report.responses), (7, 6));
        assert_eq!(reader.body("s", 4, BodyKind::Raw).unwrap(), body(3));
        assert_eq!(reader.session_requests("s").unwrap(), Some(6));
        assert_eq!(reader.session_requests("nobody").unwrap(), None);
        // Keys: a request key of "s" and an answer key of "s" find it; "other" shares request key 1000.
        let found = reader.sessions_with_keys(&[1003, 2005, 42], 10).unwrap();
        let recent = reader.recent_session_keys(10).unwrap();
        let keys_of_s = recent.iter().find(|(id, _)| id == "s").unwrap().1.clone();
        assert_eq!(found, vec![("s".to_owned(), keys_of_s.clone())]);
        assert_eq!(keys_of_s[..2], [StoredKey::Request(1000), StoredKey::Answer(2000)]);
        let both = reader.sessions_with_keys(&[1000], 10).unwrap();
        // Most recently active first: "s" has answers after "other"'s one request.
        assert_eq!(both.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["s", "other"]);
        descriptions.lock().unwrap().push(describe(location));
        archive.close();
        let deleted = pare::archive::retention::delete_session(location, "other").unwrap();
        assert_eq!(deleted.exchanges, 1);
        assert!(matches!(ArchiveReader::open(location).unwrap().session("other"), Err(ArchiveError::NoSession(_))));
        assert!(verify(ArchiveReader::open(location).unwrap().conn(), None).unwrap().ok());
    });
    let descriptions = descriptions.into_inner().unwrap();
    assert!(descriptions[0].contains("Some(Usage"), "{}", descriptions[0]);
    assert_eq!(descriptions[0], descriptions[1], "SQLite and PostgreSQL answer differently");
}

/// Regression: each writer cached its sessions' chain heads in memory, so two pare processes
/// appending to one session broke its hash chain (`pare sessions verify`: "response is at chain
/// position 99, expected 100"). Two archives on one store, taking turns on one session, keep one
/// chain on both backends.
#[test]
fn two_writers_of_one_session_keep_one_chain() {
    each_backend(|location| {
        let (a, b) = (start(location), start(location));
        for k in 0..10 {
            let writer = if k % 2 == 0 { &a } else { &b };
            let ticket = writer.record_exchange(exchange("shared", k));
            writer.flush().unwrap();
            writer.record_response(ticket, response(k));
            writer.flush().unwrap();
        }
        a.close();
        b.close();
        let reader = ArchiveReader::open(location).unwrap();
        let report = verify(reader.conn(), None).unwrap();
        assert!(report.ok(), "{location}: {:?}", report.problems);
        let seqs: Vec<i64> = reader.exchanges("shared").unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
        assert_eq!(reader.body("shared", 10, BodyKind::Forwarded).unwrap(), exchange("shared", 9).forwarded.unwrap());
    });
}

/// Two writers appending to one session at the same time (no turns) still keep one chain: the
/// session's row is locked per transaction and a lost race is retried.
#[test]
fn concurrent_writers_of_one_session_serialize() {
    each_backend(|location| {
        let writers: Vec<Arc<Archive>> = (0..3).map(|_| start(location)).collect();
        std::thread::scope(|scope| {
            for (w, archive) in writers.iter().enumerate() {
                scope.spawn(move || {
                    for k in 0..8 {
                        let ticket = archive.record_exchange(exchange("race", w * 8 + k));
                        archive.record_response(ticket, response(k));
                        if k % 3 == 0 {
                            archive.flush().unwrap();
                        }
                    }
                    archive.flush().unwrap();
                });
            }
        });
        let lost: u64 = writers.iter().map(|w| w.health().lost_records).sum();
        assert_eq!(lost, 0, "{:?}", writers.iter().map(|w| w.health()).collect::<Vec<_>>());
        for w in &writers {
            w.close();
        }
        let reader = ArchiveReader::open(location).unwrap();
        let report = verify(reader.conn(), None).unwrap();
        assert!(report.ok(), "{location}: {:?}", report.problems);
        assert_eq!((report.exchanges, report.responses), (24, 24));
    });
}

/// An exchange with `expect_requests` is written only when its session holds that many requests;
/// a stale one is refused with the counts, and its plan and answer are not written.
#[test]
fn compare_and_set_writes_only_on_the_expected_count() {
    each_backend(|location| {
        let archive = start(location);
        let rt = runtime();
        let with = |k: usize, n: i64| ExchangeRecord { expect_requests: Some(n), ..exchange("cas", k) };
        let (_, first) = rt.block_on(archive.record_exchange_committed(with(0, 0), None));
        assert_eq!(first.unwrap(), 1);
        let (ticket, stale) = rt.block_on(archive.record_exchange_committed(with(1, 0), Some(plan(3))));
        match stale {
            Err(ArchiveError::Stale { session, expected, archived }) => {
                assert_eq!((session.as_str(), expected, archived), ("cas", 0, 1))
            }
            other => panic!("{location}: expected a stale refusal, got {other:?}"),
        }
        archive.record_response(ticket, response(1));
        let (_, second) = rt.block_on(archive.record_exchange_committed(with(1, 1), None));
        assert_eq!(second.unwrap(), 2);
        // An unknown session expected to hold requests is refused, and not created.
        let (_, unknown) = rt.block_on(
            archive.record_exchange_committed(ExchangeRecord { expect_requests: Some(4), ..exchange("new", 0) }, None),
        );
        assert!(matches!(unknown, Err(ArchiveError::Stale { archived: 0, .. })), "{unknown:?}");
        archive.flush().unwrap();
        let health = archive.health();
        assert_eq!((health.lost_records, health.committed_records), (0, 2), "{health:?}");
        let reader = ArchiveReader::open(location).unwrap();
        assert!(verify(reader.conn(), None).unwrap().ok());
        assert_eq!(reader.exchanges("cas").unwrap().len(), 2);
        assert!(reader.response("cas", 2).unwrap().is_none(), "the stale exchange's answer was written");
        assert_eq!(pare::archive::plan::latest(reader.conn(), "cas").unwrap(), None);
        assert_eq!(reader.session_requests("new").unwrap(), None);
    });
}

/// An exchange nobody waits for any more (its strict wait timed out and it was forwarded, or it was
/// queued without waiting) is written whatever its `expect_requests`: a request is never left out.
#[test]
fn an_exchange_nobody_waits_for_is_written_whatever_its_expectation() {
    each_backend(|location| {
        let archive = start(location);
        let rt = runtime();
        rt.block_on(archive.queue_exchange(ExchangeRecord { expect_requests: Some(7), ..exchange("gone", 0) }));
        archive.flush().unwrap();
        let reader = ArchiveReader::open(location).unwrap();
        assert_eq!(reader.session_requests("gone").unwrap(), Some(1), "{location}");
        assert!(verify(reader.conn(), None).unwrap().ok());
    });
}

/// Replicas that start together on a new database both open it: the migration runs once.
#[test]
fn replicas_migrating_one_database_together_both_open() {
    let location = postgres();
    let opened: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4).map(|_| scope.spawn(|| store::open_location_rw(&location).map(drop))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(opened.iter().all(Result::is_ok), "{opened:?}");
    let db = store::open_location_rw(&location).unwrap();
    assert_eq!(store::postgres_schema_version(&db).unwrap(), store::PG_SCHEMA_VERSION);
}

/// A stopped database does not lose what was acknowledged: the records wait (health says why,
/// password hidden) within the queue's byte bound (beyond it they are counted lost), a strict
/// request waits at most `commit_timeout`, and when the server is back they are written in order
/// and the chain verifies.
#[test]
fn records_wait_for_a_stopped_database_and_land_when_it_returns() {
    let server = PgServer::start();
    let url = server.database().replace("postgres@", "postgres:hunter2@");
    let location = Location::parse(&url, None).unwrap();
    // A second archive with a 1 MiB queue: what waits for the database stays within it.
    let small_location = Location::parse(&server.database(), None).unwrap();
    // A third one is closed while the database is away: its held records are counted lost, and
    // closing does not hang.
    let gone = Archive::start_at(
        Location::parse(&server.database(), None).unwrap(),
        Durability::Buffered,
        Duration::from_millis(5),
    );
    let small = Archive::launch(
        small_location.clone(),
        Durability::Buffered,
        Duration::from_millis(5),
        None,
        1 << 20,
        Duration::from_secs(1),
    );
    let commit_timeout = Duration::from_millis(300);
    let archive = Archive::launch(
        location.clone(),
        Durability::Buffered,
        Duration::from_millis(5),
        None,
        64 << 20,
        commit_timeout,
    );
    for k in 0..3 {
        let ticket = archive.record_exchange(exchange("down", k));
        archive.record_response(ticket, response(k));
    }
    archive.flush().unwrap();
    assert_eq!(archive.health().committed_records, 6);
    server.stop();
    for k in 3..8 {
        let ticket = archive.record_exchange(exchange("down", k));
        archive.record_response(ticket, response(k));
    }
    archive.flush().unwrap();
    let big = |k: usize| ExchangeRecord::unchanged("big", k as i64, Bytes::from(vec![b'x'; 300 << 10]));
    for k in 0..8 {
        small.record_exchange(big(k));
        small.flush().unwrap();
    }
    let small_health = small.health();
    assert!(small_health.queue_bytes <= 1 << 20, "{small_health:?}");
    assert!(small_health.lost_records >= 4 && small_health.queue_depth >= 2, "{small_health:?}");
    let kept = 8 - small_health.lost_records;
    gone.record_exchange(exchange("gone", 0));
    gone.record_exchange(exchange("gone", 1));
    gone.flush().unwrap();
    let closing = Instant::now();
    gone.close();
    assert!(closing.elapsed() < Duration::from_secs(10), "{:?}", closing.elapsed());
    assert_eq!((gone.health().lost_records, gone.health().committed_records), (2, 0), "{:?}", gone.health());
    let started = Instant::now();
    let (_, strict) = runtime().block_on(archive.record_exchange_committed(exchange("strict", 0), None));
    assert!(matches!(strict, Err(ArchiveError::CommitTimeout(_))), "{strict:?}");
    assert!(started.elapsed() < commit_timeout + Duration::from_secs(1), "{:?}", started.elapsed());
    let health = archive.health();
    assert!(!health.writable, "{health:?}");
    assert_eq!(health.lost_records, 0, "{health:?}");
    assert!(health.queue_depth >= 10, "{health:?}");
    let shown = format!("{health:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(health.dir.contains("postgres:***@"), "{shown}");

    server.resume();
    let deadline = Instant::now() + Duration::from_secs(60);
    while archive.health().committed_records < 17 {
        assert!(Instant::now() < deadline, "the held records were not written: {:?}", archive.health());
        std::thread::sleep(Duration::from_millis(100));
    }
    let health = archive.health();
    assert!(health.writable, "{health:?}");
    assert_eq!((health.queue_depth, health.lost_records), (0, 0), "{health:?}");
    archive.close();
    while small.health().committed_records < kept {
        assert!(Instant::now() < deadline, "the small archive's held records were not written: {:?}", small.health());
        std::thread::sleep(Duration::from_millis(100));
    }
    small.close();
    let small_reader = ArchiveReader::open(&small_location).unwrap();
    assert!(verify(small_reader.conn(), None).unwrap().ok());
    assert_eq!(small_reader.exchanges("big").unwrap().len() as u64, kept);
    let reader = ArchiveReader::open(&location).unwrap();
    let report = verify(reader.conn(), None).unwrap();
    assert!(report.ok(), "{:?}", report.problems);
    assert_eq!(reader.exchanges("down").unwrap().len(), 8);
    assert_eq!(reader.exchanges("strict").unwrap().len(), 1);
    server.stop();
}

fn build_sqlite_archive(dir: &std::path::Path) {
    let archive = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(5));
    let rt = runtime();
    for session in ["alpha", "beta"] {
        for k in 0..5 {
            let plan = (k == 2).then(|| plan(1));
            let (ticket, _) = rt.block_on(archive.record_exchange_committed(exchange(session, k), plan));
            archive.record_response(ticket, response(k));
        }
    }
    archive.close();
}

/// `pare archive copy` moves every session SQLite → PostgreSQL → SQLite with the same chains,
/// bodies, answers, usage and plans, refuses to copy over a session the target holds, and says so
/// with a non-zero exit.
#[test]
fn archive_copy_round_trips_sqlite_postgres_sqlite() {
    let source = tempfile::tempdir().unwrap();
    build_sqlite_archive(source.path());
    let from = Location::Dir(source.path().to_owned());
    let pg = postgres();
    let report = copy(&from, &pg).unwrap();
    assert!(report.ok(), "{report:?}");
    assert_eq!((report.sessions, report.exchanges, report.responses), (2, 10, 10));
    let back_dir = tempfile::tempdir().unwrap();
    let back = Location::Dir(back_dir.path().join("copy"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["archive", "copy", &pg_url(&pg), back_dir.path().join("copy").to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("0 problem(s), 0 mismatch(es)"), "{stdout}");
    assert_eq!(describe(&from), describe(&pg));
    assert_eq!(describe(&from), describe(&back));
    assert!(matches!(copy(&from, &pg), Err(CopyError::Occupied(_))));
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["archive", "copy", source.path().to_str().unwrap(), &pg_url(&pg)])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds session(s)"), "{again:?}");
}

fn pg_url(location: &Location) -> String {
    // The test server trusts its clients: the shown URL (no password) connects.
    location.to_string()
}

/// Regression: `--archive postgres://…` was taken for a directory named `postgres:`; any other
/// scheme was too. The commands read a PostgreSQL archive from the URL and refuse other schemes.
#[test]
fn every_command_takes_a_postgres_url_and_refuses_other_schemes() {
    let source = tempfile::tempdir().unwrap();
    build_sqlite_archive(source.path());
    let pg = postgres();
    assert!(copy(&Location::Dir(source.path().to_owned()), &pg).unwrap().ok());
    let url = pg_url(&pg);
    let pare = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().unwrap();
    let list = pare(&["sessions", "list", "--archive", &url]);
    assert!(list.status.success(), "{list:?}");
    assert!(String::from_utf8_lossy(&list.stdout).contains("alpha"), "{list:?}");
    let verify = pare(&["sessions", "verify", "--archive", &url]);
    assert!(verify.status.success(), "{verify:?}");
    let show = pare(&["sessions", "show", "beta", "--raw", "--archive", &url]);
    assert!(String::from_utf8_lossy(&show.stdout).contains("Fix the failing test"), "{show:?}");
    let export = pare(&["export", "--archive", &url, "sft"]);
    assert!(export.status.success(), "{export:?}");
    let delete = pare(&["sessions", "delete", "alpha", "--archive", &url]);
    assert!(delete.status.success(), "{delete:?}");
    for bad in ["mysql://u:pw@h/db", "postgres:pare"] {
        let out = pare(&["sessions", "list", "--archive", bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("archive location"), "{bad}: {stderr}");
        assert!(!stderr.contains(":pw@"), "{stderr}");
    }
}

/// On PostgreSQL a blob the writer has not cached costs two statements (round trips): the lookup
/// by hash, then either one statement that inserts and links a new blob, or the link of one the
/// database holds (its content is not sent again). Both leave it linked to its sessions.
#[test]
fn a_new_blob_is_stored_and_linked_in_two_statements() {
    use pare::archive::db::Param;
    let db = store::open_location_rw(&postgres()).unwrap();
    let content = b"a message the database has not seen".repeat(10);
    let hash = store::sha256(&content);
    let before = db.statements();
    let id = store::put_blob_linked(&db, &hash, &content, "s1").unwrap();
    assert_eq!(db.statements() - before, 2, "a new blob");
    let before = db.statements();
    assert_eq!(store::put_blob_linked(&db, &hash, &content, "s2").unwrap(), id);
    assert_eq!(db.statements() - before, 2, "a blob the database holds");
    let links: i64 =
        db.query_one("SELECT count(*) FROM session_blobs WHERE blob = ?1", &[Param::Int(id)]).unwrap().get(0).unwrap();
    assert_eq!(links, 2);
    assert_eq!(store::read_blob(&db, id).unwrap(), content);
}
