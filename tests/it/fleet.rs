//! Processes sharing one archive in strict durability (a fleet of replicas behind a load balancer):
//! any of them serves any request of any session, and together they forward what one pare would.

use std::sync::Arc;

use pare::archive::query::ArchiveReader;
use pare::archive::verify::verify;
use pare::config::{Config, Durability};
use pare::wire::Wire;

use crate::resume::{WIRES, archived_config, path, send, session, start, stream, uninterrupted};
use crate::support::stub::Stub;
use crate::support::{client, pare as in_process, within};

/// `replicas` processes on the archive `config` names, in strict durability.
async fn fleet(config: &Arc<Config>, replicas: usize) -> Vec<in_process::Pare> {
    let mut started = Vec::new();
    for _ in 0..replicas {
        started.push(start(config).await);
    }
    started
}

/// Send `body` to `server` without a session header; the session pare assigned.
async fn send_unnamed(server: &in_process::Pare, wire: Wire, body: &[u8]) -> String {
    let request = client().post(server.url(path(wire))).header("content-type", "application/json");
    let response = within("pare to answer", request.body(body.to_vec()).send()).await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let session = response.headers()["x-pare-session"].to_str().unwrap().to_owned();
    within("the answer's end", response.bytes()).await.unwrap();
    session
}

/// Three replicas on one archive, each request of a session sent to the next replica in turn (a
/// round-robin load balancer), with no session header (the upstream's answers are not what the
/// agent echoes, so requests join their session by their request keys): each session stays one
/// session, every replica forwards what one uninterrupted pare forwards, and the archive holds each
/// request once in one intact hash chain.
async fn round_robin_replicas_forward_what_one_pare_does(postgres: bool) {
    for wire in WIRES {
        let stub = Stub::start(move |_| stream(wire)).await;
        let dir = tempfile::tempdir().unwrap();
        let mut config = archived_config(&stub, dir.path());
        config.archive.durability = Durability::Strict;
        if postgres {
            config.archive.url = Some(tokio::task::spawn_blocking(crate::pg_server::database).await.unwrap());
        }
        let location = config.archive.location().unwrap();
        let config = Arc::new(config);
        let replicas = fleet(&config, 3).await;
        let requests = session(wire, 24, 260);
        let mut sessions = Vec::new();
        for (k, body) in requests.iter().enumerate() {
            sessions.push(send_unnamed(&replicas[k % replicas.len()], wire, body).await);
        }
        let stale: u64 =
            replicas.iter().map(|r| r.pipeline.stats.stale_state.load(std::sync::atomic::Ordering::Relaxed)).sum();
        // The count is exported as a metric.
        let metrics = client().get(replicas[1].url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
        let counted = replicas[1].pipeline.stats.stale_state.load(std::sync::atomic::Ordering::Relaxed);
        assert!(metrics.contains(&format!("pare_stale_state_total {counted}\n")), "{metrics}");
        for replica in replicas {
            replica.shutdown().await.unwrap();
        }
        assert!(sessions.iter().all(|s| *s == sessions[0]), "{wire:?}: one session split: {sessions:?}");
        assert!(stale > 0, "{wire:?}: no replica found its state stale: the round robin did not exercise the check");
        let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
        let want = uninterrupted(&config, wire, &requests);
        assert!(want.iter().any(|r| r.summary.as_ref().is_some_and(|s| s.epoch_started)), "{wire:?}: no epoch");
        assert_eq!(received.len(), want.len(), "{wire:?}");
        for (k, (got, want)) in received.iter().zip(&want).enumerate() {
            assert!(*got == want.forwarded, "{wire:?}: request {k} is not what one pare forwards");
        }
        let (session, n) = (sessions[0].clone(), requests.len());
        let report = tokio::task::spawn_blocking(move || {
            let reader = ArchiveReader::open(location).unwrap();
            assert_eq!(reader.exchanges(&session).unwrap().len(), n, "archived once each");
            verify(reader.conn(), None).unwrap()
        })
        .await
        .unwrap();
        assert!(report.ok(), "{wire:?}: {report:?}");
    }
}

/// Regression: two processes on one archive each compacted their own view of a session (extra
/// epochs, bodies one pare would not send) and broke its hash chain.
#[tokio::test]
async fn round_robin_replicas_on_one_sqlite_archive_forward_what_one_pare_does() {
    round_robin_replicas_forward_what_one_pare_does(false).await;
}

/// The same fleet on a PostgreSQL archive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_replicas_on_a_postgresql_archive_forward_what_one_pare_does() {
    round_robin_replicas_forward_what_one_pare_does(true).await;
}

/// With a session header, sticky or not, the replicas agree too; a replica that served the
/// session's previous request reads nothing back.
#[tokio::test]
async fn a_named_session_served_by_one_replica_reads_no_state_back() {
    let wire = Wire::Messages;
    let stub = Stub::start(move |_| stream(wire)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = archived_config(&stub, dir.path());
    config.archive.durability = Durability::Strict;
    let config = Arc::new(config);
    let replicas = fleet(&config, 2).await;
    let requests = session(wire, 16, 260);
    for body in &requests {
        send(&replicas[0], wire, "sticky", body).await;
    }
    let stale = replicas[0].pipeline.stats.stale_state.load(std::sync::atomic::Ordering::Relaxed);
    for replica in replicas {
        replica.shutdown().await.unwrap();
    }
    assert_eq!(stale, 0);
    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    let want = uninterrupted(&config, wire, &requests);
    for (k, (got, want)) in received.iter().zip(&want).enumerate() {
        assert!(*got == want.forwarded, "request {k} differs");
    }
}

/// Two replicas on one archive, a session's requests alternating between them: each replica that
/// finds the session served elsewhere catches up from the stored plan before it compacts, so every
/// request is compacted once — the second replica never compacts a request again — and the
/// upstream receives what one pare forwards, the replicas together starting the epochs one pare
/// starts.
#[tokio::test]
async fn alternating_replicas_catch_up_from_the_plan_and_compact_each_request_once() {
    use std::sync::atomic::Ordering::Relaxed;
    for wire in WIRES {
        let stub = Stub::start(move |_| stream(wire)).await;
        let dir = tempfile::tempdir().unwrap();
        let mut config = archived_config(&stub, dir.path());
        config.archive.durability = Durability::Strict;
        let config = Arc::new(config);
        let replicas = fleet(&config, 2).await;
        let requests = session(wire, 24, 260);
        for (k, body) in requests.iter().enumerate() {
            send(&replicas[k % 2], wire, "alternating", body).await;
        }
        let stats = |r: &in_process::Pare| {
            (r.pipeline.stats.stale_state.load(Relaxed), r.pipeline.stats.caught_up.load(Relaxed))
        };
        let (first, second) = (stats(&replicas[0]), stats(&replicas[1]));
        let mut epochs = 0.0;
        for replica in &replicas {
            let metrics = client().get(replica.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
            epochs += metrics
                .lines()
                .filter(|l| l.starts_with("pare_epochs_total"))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
                .sum::<f64>();
        }
        for replica in replicas {
            replica.shutdown().await.unwrap();
        }
        let want = uninterrupted(&config, wire, &requests);
        let want_epochs = want.iter().filter(|r| r.summary.as_ref().is_some_and(|s| s.epoch_started)).count();
        assert!(want_epochs > 0, "{wire:?}: no epoch");
        let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
        assert_eq!(received.len(), want.len(), "{wire:?}");
        for (k, (got, want)) in received.iter().zip(&want).enumerate() {
            assert!(*got == want.forwarded, "{wire:?}: request {k} is not what one pare forwards");
        }
        assert_eq!(epochs as usize, want_epochs, "{wire:?}: the replicas started epochs one pare would not");
        // A named session is looked up on its first request (the archive holds none of it yet).
        // The second replica meets the session on its first request and catches up before each of
        // its requests; the first learns that the session roams when its second request is
        // refused as stale (compacted again once, after catching up), and catches up beforehand
        // from then on.
        let served = [requests.len().div_ceil(2) as u64, (requests.len() / 2) as u64];
        assert_eq!(second, (0, served[1]), "{wire:?}: (stale, caught up) of the second replica");
        assert_eq!(first, (1, served[0]), "{wire:?}: (stale, caught up) of the first replica");
    }
}
