//! Archive benchmarks and figures.
//!
//! `cargo bench --bench archive` measures the cost the archive adds to the request path in `buffered`
//! mode: handing a record to the writer, assigning the session, and `prepare_chat` with and without
//! the archive. Two figures are computed on request, outside criterion:
//!
//! - `PARE_BENCH_CORPUS=DIR` (e.g. `/tmp/corpus/sessions`): replays every session of the coding
//!   sources into a fresh archive each and prints archive size against the final raw body size.
//! - `PARE_BENCH_GENERATE=DIR:BYTES`: writes an archive of at least BYTES (synthetic coding sessions
//!   with incompressible tool outputs) into DIR, for timing `pare sessions verify --archive DIR`.

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use http::HeaderMap;
use pare::archive::{Archive, ExchangeRecord, store};
use pare::config::{Config, Durability};
use pare::pipeline::Pipeline;
use pare::wire::ChatBody;
use serde_json::{Value, json};

/// A coding-agent request after `steps` tool steps (~2.5 KB per step).
fn request_body(steps: usize) -> Bytes {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent working in a repository. ".repeat(100)}),
        json!({"role": "user", "content": "Fix the failing test."}),
    ];
    for k in 0..steps {
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{k}"), "type": "function", "function": {"name": "bash", "arguments": format!("{{\"command\": \"sed -n 1,80p src/file_{k}.py\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{k}"), "content": format!("def function_{k}(x):\n    return x + {k}\n").repeat(70)}));
    }
    Bytes::from(serde_json::to_vec(&json!({"model": "local", "stream": true, "messages": messages})).unwrap())
}

fn record(session: &str, raw: &Bytes) -> ExchangeRecord {
    ExchangeRecord {
        model: Some("local".into()),
        headers: vec![("user-agent".into(), "bench".into())],
        ..ExchangeRecord::unchanged(session, 0, raw.clone())
    }
}

fn request_path(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(50));
    let body = request_body(40);
    let mut group = c.benchmark_group("archive");
    // Only the hand-over is timed; the queue is drained between batches so it never fills up.
    group.bench_function("record_exchange (buffered hand-over)", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for i in 0..iters {
                let start = Instant::now();
                archive.record_exchange(record("bench", &body));
                spent += start.elapsed();
                if i % 64 == 63 {
                    archive.flush().unwrap();
                }
            }
            archive.flush().unwrap();
            spent
        })
    });

    let config = Config::default();
    let tracker = pare::session::SessionTracker::new(&config.archive);
    let parsed_body = body.clone();
    let parsed = ChatBody::parse(&parsed_body).unwrap();
    group.bench_function(format!("session assign ({} KB body, 82 messages)", body.len() / 1024), |b| {
        b.iter(|| tracker.assign(&HeaderMap::new(), Some(parsed.messages())))
    });

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut config = Config::default();
    config.archive.dir = Some(dir.path().to_owned());
    let config = Arc::new(config);
    let without = Pipeline::identity(Arc::clone(&config));
    let with = Pipeline::identity(Arc::clone(&config)).with_archive(Arc::clone(&archive));
    for (name, pipeline) in
        [("prepare_chat without archive", &without), ("prepare_chat with archive (buffered)", &with)]
    {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for i in 0..iters {
                    let start = Instant::now();
                    let prepared = runtime.block_on(pipeline.prepare_chat(&HeaderMap::new(), body.clone()));
                    spent += start.elapsed();
                    drop(prepared);
                    if i % 64 == 63 {
                        archive.flush().unwrap();
                    }
                }
                archive.flush().unwrap();
                spent
            })
        });
    }
    group.finish();
    archive.close();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = request_path
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

/// Archive size against final raw body per corpus session (requests only, as `pare replay` reads them).
fn corpus_figures(corpus: &Path) {
    // A store's fixed cost (schema pages), paid once per archive, not per session.
    let empty = {
        let dir = tempfile::tempdir().unwrap();
        drop(store::open_rw(dir.path()).unwrap());
        dir_size(dir.path())
    };
    println!("empty store: {empty} bytes");
    println!(
        "source/session  requests  final_raw_bytes  total_raw_bytes  archive_bytes  archive/final  (archive-empty)/final"
    );
    let mut ratios = Vec::new();
    let mut marginal = Vec::new();
    for source in ["swe-agent", "mini-swe-agent", "openhands", "hermes"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus.join(source))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let dir = tempfile::tempdir().unwrap();
            let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(50));
            for line in &lines {
                archive.record_exchange(record("s", &Bytes::copy_from_slice(line.as_bytes())));
            }
            archive.close();
            let conn = rusqlite::Connection::open(dir.path().join(store::DB_FILE)).unwrap();
            conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
            drop(conn);
            let size = dir_size(dir.path());
            let final_raw = lines.last().map_or(0, |l| l.len()) as u64;
            let total: u64 = lines.iter().map(|l| l.len() as u64).sum();
            let ratio = size as f64 / final_raw as f64;
            let added = (size - empty) as f64 / final_raw as f64;
            ratios.push(ratio);
            marginal.push(added);
            let name = file.file_stem().unwrap().to_string_lossy();
            let n_sessions = sessions_formed(&lines);
            println!(
                "{source}/{name}  {}  {final_raw}  {total}  {size}  {ratio:.3}  {added:.3}  sessions_formed={n_sessions}",
                lines.len()
            );
        }
    }
    for (name, mut r) in [("archive/final", ratios), ("(archive-empty)/final", marginal)] {
        r.sort_by(f64::total_cmp);
        println!(
            "{name}: sessions {}  median {:.3}  max {:.3}  min {:.3}",
            r.len(),
            r[r.len() / 2],
            r[r.len() - 1],
            r[0]
        );
    }
}

/// How many sessions the tracker forms from a corpus file when each request is answered by the
/// assistant message the next request carries at that position (1 = the session stays whole).
fn sessions_formed(lines: &[&str]) -> usize {
    let tracker = pare::session::SessionTracker::new(&Config::default().archive);
    let mut ids = std::collections::HashSet::new();
    for (k, line) in lines.iter().enumerate() {
        let Ok(body) = ChatBody::parse(line.as_bytes()) else { continue };
        let assignment = tracker.assign(&HeaderMap::new(), Some(body.messages()));
        let next: Option<Value> = lines.get(k + 1).and_then(|l| serde_json::from_str(l).ok());
        if let Some(answer) = next.as_ref().and_then(|n| n["messages"].get(body.messages().len())) {
            tracker.answered(&assignment.session, assignment.key_req, answer);
        }
        ids.insert(assignment.session);
    }
    ids.len()
}

/// Pseudo-random printable text (xxh3 stream, hex): incompressible enough that the archive grows.
fn noise(seed: u64, len: usize) -> String {
    let mut out = String::with_capacity(len + 32);
    let mut state = seed;
    while out.len() < len {
        state = xxhash_rust::xxh3::xxh3_64(&state.to_le_bytes());
        out.push_str(&format!("{state:016x} "));
    }
    out
}

fn generate(dir: &Path, target: u64) {
    let archive = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(50));
    let started = Instant::now();
    let mut session = 0u64;
    while dir_size(dir) < target {
        for _ in 0..50 {
            let id = format!("gen-{session:06}");
            let mut messages: Vec<Value> = vec![
                json!({"role": "system", "content": "You are a coding agent. ".repeat(200)}),
                json!({"role": "user", "content": noise(session, 200)}),
            ];
            for k in 0..12u64 {
                let body = Bytes::from(serde_json::to_vec(&json!({"model": "gen", "messages": messages})).unwrap());
                archive.record_exchange(record(&id, &body));
                let call = format!("call_{k}");
                messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": call, "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"cat f\"}"}}]}));
                messages
                    .push(json!({"role": "tool", "tool_call_id": call, "content": noise(session * 1000 + k, 8000)}));
            }
            session += 1;
        }
        archive.flush().unwrap();
    }
    archive.close();
    println!("generated {} bytes, {session} sessions in {:.1?}", dir_size(dir), started.elapsed());
}

fn main() {
    if let Ok(corpus) = std::env::var("PARE_BENCH_CORPUS") {
        corpus_figures(Path::new(&corpus));
        return;
    }
    if let Ok(spec) = std::env::var("PARE_BENCH_GENERATE") {
        let (dir, bytes) = spec.rsplit_once(':').expect("PARE_BENCH_GENERATE=DIR:BYTES");
        generate(Path::new(dir), bytes.parse().expect("BYTES is a number"));
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
