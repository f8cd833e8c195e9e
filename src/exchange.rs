//! The types the proxy, the pipeline, the compactor and the archive exchange about one request: the
//! compaction seam ([`ChatCompactor`], its input and output, fail-open), what compaction reports, and
//! the sink that receives the upstream's answer. A leaf module (it imports none of them but the wire
//! types), so that neither the archive nor the budget and the pipeline import each other.

use std::panic::{AssertUnwindSafe, catch_unwind};

use bytes::Bytes;
use http::HeaderMap;

use crate::wire::{Spans, WireBody};

/// What compaction reports for one request; carried into headers, the log line and the archive.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompactionSummary {
    pub tokens_raw: u64,
    pub tokens_forwarded: u64,
    /// Epoch number of the session after this request (0 = never compacted).
    pub epoch: u64,
    /// This request started an epoch (eager: an advance that changed the forwarded prefix). Said by
    /// the compactor, so a restart that seeds sessions at their archived epoch numbers counts none.
    pub epoch_started: bool,
    /// The forwarded request is over the usable window (window − answer reserve): in epoch and eager
    /// mode, compaction could not bring it under — what pare never shrinks (first system message,
    /// user messages, protected tail, tools, messages a rule keeps whole) does not fit, or at a very
    /// small window the markers left in place of what went; in off mode, the raw request is over.
    /// Forwarded anyway, and said so in the `x-pare-over-window` header, the log line, the archived
    /// summary and `pare_over_window_requests_total`.
    pub over_window: bool,
    /// The engine's detailed report (per rule savings, messages changed…).
    pub report: serde_json::Value,
}

/// Receives the upstream's answer to a request as it streams (for the archive).
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

/// Input of one compaction.
pub struct CompactInput<'a> {
    pub session: &'a str,
    pub raw: &'a [u8],
    pub body: &'a dyn WireBody,
    /// The body's neutral messages, read once for the session tracker and the compactor.
    pub messages: &'a [&'a str],
    /// Context window of the request's model when the pipeline resolved one (config or detection).
    pub window: Option<u64>,
}

/// Output of one compaction: `body` is `None` when the request is forwarded unchanged.
pub struct CompactOutput {
    pub body: Option<Vec<u8>>,
    /// Where `body`'s values lie, when the compactor wrote it with [`WireBody::write`]:
    /// the archive then stores it without parsing it. `None`: the archive parses `body` itself.
    pub spans: Option<Spans>,
    pub summary: CompactionSummary,
}

/// Anything that can compact a request. The engine is pure; implementations may keep
/// per-session state (epochs, stickiness) behind interior mutability.
pub trait ChatCompactor: Send + Sync {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput>;
}

/// Forwards every request unchanged (mode `off`, and the seam's default until wired).
pub struct IdentityCompactor;

impl ChatCompactor for IdentityCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(CompactOutput { body: None, spans: None, summary: CompactionSummary::default() })
    }
}

/// One compaction under `catch_unwind`: the proxy and `pare replay` both go through here, so that they
/// forward the same bytes. `Err` says why compaction did not apply (an error or a panic); the caller
/// then forwards the original body.
pub fn compact_fail_open(compactor: &dyn ChatCompactor, input: &CompactInput<'_>) -> Result<CompactOutput, String> {
    match catch_unwind(AssertUnwindSafe(|| compactor.compact(input))) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(err)) => Err(format!("compaction failed: {err:#}")),
        Err(panic) => Err(format!("compaction panicked: {}", panic_message(&panic))),
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
