//! The PostgreSQL archive against what a client or an operator can throw at it: text PostgreSQL
//! refuses (U+0000) in every text field and header through the four wires, a record the database
//! refuses among good ones, the readers' connection bound and a database restart, every spelling
//! of a password in the URL, and the start-up check telling permanent errors from transient ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pare::archive::db::Db;
use pare::archive::query::{ArchiveReader, SessionFilter};
use pare::archive::read::BodyKind;
use pare::archive::verify::verify;
use pare::archive::{Archive, ArchiveError, ExchangeRecord, Location, ResponseRecord};
use pare::config::location::PgLocation;
use pare::config::{Config, Durability};
use pare::exchange::BudgetReport;
use pare::pipeline::{CompactionSummary, StreamEnd};
use pare::wire::Wire;
use serde_json::json;

use crate::pg_server::{self, PgServer};
use crate::resume::{archived_config, path, session, start, stream};
use crate::support::stub::Stub;
use crate::support::{client, within};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A record of session `session` whose every text field and header holds U+0000.
fn poisoned(session: &str) -> ExchangeRecord {
    let raw =
        Bytes::from_static(b"{\"model\":\"gpt\\u0000x\",\"messages\":[{\"role\":\"user\",\"content\":\"a\0b\"}]}");
    let summary = CompactionSummary {
        tokens_raw: 10,
        tokens_forwarded: 10,
        report: Some(BudgetReport { write_failed: Some("no\0form".into()), ..Default::default() }),
        ..Default::default()
    };
    ExchangeRecord {
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("gpt\0x".into()),
        headers: vec![("user-agent".into(), "agent\0v1".into()), ("x-\0odd".into(), "v".into())],
        summary: Some(summary),
        skipped: Some("unknown field `a\0b`".into()),
        ..ExchangeRecord::unchanged(session, 1_700_000_000_000, raw)
    }
}

fn honest(session: &str, k: i64) -> ExchangeRecord {
    let raw = format!("{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"request {k}\"}}]}}");
    ExchangeRecord {
        model: Some("m".into()),
        headers: vec![("user-agent".into(), "honest".into())],
        ..ExchangeRecord::unchanged(session, 1_700_000_000_000 + k, Bytes::from(raw))
    }
}

fn poisoned_answer() -> ResponseRecord {
    ResponseRecord {
        at_ms: 1_700_000_000_100,
        status: Some(502),
        headers: vec![("content-type".into(), "text/plain\0".into())],
        stream: false,
        end: StreamEnd::UpstreamError("reset\0by peer".into()),
        body: b"bad\0gateway".to_vec(),
        truncated: None,
        assembled: Some(json!({"role": "assistant", "content": "x\u{0}y", "k\u{0}": 1})),
        key_ext: None,
    }
}

fn plain_answer() -> ResponseRecord {
    ResponseRecord {
        status: Some(200),
        headers: vec![("content-type".into(), "application/json".into())],
        end: StreamEnd::Complete,
        body: b"{}".to_vec(),
        assembled: None,
        ..poisoned_answer()
    }
}

/// Regression: a U+0000 in `model` (or any text column) failed the whole batch commit on
/// PostgreSQL, and every other client's record of the batch with it. Every text field and header
/// of a request and its answer holds U+0000, in one batch with honest records of other sessions:
/// everything is stored on both backends, the text reads back with U+FFFD where U+0000 was, the
/// bodies byte for byte, the session list (which reads the summaries as `jsonb`) works, and the
/// chains verify.
#[test]
fn text_holding_nul_is_stored_beside_honest_records_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    for location in [Location::Dir(dir.path().to_owned()), Location::parse(&pg_server::database(), None).unwrap()] {
        // A long gathering: the records share one transaction.
        let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(300));
        for k in 0..4 {
            archive.record_exchange(honest(&format!("honest-{k}"), k));
        }
        let ticket = archive.record_exchange(poisoned("nul"));
        archive.record_response(ticket, poisoned_answer());
        for k in 4..8 {
            archive.record_exchange(honest(&format!("honest-{k}"), k));
        }
        archive.flush().unwrap();
        let health = archive.health();
        assert_eq!((health.lost_records, health.committed_records), (0, 10), "{location}: {health:?}");
        archive.close();
        let reader = ArchiveReader::open(&location).unwrap();
        let sessions = reader.sessions(&SessionFilter::default()).unwrap();
        assert_eq!(sessions.len(), 9, "{location}");
        let nul = reader.exchanges("nul").unwrap();
        assert_eq!(nul[0].model.as_deref(), Some("gpt\u{FFFD}x"), "{location}");
        assert_eq!(nul[0].skipped.as_deref(), Some("unknown field `a\u{FFFD}b`"));
        let report = nul[0].summary.as_ref().unwrap().report.as_ref().unwrap();
        assert_eq!(report.write_failed.as_deref(), Some("no\u{FFFD}form"));
        assert_eq!(reader.body("nul", 1, BodyKind::Raw).unwrap(), poisoned("nul").raw, "{location}");
        let answer = reader.response("nul", 1).unwrap().unwrap();
        assert_eq!(answer.body, b"bad\0gateway", "{location}");
        assert_eq!(answer.end_reason, "upstream_error: reset\u{FFFD}by peer");
        assert_eq!(answer.assembled.unwrap(), json!({"role": "assistant", "content": "x\u{FFFD}y", "k\u{FFFD}": 1}));
        let headers: String = reader
            .conn()
            .query_one("SELECT headers FROM exchanges WHERE session = 'nul'", &[])
            .unwrap()
            .get(0)
            .unwrap();
        let headers: serde_json::Value = serde_json::from_str(&headers).unwrap();
        assert_eq!(headers, json!({"user-agent": "agent\u{FFFD}v1", "x-\u{FFFD}odd": "v"}));
        let verified = verify(reader.conn(), None).unwrap();
        assert!(verified.ok(), "{location}: {:?}", verified.problems);
    }
}

/// A model holding U+0000 through each of the four wires (a Gemini request names its model in its
/// path, percent-encoded there, and carries U+0000 in its text), sent while honest clients send
/// theirs to the same pare on a PostgreSQL archive: every request is archived, none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_through_every_wire_costs_no_honest_record() {
    for wire in [Wire::Chat, Wire::Responses, Wire::Messages, Wire::Gemini] {
        let stub = Stub::start(move |_| stream(if wire == Wire::Gemini { Wire::Chat } else { wire })).await;
        let dir = tempfile::tempdir().unwrap();
        let mut config = archived_config(&stub, dir.path());
        config.archive.url = Some(tokio::task::spawn_blocking(pg_server::database).await.unwrap());
        let location = config.archive.location().unwrap();
        let config = Arc::new(config);
        let pare = start(&config).await;
        let honest = session(wire, 3, 40);
        let mut poisoned: Vec<u8> = honest[0].clone();
        let text = String::from_utf8(poisoned.clone()).unwrap();
        // The model (where the body names it) and every text the body holds carry U+0000.
        poisoned = text.replace("test-model", "test\\u0000model").replace("thinking", "thin\\u0000king").into_bytes();
        let url_path = if wire == Wire::Gemini {
            "/v1beta/models/gem%00ini:generateContent".to_owned()
        } else {
            path(wire).into()
        };
        let send = |body: Vec<u8>, session: String, url_path: String| {
            let request = client()
                .post(pare.url(&url_path))
                .header("content-type", "application/json")
                .header("x-pare-session", session)
                .body(body)
                .send();
            async move {
                let response = within("pare to answer", request).await.unwrap();
                within("the answer's end", response.bytes()).await.unwrap();
            }
        };
        let mut sends = Vec::new();
        for round in 0..3 {
            sends.push(send(poisoned.clone(), format!("nul-{round}"), url_path.clone()));
            for (k, body) in honest.iter().enumerate() {
                sends.push(send(body.clone(), format!("honest-{round}-{k}"), url_path.clone()));
            }
        }
        futures_util::future::join_all(sends).await;
        let health = pare.pipeline.archive().unwrap().health();
        pare.shutdown().await.unwrap();
        assert_eq!(health.lost_records, 0, "{wire:?}: {health:?}");
        let n_honest = honest.len();
        tokio::task::spawn_blocking(move || {
            let reader = ArchiveReader::open(location).unwrap();
            for round in 0..3 {
                assert_eq!(reader.session_requests(&format!("nul-{round}")).unwrap(), Some(1), "{wire:?}");
                for k in 0..n_honest {
                    assert_eq!(
                        reader.session_requests(&format!("honest-{round}-{k}")).unwrap(),
                        Some(1),
                        "{wire:?}: an honest request was not archived"
                    );
                }
            }
            let model = reader.exchanges("nul-0").unwrap()[0].model.clone();
            if wire != Wire::Gemini {
                assert_eq!(model.as_deref(), Some("test\u{FFFD}model"), "{wire:?}");
            }
            assert!(verify(reader.conn(), None).unwrap().ok());
        })
        .await
        .unwrap();
    }
}

/// A database in LATIN1, which has no place for most of Unicode: a request whose model it cannot
/// store fails its transaction. The other records of that transaction are written one at a time
/// and stored; the refused record is counted (`refused_records`, `lost_records`), its strict
/// waiter told, and health names the cause while the archive stays writable.
#[test]
fn a_record_the_database_refuses_costs_no_other_record() {
    let server = pg_server::shared();
    let name = format!("latin1_{}", std::process::id());
    let mut admin = postgres::Client::connect(&server.url("postgres"), postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        ))
        .unwrap();
    let location = Location::parse(&server.url(&name), None).unwrap();
    let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(300));
    for k in 0..3 {
        let ticket = archive.record_exchange(honest(&format!("good-{k}"), k));
        archive.record_response(ticket, plain_answer());
    }
    for k in 3..6 {
        archive.record_exchange(honest(&format!("good-{k}"), k));
    }
    // The strict record ends the gathering: it shares the others' transaction.
    let refused = ExchangeRecord { model: Some("模型".into()), ..honest("bad", 9) };
    let (_, outcome) = runtime().block_on(archive.record_exchange_committed(refused, None));
    assert!(matches!(&outcome, Err(ArchiveError::NotWritable(why)) if why.contains("LATIN1")), "{outcome:?}");
    archive.flush().unwrap();
    let health = archive.health();
    assert_eq!((health.committed_records, health.lost_records, health.refused_records), (9, 1, 1), "{health:?}");
    assert!(health.writable, "{health:?}");
    assert!(health.last_error.as_deref().is_some_and(|e| e.contains("LATIN1")), "{health:?}");
    archive.close();
    let reader = ArchiveReader::open(&location).unwrap();
    for k in 0..6 {
        assert_eq!(reader.session_requests(&format!("good-{k}")).unwrap(), Some(1), "good-{k}");
    }
    assert_eq!(reader.session_requests("bad").unwrap(), None);
    assert!(verify(reader.conn(), None).unwrap().ok());
}

fn pg_location(url: &str, max_connections: usize) -> (Location, Arc<PgLocation>) {
    let location = Location::parse(url, None).unwrap().with_max_connections(max_connections);
    let Location::Postgres(pg) = &location else { panic!("{url} is not PostgreSQL") };
    let pg = Arc::clone(pg);
    (location, pg)
}

/// pare's connections to `database` (its readers' and its writer's), as the server counts them.
fn pare_connections(server: &PgServer, database: &str) -> i64 {
    let mut admin = postgres::Client::connect(&server.url("postgres"), postgres::NoTls).unwrap();
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pare' AND datname = $1",
            &[&database],
        )
        .unwrap()
        .get(0)
}

/// Regression: readers opened connections without a cap (60 concurrent retrieves: `too many
/// clients` for pare and for everything else on the database). With `archive.max_connections: 3`,
/// 60 concurrent readers all get their answers over at most 3 connections, and a reader waits for
/// a busy pool rather than opening one more.
#[test]
fn readers_share_a_bounded_pool() {
    let server = pg_server::shared();
    let url = pg_server::database();
    let database = url.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let (location, pg) = pg_location(&url, 3);
    let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
    for k in 0..5 {
        archive.record_exchange(honest("pooled", k));
    }
    archive.close();
    let most = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while done.load(Ordering::Relaxed) < 60 {
                most.fetch_max(pare_connections(server, &database) as usize, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        for _ in 0..60 {
            scope.spawn(|| {
                let reader = ArchiveReader::open(&location).unwrap();
                assert_eq!(reader.exchanges("pooled").unwrap().len(), 5);
                std::thread::sleep(Duration::from_millis(20));
                drop(reader);
                done.fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    let most = most.into_inner();
    assert!((1..=3).contains(&most), "{most} connections open at once");
    // Three held: the fourth reader waits until one is given back.
    let held: Vec<Db> = (0..3).map(|_| Db::open_pooled(&pg).unwrap()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = {
        let pg = Arc::clone(&pg);
        std::thread::spawn(move || {
            let db = Db::open_pooled(&pg);
            tx.send(()).unwrap();
            db.map(drop)
        })
    };
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "a fourth connection was opened");
    drop(held);
    assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "the waiting reader got no connection");
    waiter.join().unwrap().unwrap();
    assert!(pare_connections(server, &database) <= 3);
}

/// Regression: after a database restart, the next reads failed on the pool's stale connections.
/// A broken pooled connection is dropped and the read runs again on a new one.
#[test]
fn reads_after_a_database_restart_succeed() {
    let server = PgServer::start();
    let (location, _) = pg_location(&server.database(), 2);
    let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
    archive.record_exchange(honest("restart", 1));
    archive.close();
    // Two connections in the pool, both idle.
    let (a, b) = (ArchiveReader::open(&location).unwrap(), ArchiveReader::open(&location).unwrap());
    assert_eq!(a.session_requests("restart").unwrap(), Some(1));
    assert_eq!(b.session_requests("restart").unwrap(), Some(1));
    drop((a, b));
    server.stop();
    server.resume();
    for _ in 0..3 {
        let reader = ArchiveReader::open(&location).unwrap();
        assert_eq!(reader.session_requests("restart").unwrap(), Some(1));
    }
    // A reader holding a connection across the restart reads on too.
    let held = ArchiveReader::open(&location).unwrap();
    server.stop();
    server.resume();
    assert_eq!(held.session_requests("restart").unwrap(), Some(1));
    server.stop();
}

/// Regression: a password holding `/` or `?` (base64 passwords do) was shown in health, the UI,
/// logs and errors; an encoded option name (`?pass%77ord=`) was logged verbatim. Every spelling
/// the PostgreSQL client reads a password from is hidden in health and in the errors of an
/// archive that cannot connect (a port nothing listens on).
#[test]
fn every_spelling_of_a_password_is_hidden() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let secret = "s3cr/t?Zm9v+YmFy==";
    let encoded = "s3cr%2Ft%3FZm9v%2BYmFy%3D%3D";
    let spellings = [
        format!("postgres://pare:{secret}@127.0.0.1:{closed}/pare?sslmode=disable"),
        format!("postgres://pare:{encoded}@127.0.0.1:{closed}/pare?sslmode=disable"),
        format!("postgresql://pare@127.0.0.1:{closed}/pare?sslmode=disable&password={encoded}"),
        format!("postgres://pare@127.0.0.1:{closed}/pare?pass%77ord={encoded}&sslmode=disable"),
        format!("postgres://pare@127.0.0.1:{closed}/pare?%70assword={encoded}&sslmode=disable"),
        format!("host=127.0.0.1 port={closed} user=pare password='{secret}' dbname=pare sslmode=disable"),
        format!("host=127.0.0.1 port={closed} password=s3cr\\ t dbname=pare sslmode=disable"),
    ];
    for url in &spellings {
        let location = Location::parse(url, None).unwrap_or_else(|e| panic!("{url}: {e}"));
        let shown = location.to_string();
        let archive = Archive::launch(
            location.clone(),
            Durability::Buffered,
            Duration::from_millis(5),
            None,
            1 << 20,
            Duration::from_millis(100),
        );
        archive.record_exchange(honest("s", 1));
        archive.flush().unwrap();
        let health = format!("{:?}", archive.health());
        archive.close();
        let read_error = ArchiveReader::open(&location).err().map(|e| e.to_string()).unwrap_or_default();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
            .args(["sessions", "list", "--archive", url])
            .output()
            .unwrap();
        let cli = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{url}: {cli}");
        for text in [&shown, &health, &read_error, &cli] {
            for hidden in [secret, encoded, "s3cr", "Zm9v"] {
                assert!(!text.contains(hidden), "{url}: {hidden} shown in {text}");
            }
            let decoded = percent_encoding::percent_decode_str(text).decode_utf8_lossy();
            assert!(!decoded.contains("Zm9v"), "{url}: shown percent-encoded in {text}");
        }
        assert!(shown.contains("***"), "{url} is shown as {shown}");
        assert!(health.contains("127.0.0.1"), "{health}");
    }
}

/// Regression: a libpq keyword string (`host=… password=…`) was taken for a directory and
/// archived to SQLite there. It is read as PostgreSQL (and archives there); one that names no host
/// is refused with a message.
#[test]
fn a_keyword_string_is_postgres_never_a_directory() {
    let server = pg_server::shared();
    let url = pg_server::database();
    let database = url.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let keywords = format!("host=127.0.0.1 port={} user=postgres dbname={database} sslmode=disable", server.port);
    let location = Location::parse(&keywords, None).unwrap();
    assert!(matches!(location, Location::Postgres(_)), "{location:?}");
    let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
    archive.record_exchange(honest("keywords", 1));
    archive.close();
    let reader = ArchiveReader::open(Location::parse(&url, None).unwrap()).unwrap();
    assert_eq!(reader.session_requests("keywords").unwrap(), Some(1));
    let cwd = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .current_dir(cwd.path())
        .args(["sessions", "list", "--archive", "dbname=pare password=hunter2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("names no host"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0, "a directory was created");
    let config = Config::from_yaml("archive:\n  dir: \"host=db password=hunter2\"\n").unwrap_err().to_string();
    assert!(config.contains("archive.dir") && config.contains("archive.url"), "{config}");
    assert!(!config.contains("hunter2"), "{config}");
}

/// `pare check` and `pare serve` with `archive.url`: a database that refuses pare (an unknown
/// database, TLS the server does not offer, a wrong password) is refused at start in one line
/// naming the cause; one that cannot be reached yet (nothing listens) passes the check with a
/// note, and `serve` starts and waits for it.
#[test]
fn permanent_database_errors_refuse_the_start_and_transient_ones_do_not() {
    let server = PgServer::start();
    server.require_password("pare_pw", "right-one");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let pare = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().unwrap();
    let check = |url: &str| {
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, format!("archive:\n  url: \"{url}\"\n")).unwrap();
        let out = pare(&["check", file.to_str().unwrap()]);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let port = server.port;
    let permanent = [
        (format!("postgres://postgres@127.0.0.1:{port}/no_such_db?sslmode=disable"), "does not exist"),
        (format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=require"), "TLS"),
        (
            format!("postgres://pare_pw:wrong-one@127.0.0.1:{port}/postgres?sslmode=disable"),
            "password authentication failed",
        ),
    ];
    for (url, cause) in &permanent {
        let (code, _, stderr) = check(url);
        assert_eq!(code, Some(1), "{url}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(cause) && stderr.contains("refuses pare"), "{url}: {stderr}");
        assert!(!stderr.contains("wrong-one"), "{stderr}");
        let started = Instant::now();
        let out = pare(&["serve", "--listen", "127.0.0.1:0", "--archive", url]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(cause), "{url}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }
    let (code, stdout, stderr) =
        check(&format!("postgres://pare_pw:right-one@127.0.0.1:{port}/postgres?sslmode=disable"));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let unreachable = format!("postgres://postgres@127.0.0.1:{closed}/pare?sslmode=disable");
    let (code, stdout, stderr) = check(&unreachable);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("cannot be reached yet"), "{stdout}");
    // `serve` starts on an unreachable database: it is still up after a second.
    let mut serving = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["serve", "--listen", "127.0.0.1:0", "--archive", &unreachable])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let still_up = serving.try_wait().unwrap().is_none();
    serving.kill().unwrap();
    serving.wait().unwrap();
    assert!(still_up, "pare serve did not start on a database that is not up yet");
    server.stop();
}

/// A session's request at `at_ms` holding a shared system prompt and a large message of its own
/// (incompressible: it weighs in the store).
fn aged(session: &str, k: i64, at_ms: i64, own: &str) -> ExchangeRecord {
    let raw = json!({"model": "m", "messages": [
        {"role": "system", "content": "You are a coding agent. ".repeat(40)},
        {"role": "user", "content": own},
        {"role": "user", "content": format!("step {k}")},
    ]});
    ExchangeRecord {
        model: Some("m".into()),
        ..ExchangeRecord::unchanged(session, at_ms + k, Bytes::from(serde_json::to_vec(&raw).unwrap()))
    }
}

/// Text that does not compress: `n` bytes of hex from a xorshift seeded with `seed`.
fn noise(seed: u64, n: usize) -> String {
    let mut x = seed | 1;
    let mut out = String::with_capacity(n);
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(&format!("{x:016x}"));
    }
    out.truncate(n);
    out
}

const OLD_MS: i64 = 1_600_000_000_000; // 2020-09
const NEW_MS: i64 = 1_700_000_000_000; // 2023-11

/// `pare archive prune --before DATE` on both backends: the sessions last active before DATE go
/// whole (their requests, answers, plans, usage and the blobs no other session links), the others
/// stay readable byte for byte with the blobs they share, every chain left verifies, and SQLite's
/// file shrinks. A running writer that cached a freed blob's id stores it again for a new session
/// (the prune generation moved), and a second prune finds nothing.
#[test]
fn prune_deletes_whole_sessions_and_what_is_left_verifies() {
    let dir = tempfile::tempdir().unwrap();
    for location in [Location::Dir(dir.path().to_owned()), Location::parse(&pg_server::database(), None).unwrap()] {
        let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
        for s in 0..4u64 {
            for k in 0..2 {
                let ticket = archive.record_exchange(aged(&format!("old-{s}"), k, OLD_MS, &noise(s, 200_000)));
                archive.record_response(ticket, ResponseRecord { at_ms: OLD_MS + 500, ..plain_answer() });
            }
        }
        for s in 0..2u64 {
            archive.record_exchange(aged(&format!("new-{s}"), 0, NEW_MS, &noise(100 + s, 1000)));
        }
        archive.flush().unwrap();
        let before = pare::archive::time::parse_since("2021-01-01").unwrap();
        let report = pare::archive::retention::prune(&location, before, pare::archive::retention::Reclaim::Vacuum)
            .unwrap_or_else(|e| panic!("{location}: {e}"));
        assert_eq!((report.sessions, report.exchanges, report.responses), (4, 8, 8), "{location}: {report:?}");
        assert!(report.blobs_freed >= 4, "{location}: {report:?}");
        assert_eq!(report.vacuum_error, None, "{location}");
        if location.dir().is_some() {
            assert!(report.bytes_after * 2 < report.bytes_before, "{location}: {report:?}");
        }
        // The writer cached the id of old-0's own message, freed now: a new session sending it
        // stores it again.
        archive.record_exchange(aged("late", 0, NEW_MS, &noise(0, 200_000)));
        archive.flush().unwrap();
        assert_eq!(archive.health().lost_records, 0, "{location}");
        archive.close();
        let reader = ArchiveReader::open(&location).unwrap();
        let left: Vec<String> = reader.sessions(&SessionFilter::default()).unwrap().into_iter().map(|s| s.id).collect();
        assert_eq!(left.len(), 3, "{location}: {left:?}");
        assert!(left.iter().all(|id| id.starts_with("new-") || id == "late"), "{location}: {left:?}");
        for (id, body) in [
            ("new-1", aged("new-1", 0, NEW_MS, &noise(101, 1000))),
            ("late", aged("late", 0, NEW_MS, &noise(0, 200_000))),
        ] {
            assert_eq!(reader.body(id, 1, BodyKind::Raw).unwrap(), body.raw, "{location}: {id}");
        }
        let verified = verify(reader.conn(), None).unwrap();
        assert!(verified.ok(), "{location}: {:?}", verified.problems);
        drop(reader);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
            .args(["archive", "prune", "--before", "2021-01-01", "--archive", &location.to_string()])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.starts_with("pruned 0 session(s)"), "{location}: {stdout}{out:?}");
    }
}

/// `archive.retain_days` while pare serves: the sessions last active before the cutoff are deleted
/// at start; the recent ones stay.
#[test]
fn retain_days_prunes_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for url in [None, Some(pg_server::database())] {
        let mut config = Config::default();
        config.archive.dir = Some(dir.path().join("retained"));
        config.archive.url = url;
        let location = config.archive.location().unwrap();
        let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
        archive.record_exchange(aged("ancient", 0, OLD_MS, "a"));
        archive.record_exchange(aged("recent", 0, pare::archive::now_ms(), "b"));
        archive.close();
        config.archive.retain_days = Some(30);
        let serving = Archive::open(&config.archive);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let reader = ArchiveReader::open(&location).unwrap();
            if reader.session_requests("ancient").unwrap().is_none() {
                assert_eq!(reader.session_requests("recent").unwrap(), Some(1), "{location}");
                assert!(verify(reader.conn(), None).unwrap().ok());
                break;
            }
            assert!(Instant::now() < deadline, "{location}: the old session was not pruned");
            std::thread::sleep(Duration::from_millis(100));
        }
        serving.close();
    }
}

/// `pare sessions delete` under a running writer: the writer had cached the id of the deleted
/// session's own message; a new session sending that message stores it again (the prune
/// generation moved), so its body reads back whole.
#[test]
fn a_session_deleted_under_a_running_writer_leaves_no_dangling_blob() {
    let dir = tempfile::tempdir().unwrap();
    for location in [Location::Dir(dir.path().to_owned()), Location::parse(&pg_server::database(), None).unwrap()] {
        let archive = Archive::start_at(location.clone(), Durability::Buffered, Duration::from_millis(5));
        archive.record_exchange(aged("doomed", 0, NEW_MS, &noise(9, 50_000)));
        archive.flush().unwrap();
        pare::archive::retention::delete_session(&location, "doomed").unwrap();
        let again = aged("heir", 0, NEW_MS, &noise(9, 50_000));
        archive.record_exchange(aged("heir", 0, NEW_MS, &noise(9, 50_000)));
        archive.close();
        let reader = ArchiveReader::open(&location).unwrap();
        assert_eq!(reader.body("heir", 1, BodyKind::Raw).unwrap(), again.raw, "{location}");
        assert!(verify(reader.conn(), None).unwrap().ok(), "{location}");
    }
}
