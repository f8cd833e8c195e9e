//! The seam the proxy calls for one chat-completions request: which session it belongs to, the raw
//! record for the archive, and the compacted body to forward. Also where fail-open is enforced: any
//! error or panic inside compaction forwards the original bytes and is counted.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::HeaderMap;

use crate::config::Config;
use crate::wire::ChatBody;

/// A session's id (time-sortable, see [`crate::session`]).
pub type SessionId = String;

/// What compaction reports for one request; carried into headers, the log line and the archive.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompactionSummary {
    pub tokens_raw: u64,
    pub tokens_forwarded: u64,
    /// Epoch number of the session after this request (0 = never compacted).
    pub epoch: u64,
    /// System + tools + protected tail alone exceed the window: forwarded anyway.
    pub over_window: bool,
    /// The engine's detailed report (per rule savings, messages changed…).
    pub report: serde_json::Value,
}

/// Input of one compaction.
pub struct CompactInput<'a> {
    pub session: &'a str,
    pub raw: &'a [u8],
    pub body: &'a ChatBody<'a>,
    /// Context window of the request's model when the pipeline resolved one (config or detection).
    pub window: Option<u64>,
}

/// Output of one compaction: `body` is `None` when the request is forwarded unchanged.
pub struct CompactOutput {
    pub body: Option<Vec<u8>>,
    pub summary: CompactionSummary,
}

/// Anything that can compact a chat request. The engine is pure; implementations may keep
/// per-session state (epochs, stickiness) behind interior mutability.
pub trait ChatCompactor: Send + Sync {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput>;
}

/// Forwards every request unchanged (mode `off`, and the seam's default until wired).
pub struct IdentityCompactor;

impl ChatCompactor for IdentityCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(CompactOutput { body: None, summary: CompactionSummary::default() })
    }
}

/// Receives the upstream's answer to a chat request as it streams (for the archive).
/// The proxy calls `finish` exactly once: on end of body, on error, or when the body is dropped.
pub trait ResponseSink: Send {
    fn head(&mut self, status: u16, headers: &HeaderMap);
    fn chunk(&mut self, bytes: &Bytes);
    fn finish(self: Box<Self>, end: StreamEnd);
}

/// How a response body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    Complete,
    /// The client went away before the end.
    ClientGone,
    /// The upstream failed mid-body (reset, timeout).
    UpstreamError(String),
    /// pare answered itself (502/504…) and the upstream never did.
    NoResponse(String),
}

/// What the proxy needs to forward one chat request.
pub struct PreparedChat {
    /// The body to forward (the original bytes when nothing changed).
    pub body: Bytes,
    pub session: Option<SessionId>,
    /// The request's `model`, when the body parsed (labels metrics per model).
    pub model: Option<String>,
    pub summary: Option<CompactionSummary>,
    /// Why compaction did not apply (unparseable body, engine failure), for the log line.
    pub skipped: Option<String>,
    pub sink: Option<Box<dyn ResponseSink>>,
}

/// Counters the pipeline keeps (exported on `/_pare/metrics`).
#[derive(Debug, Default)]
pub struct PipelineStats {
    pub fail_open: AtomicU64,
    pub unparseable: AtomicU64,
}

/// Session → archive → compaction for one chat request.
pub struct Pipeline {
    pub config: Arc<Config>,
    compactor: Arc<dyn ChatCompactor>,
    pub stats: PipelineStats,
}

impl Pipeline {
    pub fn new(config: Arc<Config>, compactor: Arc<dyn ChatCompactor>) -> Pipeline {
        Pipeline { config, compactor, stats: PipelineStats::default() }
    }

    /// A pipeline that forwards everything unchanged.
    pub fn identity(config: Arc<Config>) -> Pipeline {
        Pipeline::new(config, Arc::new(IdentityCompactor))
    }

    /// Prepare one chat request for forwarding. Never fails: the worst case forwards `raw` unchanged.
    pub async fn prepare_chat(&self, _headers: &HeaderMap, raw: Bytes) -> PreparedChat {
        let body = match ChatBody::parse(&raw) {
            Ok(body) => body,
            Err(err) => {
                self.stats.unparseable.fetch_add(1, Ordering::Relaxed);
                return PreparedChat {
                    body: raw.clone(),
                    session: None,
                    model: None,
                    summary: None,
                    skipped: Some(err.to_string()),
                    sink: None,
                };
            }
        };
        let session = String::new();
        let input = CompactInput { session: &session, raw: &raw, body: &body, window: None };
        let result = catch_unwind(AssertUnwindSafe(|| self.compactor.compact(&input)));
        let (forward, summary, skipped) = match result {
            Ok(Ok(out)) => (out.body.map(Bytes::from).unwrap_or_else(|| raw.clone()), Some(out.summary), None),
            Ok(Err(err)) => {
                self.stats.fail_open.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %format!("{err:#}"), "compaction failed; forwarding the original request");
                (raw.clone(), None, Some(format!("compaction failed: {err:#}")))
            }
            Err(panic) => {
                self.stats.fail_open.fetch_add(1, Ordering::Relaxed);
                let what = panic_message(&panic);
                tracing::error!(panic = %what, "compaction panicked; forwarding the original request");
                (raw.clone(), None, Some(format!("compaction panicked: {what}")))
            }
        };
        PreparedChat { body: forward, session: None, model: body.model(), summary, skipped, sink: None }
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}
