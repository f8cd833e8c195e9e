//! Money through `pare serve`: a model the price table names takes its window from it (and the
//! answer says so), its requests' cost with pare and without it is counted in
//! `pare_cost_usd_total`, shown on the UI's index and session page and in `sessions list`; a model
//! with no price shows tokens only; a `models:` price overrides the table.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::support::pare::{config_for, start_with_pipeline};
use crate::support::stub::{Recorded, Reply, Stub};
use crate::support::{client, within};

/// A chat answer reporting 1,000 prompt tokens, 600 of them cached, and 50 output tokens.
fn answer(request: &Recorded) -> Reply {
    Reply::json(
        200,
        json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000, "model": request.json()["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                "prompt_tokens_details": {"cached_tokens": 600}}}),
    )
}

fn pare_cli(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().expect("run pare");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_is_counted_shown_and_listed_and_unknown_models_show_tokens_only() {
    let stub = Stub::start(answer).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.detect_window = false;
    config.models = pare::config::Config::from_yaml(
        "models:\n  - match: \"^priced-local\"\n    context_window: 32768\n    price: {input: 1.0, output: 2.0}\n",
    )
    .unwrap()
    .models;
    let config = Arc::new(config);
    let pipeline = Arc::new(pare::pipeline::Pipeline::from_config(config.clone()).unwrap());
    let server = start_with_pipeline(config.clone(), pipeline).await;

    let mut windows = Vec::new();
    for model in ["gpt-4o", "my-local-model", "priced-local-7b"] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "what changed?"}]});
        let response = within(
            "pare to answer",
            client()
                .post(server.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-pare-session", model)
                .body(body.to_string())
                .send(),
        )
        .await
        .unwrap();
        assert!(response.status().is_success(), "{model}");
        let header = |name: &str| response.headers()[name].to_str().unwrap().to_owned();
        windows.push((header("x-pare-window"), header("x-pare-window-source")));
        response.bytes().await.unwrap();
    }
    assert_eq!(
        windows,
        [("128000".into(), "prices".into()), ("65536".into(), "default".into()), ("32768".into(), "models".into())]
    );
    let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    let index = client().get(server.url("/_pare/ui/")).send().await.unwrap().text().await.unwrap();
    let page = client().get(server.url("/_pare/ui/session/gpt-4o")).send().await.unwrap().text().await.unwrap();
    let unpriced =
        client().get(server.url("/_pare/ui/session/my-local-model")).send().await.unwrap().text().await.unwrap();
    server.shutdown().await.unwrap();

    // gpt-4o at 2.5 input, 1.25 cached, 10 output per million: 400 uncached, 600 cached, 50 out.
    // Without pare: the same request (nothing to compact, no previous prompt), the same cost.
    let expected = (400.0 * 2.5 + 600.0 * 1.25 + 50.0 * 10.0) * 1e-6;
    let figure = |kind: &str, model: &str| -> f64 {
        let prefix = format!(r#"pare_cost_usd_total{{kind="{kind}",model="{model}",wire="chat"}} "#);
        let line = metrics.lines().find_map(|l| l.strip_prefix(prefix.as_str()));
        line.unwrap_or_else(|| panic!("{prefix} in {metrics}")).parse().unwrap()
    };
    for kind in ["with_pare", "without_pare"] {
        assert!((figure(kind, "gpt-4o") - expected).abs() < 1e-12, "{kind}: against {expected}");
    }
    // A models: price: 1,000 prompt tokens at 1.0 (no cache price: cached tokens bill as input), 50 at 2.0.
    assert!((figure("with_pare", "priced-local-7b") - 1_100.0 * 1e-6).abs() < 1e-12);
    assert!(
        metrics.contains(r#"pare_cost_unpriced_requests_total{model="my-local-model",wire="chat"} 1"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"pare_cost_usd_total{kind="with_pare",model="my-local-model""#), "{metrics}");

    assert!(index.contains("$0.0022 → $0.0022"), "{index}");
    assert!(index.contains("tokens only"), "{index}");
    assert!(
        page.contains(r#"id="session-cost""#) && page.contains("$0.0022 with pare · $0.0022 without (est.)"),
        "{page}"
    );
    assert!(unpriced.contains("no price for this model: tokens only"), "{unpriced}");

    let archive = dir.path().to_str().unwrap();
    let listed: Vec<Value> = pare_cli(&["sessions", "list", "--json", "--archive", archive])
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let by_id = |id: &str| listed.iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("{id} listed"));
    let gpt = by_id("gpt-4o");
    assert!((gpt["cost_usd_with_pare"].as_f64().unwrap() - expected).abs() < 1e-12, "{gpt}");
    assert_eq!(gpt["cost_unpriced_requests"], json!(0));
    let local = by_id("my-local-model");
    assert_eq!((&local["cost_usd_with_pare"], &local["cost_unpriced_requests"]), (&Value::Null, &json!(1)));
    let table = pare_cli(&["sessions", "list", "--archive", archive]);
    let row = |id: &str| table.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} in\n{table}"));
    assert!(row("gpt-4o").contains("$0.0022 → $0.0022"), "{table}");
    assert!(row("my-local-model").contains("tokens only"), "{table}");
}
