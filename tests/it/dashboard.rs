//! The Grafana dashboard in `deploy/` queries only series pare serves: every metric name in its
//! PromQL expressions is in a live pare's `/_pare/metrics` (a sample, or its family's `# TYPE`
//! line for a labelled family that has no sample yet).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Value, json};

use crate::support::pare::{config_for, start_with_pipeline};
use crate::support::stub::{Recorded, Reply, Stub};
use crate::support::{CodingAgent, client, coding_session, within};

const DASHBOARD: &str = include_str!("../../deploy/grafana-dashboard.json");

/// An OpenAI-like upstream; model `cached` reports cache reads and writes (as OpenRouter does),
/// model `silent` no usage at all.
fn answer(request: &Recorded) -> Reply {
    let body = request.json();
    let usage = match body["model"].as_str() {
        Some("cached") => json!({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
            "prompt_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 40}}),
        Some("silent") => Value::Null,
        _ => return Stub::openai(request),
    };
    let mut completion = crate::support::stub::completion(body["model"].as_str().unwrap(), "done");
    completion["usage"] = usage;
    Reply::json(200, completion)
}

/// Every `expr` in the dashboard, however deep its panel sits.
fn expressions(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => expressions(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

/// The metric names an expression queries: its identifiers that start with `pare_` (PromQL's
/// functions, label names and Grafana's variables do not).
fn metric_names(expr: &str) -> impl Iterator<Item = &str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).filter(|word| word.starts_with("pare_"))
}

/// Whether the scrape `text` has series `name`: a sample of it, or the `# TYPE` line of the family
/// it belongs to (`_total` of a counter; `_bucket`, `_sum`, `_count` of a histogram; a gauge).
fn exposes(text: &str, name: &str) -> bool {
    let sampled = text.lines().any(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])));
    let declared = |family: &str, kind: &str| text.lines().any(|l| l == format!("# TYPE {family} {kind}"));
    sampled
        || name.strip_suffix("_total").is_some_and(|f| declared(f, "counter"))
        || ["_bucket", "_sum", "_count"].iter().any(|s| name.strip_suffix(s).is_some_and(|f| declared(f, "histogram")))
        || declared(name, "gauge")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_the_dashboard_queries_exists() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    expressions(&dashboard, &mut exprs);
    let names: BTreeSet<&str> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    // Each area the dashboard is for has its series.
    for needed in [
        "pare_tokens_raw_total",
        "pare_cost_usd_total",
        "pare_epochs_total",
        "pare_upstream_cached_tokens_total",
        "pare_upstream_seconds_bucket",
        "pare_archive_writable",
    ] {
        assert!(names.contains(needed), "the dashboard queries {needed}: {names:?}");
    }

    // Traffic that gives every family a sample: a session long enough for epochs at a small
    // window, a request over the window, answers with cache figures and without usage, a priced
    // model and an unpriced one.
    let stub = Stub::start(answer).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.detect_window = false;
    config.budget.default_context_window = 2048;
    config.budget.output_reserve = 512;
    let config = Arc::new(config);
    let pipeline = Arc::new(pare::pipeline::Pipeline::from_config(config.clone()).unwrap());
    let server = start_with_pipeline(config, pipeline).await;
    let agent = CodingAgent { model: "test-model", tool: "terminal", id_prefix: "call_", reasoning: None };
    let mut bodies = coding_session(&agent, 12, 150);
    let huge: String = (0..3000).map(|i| format!("word{i} ")).collect();
    bodies.push(json!({"model": "test-model", "messages": [{"role": "user", "content": huge}]}));
    for model in ["gpt-4o", "cached", "silent"] {
        bodies.push(json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}));
    }
    for body in &bodies {
        let response = within(
            "pare to answer",
            client()
                .post(server.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-pare-session", body["model"].as_str().unwrap())
                .body(body.to_string())
                .send(),
        )
        .await
        .unwrap();
        assert!(response.status().is_success());
        response.bytes().await.unwrap();
    }
    let text = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    server.shutdown().await.unwrap();

    let missing: Vec<&&str> = names.iter().filter(|name| !exposes(&text, name)).collect();
    assert!(missing.is_empty(), "the dashboard queries series pare does not serve: {missing:?}\n{text}");
    // The check itself tells a series pare serves from one it does not.
    assert!(exposes(&text, "pare_requests_total") && !exposes(&text, "pare_requests_totally"));
    assert!(!exposes(&text, "pare_uncached_made_up_total"));
}
