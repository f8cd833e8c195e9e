//! The context window of a request's model, and the tokens reserved for its answer.
//!
//! Precedence: a `models:` entry whose pattern matches the model, then the window the upstream reports
//! (detected once and cached, failures cached too so a server without the endpoint is not asked on
//! every request), then `budget.default_context_window`. The answer reserve is the request's
//! `max_completion_tokens` / `max_tokens`, else the model's `output_reserve`, else the budget's.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regex::Regex;
use serde_json::Value;

use super::tokens::{Encoding, UnknownEncoding};
use crate::config::{BudgetConfig, Config, ModelConfig};
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
    /// `budget.anthropic_context_window` for the Messages API, else `budget.default_context_window`.
    pub fn default_window_for(&self, wire: Wire) -> u64 {
        match wire {
            Wire::Messages => self.anthropic_window,
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

/// Resolves the context window of a model: config, else detection (cached), else the default.
pub struct WindowResolver {
    client: reqwest::Client,
    /// The upstream's root, without a trailing `/v1` or `/`.
    root: String,
    table: ModelTable,
    detect: DetectConfig,
    /// model → (detected window or `None` for a failed detection, when it was learnt).
    cache: Mutex<HashMap<String, (Option<u64>, Instant)>>,
}

impl WindowResolver {
    pub fn new(client: reqwest::Client, upstream_url: &str, table: ModelTable, detect: DetectConfig) -> WindowResolver {
        let trimmed = upstream_url.trim_end_matches('/');
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_owned();
        WindowResolver { client, root, table, detect, cache: Mutex::new(HashMap::new()) }
    }

    /// The context window of `model`: config, else detected, else `budget.default_context_window`.
    pub async fn window(&self, model: Option<&str>) -> u64 {
        self.window_for(Wire::Chat, model).await
    }

    /// The context window of `model` in a request of format `wire`: config, else detected, else the
    /// default for the format ([`ModelTable::default_window_for`]).
    pub async fn window_for(&self, wire: Wire, model: Option<&str>) -> u64 {
        if let Some(window) = self.table.settings(model).context_window {
            return window;
        }
        if self.detect.enabled
            && let Some(window) = self.detected(model.unwrap_or("")).await
        {
            return window;
        }
        self.table.default_window_for(wire)
    }

    /// The window the upstream reports for `model`, through the cache.
    pub async fn detected(&self, model: &str) -> Option<u64> {
        if let Some((window, at)) = self.lock().get(model).copied() {
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
        self.lock().insert(model.to_owned(), (window, Instant::now()));
        window
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Option<u64>, Instant)>> {
        self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Ask every kind of server at once; the most specific answer wins.
    async fn probe(&self, model: &str) -> Option<u64> {
        let (llama, vllm, lmstudio, ollama) = tokio::join!(
            self.get_json("/props"),
            self.get_json("/v1/models"),
            self.get_json("/api/v0/models"),
            self.post_json("/api/show", serde_json::json!({ "model": model })),
        );
        llama
            .as_ref()
            .and_then(llama_cpp_window)
            .or_else(|| vllm.as_ref().and_then(|v| vllm_window(v, model)))
            .or_else(|| lmstudio.as_ref().and_then(|v| lm_studio_window(v, model)))
            .or_else(|| ollama.as_ref().and_then(ollama_window))
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

async fn read_json(request: reqwest::RequestBuilder) -> Option<Value> {
    let response = request.send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let bytes = response.bytes().await.ok()?;
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

    #[test]
    fn bad_model_pattern_is_named() {
        // Built directly: `Config::from_yaml` would already refuse the pattern.
        let config = Config {
            models: vec![ModelConfig {
                pattern: "(".into(),
                context_window: Some(10),
                output_reserve: None,
                encoding: None,
            }],
            ..Config::default()
        };
        let err = ModelTable::from_config(&config).unwrap_err();
        assert!(err.to_string().contains("models[0].match `(`"), "{err}");
    }
}
