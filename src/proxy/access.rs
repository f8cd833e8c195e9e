//! The one log line per request: what was asked, what came back, how long the upstream took and how
//! long pare itself took, and what compaction did; and one line per call to pare's own endpoints.
//! Every duration in a log line is in milliseconds (`*_ms`, two decimals); the metrics' are in
//! seconds (`*_seconds`), as Prometheus names them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;

use super::metrics::{Exchange, Metrics};
use crate::exchange::Usage;
use crate::exchange::{CompactionSummary, StreamEnd};

/// Everything the access line reports, filled in as the exchange progresses.
#[derive(Debug)]
pub struct AccessLog {
    pub method: Method,
    /// The path only: query strings may carry keys.
    pub path: String,
    pub started: Instant,
    pub status: u16,
    /// Upstream dispatch → response headers.
    pub upstream: Option<Duration>,
    /// Time pare itself spent on the request (after the body was read, before dispatch; and on the
    /// response head).
    pub pare: Duration,
    pub summary: Option<CompactionSummary>,
    pub session: Option<String>,
    pub model: Option<String>,
    /// Why compaction did not apply, when it did not — also why a request was neither compacted nor
    /// archived (a compressed body pare does not decode: another encoding, corrupt, or over
    /// `server.max_body` once decoded).
    pub skipped: Option<String>,
    pub bytes_out: u64,
    /// What the upstream reported it billed for the answer, when it did (set when the answer ends).
    pub usage: Option<Usage>,
    /// pare read the answer (a format it compacts): `usage` is then `None` only when the upstream
    /// reported none.
    pub answer_read: bool,
    /// Counted here when the exchange ends; `None` in unit tests.
    metrics: Option<Arc<Metrics>>,
}

impl AccessLog {
    pub fn new(method: Method, path: &str, started: Instant) -> AccessLog {
        AccessLog {
            method,
            path: path.to_owned(),
            started,
            status: 0,
            upstream: None,
            pare: Duration::ZERO,
            summary: None,
            session: None,
            model: None,
            skipped: None,
            bytes_out: 0,
            usage: None,
            answer_read: false,
            metrics: None,
        }
    }

    /// Count this exchange in `metrics` (in flight now, finished when the line is emitted).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> AccessLog {
        metrics.started();
        self.metrics = Some(metrics);
        self
    }

    /// Emit the line and count the exchange; `end` says how the response body ended.
    pub fn emit(mut self, end: &StreamEnd) {
        if let Some(metrics) = self.metrics.take() {
            metrics.finished(&Exchange {
                path: &self.path,
                status: self.status,
                end,
                upstream: self.upstream,
                overhead: self.pare,
                summary: self.summary.as_ref(),
                model: self.model.as_deref(),
                session: self.session.as_deref(),
                usage: self.usage.as_ref(),
                answer_read: self.answer_read,
            });
        }
        let end_text = match end {
            StreamEnd::Complete => "complete".to_owned(),
            StreamEnd::ClientGone => "client_gone".to_owned(),
            StreamEnd::UpstreamError(e) => format!("upstream_error: {e}"),
            StreamEnd::NoResponse(e) => format!("no_response: {e}"),
        };
        tracing::info!(
            target: "pare::access",
            method = %self.method,
            path = %self.path,
            status = self.status,
            upstream_ms = self.upstream.map(millis),
            pare_ms = millis(self.pare),
            total_ms = millis(self.started.elapsed()),
            bytes_out = self.bytes_out,
            tokens_raw = self.summary.as_ref().map(|s| s.tokens_raw),
            tokens_forwarded = self.summary.as_ref().map(|s| s.tokens_forwarded),
            epoch = self.summary.as_ref().map(|s| s.epoch),
            over_window = self.summary.as_ref().map(|s| s.over_window),
            window = self.summary.as_ref().and_then(|s| s.report.as_ref()).map(|r| r.window),
            window_source = self.summary.as_ref().and_then(|s| s.report.as_ref()?.window_source).map(|w| w.name()),
            upstream_prompt_tokens = self.usage.and_then(|u| u.prompt),
            upstream_cached_tokens = self.usage.and_then(|u| u.cached),
            model = self.model.as_deref(),
            session = self.session.as_deref(),
            skipped = self.skipped.as_deref(),
            end = %end_text,
            "request"
        );
    }
}

/// The one log line of a call to one of pare's own endpoints (`/_pare/…`, the gateway): method,
/// path, status and how long pare took to answer, in milliseconds as the request line gives them.
pub fn pare_endpoint(method: &Method, path: &str, status: u16, started: Instant) {
    tracing::info!(
        target: "pare::access",
        method = %method,
        path = %path,
        status,
        total_ms = millis(started.elapsed()),
        "pare endpoint"
    );
}

/// Milliseconds to two decimals (`3.72`): the log line's precision, not the float's.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        // Dropped without a line (a panic unwound through the exchange): still leave the in-flight gauge.
        if let Some(metrics) = self.metrics.take() {
            metrics.finished(&Exchange {
                path: &self.path,
                status: 500,
                end: &StreamEnd::NoResponse("request handling panicked".into()),
                upstream: self.upstream,
                overhead: self.pare,
                summary: None,
                model: None,
                session: None,
                usage: None,
                answer_read: false,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_figures_are_rounded_to_two_decimals() {
        assert_eq!(format!("{}", millis(Duration::from_nanos(3_721_505_999))), "3721.51");
        assert_eq!(format!("{}", millis(Duration::from_nanos(3_721_506))), "3.72");
        assert_eq!(format!("{}", millis(Duration::ZERO)), "0");
    }
}
