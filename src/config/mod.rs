//! pare's configuration: the YAML schema, its defaults (equal to `compaction.example.yaml`), loading,
//! and validation that reports every problem with its line.
//!
//! Types are strict (`deny_unknown_fields`): a misspelt key is an error, never silently ignored.
//! Every field has a default so that an empty file — or no file — is a complete configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub archive: ArchiveConfig,
    pub compaction: CompactionConfig,
    pub budget: BudgetConfig,
    /// Per-model overrides, first match wins.
    pub models: Vec<ModelConfig>,
    pub log: LogConfig,
}

/// The listening side.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on. Loopback by default: pare forwards the agent's credentials.
    pub listen: String,
    /// Allow a non-loopback `listen` address (then `auth_token` is required).
    pub allow_non_loopback: bool,
    /// Token clients must present in the `x-pare-token` header; the agent's own `Authorization`
    /// still reaches the upstream untouched.
    pub auth_token: Option<String>,
    /// Largest request body accepted, in bytes; larger bodies get 413.
    pub max_body: u64,
    /// How long in-flight requests may run after SIGINT/SIGTERM before pare exits, in seconds.
    pub shutdown_grace_secs: u64,
    /// Time allowed to receive a request's headers, in seconds (slowloris guard).
    pub header_read_timeout_secs: u64,
    /// Largest number of request headers accepted.
    pub max_headers: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8787".into(),
            allow_non_loopback: false,
            auth_token: None,
            max_body: 32 * 1024 * 1024,
            shutdown_grace_secs: 30,
            header_read_timeout_secs: 30,
            max_headers: 100,
        }
    }
}

/// The model endpoint pare forwards to.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Base URL, `http://host:port` or `http://host:port/v1` (see README, "Path mapping").
    pub url: String,
    /// When set, replaces the agent's `Authorization` (agents often carry a dummy key).
    pub api_key: Option<String>,
    pub connect_timeout_secs: u64,
    /// Overall time for one upstream exchange, streaming included. Local models are slow.
    pub timeout_secs: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8080".into(),
            api_key: None,
            connect_timeout_secs: 10,
            timeout_secs: 600,
        }
    }
}

impl UpstreamConfig {
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout_secs)
    }
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_secs)
    }
}

/// When the archive commits a record relative to forwarding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// A background writer commits in groups; the request path never waits on the disk.
    #[default]
    Buffered,
    /// Each request waits until its raw record is committed before it is forwarded.
    Strict,
}

/// The raw archive.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveConfig {
    pub enabled: bool,
    /// Directory of the store; default `$XDG_DATA_HOME/pare` (`~/.local/share/pare`).
    pub dir: Option<PathBuf>,
    pub durability: Durability,
    /// Longest time a record waits in the writer's queue before a group commit, in milliseconds.
    pub flush_interval_ms: u64,
    /// Request headers naming the session explicitly, first present wins.
    pub session_headers: Vec<String>,
    /// Extra request headers never stored (Authorization, api-key, cookies are always dropped).
    pub redact_headers: Vec<String>,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: None,
            durability: Durability::Buffered,
            flush_interval_ms: 50,
            session_headers: vec!["x-pare-session".into()],
            redact_headers: Vec::new(),
        }
    }
}

impl ArchiveConfig {
    /// The archive directory in force: `dir`, else `$XDG_DATA_HOME/pare`, else `~/.local/share/pare`.
    pub fn resolved_dir(&self) -> PathBuf {
        if let Some(dir) = &self.dir {
            return dir.clone();
        }
        if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(xdg).join("pare");
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        home.join(".local/share/pare")
    }
}

/// When compaction runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Compact in rare large steps at a high-water mark; append-only in between (cache-friendly).
    #[default]
    Epoch,
    /// Apply the rules on every request, freezing the frontier every `budget.polling` turns.
    Eager,
    /// Archive only; forward every request unchanged.
    Off,
}

/// What the rules do.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    pub mode: Mode,
    /// Rule pack: a built-in name (`default`, `hermes`, `openai`) or a path to a YAML pack.
    pub pack: String,
    /// Overrides applied on top of the pack, same shape as a pack's `rules:` section.
    pub rules: Option<serde_json::Value>,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Epoch,
            pack: "default".into(),
            rules: None,
        }
    }
}

/// Token budget, tiers and epochs.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    /// Window used when neither `models` nor detection gives one, in tokens.
    pub default_context_window: u64,
    /// Tokens reserved for the answer when the request names no `max_tokens`.
    pub output_reserve: u64,
    /// Ask the upstream for the model's window (vLLM, llama.cpp, Ollama, LM Studio).
    pub detect_window: bool,
    /// Share of the usable window at which an epoch starts.
    pub high_water: f64,
    /// Share of the usable window an epoch compacts down to.
    pub low_water: f64,
    /// Eager mode: advance the frozen frontier every this many turns.
    pub polling: u32,
    /// Tokenizer encoding: `o200k_base` or `cl100k_base` (per-model in `models`).
    pub encoding: String,
    /// Salience parameters.
    pub salience: SalienceConfig,
    /// Shares of the target given to each tier.
    pub tiers: TierBudgets,
    /// Sessions whose compaction state is kept in memory (least recently used are dropped).
    pub max_sessions: usize,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            default_context_window: 65536,
            output_reserve: 4096,
            detect_window: true,
            high_water: 0.75,
            low_water: 0.50,
            polling: 4,
            encoding: "o200k_base".into(),
            salience: SalienceConfig::default(),
            tiers: TierBudgets::default(),
            max_sessions: 256,
        }
    }
}

/// `S = w_recency·R + w_error·E + w_keywords·K + w_files·F`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SalienceConfig {
    /// Recency half-scale in turns: `R = exp(-age/tau)`.
    pub tau_turns: f64,
    pub w_recency: f64,
    pub w_error: f64,
    pub w_keywords: f64,
    pub w_files: f64,
}

impl Default for SalienceConfig {
    fn default() -> Self {
        Self {
            tau_turns: 8.0,
            w_recency: 0.4,
            w_error: 0.3,
            w_keywords: 0.2,
            w_files: 0.1,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierBudgets {
    pub focus: f64,
    pub recent: f64,
    pub summary: f64,
    pub background: f64,
}

impl Default for TierBudgets {
    fn default() -> Self {
        Self {
            focus: 0.4,
            recent: 0.3,
            summary: 0.2,
            background: 0.1,
        }
    }
}

/// Per-model settings, matched on the request's `model` by regex.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Regular expression over the request's `model`.
    #[serde(rename = "match")]
    pub pattern: String,
    pub context_window: Option<u64>,
    pub output_reserve: Option<u64>,
    pub encoding: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` or `json`; `--log-format` overrides.
    pub format: Option<String>,
}

/// A configuration that failed to load: every problem found, each with its line when known.
#[derive(Debug, thiserror::Error)]
#[error("{}", render_problems(.path, .problems))]
pub struct ConfigError {
    pub path: Option<PathBuf>,
    pub problems: Vec<Problem>,
}

/// One problem in a configuration or rule pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, when the problem can be placed.
    pub line: Option<u64>,
    /// Dotted path of the key, e.g. `budget.high_water`.
    pub path: String,
    pub message: String,
}

fn render_problems(path: &Option<PathBuf>, problems: &[Problem]) -> String {
    let name = path
        .as_deref()
        .map(Path::display)
        .map(|d| d.to_string())
        .unwrap_or_else(|| "config".into());
    let mut out = format!("{} problem(s) in {name}", problems.len());
    for p in problems {
        match p.line {
            Some(line) => out.push_str(&format!("\n  {name}:{line}: {}: {}", p.path, p.message)),
            None => out.push_str(&format!("\n  {name}: {}: {}", p.path, p.message)),
        }
    }
    out
}

impl Config {
    /// Parse and validate a configuration from YAML text.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = serde_saphyr::from_str(text).map_err(|e| ConfigError {
            path: None,
            problems: vec![Problem {
                line: None,
                path: String::new(),
                message: e.to_string(),
            }],
        })?;
        Ok(config)
    }

    /// Load a configuration file, or the built-in defaults when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let Some(path) = path else {
            return Ok(Config::default());
        };
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: Some(path.to_owned()),
            problems: vec![Problem {
                line: None,
                path: String::new(),
                message: format!("cannot read: {e}"),
            }],
        })?;
        Config::from_yaml(&text).map_err(|mut e| {
            e.path = Some(path.to_owned());
            e
        })
    }
}
