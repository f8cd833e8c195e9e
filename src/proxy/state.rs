//! What every exchange shares, built once by the server: configuration, pipeline, upstream client,
//! metrics, the audit UI, the guard and limits, and the health check's probe.

use std::sync::Arc;

use http::HeaderValue;

use super::body::Finishing;
use super::guard::{Guard, Keys};
use super::limits::BufferBudget;
use super::metrics::Metrics;
use super::upstream::{Probe, Upstream};
use crate::config::Config;
use crate::pipeline::Pipeline;

/// Everything one exchange needs, shared by all connections.
pub struct Proxy {
    pub config: Arc<Config>,
    pub pipeline: Arc<Pipeline>,
    pub upstream: Upstream,
    pub metrics: Arc<Metrics>,
    /// The audit UI over the archive (`None` when archiving is off).
    pub ui: Option<Arc<crate::ui::Ui>>,
    /// Exchanges whose end is being recorded after their last byte went out.
    pub finishing: Arc<Finishing>,
    /// The `Host` and `Origin` pare answers to.
    pub guard: Guard,
    /// The owner token (and `server.auth_token`), where requests may carry it, the pace of wrong ones.
    pub keys: Keys,
    /// Request bytes held by all exchanges together (`server.max_buffered_bytes`).
    pub buffers: Arc<BufferBudget>,
    /// This process's id in [`VIA_HEADER`]: a request that carries it has come back to pare.
    pub via: HeaderValue,
    /// Compressed bodies decoded at once (half the cores, at least one).
    pub decoders: tokio::sync::Semaphore,
    /// Retrievals that `grep` a content at once ([`super::retrieve::MAX_GREPS`]): each runs on the
    /// blocking pool, so that none holds a thread that serves connections.
    pub greps: tokio::sync::Semaphore,
    /// The health check's upstream probe, shared by all checks.
    pub probe: Probe,
    /// The gateway's compress engine, built on the first `POST /v1/compress` (or why it cannot be).
    pub gateway: std::sync::OnceLock<Result<Arc<super::gateway::GatewayEngine>, String>>,
}

/// The header in which each pare on a request's way names itself (appended, never removed): a
/// request that arrives naming this pare went round a loop and gets 508.
pub const VIA_HEADER: &str = "x-pare-via";
