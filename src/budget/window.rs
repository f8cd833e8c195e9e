//! The context window of a request's model, and the tokens reserved for its answer.
//!
//! Precedence: a `models:` entry whose pattern matches the model, then the window the upstream reports
//! (detected once per model and cached, failures cached too so a server without the endpoint is not
//! asked on every request; see [`WindowResolver`] for what detection costs the upstream), then the
//! model's input limit in the built-in price table ([`super::price::PriceTable`]: the Claude, GPT,
//! Gemini… models need no `models:` entry), then `budget.default_context_window`. The answer reserve is the request's
//! `max_completion_tokens` / `max_tokens`, else the model's `output_reserve`, else the budget's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use regex::Regex;
use serde_json::Value;

use super::price::PriceTable;
use crate::config::{BudgetConfig, Config, ModelConfig};
use crate::exchange::WindowSource;
use crate::tokens::{Encoding, UnknownEncoding};
use crate::wire::Wire;

/// A `models:` entry that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelTableError {
    #[error("models[{index}].match `{pattern}` is not a valid regular expression: {source}")]
    Pattern { index: usize, pattern: String, source: Box<regex::Error> },
    #[error("models[{index}].encoding: {source}")]
    Encoding { index: usize, source: UnknownEncoding },
    #[error("budget.encoding: {0}")]
    DefaultEncoding(UnknownEncoding),
}

/// The settings in force for one model, after `models:` overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSettings {
    /// From a `models:` entry; `None` means detect or use the default.
    pub context_window: Option<u64>,
    pub output_reserve: u64,
    pub encoding: Encoding,
}

/// The window of a Gemini API request whose model no `models:` entry names: the input limit of the
/// Gemini 2.5 and 3 models (1,048,576 tokens). A smaller model, or a smaller working window, is
/// given by a `models:` entry (`pattern: "^gemini-2\\.0-flash-lite"`, `context_window: …`).
pub const GEMINI_CONTEXT_WINDOW: u64 = 1_048_576;

/// The compiled `models:` table (first match wins) with the budget's defaults.
#[derive(Debug, Clone)]
pub struct ModelTable {
    entries: Vec<(Regex, ModelConfig, Option<Encoding>)>,
    default_encoding: Encoding,
    default_reserve: u64,
    default_window: u64,
    anthropic_window: u64,
}

impl ModelTable {
    pub fn from_config(config: &Config) -> Result<ModelTable, ModelTableError> {
        let mut entries = Vec::with_capacity(config.models.len());
        for (index, model) in config.models.iter().enumerate() {
            let regex = Regex::new(&model.pattern).map_err(|source| ModelTableError::Pattern {
                index,
                pattern: model.pattern.clone(),
                source: Box::new(source),
            })?;
            let encoding = match &model.encoding {
                Some(name) => Some(name.parse().map_err(|source| ModelTableError::Encoding { index, source })?),
                None => None,
            };
            entries.push((regex, model.clone(), encoding));
        }
        let budget: &BudgetConfig = &config.budget;
        Ok(ModelTable {
            entries,
            default_encoding: budget.encoding.parse().map_err(ModelTableError::DefaultEncoding)?,
            default_reserve: budget.output_reserve,
            default_window: budget.default_context_window,
            anthropic_window: budget.anthropic_context_window,
        })
    }

    /// Settings for a model name (`None` when the request names none).
    pub fn settings(&self, model: Option<&str>) -> ModelSettings {
        let entry = model.and_then(|name| self.entries.iter().find(|(re, _, _)| re.is_match(name)));
        ModelSettings {
            context_window: entry.and_then(|(_, m, _)| m.context_window),
            output_reserve: entry.and_then(|(_, m, _)| m.output_reserve).unwrap_or(self.default_reserve),
            encoding: entry.and_then(|(_, _, e)| *e).unwrap_or(self.default_encoding),
        }
    }

    /// `budget.default_context_window`.
    pub fn default_window(&self) -> u64 {
        self.default_window
    }

    /// The window of a request of format `wire` when neither `models:` nor detection gives one:
    /// `budget.anthropic_context_window` for the Messages API, [`GEMINI_CONTEXT_WINDOW`] for the
    /// Gemini API, else `budget.default_context_window`.
    pub fn default_window_for(&self, wire: Wire) -> u64 {
        match wire {
            Wire::Messages => self.anthropic_window,
            Wire::Gemini => GEMINI_CONTEXT_WINDOW,
            Wire::Chat | Wire::Responses => self.default_window,
        }
    }

    /// Every encoding the table can select, the default first.
    pub fn encodings(&self) -> Vec<Encoding> {
        let mut out = vec![self.default_encoding];
        for (_, _, e) in &self.entries {
            if let Some(e) = e
                && !out.contains(e)
            {
                out.push(*e);
            }
        }
        out
    }
}

/// Tokens reserved for the answer: the request's own limit when it names one (chat's
/// `max_completion_tokens` or `max_tokens`, Responses' `max_output_tokens`), else `configured`. Capped at half the window so that a request asking for more than the window
/// still leaves room to fit its prompt.
pub fn answer_reserve(requested: Option<u64>, configured: u64, window: u64) -> u64 {
    requested.unwrap_or(configured).min(window / 2)
}

/// Tuning of upstream window detection.
#[derive(Debug, Clone)]
pub struct DetectConfig {
    pub enabled: bool,
    /// Time allowed for each probe.
    pub timeout: Duration,
    /// How long a failed detection is remembered before asking again.
    pub retry_after: Duration,
    /// How long a detected window is trusted.
    pub ttl: Duration,
}

impl DetectConfig {
    pub fn from_budget(budget: &BudgetConfig) -> DetectConfig {
        DetectConfig {
            enabled: budget.detect_window,
            timeout: Duration::from_millis(budget.detect_timeout_ms),
            retry_after: Duration::from_secs(budget.detect_retry_secs),
            ttl: Duration::from_secs(budget.detect_ttl_secs),
        }
    }
}

/// The kinds of server whose window pare can read, each from its own endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerKind {
    /// llama.cpp, `GET /props`.
    LlamaCpp,
    /// vLLM, `GET /v1/models`.
    Vllm,
    /// LM Studio, `GET /api/v0/models`.
    LmStudio,
    /// Ollama, `POST /api/show` (the only endpoint that depends on the model).
    Ollama,
}

/// What the upstream is, as the last full probe found.
#[derive(Debug, Clone, Copy)]
struct Discovery {
    /// The kind that gave a window; `None`: none of the four did.
    kind: Option<ServerKind>,
    at: Instant,
}

/// One model's detection: the window (`None` for a failed one) and when it was learnt.
type Detection = Option<(Option<u64>, Instant)>;

/// Most model names remembered. Past it, the names no request is detecting are forgotten (a
/// client that sends a new name on every request must not grow pare's memory without bound).
const MAX_MODELS: usize = 1024;

/// Resolves the context window of a model: config, else detection (cached), else the default.
///
/// Detection costs the upstream one request per new model name: the first detection asks the four
/// kinds of server at once and remembers which kind answered (for `budget.detect_ttl_secs`); later
/// names ask that kind's endpoint alone — or, when no kind answered, only Ollama's per-model
/// `/api/show` (for `budget.detect_retry_secs`, after which all four are asked again). Concurrent
/// requests for the same new model wait for one detection and share its answer.
pub struct WindowResolver {
    client: reqwest::Client,
    /// The upstream's root, without a trailing `/v1` or `/`.
    root: String,
    table: ModelTable,
    detect: DetectConfig,
    /// model → its detection, behind a lock of its own that a detection holds until it is done.
    cache: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Detection>>>>,
    /// What kind of server the upstream is; held while the four kinds are asked, so that new models
    /// arriving meanwhile wait for that answer instead of asking all four again.
    discovery: tokio::sync::Mutex<Option<Discovery>>,
    /// The models warned about taking the default window (at most [`MAX_MODELS`], then forgotten).
    warned: Mutex<std::collections::HashSet<String>>,
}

impl WindowResolver {
    pub fn new(client: reqwest::Client, upstream_url: &str, table: ModelTable, detect: DetectConfig) -> WindowResolver {
        let trimmed = upstream_url.trim_end_matches('/');
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_owned();
        WindowResolver {
            client,
            root,
            table,
            detect,
            cache: Mutex::new(HashMap::new()),
            discovery: tokio::sync::Mutex::new(None),
            warned: Mutex::default(),
        }
    }

    /// The context window of `model`: config, else detected, else `budget.default_context_window`.
    pub async fn window(&self, model: Option<&str>) -> u64 {
        self.window_for(Wire::Chat, model).await
    }

    /// The context window of `model` in a request of format `wire`: config, else detected, else the
    /// price table's, else the default for the format ([`ModelTable::default_window_for`]).
    /// A model whose window falls back to the default is named in one warning (per model name).
    pub async fn window_for(&self, wire: Wire, model: Option<&str>) -> u64 {
        self.resolve(wire, model).await.0
    }

    /// [`WindowResolver::window_for`] and where the window came from.
    pub async fn resolve(&self, wire: Wire, model: Option<&str>) -> (u64, WindowSource) {
        if let Some(window) = self.table.settings(model).context_window {
            return (window, WindowSource::Models);
        }
        if self.detect.enabled
            && let Some(window) = self.detected(model.unwrap_or("")).await
        {
            return (window, WindowSource::Upstream);
        }
        if let Some(entry) = model.and_then(|name| PriceTable::builtin().get(name)) {
            return (entry.window, WindowSource::Prices);
        }
        let window = self.table.default_window_for(wire);
        let name = model.unwrap_or("");
        let mut warned = self.warned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !warned.contains(name) {
            if warned.len() >= MAX_MODELS {
                warned.clear();
            }
            warned.insert(name.to_owned());
            tracing::warn!(
                model = name,
                window,
                default = match wire {
                    Wire::Messages => "budget.anthropic_context_window",
                    Wire::Gemini => "the Gemini input limit",
                    Wire::Chat | Wire::Responses => "budget.default_context_window",
                },
                detection = if self.detect.enabled { "no answer" } else { "off" },
                "no `models:` entry matches this model, the upstream reports no window and the price table \
                 does not name it: compacting to the default window; give the model's window in `models:` \
                 (match, context_window)"
            );
        }
        (window, WindowSource::Default)
    }

    /// Where a model's window comes from, first source first, for the start-up line: the `models:`
    /// entries that give one, the upstream's report (when detection is on), the defaults per format.
    pub fn sources(&self) -> String {
        let mut out: Vec<String> = self
            .table
            .entries
            .iter()
            .filter_map(|(_, m, _)| Some(format!("models `{}` {}", m.pattern, m.context_window?)))
            .collect();
        if self.detect.enabled {
            out.push("the upstream's report".into());
        }
        let prices = PriceTable::builtin();
        out.push(format!("the price table ({} models, {})", prices.len(), prices.source));
        out.push(format!(
            "default {} (Messages {}, Gemini {})",
            self.table.default_window, self.table.anthropic_window, GEMINI_CONTEXT_WINDOW
        ));
        out.join(", else ")
    }

    /// The window the upstream reports for `model`, through the cache.
    pub async fn detected(&self, model: &str) -> Option<u64> {
        let slot = self.slot(model);
        let mut detection = slot.lock().await;
        if let Some((window, at)) = *detection {
            let fresh_for = if window.is_some() { self.detect.ttl } else { self.detect.retry_after };
            if at.elapsed() < fresh_for {
                return window;
            }
        }
        let window = self.probe(model).await;
        match window {
            Some(n) => {
                tracing::info!(model, window = n, upstream = %self.root, "detected context window")
            }
            None => {
                tracing::debug!(model, upstream = %self.root, "upstream does not report a context window")
            }
        }
        *detection = Some((window, Instant::now()));
        window
    }

    /// The detection slot of `model`, made when it has none.
    fn slot(&self, model: &str) -> Arc<tokio::sync::Mutex<Detection>> {
        let mut cache = self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(slot) = cache.get(model) {
            return Arc::clone(slot);
        }
        if cache.len() >= MAX_MODELS {
            cache.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
        let slot = Arc::new(tokio::sync::Mutex::new(None));
        cache.insert(model.to_owned(), Arc::clone(&slot));
        slot
    }

    /// Ask the upstream for `model`'s window: the kind of server found earlier, else all four kinds.
    async fn probe(&self, model: &str) -> Option<u64> {
        let mut discovery = self.discovery.lock().await;
        if let Some(found) = *discovery {
            let fresh_for = if found.kind.is_some() { self.detect.ttl } else { self.detect.retry_after };
            if found.at.elapsed() < fresh_for {
                drop(discovery);
                return self.ask(found.kind.unwrap_or(ServerKind::Ollama), model).await;
            }
        }
        let (kind, window) = self.discover(model).await;
        *discovery = Some(Discovery { kind, at: Instant::now() });
        window
    }

    /// Ask every kind of server at once; the most specific answer wins, and names the kind.
    async fn discover(&self, model: &str) -> (Option<ServerKind>, Option<u64>) {
        let (llama, vllm, lmstudio, ollama) = tokio::join!(
            self.get_json("/props"),
            self.get_json("/v1/models"),
            self.get_json("/api/v0/models"),
            self.post_json("/api/show", serde_json::json!({ "model": model })),
        );
        let answers = [
            (ServerKind::LlamaCpp, llama.as_ref().and_then(llama_cpp_window)),
            (ServerKind::Vllm, vllm.as_ref().and_then(|v| vllm_window(v, model))),
            (ServerKind::LmStudio, lmstudio.as_ref().and_then(|v| lm_studio_window(v, model))),
            (ServerKind::Ollama, ollama.as_ref().and_then(ollama_window)),
        ];
        answers.into_iter().find_map(|(kind, window)| Some((Some(kind), Some(window?)))).unwrap_or((None, None))
    }

    /// One request: the window `kind`'s endpoint reports for `model`.
    async fn ask(&self, kind: ServerKind, model: &str) -> Option<u64> {
        match kind {
            ServerKind::LlamaCpp => self.get_json("/props").await.as_ref().and_then(llama_cpp_window),
            ServerKind::Vllm => self.get_json("/v1/models").await.as_ref().and_then(|v| vllm_window(v, model)),
            ServerKind::LmStudio => {
                self.get_json("/api/v0/models").await.as_ref().and_then(|v| lm_studio_window(v, model))
            }
            ServerKind::Ollama => self
                .post_json("/api/show", serde_json::json!({ "model": model }))
                .await
                .as_ref()
                .and_then(ollama_window),
        }
    }

    async fn get_json(&self, path: &str) -> Option<Value> {
        let request = self.client.get(format!("{}{path}", self.root)).timeout(self.detect.timeout);
        read_json(request).await
    }

    async fn post_json(&self, path: &str, body: Value) -> Option<Value> {
        let request = self
            .client
            .post(format!("{}{path}", self.root))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .timeout(self.detect.timeout);
        read_json(request).await
    }
}

/// The most bytes of a probe's answer pare reads; a longer answer is no window.
pub const MAX_PROBE_BYTES: usize = 16 * 1024 * 1024;

async fn read_json(request: reqwest::RequestBuilder) -> Option<Value> {
    let mut response = request.send().await.ok()?;
    if !response.status().is_success() || response.content_length().is_some_and(|n| n > MAX_PROBE_BYTES as u64) {
        return None;
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response.chunk().await.ok()? {
        if bytes.len() + chunk.len() > MAX_PROBE_BYTES {
            return None;
        }
        bytes.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&bytes).ok()
}

fn positive(v: &Value) -> Option<u64> {
    v.as_u64().filter(|n| *n > 0)
}

/// llama.cpp `GET /props`: `default_generation_settings.n_ctx` (the per-slot context).
pub fn llama_cpp_window(props: &Value) -> Option<u64> {
    positive(props.pointer("/default_generation_settings/n_ctx")?)
}

/// Entries of a `{"data": [...]}` model list: the one whose `id` is `model`, else the only one.
fn model_entry<'v>(list: &'v Value, model: &str) -> Option<&'v Value> {
    let data = list.get("data")?.as_array()?;
    data.iter().find(|m| m.get("id").and_then(Value::as_str) == Some(model)).or(match data.as_slice() {
        [only] => Some(only),
        _ => None,
    })
}

/// vLLM `GET /v1/models`: `data[].max_model_len`.
pub fn vllm_window(models: &Value, model: &str) -> Option<u64> {
    positive(model_entry(models, model)?.get("max_model_len")?)
}

/// LM Studio `GET /api/v0/models`: the loaded context when the model is loaded, else `max_context_length`.
pub fn lm_studio_window(models: &Value, model: &str) -> Option<u64> {
    let entry = model_entry(models, model)?;
    entry.get("loaded_context_length").and_then(positive).or_else(|| positive(entry.get("max_context_length")?))
}

/// Ollama `POST /api/show`: a `num_ctx` set in the model's parameters (what the server actually
/// runs with), else `model_info.<arch>.context_length`.
pub fn ollama_window(show: &Value) -> Option<u64> {
    let num_ctx = show.get("parameters").and_then(Value::as_str).and_then(|params| {
        params.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("num_ctx")).then(|| words.next()?.parse::<u64>().ok()).flatten()
        })
    });
    num_ctx.filter(|n| *n > 0).or_else(|| {
        let info = show.get("model_info")?.as_object()?;
        info.iter().filter(|(k, _)| k.ends_with(".context_length")).find_map(|(_, v)| positive(v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reserve_prefers_the_request_and_is_capped() {
        let raw = br#"{"model":"m","messages":[],"max_tokens":1000}"#;
        assert_eq!(
            answer_reserve(
                crate::wire::WireBody::output_limit(&crate::wire::ChatBody::parse(raw).unwrap()),
                4096,
                65536
            ),
            1000
        );
        let raw = br#"{"model":"m","messages":[],"max_tokens":1000,"max_completion_tokens":2000}"#;
        assert_eq!(
            answer_reserve(
                crate::wire::WireBody::output_limit(&crate::wire::ChatBody::parse(raw).unwrap()),
                4096,
                65536
            ),
            2000
        );
        let raw = br#"{"model":"m","messages":[]}"#;
        assert_eq!(
            answer_reserve(
                crate::wire::WireBody::output_limit(&crate::wire::ChatBody::parse(raw).unwrap()),
                4096,
                65536
            ),
            4096
        );
        let raw = br#"{"model":"m","messages":[],"max_tokens":100000}"#;
        assert_eq!(
            answer_reserve(
                crate::wire::WireBody::output_limit(&crate::wire::ChatBody::parse(raw).unwrap()),
                4096,
                65536
            ),
            32768
        );
    }

    #[test]
    fn ollama_prefers_num_ctx_over_the_trained_length() {
        let show = json!({"parameters": "stop \"<|im_end|>\"\nnum_ctx                        32768", "model_info": {"qwen2.context_length": 131072}});
        assert_eq!(ollama_window(&show), Some(32768));
        let show = json!({"model_info": {"general.architecture": "qwen2", "qwen2.context_length": 131072}});
        assert_eq!(ollama_window(&show), Some(131072));
    }

    #[test]
    fn model_lists_pick_the_named_model_or_the_only_one() {
        let list = json!({"data": [{"id": "a", "max_model_len": 1000}, {"id": "b", "max_model_len": 2000}]});
        assert_eq!(vllm_window(&list, "b"), Some(2000));
        assert_eq!(vllm_window(&list, "c"), None);
        let one = json!({"data": [{"id": "a", "max_model_len": 1000}]});
        assert_eq!(vllm_window(&one, "other-name"), Some(1000));
    }

    /// An upstream on 127.0.0.1 that answers `GET /props` with a 16k window (or nothing, 404) and
    /// counts the requests it gets per path. Each answer is delayed a little, so that concurrent
    /// detections overlap.
    async fn upstream(props: bool) -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let paths = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&paths);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && socket.read(&mut byte).await.is_ok_and(|n| n == 1) {
                        head.push(byte[0]);
                    }
                    let text = String::from_utf8_lossy(&head).into_owned();
                    let length: usize = text
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned())
                        })
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    let mut body = vec![0u8; length];
                    let _ = socket.read_exact(&mut body).await;
                    let path = text.split_whitespace().nth(1).unwrap_or("").to_owned();
                    seen.lock().unwrap().push(path.clone());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let (status, body) = match (props, path.as_str()) {
                        (true, "/props") => ("200 OK", r#"{"default_generation_settings":{"n_ctx":16384}}"#),
                        _ => ("404 Not Found", r#"{"error":"not found"}"#),
                    };
                    let response = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(response.as_bytes()).await;
                });
            }
        });
        (url, paths)
    }

    fn resolver_for(url: &str) -> WindowResolver {
        crate::outbound::install_crypto_provider();
        let config = Config::default();
        WindowResolver::new(
            reqwest::Client::new(),
            url,
            ModelTable::from_config(&config).unwrap(),
            DetectConfig::from_budget(&config.budget),
        )
    }

    /// Regression: every request for a model not yet detected probed the upstream (four requests
    /// each), however many were already waiting for the same answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_for_a_new_model_share_one_probe() {
        let (url, paths) = upstream(true).await;
        let resolver = Arc::new(resolver_for(&url));
        let asks: Vec<_> = (0..20)
            .map(|_| {
                let resolver = Arc::clone(&resolver);
                tokio::spawn(async move { resolver.window(Some("qwen")).await })
            })
            .collect();
        for ask in asks {
            assert_eq!(ask.await.unwrap(), 16384);
        }
        let asked = paths.lock().unwrap().clone();
        assert_eq!(asked.len(), 4, "{asked:?}");
    }

    /// Regression: each new model name cost four upstream requests (2,000 requests with fresh names
    /// → 9,350 upstream requests). Once the server's kind is known, a new name costs one request;
    /// with no kind found, only the one endpoint whose answer depends on the model is asked.
    #[tokio::test]
    async fn a_new_model_name_costs_one_upstream_request() {
        let (url, paths) = upstream(true).await;
        let resolver = resolver_for(&url);
        assert_eq!(resolver.window(Some("first")).await, 16384);
        assert_eq!(paths.lock().unwrap().len(), 4);
        for name in ["second", "third", "fourth"] {
            assert_eq!(resolver.window(Some(name)).await, 16384);
        }
        let asked = paths.lock().unwrap().clone();
        assert_eq!(asked[4..], ["/props", "/props", "/props"], "{asked:?}");

        let (url, paths) = upstream(false).await;
        let resolver = resolver_for(&url);
        let default = Config::default().budget.default_context_window;
        assert_eq!(resolver.window(Some("first")).await, default);
        for name in ["second", "third"] {
            assert_eq!(resolver.window(Some(name)).await, default);
        }
        let asked = paths.lock().unwrap().clone();
        assert_eq!(asked.len(), 6, "{asked:?}");
        assert_eq!(asked[4..], ["/api/show", "/api/show"], "{asked:?}");
    }

    #[test]
    fn bad_model_pattern_is_named() {
        // Built directly: `Config::from_yaml` would already refuse the pattern.
        let config = Config {
            models: vec![ModelConfig {
                pattern: "(".into(),
                context_window: Some(10),
                output_reserve: None,
                encoding: None,
                price: None,
            }],
            ..Config::default()
        };
        let err = ModelTable::from_config(&config).unwrap_err();
        assert!(err.to_string().contains("models[0].match `(`"), "{err}");
    }
}
