//! The audit UI over a large archive: `cargo bench --bench ui` writes 10,000 one-request sessions
//! with the real archive writer, then times the pages a user opens first: the sessions index (first
//! page, a deep page, filtered by model) and one session. Each is the whole route, as `pare serve`
//! runs it on its blocking pool: opening the store read-only, the queries, rendering the HTML.

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use pare::archive::{Archive, ExchangeRecord, ResponseRecord};
use pare::config::Durability;
use pare::pipeline::{CompactionSummary, StreamEnd};
use pare::ui::Ui;
use serde_json::json;

const SESSIONS: usize = 10_000;

/// `n` sessions of one request and its answer each, a minute apart, two models.
fn large_archive(dir: &Path, n: usize) {
    let archive = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(50));
    for k in 1..=n {
        let model = if k % 2 == 0 { "qwen-14b" } else { "llama-8b" };
        let body = json!({"model": model, "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": format!("task {k}")},
        ]});
        let at_ms = 1_760_000_000_000 + k as i64 * 60_000;
        let ticket = archive.record_exchange(ExchangeRecord {
            session: format!("s{k:05}"),
            at_ms,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: Some(model.into()),
            headers: Vec::new(),
            raw: Bytes::from(serde_json::to_vec(&body).unwrap()),
            raw_spans: None,
            forwarded: None,
            forwarded_spans: None,
            summary: Some(CompactionSummary { tokens_raw: 30, tokens_forwarded: 30, ..Default::default() }),
            late_summary: None,
            skipped: None,
            key_req: None,
            expect_requests: None,
            lists: Default::default(),
        });
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": format!("done {k}")}}]});
        archive.record_response(
            ticket,
            ResponseRecord {
                at_ms: at_ms + 500,
                status: Some(200),
                headers: Vec::new(),
                stream: false,
                end: StreamEnd::Complete,
                body: serde_json::to_vec(&answer).unwrap(),
                truncated: None,
                assembled: None,
                key_ext: None,
            },
        );
    }
    archive.close();
}

fn pages(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    large_archive(dir.path(), SESSIONS);
    let ui = Ui::new(dir.path().to_owned());
    let mut group = c.benchmark_group("ui_10k_sessions");
    for (name, path, query) in [
        ("index_first_page", "/_pare/ui/", None),
        ("index_page_150", "/_pare/ui/", Some("page=150")),
        ("index_model_filter", "/_pare/ui/", Some("model=qwen&page=20")),
        ("session", "/_pare/ui/session/s05000", None),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let reply = ui.route("GET", path, query);
                assert_eq!(reply.status, 200);
                reply
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = pages
}
criterion_main!(benches);
