//! pare's configuration: the YAML schema, its defaults (equal to `compaction.example.yaml`), loading,
//! and validation that reports every problem with its line.
//!
//! Types are strict (`deny_unknown_fields`): a misspelt key is an error, never silently ignored.
//! Every field has a default so that an empty file — or no file — is a complete configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod location;
pub mod pack;
pub mod yaml;

pub use yaml::{Problem, regex_error};

/// Default of `archive.max_queue_bytes`: most bytes of records waiting for the archive's writer
/// (`archive` module docs). 64 MiB is ≈ 70 records of a 900 KB request, more than a healthy writer
/// has waiting in a burst (BENCHMARKS.md, *Bursts*), and small next to the memory budget.
pub const DEFAULT_MAX_QUEUE_BYTES: u64 = 64 * 1024 * 1024;

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
    pub memory: MemoryConfig,
}

/// What pare keeps in memory.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// One budget in bytes for all per-session state (session keys, frozen prefixes, the archive
    /// writer's per-message digests, the token and key caches); least recently used sessions are evicted past it and
    /// rebuilt from the archive when they come back.
    pub max_state_bytes: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self { max_state_bytes: crate::memory::DEFAULT_MAX_STATE_BYTES }
    }
}

/// Keys that a byte budget replaced: refused with a pointer to it.
const REPLACED_KEYS: &[&str] = &["budget.max_sessions", "archive.tracked_sessions"];

/// The listening side.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on. Loopback by default: pare forwards the agent's credentials.
    pub listen: String,
    /// Allow a non-loopback `listen` address (then `auth_token` is required).
    pub allow_non_loopback: bool,
    /// Token clients must present in the `x-pare-token` header on every path; the agent's own
    /// `Authorization` still reaches the upstream untouched. When set, it is also the owner token.
    pub auth_token: Option<String>,
    /// The owner token: what reads pare's own endpoints (`/_pare/`, but for health) and the gateway
    /// endpoints (`/v1/compress`, `/v1/retrieve/`); the agent-facing paths do not need it.
    /// `None`: `auth_token` when set, else the token kept in `owner_token_file`, made at first start.
    pub owner_token: Option<String>,
    /// Where the owner token made at first start is kept (0600); `None`: `token` in the archive
    /// directory (`archive.dir`, also for a PostgreSQL archive) ([`ServerConfig::owner_token_path`]).
    pub owner_token_file: Option<PathBuf>,
    /// Largest request body accepted, in bytes; larger bodies get 413.
    pub max_body: u64,
    /// How long in-flight requests may run after SIGINT/SIGTERM before pare exits, in seconds.
    pub shutdown_grace_secs: u64,
    /// Time allowed to receive a request's headers, in seconds (slowloris guard).
    pub header_read_timeout_secs: u64,
    /// Largest number of request headers accepted.
    pub max_headers: usize,
    /// Largest total size of a request's headers in bytes (`name: value` lines; the HTTP/2 header
    /// list too); larger heads get 431.
    pub max_header_bytes: usize,
    /// Threads of the async runtime that serve connections; `None`: half the cores this process may
    /// use, at least one ([`default_worker_threads`]).
    pub worker_threads: Option<usize>,
    /// Host names accepted in `Host` besides IP literals and `localhost` (`*`: any). A name pare
    /// does not know is refused: it is how a web page that rebinds its name to 127.0.0.1 calls pare.
    pub allowed_hosts: Vec<String>,
    /// Web origins (`https://app.example.com`) allowed to call pare besides pages served from the
    /// machine itself (`*`: any). Agents send no `Origin`; a browser on another site does.
    pub allowed_origins: Vec<String>,
    /// Time a request body may go without a byte before pare answers 408, in seconds.
    pub body_read_timeout_secs: u64,
    /// Time a connection with no request in flight may stay silent before pare closes it, in
    /// seconds (keep-alive and HTTP/2 connections; before its first request the header timeout applies).
    pub idle_timeout_secs: u64,
    /// Request bytes all connections together may hold in memory: bodies being read, decoded and
    /// forwarded, compaction's working set from before it starts to its end
    /// ([`crate::proxy::limits::working_set`]) and retrieved contents; a request that would pass it
    /// gets 503 with `retry-after`.
    pub max_buffered_bytes: u64,
}

/// The fewest characters a token (`server.auth_token`, `server.owner_token`) may have.
pub const MIN_TOKEN_CHARS: usize = 16;

impl ServerConfig {
    /// The file that keeps the owner token made at first start: `owner_token_file`, else `token`
    /// in the archive directory `archive` resolves to.
    pub fn owner_token_path(&self, archive: &ArchiveConfig) -> PathBuf {
        self.owner_token_file.clone().unwrap_or_else(|| archive.resolved_dir().join("token"))
    }
}

/// The async runtime's threads when `server.worker_threads` is unset: half the cores this process
/// may use (its CPU affinity and cgroup quota count), at least one. pare is a sidecar that shares
/// its host with the agent and often with the model server; a request's own work on the runtime
/// is tens of microseconds, and the heavy work — large bodies, epochs, token counting, the archive
/// — runs on threads of its own. More runtime threads hand each exchange's tasks between cores: a
/// warm exchange takes longer, while more requests per second are served at saturation
/// (BENCHMARKS.md, *Real sessions and the warm path*).
pub fn default_worker_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| (cores.get() / 2).max(1))
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8787".into(),
            allow_non_loopback: false,
            auth_token: None,
            owner_token: None,
            owner_token_file: None,
            max_body: 32 * 1024 * 1024,
            shutdown_grace_secs: 30,
            header_read_timeout_secs: 30,
            max_headers: 100,
            max_header_bytes: 64 * 1024,
            worker_threads: None,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            body_read_timeout_secs: 30,
            idle_timeout_secs: 120,
            max_buffered_bytes: 512 * 1024 * 1024,
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
        Self { url: "http://127.0.0.1:8080".into(), api_key: None, connect_timeout_secs: 10, timeout_secs: 600 }
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

/// Default of `archive.max_held_answer_bytes`: 256 MiB holds four answers at the 64 MiB cap of one,
/// thousands of ordinary ones (a few KB to a few hundred KB of SSE each).
pub const DEFAULT_MAX_HELD_ANSWER_BYTES: u64 = 256 * 1024 * 1024;

/// The raw archive.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveConfig {
    pub enabled: bool,
    /// Directory of the store; default `$XDG_DATA_HOME/pare` (`~/.local/share/pare`).
    pub dir: Option<PathBuf>,
    /// A PostgreSQL database to archive to instead of `dir` (`postgres://USER@HOST:PORT/DB`,
    /// TLS per its `sslmode`); `null`: the SQLite store in `dir` (`crate::config::location`).
    pub url: Option<String>,
    /// File whose first line is the password of `url`, when the URL carries none (else
    /// `$PGPASSWORD`).
    pub password_file: Option<PathBuf>,
    /// Most connections pare's readers (the proxy's session lookups, the UI, retrieval) hold open
    /// to a PostgreSQL archive at once; a reader waits for one when all are busy. The writer has
    /// one more of its own.
    pub max_connections: usize,
    /// Delete whole sessions last active more than this many days ago, at start and hourly while
    /// pare serves (`crate::archive::retention`); `null`: keep everything.
    pub retain_days: Option<u64>,
    /// Longest a `strict` request waits for room in the archive's queue and its commit, together,
    /// before it is forwarded anyway (counted), milliseconds.
    pub commit_timeout_ms: u64,
    pub durability: Durability,
    /// Records arriving within this many milliseconds of a group's first record share its commit (the
    /// longest a buffered record waits for it; a strict request, a flush or shutdown do not wait).
    pub flush_interval_ms: u64,
    /// Request headers naming the session explicitly, first present wins.
    pub session_headers: Vec<String>,
    /// Extra request headers never stored. Always dropped: Authorization, api-key, x-api-key,
    /// cookies, x-pare-token, and every name containing a credential word such as `auth`, `token`,
    /// `secret`, `api-key` or `signature` (`crate::archive::CREDENTIAL_NAME_PARTS`).
    pub redact_headers: Vec<String>,
    /// Request headers stored although their names look like credentials (they contain or end in
    /// `key`, `token`, `secret`, `auth`…); never the always-dropped ones nor `redact_headers`.
    pub safe_headers: Vec<String>,
    /// Largest size of the store in bytes (`null`: no limit). When reached, new records are counted as
    /// lost and reported on `/_pare/health`, exactly as on a full disk; pare keeps proxying.
    pub max_bytes: Option<u64>,
    /// Most bytes of records waiting for the archive writer; a request whose record does not fit
    /// waits for room (see `crate::archive`).
    pub max_queue_bytes: u64,
    /// Most bytes of streaming answers held in memory for the archive, all exchanges in flight
    /// together (one answer alone stops at 64 MiB). An answer that does not fit is still streamed to
    /// the client unchanged; its archived copy stops there, marked truncated and counted.
    pub max_held_answer_bytes: u64,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: None,
            url: None,
            password_file: None,
            max_connections: location::DEFAULT_MAX_CONNECTIONS,
            retain_days: None,
            commit_timeout_ms: 10_000,
            durability: Durability::Buffered,
            flush_interval_ms: 50,
            session_headers: vec!["x-pare-session".into()],
            redact_headers: Vec::new(),
            safe_headers: vec!["idempotency-key".into(), "x-idempotency-key".into()],
            max_bytes: None,
            max_queue_bytes: DEFAULT_MAX_QUEUE_BYTES,
            max_held_answer_bytes: DEFAULT_MAX_HELD_ANSWER_BYTES,
        }
    }
}

impl ArchiveConfig {
    /// Where the archive is: `url` when set, else [`ArchiveConfig::resolved_dir`].
    pub fn location(&self) -> Result<location::Location, location::LocationError> {
        use location::{Location, LocationError};
        match &self.url {
            None => Ok(Location::Dir(self.resolved_dir())),
            Some(url) => match Location::parse(url, self.password_file.as_deref())? {
                Location::Dir(_) => Err(LocationError::UnknownScheme(location::redact(url))),
                pg => Ok(pg.with_max_connections(self.max_connections)),
            },
        }
    }

    /// The archive directory in force: `dir`, else `$XDG_DATA_HOME/pare`, else `~/.local/share/pare`.
    pub fn resolved_dir(&self) -> PathBuf {
        if let Some(dir) = &self.dir {
            return dir.clone();
        }
        if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(xdg).join("pare");
        }
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
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
    /// Forward every request unchanged, and compute what `epoch` would have forwarded (the same
    /// compactor, its state kept per session) to report the projected savings, epochs and uncached
    /// prefill under their own names (`pare_observed_*`), before pare is let change traffic.
    Observe,
}

impl Mode {
    /// Whether the forwarded request may differ from the raw one (`epoch`, `eager`).
    pub fn changes_requests(self) -> bool {
        matches!(self, Mode::Epoch | Mode::Eager)
    }
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
    /// Decode a request body sent with `content-encoding: zstd` or `gzip` (Codex CLI can send one)
    /// to compact it; it is then forwarded uncompressed. `false`: such bodies pass through untouched.
    pub decode_request_bodies: bool,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self { mode: Mode::Epoch, pack: "default".into(), rules: None, decode_request_bodies: true }
    }
}

/// Token budget, tiers and epochs.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    /// Window used when neither `models` nor detection gives one, in tokens.
    pub default_context_window: u64,
    /// Window of a Messages API request (`/v1/messages`) when neither `models` nor detection gives
    /// one: Anthropic's models take 200k tokens. Its tokens are counted with `encoding` (Anthropic's
    /// tokenizer is not public), an estimate.
    pub anthropic_context_window: u64,
    /// Tokens reserved for the answer when the request names no `max_tokens`.
    pub output_reserve: u64,
    /// Ask the upstream for the model's window (vLLM, llama.cpp, Ollama, LM Studio).
    pub detect_window: bool,
    /// Share of the usable window at which an epoch starts.
    pub high_water: f64,
    /// Share of the usable window an epoch compacts down to.
    pub low_water: f64,
    /// Epoch mode: the least history an epoch leaves, in tokens, raising `low_water` by at most
    /// `max_rise` of the gap to `high_water`; `null`: `low_water` alone.
    pub history_floor: Option<HistoryFloorConfig>,
    /// Epoch mode: requests of the session's growth (its tokens per turn) an epoch leaves room for
    /// below `high_water`: the history floor raises an epoch's target no higher than that leaves,
    /// so that the next epoch is this many requests away. 0: the floor alone.
    pub epoch_room: u32,
    /// Eager mode's `high_water`: above this share of the usable window, salience tiers and elision
    /// run on top of the rules. Apart from the epoch marks because eager serves upstreams without a
    /// prompt cache, where compacting often costs no prefill.
    pub eager_high_water: f64,
    /// Eager mode's `low_water`: what tiers and elision compact down to.
    pub eager_low_water: f64,
    /// Eager mode's budget for the history (what lies between the task and the protected tail), a
    /// share of the usable window; `null`: the window marks alone.
    pub eager_history: Option<HistoryShare>,
    /// Eager mode: advance the frozen frontier every this many turns (1, as SWE-agent's `polling`:
    /// eager is for upstreams without a prompt cache, where a stable prefix buys nothing).
    pub polling: u32,
    /// Tokenizer encoding: `o200k_base` or `cl100k_base` (per-model in `models`).
    pub encoding: String,
    /// Salience parameters.
    pub salience: SalienceConfig,
    /// Shares of the target given to each tier.
    pub tiers: TierBudgets,
    /// Tokens counted for one image part (images are never tokenized as text). 765 is what OpenAI
    /// charges for a 1024×1024 image at high detail.
    pub image_tokens: u64,
    /// Tokens counted for one audio part (never tokenized as text): about 30 s at Gemini's 32
    /// tokens a second.
    pub audio_tokens: u64,
    /// Tokens counted for one document, video or other file part (a PDF, Gemini `fileData`…):
    /// a few pages at Anthropic's 1,500–3,000 tokens a page.
    pub document_tokens: u64,
    /// Messages whose token counts are cached (by content hash); a warm request then tokenizes only
    /// the messages it adds.
    pub token_cache_entries: usize,
    /// Time allowed for one window-detection probe of the upstream, in milliseconds.
    pub detect_timeout_ms: u64,
    /// After a failed detection, wait this long before asking the upstream again, in seconds.
    pub detect_retry_secs: u64,
    /// A detected window is trusted this long (a local server may be restarted with another
    /// context size), in seconds.
    pub detect_ttl_secs: u64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            default_context_window: 65536,
            anthropic_context_window: 200_000,
            output_reserve: 4096,
            detect_window: true,
            // Measured on the corpus (`pare eval`, 16k window): 0.9/0.4 gives uncached prefill 1.23× raw
            // and needle recall 0.954, against 1.38× and 0.885 for 0.75/0.5. An epoch re-sends at most
            // low × usable tokens and then buys (high − low) × usable tokens of appends, so the prefill
            // cost is bounded by 1 + low/(high − low) = 1.8× raw even with no cache reuse at all; 0.1
            // of the usable window stays as slack for tokenizer mismatch with the model's own.
            high_water: 0.9,
            low_water: 0.4,
            history_floor: Some(HistoryFloorConfig::default()),
            epoch_room: 2,
            // Measured on the corpus (`pare eval --mode eager`, 16k window, coding sessions, low 0.4):
            // 0.9 saves 44.7 % at needle recall 0.981, 0.7 49.1 % / 0.969, 0.65 50.3 % / 0.973, 0.6
            // 51.6 % / 0.943: 0.65 is the highest mark that saves half, and the lowest measured that
            // keeps recall above 0.95. Prefill, which keeps the epoch marks high, is not eager's cost.
            eager_high_water: 0.65,
            eager_low_water: 0.4,
            eager_history: Some(HistoryShare::default()),
            polling: 1,
            encoding: "o200k_base".into(),
            salience: SalienceConfig::default(),
            tiers: TierBudgets::default(),
            image_tokens: 765,
            audio_tokens: 1000,
            document_tokens: 3000,
            token_cache_entries: 131_072,
            detect_timeout_ms: 2_000,
            detect_retry_secs: 60,
            detect_ttl_secs: 600,
        }
    }
}

/// `S = w_recency·R + w_error·E + w_keywords·K + w_files·F`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SalienceConfig {
    /// Recency scale in turns: `R = exp(-age/tau)`.
    pub tau_turns: f64,
    /// Opt-in: recency on the wall clock, scale in seconds — `R = exp(-age/tau_seconds)` with the age
    /// since the proxy first received the message. `None`: turns (deterministic; what replay and
    /// eval, which have no arrival times, always use).
    pub tau_seconds: Option<f64>,
    pub w_recency: f64,
    pub w_error: f64,
    pub w_keywords: f64,
    pub w_files: f64,
}

impl Default for SalienceConfig {
    fn default() -> Self {
        Self { tau_turns: 8.0, tau_seconds: None, w_recency: 0.4, w_error: 0.3, w_keywords: 0.2, w_files: 0.1 }
    }
}

/// Eager mode's history budget, as shares of the usable window: when the history after the rules
/// weighs more than `high` × usable, salience tiers and elision bring it down to `low` × usable.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryShare {
    pub high: f64,
    pub low: f64,
}

impl HistoryShare {
    /// The budget in tokens for a usable window of `usable` tokens.
    pub fn tokens(&self, usable: u64) -> (u64, u64) {
        ((self.high * usable as f64) as u64, (self.low * usable as f64) as u64)
    }
}

impl Default for HistoryShare {
    fn default() -> Self {
        // 0.28 / 0.1 of a 16k window's usable 12,288 tokens is the fixed 3,500 / 1,250 measured on the
        // shared corpus at 16k and 32k; as a share, a 32k window keeps 8,028 / 2,867 tokens of history
        // instead of compacting it as hard as a 16k one. Measured on the tuning half of the shared and
        // long corpora (`pare eval --split tune --mode eager --window 32768`, coding sessions, saved /
        // needle recall): fixed 3,500 / 1,250 75.0 % / 0.822, 6,000 / 2,000 69.9 % / 0.888, shares
        // 0.28 / 0.1 65.7 % / 0.913. See BENCHMARKS.md, "Held-out evaluation".
        Self { high: 0.28, low: 0.1 }
    }
}

/// Epoch mode's floor for the history (what lies between the task and the protected tail): an
/// epoch's target is `low_water` × usable, raised when needed so that the history keeps `tokens`,
/// by at most `max_rise` of the gap between the two water marks (an epoch keeps buying at least
/// `1 − max_rise` of that gap in appends).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryFloorConfig {
    pub tokens: u64,
    pub max_rise: f64,
}

impl Default for HistoryFloorConfig {
    fn default() -> Self {
        // At 16k (12,288 usable) low water leaves the history about 1,000 tokens once the task and a
        // 5-turn tail are counted; at 32k it leaves enough that the floor changed no byte on the corpus
        // (epoch 32k, both sides of the split). Measured on
        // the tuning side of the split (`pare eval --split tune --mode epoch`, coding sessions, 16k,
        // saved / uncached prefill / needle recall), floor and highest target as a share of usable:
        // none 66.7 % / 1.36× / 0.850; 2,000 up to 0.6 65.6 % / 1.47× / 0.891; 3,000 up to 0.6
        // 64.3 % / 1.57× / 0.901, up to 0.7 (max_rise 0.6) 64.0 % / 1.63× / 0.916, up to 0.8 63.9 % /
        // 1.68× / 0.921; 4,000 up to 0.7 62.6 % / 1.81× / 0.928; 5,000 up to 0.7 61.4 % / 2.01× /
        // 0.940. Epoch 32k forwarded the same bytes with 3,000 and 4,000 up to 0.7, not with 5,000. See
        // BENCHMARKS.md, "Held-out evaluation".
        Self { tokens: 3000, max_rise: 0.6 }
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
        Self { focus: 0.4, recent: 0.3, summary: 0.2, background: 0.1 }
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
    /// The model's prices, over the built-in table's (`budget::price`).
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

/// What a model costs, in USD per million tokens. A cache price left out bills those tokens at
/// `input` (a provider that does not price them apart).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// An uncached prompt token.
    pub input: f64,
    /// A prompt token read from the provider's cache.
    #[serde(default)]
    pub cached: Option<f64>,
    /// A prompt token written to the cache for 5 minutes (Anthropic's default; what pare bills
    /// reported cache writes at).
    #[serde(default)]
    pub write: Option<f64>,
    /// A prompt token written to the cache for 1 hour.
    #[serde(default)]
    pub write_1h: Option<f64>,
    /// An answer token.
    pub output: f64,
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

fn render_problems(path: &Option<PathBuf>, problems: &[Problem]) -> String {
    let name = path.as_deref().map(Path::display).map(|d| d.to_string()).unwrap_or_else(|| "config".into());
    let mut out = format!("{} problem(s) in {name}", problems.len());
    for p in problems {
        match p.line {
            Some(line) => out.push_str(&format!("\n  {name}:{line}: {}: {}", p.path, p.message)),
            None => out.push_str(&format!("\n  {name}: {}: {}", p.path, p.message)),
        }
    }
    out
}

/// Values given on the command line (`pare serve --listen …`), which replace the file's before the
/// configuration is checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub listen: Option<String>,
    pub upstream: Option<String>,
    /// `--archive`: a directory, or a `postgres://` URL (then `archive.url`).
    pub archive: Option<String>,
    pub mode: Option<Mode>,
}

impl Overrides {
    /// Put the given values in place of the configuration's.
    pub fn apply(&self, config: &mut Config) {
        if let Some(listen) = &self.listen {
            config.server.listen = listen.clone();
        }
        if let Some(upstream) = &self.upstream {
            config.upstream.url = upstream.clone();
        }
        if let Some(archive) = &self.archive {
            if location::names_database(archive) {
                config.archive.url = Some(archive.clone());
            } else {
                // A directory given on the command line wins over a URL in the file.
                config.archive.url = None;
                config.archive.dir = Some(PathBuf::from(archive));
            }
        }
        if let Some(mode) = self.mode {
            config.compaction.mode = mode;
        }
    }

    /// The flag that gave the value at `path`, when one did.
    fn flag_of(&self, path: &str) -> Option<&'static str> {
        match path {
            "server.listen" if self.listen.is_some() => Some("--listen"),
            "upstream.url" if self.upstream.is_some() => Some("--upstream"),
            "archive.dir" | "archive.url" if self.archive.is_some() => Some("--archive"),
            "compaction.mode" if self.mode.is_some() => Some("--mode"),
            _ => None,
        }
    }
}

/// Tokenizer encodings pare can count with.
pub const ENCODINGS: &[&str] = &["o200k_base", "cl100k_base"];

impl Config {
    /// Parse and validate a configuration from YAML text, reporting every problem.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        match Config::from_yaml_all(text) {
            (Some(config), problems) if problems.is_empty() => Ok(config),
            (_, problems) => Err(ConfigError { path: None, problems }),
        }
    }

    /// Every problem of a configuration — its own, those of the rule pack it selects and of its
    /// `compaction.rules` overrides — in line order (unplaceable ones last), and the configuration
    /// with defaults in place of the bad values when the rest could be read. The one check that
    /// `pare check`, `pare serve` and every other command run.
    pub fn from_yaml_all(text: &str) -> (Option<Config>, Vec<Problem>) {
        Config::from_yaml_overridden(text, &Overrides::default())
    }

    /// [`Config::from_yaml_all`] with command-line values in place of the file's: they are checked
    /// like the file's, and a problem with one names its flag instead of a line.
    pub fn from_yaml_overridden(text: &str, overrides: &Overrides) -> (Option<Config>, Vec<Problem>) {
        let root = match yaml::parse(text) {
            Ok(root) => root,
            Err(problem) => return (None, vec![problem]),
        };
        let mut problems = Vec::new();
        let config: Option<Config> = yaml::deserialize_all(&root, &mut problems);
        for p in problems.iter_mut().filter(|p| REPLACED_KEYS.contains(&p.path.as_str())) {
            p.message = "replaced by `memory.max_state_bytes`: one budget in bytes for all per-session state \
                         (least recently used sessions are evicted past it)"
                .into();
        }
        let config = config.map(|mut config| {
            overrides.apply(&mut config);
            let line_of = |path: &str| root.line_of(path);
            let selected = crate::config::pack::check_selected(
                &config.compaction.pack,
                config.compaction.rules.as_ref(),
                &line_of,
            );
            for mut p in config.validate().into_iter().chain(selected) {
                match overrides.flag_of(&p.path) {
                    Some(flag) => {
                        p.line = None;
                        p.path = format!("{flag} ({})", p.path);
                    }
                    None => p.line = p.line.or_else(|| root.line_of(&p.path)),
                }
                problems.push(p);
            }
            config
        });
        problems.sort_by_key(|p| p.line.unwrap_or(u64::MAX));
        (config, problems)
    }

    /// Load a configuration file, or the built-in defaults when `path` is `None`, refusing it with
    /// every problem of [`Config::from_yaml_all`].
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        Config::load_overridden(path, &Overrides::default())
    }

    /// [`Config::load`] with command-line values in place of the file's ([`Overrides`]).
    pub fn load_overridden(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let text = match path {
            Some(path) => std::fs::read_to_string(path).map_err(|e| ConfigError {
                path: Some(path.to_owned()),
                problems: vec![Problem { line: None, path: String::new(), message: format!("cannot read: {e}") }],
            })?,
            None => String::new(),
        };
        match Config::from_yaml_overridden(&text, overrides) {
            (Some(config), problems) if problems.is_empty() => Ok(config),
            (_, problems) => Err(ConfigError { path: path.map(Path::to_owned), problems }),
        }
    }

    /// Semantic checks that the types alone cannot express. Every problem, not only the first.
    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut bad = |path: &str, message: String| {
            problems.push(Problem { line: None, path: path.to_owned(), message });
        };

        match self.server.listen.parse::<std::net::SocketAddr>() {
            Err(_) => bad("server.listen", format!("`{}` is not an IP:port address", self.server.listen)),
            Ok(addr) if !addr.ip().is_loopback() && !self.server.allow_non_loopback => bad(
                "server.listen",
                format!(
                    "`{addr}` is not a loopback address; set server.allow_non_loopback: true (with server.auth_token) to expose pare"
                ),
            ),
            Ok(_) => {}
        }
        match self.server.auth_token.as_deref() {
            Some(token) if token.trim().is_empty() => bad(
                "server.auth_token",
                "is blank: a token of spaces guards nothing; give a secret, or null for no token".into(),
            ),
            None if self.server.allow_non_loopback => {
                bad("server.auth_token", "a non-loopback listener needs an auth_token".into())
            }
            _ => {}
        }
        for (key, token) in
            [("server.auth_token", &self.server.auth_token), ("server.owner_token", &self.server.owner_token)]
        {
            if let Some(token) = token.as_deref().filter(|t| !t.trim().is_empty())
                && token.trim().chars().count() < MIN_TOKEN_CHARS
            {
                bad(
                    key,
                    format!(
                        "is {} characters: a token needs at least {MIN_TOKEN_CHARS} (a short one is guessed; `openssl rand -hex 16` makes one)",
                        token.trim().chars().count()
                    ),
                );
            }
        }
        if self.server.auth_token.is_some() && self.server.owner_token.is_some() {
            bad(
                "server.owner_token",
                "set with server.auth_token, which already guards every path: keep one of them".into(),
            );
        }
        if self.memory.max_state_bytes == 0 {
            bad("memory.max_state_bytes", "must be at least 1 byte".into());
        }
        if self.server.max_body == 0 {
            bad("server.max_body", "must be at least 1 byte".into());
        }
        if self.server.header_read_timeout_secs == 0 {
            bad("server.header_read_timeout_secs", "must be at least 1 second".into());
        }
        if self.server.body_read_timeout_secs == 0 {
            bad("server.body_read_timeout_secs", "must be at least 1 second".into());
        }
        if self.server.idle_timeout_secs == 0 {
            bad("server.idle_timeout_secs", "must be at least 1 second".into());
        }
        if self.server.max_buffered_bytes < self.server.max_body {
            bad(
                "server.max_buffered_bytes",
                format!(
                    "{} is below server.max_body ({}): no request of the largest size could be read",
                    self.server.max_buffered_bytes, self.server.max_body
                ),
            );
        }
        for (key, items) in [
            ("server.allowed_hosts", &self.server.allowed_hosts),
            ("server.allowed_origins", &self.server.allowed_origins),
        ] {
            for item in items {
                if item.trim().is_empty() {
                    bad(key, "an empty entry matches nothing; remove it".into());
                }
            }
        }
        for origin in &self.server.allowed_origins {
            if origin != "*" && !(origin.starts_with("http://") || origin.starts_with("https://")) {
                bad("server.allowed_origins", format!("`{origin}` is not an origin such as https://app.example.com"));
            }
        }
        if self.server.max_header_bytes < 8192 {
            bad("server.max_header_bytes", format!("{} is below the minimum of 8192", self.server.max_header_bytes));
        }
        if self.server.max_headers == 0 {
            bad("server.max_headers", "must be at least 1".into());
        }
        if self.server.worker_threads == Some(0) {
            bad("server.worker_threads", "must be at least 1 (or null: half the cores)".into());
        }

        match reqwest::Url::parse(&self.upstream.url) {
            // `localhost:9100` parses as a URL of scheme `localhost`, `127.0.0.1:9100` as none at all:
            // the same mistake gets the same answer.
            _ if !self.upstream.url.contains("://") => bad(
                "upstream.url",
                format!(
                    "`{0}` has no scheme; write `http://{0}` (or https://)",
                    self.upstream.url.trim_end_matches('/')
                ),
            ),
            Err(e) => bad("upstream.url", format!("`{}` is not a URL: {e}", self.upstream.url)),
            Ok(url) if !matches!(url.scheme(), "http" | "https") => {
                bad("upstream.url", format!("`{}` must be http:// or https://", self.upstream.url))
            }
            Ok(url) if url.host_str().is_none() => bad("upstream.url", format!("`{}` has no host", self.upstream.url)),
            Ok(url) if url.query().is_some() || url.fragment().is_some() => {
                bad("upstream.url", format!("`{}` must not carry a query or fragment", self.upstream.url))
            }
            Ok(url) => {
                if let Some(base) = endpoint_base(&url) {
                    bad(
                        "upstream.url",
                        format!(
                            "`{}` names an endpoint, not the server's base URL; use `{base}` (pare appends each \
                             request's own path, e.g. /v1/chat/completions)",
                            self.upstream.url
                        ),
                    )
                }
            }
        }
        if self.upstream.connect_timeout_secs == 0 {
            bad("upstream.connect_timeout_secs", "must be at least 1 second".into());
        }
        if self.upstream.timeout_secs == 0 {
            bad("upstream.timeout_secs", "must be at least 1 second".into());
        }

        if self.archive.max_queue_bytes < 1024 * 1024 {
            bad("archive.max_queue_bytes", format!("{} is under 1 MiB (1048576)", self.archive.max_queue_bytes));
        }
        if self.archive.max_held_answer_bytes < 1024 * 1024 {
            bad(
                "archive.max_held_answer_bytes",
                format!("{} is under 1 MiB (1048576)", self.archive.max_held_answer_bytes),
            );
        }
        if let Err(e) = self.archive.location() {
            bad(
                if self.archive.password_file.is_some() && matches!(e, location::LocationError::PasswordFile { .. }) {
                    "archive.password_file"
                } else {
                    "archive.url"
                },
                e.to_string(),
            );
        }
        if self.archive.retain_days == Some(0) {
            bad("archive.retain_days", "0 would delete every session: give at least 1, or null to keep all".into());
        }
        if !(1..=1000).contains(&self.archive.max_connections) {
            bad("archive.max_connections", format!("{} is outside 1..=1000", self.archive.max_connections));
        }
        if let Some(dir) = self.archive.dir.as_ref().and_then(|dir| dir.to_str())
            && location::names_database(dir)
        {
            bad(
                "archive.dir",
                format!("`{}` names a PostgreSQL database, not a directory: set archive.url", location::redact(dir)),
            );
        }
        if !(1..=600_000).contains(&self.archive.commit_timeout_ms) {
            bad("archive.commit_timeout_ms", format!("{} is outside 1..=600000", self.archive.commit_timeout_ms));
        }
        if !(1..=10_000).contains(&self.archive.flush_interval_ms) {
            bad("archive.flush_interval_ms", format!("{} is outside 1..=10000", self.archive.flush_interval_ms));
        }
        for (list, name) in [
            (&self.archive.session_headers, "session_headers"),
            (&self.archive.redact_headers, "redact_headers"),
            (&self.archive.safe_headers, "safe_headers"),
        ] {
            for (i, h) in list.iter().enumerate() {
                if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                    bad(&format!("archive.{name}.{i}"), format!("`{h}` is not a valid header name"));
                }
            }
        }

        if self.compaction.pack.trim().is_empty() {
            bad("compaction.pack", "must name a built-in pack or a file".into());
        }

        let b = &self.budget;
        // Each mode's pair of water marks: 0 < low < high <= 1.
        for (prefix, high, low) in [("", b.high_water, b.low_water), ("eager_", b.eager_high_water, b.eager_low_water)]
        {
            if !(low > 0.0 && low < high && high <= 1.0) {
                bad(
                    &format!("budget.{prefix}high_water"),
                    format!("need 0 < {prefix}low_water ({low}) < {prefix}high_water ({high}) <= 1"),
                );
            }
        }
        if b.default_context_window < 1024 {
            bad(
                "budget.default_context_window",
                format!("{} tokens is too small (at least 1024)", b.default_context_window),
            );
        }
        if b.anthropic_context_window < 1024 {
            bad(
                "budget.anthropic_context_window",
                format!("{} tokens is too small (at least 1024)", b.anthropic_context_window),
            );
        }
        if b.output_reserve >= b.default_context_window {
            bad("budget.output_reserve", "must be smaller than default_context_window".into());
        }
        if let Some(h) = b.eager_history.filter(|h| !(0.0 < h.low && h.low < h.high && h.high <= 1.0)) {
            bad("budget.eager_history", format!("need 0 < low ({}) < high ({}) ≤ 1", h.low, h.high));
        }
        if let Some(f) = b.history_floor.filter(|f| !(0.0..1.0).contains(&f.max_rise)) {
            bad("budget.history_floor", format!("need 0 <= max_rise ({}) < 1", f.max_rise));
        }
        if b.polling == 0 {
            bad("budget.polling", "must be at least 1 turn".into());
        }
        if !ENCODINGS.contains(&b.encoding.as_str()) {
            bad("budget.encoding", format!("unknown encoding `{}` (known: {})", b.encoding, ENCODINGS.join(", ")));
        }
        let s = &b.salience;
        if !(s.tau_turns > 0.0 && s.tau_turns.is_finite()) {
            bad("budget.salience.tau_turns", "must be a positive number of turns".into());
        }
        if s.tau_seconds.is_some_and(|t| !(t > 0.0 && t.is_finite())) {
            bad("budget.salience.tau_seconds", "must be a positive number of seconds, or null (turns)".into());
        }
        for (name, w) in
            [("w_recency", s.w_recency), ("w_error", s.w_error), ("w_keywords", s.w_keywords), ("w_files", s.w_files)]
        {
            if !(w >= 0.0 && w.is_finite()) {
                bad(&format!("budget.salience.{name}"), format!("{w} must be a non-negative number"));
            }
        }
        let t = &b.tiers;
        let shares = [("focus", t.focus), ("recent", t.recent), ("summary", t.summary), ("background", t.background)];
        for (name, v) in shares {
            if !(0.0..=1.0).contains(&v) {
                bad(&format!("budget.tiers.{name}"), format!("{v} is outside 0..=1"));
            }
        }
        let sum: f64 = shares.iter().map(|(_, v)| v).sum();
        if (sum - 1.0).abs() > 1e-6 {
            bad("budget.tiers", format!("shares add up to {sum}, not 1"));
        }

        for (i, m) in self.models.iter().enumerate() {
            if let Err(e) = regex::Regex::new(&m.pattern) {
                bad(&format!("models.{i}.match"), format!("`{}` is not a valid regex: {}", m.pattern, regex_error(&e)));
            }
            if m.context_window.is_some_and(|w| w < 1024) {
                bad(&format!("models.{i}.context_window"), "too small (at least 1024)".into());
            }
            if let (Some(w), Some(r)) = (m.context_window, m.output_reserve)
                && r >= w
            {
                bad(&format!("models.{i}.output_reserve"), "must be smaller than context_window".into());
            }
            if let Some(enc) = &m.encoding
                && !ENCODINGS.contains(&enc.as_str())
            {
                bad(&format!("models.{i}.encoding"), format!("unknown encoding `{enc}`"));
            }
            if let Some(price) = &m.price {
                for (key, value) in [
                    ("input", Some(price.input)),
                    ("cached", price.cached),
                    ("write", price.write),
                    ("write_1h", price.write_1h),
                    ("output", Some(price.output)),
                ] {
                    if let Some(v) = value
                        && !(v.is_finite() && v >= 0.0)
                    {
                        bad(
                            &format!("models.{i}.price.{key}"),
                            format!("{v} is not a price (USD per million tokens, 0 or more)"),
                        );
                    }
                }
            }
        }

        if let Some(f) = &self.log.format
            && f != "text"
            && f != "json"
        {
            bad("log.format", format!("`{f}` is not `text` or `json`"));
        }
        problems
    }
}

/// API endpoints that an upstream URL may wrongly end with: pare forwards each request's own path
/// (`…/chat/completions`, `…/responses`, `…/messages`) under the base URL.
const ENDPOINT_PATHS: &[&str] = &["/chat/completions", "/completions", "/responses", "/messages"];

/// The base URL to use instead of an upstream URL that ends in an API endpoint
/// (`http://h/v1/chat/completions` → `http://h/v1`), `None` when it is a base URL.
fn endpoint_base(url: &reqwest::Url) -> Option<String> {
    let path = url.path().trim_end_matches('/');
    let base_path = ENDPOINT_PATHS.iter().find_map(|endpoint| path.strip_suffix(endpoint))?;
    let mut base = url.clone();
    base.set_path(base_path);
    Some(base.as_str().trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PostgreSQL URL is an archive location; another scheme is refused with the key that gave
    /// it, its password hidden; `--archive URL` sets `archive.url`.
    #[test]
    fn archive_urls_are_checked_and_their_passwords_hidden() {
        let ok =
            Config::from_yaml("archive:\n  url: postgres://pare:pw@db.internal:5432/pare?sslmode=require\n").unwrap();
        assert_eq!(
            ok.archive.location().unwrap().to_string(),
            "postgres://pare:***@db.internal:5432/pare?sslmode=require"
        );
        let err = Config::from_yaml("archive:\n  url: mysql://pare:pw@db/pare\n  commit_timeout_ms: 0\n").unwrap_err();
        let paths: Vec<&str> = err.problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["archive.url", "archive.commit_timeout_ms"], "{err}");
        assert!(!err.to_string().contains(":pw@"), "{err}");
        let mut config = Config::default();
        Overrides { archive: Some("postgresql://h/db".into()), ..Overrides::default() }.apply(&mut config);
        assert_eq!((config.archive.url.as_deref(), config.archive.dir.as_deref()), (Some("postgresql://h/db"), None));
        Overrides { archive: Some("./postgres-data".into()), ..Overrides::default() }.apply(&mut config);
        assert_eq!(config.archive.dir.as_deref(), Some(Path::new("./postgres-data")));
        assert_eq!(config.archive.url, None);
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Config::default().validate(), Vec::new());
        assert_eq!(Config::from_yaml("").unwrap(), Config::default());
        assert_eq!(Config::from_yaml("# only a comment\n").unwrap(), Config::default());
    }

    #[test]
    fn session_counts_are_refused_for_the_byte_budget() {
        let err = Config::from_yaml("archive:\n  tracked_sessions: 10\nbudget:\n  max_sessions: 2\n").unwrap_err();
        let got: Vec<(Option<u64>, &str)> = err.problems.iter().map(|p| (p.line, p.path.as_str())).collect();
        assert_eq!(got, vec![(Some(2), "archive.tracked_sessions"), (Some(4), "budget.max_sessions")]);
        assert!(err.problems.iter().all(|p| p.message.contains("memory.max_state_bytes")), "{err}");
        let config = Config::from_yaml("memory:\n  max_state_bytes: 1048576\n").unwrap();
        assert_eq!(config.memory.max_state_bytes, 1 << 20);
        let zero = Config::from_yaml("memory:\n  max_state_bytes: 0\n").unwrap_err();
        assert_eq!(zero.problems[0].path, "memory.max_state_bytes");
    }

    #[test]
    fn every_type_and_semantic_problem_is_listed_with_its_line() {
        let text = "\
server:
  listen: 0.0.0.0:8787
  max_body: lots
upstream:
  url: ftp://example
budget:
  high_water: 0.4
  low_water: 0.6
  encodng: o200k_base
models:
  - match: '('
    context_window: 100
";
        let err = Config::from_yaml(text).unwrap_err();
        let got: Vec<(Option<u64>, &str)> = err.problems.iter().map(|p| (p.line, p.path.as_str())).collect();
        // Type errors and the semantic checks that run on what remains (bad nodes take defaults).
        assert_eq!(
            got,
            vec![
                (Some(2), "server.listen"),
                (Some(3), "server.max_body"),
                (Some(5), "upstream.url"),
                (Some(7), "budget.high_water"),
                (Some(9), "budget.encodng"),
                (Some(11), "models.0.match"),
                (Some(12), "models.0.context_window"),
            ],
            "{err}"
        );
        let rendered = err.to_string();
        assert!(rendered.starts_with("7 problem(s) in config"), "{rendered}");
    }

    /// The paths of the problems a configuration that must be rejected has.
    fn rejected(yaml: &str) -> Vec<String> {
        let err = Config::from_yaml(yaml).unwrap_err();
        err.problems.iter().map(|p| p.path.clone()).collect()
    }

    #[test]
    fn worker_threads_are_a_positive_count_or_null() {
        assert_eq!(rejected("server:\n  worker_threads: 0\n"), ["server.worker_threads"]);
        assert_eq!(Config::from_yaml("server:\n  worker_threads: 4\n").unwrap().server.worker_threads, Some(4));
        assert_eq!(Config::from_yaml("server:\n  worker_threads: null\n").unwrap().server.worker_threads, None);
    }

    #[test]
    fn eager_marks_are_checked_like_the_epoch_marks() {
        let got = rejected("budget:\n  eager_high_water: 0.3\n  eager_low_water: 0.5\n");
        assert_eq!(got, ["budget.eager_high_water"]);
        let ok = Config::from_yaml("budget:\n  eager_high_water: 1.0\n  eager_low_water: 0.2\n").unwrap();
        assert_eq!((ok.budget.eager_high_water, ok.budget.high_water), (1.0, 0.9));
    }

    #[test]
    fn history_floor_is_checked_filled_in_and_can_be_turned_off() {
        for bad in ["max_rise: 1.0", "max_rise: -0.1"] {
            assert_eq!(rejected(&format!("budget:\n  history_floor:\n    {bad}\n")), ["budget.history_floor"], "{bad}");
        }
        let partial = Config::from_yaml("budget:\n  history_floor:\n    tokens: 500\n").unwrap();
        assert_eq!(partial.budget.history_floor, Some(HistoryFloorConfig { tokens: 500, max_rise: 0.6 }));
        let off = Config::from_yaml("budget:\n  history_floor: null\n").unwrap();
        assert_eq!(off.budget.history_floor, None);
        assert_eq!(Config::default().budget.history_floor, Some(HistoryFloorConfig { tokens: 3000, max_rise: 0.6 }));
    }

    #[test]
    fn eager_history_is_checked_filled_in_and_can_be_turned_off() {
        for bad in ["high: 0.2\n    low: 0.2", "high: 1.5\n    low: 0.1", "high: 0.2\n    low: 0"] {
            assert_eq!(rejected(&format!("budget:\n  eager_history:\n    {bad}\n")), ["budget.eager_history"], "{bad}");
        }
        let partial = Config::from_yaml("budget:\n  eager_history:\n    high: 0.5\n").unwrap();
        assert_eq!(partial.budget.eager_history, Some(HistoryShare { high: 0.5, low: 0.1 }));
        let off = Config::from_yaml("budget:\n  eager_history: null\n").unwrap();
        assert_eq!(off.budget.eager_history, None);
        assert_eq!(Config::default().budget.eager_history, Some(HistoryShare { high: 0.28, low: 0.1 }));
        assert_eq!(HistoryShare { high: 0.28, low: 0.1 }.tokens(12_288), (3440, 1228));
    }

    #[test]
    fn the_example_file_is_the_built_in_default() {
        let text = include_str!("../../compaction.example.yaml");
        assert_eq!(Config::from_yaml(text).unwrap(), Config::default());
    }

    /// Every key of the schema appears in `compaction.example.yaml` (so the file documents them all).
    #[test]
    fn the_example_file_names_every_key() {
        fn paths(value: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
            if let serde_json::Value::Object(map) = value {
                for (k, v) in map {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    paths(v, &path, out);
                    out.push(path);
                }
            }
        }
        let text = include_str!("../../compaction.example.yaml");
        let root = yaml::parse(text).unwrap();
        let mut in_example = Vec::new();
        paths(&root.to_json(), "", &mut in_example);
        let mut in_schema = Vec::new();
        paths(&serde_json::to_value(Config::default()).unwrap(), "", &mut in_schema);
        let missing: Vec<&String> = in_schema.iter().filter(|p| !in_example.contains(p)).collect();
        assert!(missing.is_empty(), "keys missing from compaction.example.yaml: {missing:?}");
    }

    #[test]
    fn non_loopback_needs_both_the_flag_and_a_token() {
        let err = Config::from_yaml("server:\n  listen: 0.0.0.0:8787\n  allow_non_loopback: true\n").unwrap_err();
        assert_eq!(err.problems.len(), 1);
        assert_eq!(err.problems[0].path, "server.auth_token");
        let ok = Config::from_yaml(
            "server:\n  listen: 0.0.0.0:8787\n  allow_non_loopback: true\n  auth_token: 0123456789abcdef\n",
        );
        assert!(ok.is_ok());
    }

    /// Regression: a one-character `auth_token` was accepted for a non-loopback listener.
    #[test]
    fn tokens_shorter_than_sixteen_characters_are_refused() {
        let err = Config::from_yaml(
            "server:\n  listen: 0.0.0.0:8787\n  allow_non_loopback: true\n  auth_token: t\n  owner_token: 0123456789abcde\n",
        )
        .unwrap_err();
        let paths: Vec<&str> = err.problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["server.auth_token", "server.owner_token", "server.owner_token"], "{err}");
        assert!(err.problems[0].message.contains("at least 16"), "{err}");
        assert!(Config::from_yaml("server:\n  owner_token: 0123456789abcdef\n").is_ok());
    }
}
