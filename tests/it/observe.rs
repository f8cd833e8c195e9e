//! Mode `observe`: every request reaches the upstream byte for byte as the agent sent it, while the
//! archived summaries and `/_pare/metrics` say what epoch mode would have forwarded — the same
//! figures `pare replay` and `pare eval` give for the same requests — and a pare restarted in epoch
//! mode goes on from the raw requests the upstream holds.
//!
//! The session is a real one from the shared corpus: SWE-agent's demonstration trajectory
//! `replay__marshmallow-code__marshmallow-1867__function_calling__install-1` (SWE-agent/SWE-agent,
//! MIT), converted as the corpus converts it (one chat-completions body per request).

use std::sync::Arc;

use pare::budget::SessionCompactor;
use pare::budget::replay::{replay_session, session_lines};
use pare::compact::Engine;
use pare::config::{Config, Mode};
use pare::exchange::CompactionSummary;
use pare::observe::Shape;
use pare::wire::Wire;

use crate::resume::{send, start, stream};
use crate::support::stub::Stub;
use crate::support::{client, pare as in_process};

const SESSION: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/observe/swe-agent-marshmallow-1867.jsonl");

/// A window at which the session compacts twice.
const WINDOW: u64 = 6000;

fn config(stub: &Stub, dir: &std::path::Path, mode: Mode) -> Config {
    let mut config = in_process::config_for(stub);
    config.compaction.mode = mode;
    // The session's model (gpt-4o) has a window in the price table: `models:` sets this one.
    config.models = vec![pare::config::ModelConfig {
        pattern: ".*".into(),
        context_window: Some(WINDOW),
        output_reserve: None,
        encoding: None,
        price: None,
    }];
    config.budget.detect_window = false;
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config
}

fn compactor(config: &Config, mode: Mode) -> (SessionCompactor, Arc<Engine>) {
    let mut config = config.clone();
    config.compaction.mode = mode;
    let engine = Arc::new(Engine::from_config(&config).unwrap());
    (SessionCompactor::new(&config, engine.clone()).unwrap(), engine)
}

fn summaries(dir: &std::path::Path, session: &str) -> Vec<CompactionSummary> {
    let reader = pare::archive::query::ArchiveReader::open(dir).unwrap();
    reader.exchanges(session).unwrap().into_iter().map(|x| x.summary.expect("a summary")).collect()
}

/// A counter's value in a scrape (`name_total N`).
fn counter(metrics: &str, name: &str) -> u64 {
    let line = metrics.lines().find(|l| l.starts_with(&format!("{name}_total "))).unwrap_or_else(|| panic!("{name}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn observe_forwards_every_request_as_sent_and_projects_what_replay_forwards() {
    let stub = Stub::start(|_| stream(Wire::Chat)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = Arc::new(config(&stub, dir.path(), Mode::Observe));
    let text = std::fs::read(SESSION).unwrap();
    let requests = session_lines(&text);
    let server = start(&config).await;
    for body in &requests {
        send(&server, Wire::Chat, "observed", body).await;
    }
    // The archive's writer waits for each projection: once every record is in, so are the figures.
    server.shutdown().await.unwrap();

    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    assert_eq!(received.len(), requests.len());
    for (k, (got, sent)) in received.iter().zip(&requests).enumerate() {
        assert!(got.as_slice() == *sent, "request {k} reached the upstream changed");
    }

    let (epoch_mode, engine) = compactor(&config, Mode::Epoch);
    let replayed = replay_session(&epoch_mode, Wire::Chat, "replayed", &requests, Some(WINDOW));
    let archived = summaries(dir.path(), "observed");
    assert_eq!(archived.len(), requests.len());
    for (k, (summary, replayed)) in archived.iter().zip(&replayed).enumerate() {
        // What was forwarded: the raw request.
        assert_eq!(summary.tokens_forwarded, summary.tokens_raw, "request {k}");
        assert_eq!((summary.epoch, summary.epoch_started), (0, false), "request {k}");
        assert_eq!(summary.report.as_ref().unwrap().mode, Mode::Observe, "request {k}");
        // What epoch mode would have forwarded: what replay forwards.
        let observed = summary.observed.as_ref().unwrap_or_else(|| panic!("request {k} projected"));
        let want = replayed.summary.as_ref().unwrap();
        assert_eq!(summary.tokens_raw, want.tokens_raw, "request {k}");
        assert_eq!(observed.tokens_forwarded, want.tokens_forwarded, "request {k}");
        assert_eq!((observed.epoch, observed.epoch_started), (want.epoch, want.epoch_started), "request {k}");
        let body = pare::wire::parse(Wire::Chat, &replayed.forwarded).unwrap();
        let messages = body.messages();
        let shape =
            Shape::of(&messages, &pare::neutral::message_hashes(&messages), body.tools(), epoch_mode.counter(None));
        assert_eq!(observed.tokens_forwarded, shape.total(), "request {k}");
    }

    // The session's totals are `pare eval`'s.
    let (fresh, _) = compactor(&config, Mode::Epoch);
    let eval = pare::eval::evaluate_session(&fresh, engine.as_ref(), Wire::Chat, "evaluated", &requests, WINDOW);
    let observed: Vec<_> = archived.iter().map(|s| s.observed.clone().unwrap()).collect();
    assert!(eval.epochs >= 2 && eval.tokens_forwarded < eval.tokens_raw, "the session compacts: {eval:?}");
    assert_eq!(observed.iter().map(|o| o.tokens_forwarded).sum::<u64>(), eval.tokens_forwarded);
    assert_eq!(archived.iter().map(|s| s.tokens_raw).sum::<u64>(), eval.tokens_raw);
    assert_eq!(observed.iter().map(|o| o.epoch).max(), Some(eval.epochs));
    assert_eq!(observed.iter().map(|o| o.uncached_raw).sum::<u64>(), eval.uncached_raw);
    assert_eq!(observed.iter().map(|o| o.uncached_forwarded).sum::<u64>(), eval.uncached_forwarded);

    // `sessions show` says so.
    let show = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["sessions", "show", "observed", "--archive"])
        .arg(dir.path())
        .output()
        .unwrap();
    let shown = String::from_utf8(show.stdout).unwrap();
    let line = shown.lines().find(|l| l.starts_with("observe mode: ")).unwrap_or_else(|| panic!("{shown}"));
    let n = |v: u64| pare::compact::markers::group_digits(v as usize);
    let want = format!(
        "epoch mode would have forwarded {} of {} tokens over {} request(s)",
        n(eval.tokens_forwarded),
        n(eval.tokens_raw),
        requests.len()
    );
    assert!(line.contains(&want), "{line}");
    let prefill = format!(
        "uncached prefill {} with it against {} as forwarded",
        n(eval.uncached_forwarded),
        n(eval.uncached_raw)
    );
    assert!(line.contains(&prefill) && line.contains(&format!("in {} epoch(s)", eval.epochs)), "{line}");
}

#[tokio::test]
async fn observed_figures_are_exported_under_their_own_names() {
    let stub = Stub::start(|_| stream(Wire::Chat)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = Arc::new(config(&stub, dir.path(), Mode::Observe));
    let text = std::fs::read(SESSION).unwrap();
    let requests = session_lines(&text);
    let server = start(&config).await;
    for body in &requests {
        send(&server, Wire::Chat, "observed", body).await;
    }
    let scrape = || async { client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap() };
    // The projections run after forwarding: wait until the last is counted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut metrics = scrape().await;
    while counter(&metrics, "pare_observed_requests") < requests.len() as u64 {
        assert!(std::time::Instant::now() < deadline, "every request projected: {metrics}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        metrics = scrape().await;
    }
    let page = client().get(server.url("/_pare/ui/session/observed")).send().await.unwrap().text().await.unwrap();
    server.shutdown().await.unwrap();

    let archived = summaries(dir.path(), "observed");
    let totals = pare::exchange::ObservedTotals::of(&archived).unwrap();
    assert!(page.contains(&format!("<p id=\"observed\">{}</p>", totals.line())), "{page}");
    let observed: Vec<_> = archived.iter().map(|s| s.observed.clone().unwrap()).collect();
    let sum = |f: fn(&pare::exchange::Observed) -> u64| observed.iter().map(f).sum::<u64>();
    assert_eq!(counter(&metrics, "pare_observed_tokens_raw"), archived.iter().map(|s| s.tokens_raw).sum::<u64>());
    assert_eq!(counter(&metrics, "pare_observed_tokens_forwarded"), sum(|o| o.tokens_forwarded));
    assert_eq!(counter(&metrics, "pare_observed_epochs"), sum(|o| u64::from(o.epoch_started)));
    assert_eq!(counter(&metrics, "pare_observed_uncached_prefill_raw"), sum(|o| o.uncached_raw));
    assert_eq!(counter(&metrics, "pare_observed_uncached_prefill_forwarded"), sum(|o| o.uncached_forwarded));
    assert_eq!(counter(&metrics, "pare_observed_skipped"), 0);
    // Nothing was forwarded compacted: the proxy's own series count no epoch, no compacted request.
    for family in ["pare_epochs_total{", "pare_compacted_requests_total{"] {
        assert!(!metrics.lines().any(|l| l.starts_with(family)), "{family}: {metrics}");
    }
    assert!(metrics.contains("pare_tokens_forwarded_total{"), "the proxy's own series are there");
}

/// Switching to epoch mode is a restart: the session stays one, and goes on from the raw requests
/// the upstream holds — not from the prefix observe projected, which the upstream never saw: the
/// first request past the high-water mark is an epoch that keeps the head of them it can, the
/// requests after it append.
#[tokio::test]
async fn a_pare_restarted_in_epoch_mode_goes_on_from_what_the_upstream_holds() {
    let stub = Stub::start(|_| stream(Wire::Chat)).await;
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read(SESSION).unwrap();
    let requests = session_lines(&text);
    let half = requests.len() - 3;
    let observing = Arc::new(config(&stub, dir.path(), Mode::Observe));
    let server = start(&observing).await;
    for body in &requests[..half] {
        send(&server, Wire::Chat, "switched", body).await;
    }
    server.shutdown().await.unwrap();
    let projected = summaries(dir.path(), "switched").last().and_then(|s| s.observed.clone());
    assert!(projected.is_some_and(|o| o.epoch > 0), "observe projected an epoch before the restart");

    let compacting = Arc::new(config(&stub, dir.path(), Mode::Epoch));
    let server = start(&compacting).await;
    for body in &requests[half..half + 2] {
        send(&server, Wire::Chat, "switched", body).await;
    }
    server.shutdown().await.unwrap();

    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    let archived = summaries(dir.path(), "switched");
    assert_eq!((received.len(), archived.len()), (half + 2, half + 2), "the session stayed one");
    let (epoch_mode, _) = compactor(&compacting, Mode::Epoch);
    let messages = |bytes: &[u8]| -> Vec<String> {
        let body = pare::wire::parse(Wire::Chat, bytes).unwrap();
        body.messages().into_iter().map(str::to_owned).collect()
    };
    // Not the projection: resumed from it, pare would forward what replay forwards.
    let replayed = replay_session(&epoch_mode, Wire::Chat, "replayed", &requests[..=half], Some(WINDOW));
    assert!(received[half] != replayed[half].forwarded, "the first request after the restart is not the projection");
    // An epoch over the raw requests (numbered from the first: the projection's were never forwarded)
    // that keeps a head of what the upstream holds.
    let summary = &archived[half];
    assert_eq!(summary.report.as_ref().unwrap().mode, Mode::Epoch);
    assert!(summary.observed.is_none());
    assert_eq!((summary.epoch, summary.epoch_started), (1, true));
    let (held, after) = (messages(requests[half - 1]), messages(&received[half]));
    let kept = held.iter().zip(&after).take_while(|(a, b)| a == b).count();
    let first_user = held.iter().position(|m| pare::neutral::role_of(m) == "user").unwrap();
    assert!(kept > first_user, "the epoch keeps the head the upstream holds ({kept} messages)");
    // The next request appends.
    let next = messages(&received[half + 1]);
    assert!(next.starts_with(&after), "the request after the epoch appends");
    assert!(!archived[half + 1].epoch_started);
}

/// In `strict` durability the record is committed with its projection before the request is
/// forwarded: the same figures.
#[tokio::test]
async fn strict_durability_commits_each_record_with_its_projection() {
    let stub = Stub::start(|_| stream(Wire::Chat)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut strict = config(&stub, dir.path(), Mode::Observe);
    strict.archive.durability = pare::config::Durability::Strict;
    let strict = Arc::new(strict);
    let text = std::fs::read(SESSION).unwrap();
    let requests = session_lines(&text);
    let server = start(&strict).await;
    for body in &requests {
        send(&server, Wire::Chat, "strict", body).await;
    }
    server.shutdown().await.unwrap();

    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    assert!(received.iter().zip(&requests).all(|(got, sent)| got.as_slice() == *sent));
    let (fresh, engine) = compactor(&strict, Mode::Epoch);
    let eval = pare::eval::evaluate_session(&fresh, engine.as_ref(), Wire::Chat, "evaluated", &requests, WINDOW);
    let archived = summaries(dir.path(), "strict");
    let totals = pare::exchange::ObservedTotals::of(&archived).unwrap();
    assert_eq!(totals.requests, requests.len() as u64);
    assert_eq!((totals.tokens_raw, totals.tokens_forwarded), (eval.tokens_raw, eval.tokens_forwarded));
    assert_eq!((totals.uncached_raw, totals.uncached_forwarded), (eval.uncached_raw, eval.uncached_forwarded));
    assert_eq!(totals.epochs, eval.epochs);
}
