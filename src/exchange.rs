//! The types the proxy, the pipeline, the compactor and the archive exchange about one request:
//! what compaction reports, and the sink that receives the upstream's answer. A leaf module (it
//! imports none of them), so that the archive and the pipeline do not import each other.

use bytes::Bytes;
use http::HeaderMap;

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
