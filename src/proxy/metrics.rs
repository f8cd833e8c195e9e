//! `/_pare/metrics`: Prometheus (OpenMetrics text) series for requests, latency, pare's own overhead,
//! tokens per model, epochs, fail-open, and the upstream's own usage figures (prompt, cached, cache
//! writes, output), counted when an answer that reported them ends, and what the answered requests
//! cost in USD with pare and (estimated) without it (`CostSeries`). A figure the upstream never
//! reported for a model and wire has no series there (absent, not zero). Other parts of pare (the archive) register their own
//! series into the same [`Registry`] before the server starts (see [`super::run_with_registry`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::archive::response::Truncation;
use crate::budget::price::Prices;
use crate::exchange::Usage;
use crate::exchange::{CompactionSummary, StreamEnd};
use crate::pipeline::Pipeline;

/// The content type of the scrape answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// At most this many distinct `model` label values; later ones are counted as `other` (the label
/// comes from the client and must not grow without bound).
const MAX_MODELS: usize = 64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
    /// The request's wire format (`chat`, `responses`, `messages`).
    wire: &'static str,
}

/// A model and wire, and which side of the comparison a prefill figure is.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PrefillLabels {
    model: String,
    wire: &'static str,
    /// `pare`: what the upstream computed for the forwarded request; `raw`: pare's estimate for the
    /// request as the agent sent it.
    with: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    end: &'static str,
}

/// The proxy's series.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    ends: Family<EndLabels, Counter>,
    upstream_seconds: Family<RouteLabels, Histogram>,
    overhead_seconds: Family<RouteLabels, Histogram>,
    in_flight: Gauge,
    tokens_raw: Family<ModelLabels, Counter>,
    tokens_forwarded: Family<ModelLabels, Counter>,
    compacted: Family<ModelLabels, Counter>,
    over_window: Family<ModelLabels, Counter>,
    epochs: Family<ModelLabels, Counter>,
    upstream: UpstreamSeries,
    prefill: PrefillSeries,
    cost: CostSeries,
    models: Mutex<HashSet<String>>,
}

/// Uncached prefill with and without pare ([`crate::archive::prefill`]), counted when an exchange
/// whose request carries an estimate ends.
#[derive(Debug, Default)]
struct PrefillSeries {
    uncached: Family<PrefillLabels, Counter>,
    raw_over_window: Family<ModelLabels, Counter>,
}

impl PrefillSeries {
    fn register(&self, pare: &mut Registry) {
        pare.register(
            "uncached_prefill_tokens",
            "Prompt tokens the upstream computed afresh: with=\"pare\" the forwarded requests (the upstream's prompt − cached where reported, else pare's estimate), with=\"raw\" pare's estimate for the requests as sent, by model and wire format",
            self.uncached.clone(),
        );
        pare.register(
            "raw_over_window_requests",
            "Requests that as sent were over the model's window (the upstream would have refused them without pare), by model and wire format",
            self.raw_over_window.clone(),
        );
    }

    fn count(&self, labels: &ModelLabels, summary: &CompactionSummary, usage: Option<&Usage>) {
        let Some(estimate) = summary.prefill else { return };
        let Some((with_pare, _)) = crate::archive::prefill::uncached_with_pare(usage, Some(summary)) else { return };
        for (with, tokens) in [("pare", with_pare), ("raw", estimate.raw)] {
            let labels = PrefillLabels { model: labels.model.clone(), wire: labels.wire, with };
            self.uncached.get_or_create(&labels).inc_by(tokens);
        }
        if estimate.raw_over_window {
            self.raw_over_window.get_or_create(labels).inc();
        }
    }
}

/// The upstream's reported usage, summed by model and wire format ([`crate::archive::usage`]).
#[derive(Debug, Default)]
struct UpstreamSeries {
    prompt: Family<ModelLabels, Counter>,
    cached: Family<ModelLabels, Counter>,
    cache_write: Family<ModelLabels, Counter>,
    output: Family<ModelLabels, Counter>,
    /// Answers of the formats pare reads whose upstream reported no usage at all.
    unreported: Family<ModelLabels, Counter>,
}

impl UpstreamSeries {
    fn register(&self, pare: &mut Registry) {
        for (name, help, family) in [
            (
                "upstream_prompt_tokens",
                "Prompt tokens the upstream reported it processed (cached or not), by model and wire format",
                &self.prompt,
            ),
            (
                "upstream_cached_tokens",
                "Prompt tokens the upstream reported read from its prompt cache, by model and wire format",
                &self.cached,
            ),
            (
                "upstream_cache_write_tokens",
                "Prompt tokens the upstream reported written to its prompt cache, by model and wire format",
                &self.cache_write,
            ),
            ("upstream_output_tokens", "Answer tokens the upstream reported, by model and wire format", &self.output),
            (
                "upstream_usage_unreported",
                "Answers whose upstream reported no usage, by model and wire format",
                &self.unreported,
            ),
        ] {
            pare.register(name, help, family.clone());
        }
    }

    fn count(&self, labels: &ModelLabels, usage: Option<&Usage>) {
        let Some(usage) = usage else {
            self.unreported.get_or_create(labels).inc();
            return;
        };
        for (family, figure) in [
            (&self.prompt, usage.prompt),
            (&self.cached, usage.cached),
            (&self.cache_write, usage.cache_write),
            (&self.output, usage.output),
        ] {
            if let Some(n) = figure {
                family.get_or_create(labels).inc_by(n);
            }
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CostLabels {
    /// `with_pare` (what the requests cost as forwarded) or `without_pare` (the estimate of the
    /// same requests sent raw).
    kind: &'static str,
    model: String,
    wire: &'static str,
}

/// Most sessions whose last request is remembered for the cost estimates; past it the memory starts
/// afresh (the next request of a forgotten session is estimated as its first).
const MAX_COST_SESSIONS: usize = 4096;

/// What the answered requests cost, in USD ([`crate::budget::cost`]): with pare (the upstream's
/// figures, else pare's estimate) and without it (estimated), by model and wire format; requests of
/// a model with no price are counted apart, never priced.
#[derive(Debug)]
struct CostSeries {
    usd: Family<CostLabels, Counter<f64, AtomicU64>>,
    unpriced: Family<ModelLabels, Counter>,
    prices: Arc<Prices>,
    /// Each session's previous prompt counts (raw and forwarded).
    previous: Mutex<HashMap<String, CompactionSummary>>,
}

impl CostSeries {
    fn new(prices: Arc<Prices>) -> CostSeries {
        CostSeries { usd: Family::default(), unpriced: Family::default(), prices, previous: Mutex::default() }
    }

    fn register(&self, pare: &mut Registry) {
        pare.register(
            "cost_usd",
            "What the answered requests cost in USD, by kind: with_pare (the upstream's usage at the model's price, else pare's estimate) and without_pare (pare's estimate of the same requests sent uncompacted), net of cache reads and writes; by model and wire format",
            self.usd.clone(),
        );
        pare.register(
            "cost_unpriced_requests",
            "Answered requests of a model with no price (neither models: nor the price table names it), by model and wire format",
            self.unpriced.clone(),
        );
    }

    fn count(&self, labels: &ModelLabels, exchange: &Exchange<'_>, summary: &CompactionSummary) {
        let counts = CompactionSummary {
            tokens_raw: summary.tokens_raw,
            tokens_forwarded: summary.tokens_forwarded,
            ..CompactionSummary::default()
        };
        let previous = exchange.session.and_then(|session| {
            let mut previous = self.previous.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if previous.len() >= MAX_COST_SESSIONS && !previous.contains_key(session) {
                previous.clear();
            }
            previous.insert(session.to_owned(), counts)
        });
        let Some(price) = exchange.model.and_then(|model| self.prices.of(model)) else {
            self.unpriced.get_or_create(labels).inc();
            return;
        };
        let (forwarded, raw) = crate::budget::cost::prompts(previous.as_ref(), summary);
        let cost = crate::budget::cost::request_cost(&price.price, exchange.usage, forwarded, raw);
        for (kind, usd) in [("with_pare", cost.with_pare), ("without_pare", cost.without_pare)] {
            let labels = CostLabels { kind, model: labels.model.clone(), wire: labels.wire };
            self.usd.get_or_create(&labels).inc_by(usd);
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

/// The route label of a path: a small fixed set, never the raw path.
pub fn route(path: &str) -> &'static str {
    if path.starts_with("/_pare") {
        "pare"
    } else if path.ends_with("/chat/completions") {
        "chat_completions"
    } else if path.ends_with("/responses") {
        "responses"
    } else if path.ends_with("/v1/messages") {
        "messages"
    } else if path.ends_with("/v1/messages/count_tokens") {
        "count_tokens"
    } else if path.ends_with("/completions") {
        "completions"
    } else if path.ends_with("/embeddings") {
        "embeddings"
    } else if path.ends_with("/models") || path.contains("/models/") {
        "models"
    } else {
        "other"
    }
}

impl Metrics {
    /// Register pare's proxy series (and the pipeline's counters) into `registry`.
    pub fn new(mut registry: Registry, pipeline: Arc<Pipeline>) -> Metrics {
        let requests = Family::<RequestLabels, Counter>::default();
        let ends = Family::<EndLabels, Counter>::default();
        let latency = || Histogram::new(exponential_buckets(0.0001, 2.5, 16));
        let upstream_seconds = Family::<RouteLabels, Histogram>::new_with_constructor(latency as fn() -> Histogram);
        let overhead_seconds = Family::<RouteLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.000_01, 2.5, 14))) as fn() -> Histogram,
        );
        let in_flight = Gauge::default();
        let tokens_raw = Family::<ModelLabels, Counter>::default();
        let tokens_forwarded = Family::<ModelLabels, Counter>::default();
        let compacted = Family::<ModelLabels, Counter>::default();
        let over_window = Family::<ModelLabels, Counter>::default();
        let epochs = Family::<ModelLabels, Counter>::default();
        let upstream = UpstreamSeries::default();
        let prefill = PrefillSeries::default();
        let cost = CostSeries::new(Arc::clone(pipeline.prices()));

        let pare = registry.sub_registry_with_prefix("pare");
        pare.register("requests", "Requests answered, by route and status", requests.clone());
        pare.register("responses_ended", "Response bodies by how they ended", ends.clone());
        pare.register("upstream_seconds", "Upstream time to response headers, by route", upstream_seconds.clone());
        pare.register("overhead_seconds", "Time pare itself spent on a request, by route", overhead_seconds.clone());
        pare.register("requests_in_flight", "Exchanges not yet finished (streams included)", in_flight.clone());
        pare.register(
            "tokens_raw",
            "Prompt tokens as the agent sent them, by model and wire format",
            tokens_raw.clone(),
        );
        pare.register(
            "tokens_forwarded",
            "Prompt tokens as forwarded upstream, by model and wire format",
            tokens_forwarded.clone(),
        );
        pare.register(
            "compacted_requests",
            "Requests forwarded smaller than received, by model and wire format",
            compacted.clone(),
        );
        pare.register(
            "over_window_requests",
            "Requests forwarded over the usable window (system + users + tail + tools alone do not fit), by model and wire format",
            over_window.clone(),
        );
        pare.register("epochs", "Compaction epochs started, by model and wire format", epochs.clone());
        upstream.register(pare);
        prefill.register(pare);
        cost.register(pare);
        registry.register_collector(Box::new(PipelineCollector { pipeline }));

        Metrics {
            registry,
            requests,
            ends,
            upstream_seconds,
            overhead_seconds,
            in_flight,
            tokens_raw,
            tokens_forwarded,
            compacted,
            over_window,
            epochs,
            upstream,
            prefill,
            cost,
            models: Mutex::new(HashSet::new()),
        }
    }

    /// An exchange started (paired with exactly one [`Metrics::finished`]).
    pub fn started(&self) {
        self.in_flight.inc();
    }

    /// An exchange ended; everything the access line knows is counted.
    pub fn finished(&self, exchange: &Exchange<'_>) {
        self.in_flight.dec();
        let route = route(exchange.path);
        self.requests.get_or_create(&RequestLabels { route, status: exchange.status }).inc();
        let end = match exchange.end {
            StreamEnd::Complete => "complete",
            StreamEnd::ClientGone => "client_gone",
            StreamEnd::UpstreamError(_) => "upstream_error",
            StreamEnd::NoResponse(_) => "no_response",
        };
        self.ends.get_or_create(&EndLabels { end }).inc();
        if let Some(upstream) = exchange.upstream {
            self.upstream_seconds.get_or_create(&RouteLabels { route }).observe(upstream.as_secs_f64());
        }
        self.overhead_seconds.get_or_create(&RouteLabels { route }).observe(exchange.overhead.as_secs_f64());
        if let Some(summary) = exchange.summary {
            let wire = crate::wire::Wire::of_path(exchange.path).unwrap_or_default().name();
            let labels = ModelLabels { model: self.model_label(exchange.model), wire };
            self.tokens_raw.get_or_create(&labels).inc_by(summary.tokens_raw);
            self.tokens_forwarded.get_or_create(&labels).inc_by(summary.tokens_forwarded);
            if summary.tokens_forwarded < summary.tokens_raw {
                self.compacted.get_or_create(&labels).inc();
            }
            if summary.over_window {
                self.over_window.get_or_create(&labels).inc();
            }
            if summary.epoch_started {
                self.epochs.get_or_create(&labels).inc();
            }
            self.prefill.count(&labels, summary, exchange.usage);
        }
        // The answers pare read (a format it compacts), when the upstream answered.
        let answered = (200..300).contains(&exchange.status) && *exchange.end == StreamEnd::Complete;
        if let Some(wire) = crate::wire::Wire::of_path(exchange.path)
            && exchange.answer_read
            && (answered || exchange.usage.is_some())
        {
            let labels = ModelLabels { model: self.model_label(exchange.model), wire: wire.name() };
            self.upstream.count(&labels, exchange.usage);
            if let Some(summary) = exchange.summary {
                self.cost.count(&labels, exchange, summary);
            }
        }
    }

    fn model_label(&self, model: Option<&str>) -> String {
        let Some(model) = model else {
            return "unknown".to_owned();
        };
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        if models.contains(model) {
            return model.to_owned();
        }
        if models.len() < MAX_MODELS {
            models.insert(model.to_owned());
            return model.to_owned();
        }
        "other".to_owned()
    }

    /// The scrape answer.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// What [`Metrics::finished`] needs to know about one exchange.
pub struct Exchange<'a> {
    pub path: &'a str,
    pub status: u16,
    pub end: &'a StreamEnd,
    pub upstream: Option<Duration>,
    pub overhead: Duration,
    pub summary: Option<&'a CompactionSummary>,
    pub model: Option<&'a str>,
    /// The request's session (what its previous request was, for the cost estimates).
    pub session: Option<&'a str>,
    /// What the upstream reported it billed for the answer.
    pub usage: Option<&'a Usage>,
    /// pare read the answer: no `usage` then means the upstream reported none.
    pub answer_read: bool,
}

/// Exports the pipeline's own counters (fail-open, unparseable, bypassed) at scrape time.
struct PipelineCollector {
    pipeline: Arc<Pipeline>,
}

impl std::fmt::Debug for PipelineCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PipelineCollector")
    }
}

impl Collector for PipelineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &self.pipeline.stats;
        let mut counters = vec![
            (
                "pare_fail_open",
                "Chat requests forwarded unchanged because compaction failed or panicked",
                stats.fail_open.load(Relaxed),
            ),
            (
                "pare_unparseable",
                "Chat requests forwarded unchanged because pare could not parse them",
                stats.unparseable.load(Relaxed),
            ),
            (
                "pare_bypassed",
                "Chat requests forwarded uncompacted because they carried x-pare-bypass",
                stats.bypassed.load(Relaxed),
            ),
            (
                "pare_strict_unconfirmed",
                "Strict-durability requests forwarded before their raw record was confirmed committed",
                stats.strict_unconfirmed.load(Relaxed),
            ),
            (
                "pare_stale_state",
                "Strict-durability requests compacted again because another process had served their session",
                stats.stale_state.load(Relaxed),
            ),
            (
                "pare_caught_up",
                "Requests whose session's compaction state caught up from the archive before compaction",
                stats.caught_up.load(Relaxed),
            ),
        ];
        let memory = self.pipeline.memory();
        counters.push(("pare_memory_evictions", "Sessions the memory budget evicted", memory.evictions));
        let archive = self.pipeline.archive().map(|archive| archive.health());
        if let Some(health) = &archive {
            counters.push((
                "pare_archive_committed_records",
                "Records the archive committed",
                health.committed_records,
            ));
            counters.push((
                "pare_archive_commits",
                "Transactions the archive committed (records arriving together share one)",
                health.commits,
            ));
            counters.push((
                "pare_archive_lost_records",
                "Records the archive could not store (disk full, read-only, queue full)",
                health.lost_records,
            ));
            counters.push((
                "pare_archive_refused_records",
                "Records the archive's store refused on their own (the rest of their transaction was written)",
                health.refused_records,
            ));
            counters.push((
                "pare_archive_queue_waits",
                "Requests that waited for room in the archive's queue (archive.max_queue_bytes)",
                health.queue_waits,
            ));
        }
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        let answers = self.pipeline.held_answers();
        let mut truncated = encoder.encode_descriptor(
            "pare_answers_truncated",
            "Answers archived truncated, by reason: held_cap (archive.max_held_answer_bytes reached by all answers in flight), answer_cap (one answer over 64 MiB)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (reason, why) in [("held_cap", Truncation::HeldCap), ("answer_cap", Truncation::AnswerCap)] {
            let counter = ConstCounter::new(answers.n_truncated(why));
            counter.encode(truncated.encode_family(&ReasonLabels { reason })?)?;
        }
        for (name, help, value) in [
            (
                "pare_memory_state_bytes",
                "Bytes of per-session state held (caches' reservations included)",
                memory.held_bytes,
            ),
            ("pare_memory_max_state_bytes", "The per-session state budget (memory.max_state_bytes)", memory.max_bytes),
            ("pare_memory_sessions", "Sessions with state in memory", memory.sessions),
            (
                "pare_answer_bytes_held",
                "Bytes of streaming answers held in memory for the archive, all exchanges in flight",
                answers.held_bytes(),
            ),
            (
                "pare_max_held_answer_bytes",
                "The cap on answers held for the archive (archive.max_held_answer_bytes)",
                answers.max_bytes(),
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)?;
        }
        if let Some(health) = &archive {
            for (name, help, value) in [
                ("pare_archive_queue_depth", "Records waiting for the archive writer", health.queue_depth as i64),
                (
                    "pare_archive_queue_bytes",
                    "Bytes of records waiting for the archive writer",
                    health.queue_bytes as i64,
                ),
                ("pare_archive_writable", "1 while the archive commits, 0 after a failure", i64::from(health.writable)),
            ] {
                let gauge = ConstGauge::new(value);
                let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
                gauge.encode(metric)?;
            }
        }
        if let Some(observer) = self.pipeline.observer() {
            encode_observed(&observer.stats, &mut encoder)?;
        }
        Ok(())
    }
}

/// Mode `observe`'s series: what epoch mode would have done with the requests forwarded unchanged.
fn encode_observed(stats: &crate::observe::ObservedStats, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    use std::sync::atomic::Ordering::Relaxed;
    for (name, help, value) in [
        (
            "pare_observed_requests",
            "Requests mode observe forwarded unchanged and projected as epoch mode would have forwarded them",
            &stats.requests,
        ),
        (
            "pare_observed_tokens_raw",
            "Prompt tokens of the projected requests, as sent and forwarded",
            &stats.tokens_raw,
        ),
        (
            "pare_observed_tokens_forwarded",
            "Prompt tokens epoch mode would have forwarded for the projected requests",
            &stats.tokens_forwarded,
        ),
        ("pare_observed_epochs", "Epochs epoch mode would have started", &stats.epochs),
        (
            "pare_observed_uncached_prefill_raw",
            "Prompt tokens of the projected requests a prefix cache could not reuse from their session's previous request, as forwarded (estimate)",
            &stats.uncached_raw,
        ),
        (
            "pare_observed_uncached_prefill_forwarded",
            "The same had epoch mode forwarded them (estimate)",
            &stats.uncached_forwarded,
        ),
        (
            "pare_observed_skipped",
            "Requests mode observe forwarded without a projection (its queue was full, or compaction failed)",
            &stats.skipped,
        ),
    ] {
        let counter = ConstCounter::new(value.load(Relaxed));
        let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
        counter.encode(metric)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn metrics() -> Metrics {
        let pipeline = Arc::new(Pipeline::identity(Arc::new(Config::default())));
        Metrics::new(Registry::default(), pipeline)
    }

    fn chat(summary: &CompactionSummary, model: &str) -> Exchange<'static> {
        let summary: &'static CompactionSummary = Box::leak(Box::new(summary.clone()));
        let model: &'static str = Box::leak(model.to_owned().into_boxed_str());
        Exchange {
            path: "/v1/chat/completions",
            status: 200,
            end: &StreamEnd::Complete,
            upstream: Some(Duration::from_millis(3)),
            overhead: Duration::from_micros(40),
            summary: Some(summary),
            model: Some(model),
            session: Some("s1"),
            usage: None,
            answer_read: true,
        }
    }

    #[test]
    fn routes_are_a_closed_set() {
        assert_eq!(route("/v1/chat/completions"), "chat_completions");
        assert_eq!(route("/api/v1/chat/completions"), "chat_completions");
        assert_eq!(route("/v1/completions"), "completions");
        assert_eq!(route("/v1/models/gpt-4o"), "models");
        assert_eq!(route("/props"), "other");
        assert_eq!(route("/v1/responses"), "responses");
        assert_eq!(route("/v1/responses/resp_1"), "other");
        assert_eq!(route("/v1/messages"), "messages");
        assert_eq!(route("/v1/messages/count_tokens"), "count_tokens");
        assert_eq!(route("/v1/messages/batches"), "other");
        assert_eq!(route("/_pare/metrics"), "pare");
    }

    #[test]
    fn tokens_and_epochs_are_counted_per_model() {
        let metrics = metrics();
        let epoch0 = CompactionSummary { tokens_raw: 100, tokens_forwarded: 100, epoch: 0, ..Default::default() };
        let epoch1 = CompactionSummary {
            tokens_raw: 200,
            tokens_forwarded: 120,
            epoch: 1,
            epoch_started: true,
            ..Default::default()
        };
        // The next request of the same epoch (and over the window): no epoch started.
        let over = CompactionSummary { over_window: true, epoch_started: false, ..epoch1.clone() };
        for exchange in [chat(&epoch0, "qwen"), chat(&epoch1, "qwen"), chat(&over, "qwen")] {
            metrics.started();
            metrics.finished(&exchange);
        }
        let text = metrics.encode().unwrap();
        assert!(text.contains(r#"pare_tokens_raw_total{model="qwen",wire="chat"} 500"#), "{text}");
        assert!(text.contains(r#"pare_tokens_forwarded_total{model="qwen",wire="chat"} 340"#), "{text}");
        assert!(text.contains(r#"pare_epochs_total{model="qwen",wire="chat"} 1"#), "{text}");
        assert!(text.contains(r#"pare_compacted_requests_total{model="qwen",wire="chat"} 2"#), "{text}");
        assert!(text.contains(r#"pare_over_window_requests_total{model="qwen",wire="chat"} 1"#), "{text}");
        assert!(text.contains(r#"pare_requests_total{route="chat_completions",status="200"} 3"#), "{text}");
        assert!(text.contains("pare_requests_in_flight 0"), "{text}");
        assert!(text.contains("pare_fail_open_total 0"), "{text}");
        assert!(text.contains("pare_memory_evictions_total 0"), "{text}");
        assert!(text.contains(r#"pare_answers_truncated_total{reason="held_cap"} 0"#), "{text}");
        assert!(text.contains("pare_answer_bytes_held 0"), "{text}");
        let budget = format!("pare_memory_max_state_bytes {}", crate::memory::DEFAULT_MAX_STATE_BYTES);
        assert!(text.contains(&budget), "{text}");
    }

    /// The upstream's figures are summed by model and wire; a figure never reported has no series
    /// (absent, not 0), and an answer without usage is counted as such.
    #[test]
    fn upstream_usage_is_counted_by_model_and_wire_and_unreported_is_not_zero() {
        let metrics = metrics();
        let claude = Usage { prompt: Some(3000), cached: Some(2048), cache_write: Some(100), output: Some(9) };
        let local = Usage { prompt: Some(11), cached: None, cache_write: None, output: Some(4) };
        let answers = [
            ("/v1/messages", "claude", Some(&claude)),
            ("/v1/messages", "claude", Some(&claude)),
            ("/v1/chat/completions", "qwen", Some(&local)),
            ("/v1/chat/completions", "qwen", None),
        ];
        for (path, model, usage) in answers {
            metrics.started();
            metrics.finished(&Exchange {
                path,
                model: Some(model),
                usage,
                summary: None,
                ..chat(&Default::default(), model)
            });
        }
        // An answer pare did not read (a compressed body it forwarded as sent) says nothing.
        metrics.started();
        metrics.finished(&Exchange { answer_read: false, ..chat(&Default::default(), "qwen") });
        let text = metrics.encode().unwrap();
        for line in [
            r#"pare_upstream_prompt_tokens_total{model="claude",wire="messages"} 6000"#,
            r#"pare_upstream_cached_tokens_total{model="claude",wire="messages"} 4096"#,
            r#"pare_upstream_cache_write_tokens_total{model="claude",wire="messages"} 200"#,
            r#"pare_upstream_output_tokens_total{model="claude",wire="messages"} 18"#,
            r#"pare_upstream_prompt_tokens_total{model="qwen",wire="chat"} 11"#,
            r#"pare_upstream_usage_unreported_total{model="qwen",wire="chat"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(!text.contains(r#"pare_upstream_cached_tokens_total{model="qwen""#), "{text}");
    }

    /// The forwarded side takes the upstream's figure where it reported one, else pare's estimate;
    /// the raw side is pare's estimate; a request without an estimate counts on neither side.
    #[test]
    fn uncached_prefill_is_counted_with_and_without_pare() {
        use crate::exchange::PrefillEstimate;
        let metrics = metrics();
        let estimated = |forwarded, raw, raw_over_window| CompactionSummary {
            prefill: Some(PrefillEstimate { forwarded, raw, raw_over_window }),
            ..Default::default()
        };
        let reported = Usage { prompt: Some(900), cached: Some(100), cache_write: None, output: Some(1) };
        let first = estimated(1000, 1000, false);
        let second = estimated(300, 50, true);
        let unknown = CompactionSummary::default();
        for (summary, usage) in [(&first, Some(&reported)), (&second, None), (&unknown, Some(&reported))] {
            metrics.started();
            metrics.finished(&Exchange { usage, ..chat(summary, "qwen") });
        }
        let text = metrics.encode().unwrap();
        for line in [
            r#"pare_uncached_prefill_tokens_total{model="qwen",wire="chat",with="pare"} 1100"#,
            r#"pare_uncached_prefill_tokens_total{model="qwen",wire="chat",with="raw"} 1050"#,
            r#"pare_raw_over_window_requests_total{model="qwen",wire="chat"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    /// A priced model's requests add their cost with pare (the upstream's figures) and without it
    /// (estimated); a model with no price is counted, never priced.
    #[test]
    fn cost_is_counted_by_kind_and_an_unknown_model_is_unpriced() {
        let metrics = metrics();
        let first = CompactionSummary { tokens_raw: 1_000, tokens_forwarded: 1_000, ..Default::default() };
        let second = CompactionSummary { tokens_raw: 3_000, tokens_forwarded: 1_500, ..Default::default() };
        let usage = Usage { prompt: Some(1_500), cached: Some(1_000), cache_write: None, output: Some(100) };
        for (summary, model, usage) in
            [(&first, "gpt-4o", None), (&second, "gpt-4o", Some(&usage)), (&first, "my-local-model", None)]
        {
            metrics.started();
            metrics.finished(&Exchange { usage, ..chat(summary, model) });
        }
        let text = metrics.encode().unwrap();
        let figure = |kind: &str| -> f64 {
            let prefix = format!(r#"pare_cost_usd_total{{kind="{kind}",model="gpt-4o",wire="chat"}} "#);
            text.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .unwrap_or_else(|| panic!("{kind} in {text}"))
                .parse()
                .unwrap()
        };
        // gpt-4o: 2.5 input, 1.25 cached, 10 output per million. First request (nothing reported):
        // 1,000 uncached both ways. Second: with pare 500 uncached + 1,000 cached + 100 out; without,
        // 3,000 raw of which the previous 1,000 cached.
        let with_pare = (1_000.0 * 2.5 + 500.0 * 2.5 + 1_000.0 * 1.25 + 100.0 * 10.0) * 1e-6;
        let without_pare = (1_000.0 * 2.5 + 2_000.0 * 2.5 + 1_000.0 * 1.25 + 100.0 * 10.0) * 1e-6;
        assert!((figure("with_pare") - with_pare).abs() < 1e-12, "{text}");
        assert!((figure("without_pare") - without_pare).abs() < 1e-12, "{text}");
        assert!(text.contains(r#"pare_cost_unpriced_requests_total{model="my-local-model",wire="chat"} 1"#), "{text}");
        assert!(!text.contains(r#"pare_cost_usd_total{kind="with_pare",model="my-local-model""#), "{text}");
    }

    #[test]
    fn model_labels_are_bounded() {
        let metrics = metrics();
        for i in 0..MAX_MODELS + 5 {
            metrics.model_label(Some(&format!("m{i}")));
        }
        assert_eq!(metrics.model_label(Some("m0")), "m0");
        assert_eq!(metrics.model_label(Some("one-too-many")), "other");
        assert_eq!(metrics.model_label(None), "unknown");
    }
}
