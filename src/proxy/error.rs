//! Errors pare itself answers with, each naming who failed (the client, the upstream or pare), in
//! the shape the client parses: OpenAI's `{"error": {…}}`, or Anthropic's
//! `{"type": "error", "error": {…}}` for Anthropic clients.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// The error shape a client parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// `{"error": {"message", "type", "code"}}`: Chat Completions, Responses and everything else.
    #[default]
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`: Anthropic Messages clients.
    Anthropic,
    /// `{"error": {"code", "message", "status"}}`: Gemini API clients (`google-genai`, Gemini CLI).
    Google,
}

impl Dialect {
    /// Anthropic's for a request to `…/v1/messages…` or one carrying `anthropic-version` (which
    /// the anthropic SDKs and Claude Code send on every request); Google's for a request to a
    /// Gemini method (`…/models/{m}:generateContent`, `:countTokens`, anything under `/v1beta/`)
    /// or one carrying `x-goog-api-client` or `x-goog-api-key` (the google-genai SDKs send both);
    /// OpenAI's otherwise.
    pub fn of(path: &str, headers: &http::HeaderMap) -> Dialect {
        let google_method = path.rsplit('/').next().is_some_and(|last| last.contains(':'));
        if google_method
            || path.starts_with("/v1beta/")
            || headers.contains_key("x-goog-api-client")
            || headers.contains_key("x-goog-api-key")
        {
            Dialect::Google
        } else if path.contains("/v1/messages") || headers.contains_key("anthropic-version") {
            Dialect::Anthropic
        } else {
            Dialect::OpenAi
        }
    }
}

/// Who is at fault for a failed exchange (decides the status and the error `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
    Client,
    Upstream,
    Pare,
}

/// Why the guard (`proxy::guard`) refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("host {host:?} is not one pare answers to (add it to server.allowed_hosts)")]
    Host { host: String },
    #[error("origin {origin:?} is not allowed to call pare (add it to server.allowed_origins)")]
    Origin { origin: String },
}

/// An exchange pare could not complete; turned into an OpenAI-shaped error response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    #[error("request body of {size} bytes is over the limit of {limit} bytes (server.max_body)")]
    BodyTooLarge { size: u64, limit: u64 },
    #[error("request body is over the limit of {limit} bytes (server.max_body)")]
    BodyTooLargeStreamed { limit: u64 },
    #[error("request headers of {size} bytes are over the limit of {limit} bytes (server.max_header_bytes)")]
    HeadersTooLarge { size: usize, limit: usize },
    #[error("cannot read the request body: {cause}")]
    ClientBody { cause: String },
    #[error("request body sent no bytes for {secs} s (server.body_read_timeout_secs)")]
    BodyStalled { secs: u64 },
    #[error(
        "missing or wrong pare token (send it in x-pare-token; for the audit UI open the URL pare printed at start, /_pare/ui/?token=…)"
    )]
    Unauthorized,
    #[error("too many wrong pare tokens are waiting their turn; retry in a moment")]
    TokenGuesses,
    #[error("{0}")]
    Forbidden(#[from] Refusal),
    #[error("pare holds {limit} bytes of request bodies already (server.max_buffered_bytes); retry in a moment")]
    Busy { limit: u64 },
    #[error("this request has passed through this pare before: upstream {url} leads back to pare")]
    Loop { url: String },
    #[error("no pare endpoint at {path}")]
    NotFound { path: String },
    #[error("{path}: pare does not carry WebSocket upgrades; send the request over HTTP")]
    WebSocket { path: String },
    #[error("upstream {url} is unreachable: {cause}")]
    UpstreamUnreachable { url: String, cause: String },
    #[error("upstream {url} did not answer within {secs} s (upstream.timeout_secs / connect_timeout_secs)")]
    UpstreamTimeout { url: String, secs: u64 },
    #[error("pare failed: {cause}")]
    Internal { cause: String },
}

impl ProxyError {
    pub fn culprit(&self) -> Culprit {
        match self {
            ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTooLargeStreamed { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::BodyStalled { .. }
            | ProxyError::Unauthorized
            | ProxyError::TokenGuesses
            | ProxyError::Forbidden(_)
            | ProxyError::NotFound { .. }
            | ProxyError::WebSocket { .. } => Culprit::Client,
            ProxyError::UpstreamUnreachable { .. } | ProxyError::UpstreamTimeout { .. } => Culprit::Upstream,
            ProxyError::Internal { .. } | ProxyError::Busy { .. } | ProxyError::Loop { .. } => Culprit::Pare,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BodyTooLarge { .. } | ProxyError::BodyTooLargeStreamed { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::ClientBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::BodyStalled { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::TokenGuesses => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::Forbidden(_) => StatusCode::FORBIDDEN,
            ProxyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Loop { .. } => StatusCode::LOOP_DETECTED,
            ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::WebSocket { .. } => StatusCode::UPGRADE_REQUIRED,
            ProxyError::UpstreamUnreachable { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `error.code` value: stable, machine-readable.
    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::BodyTooLarge { .. } | ProxyError::BodyTooLargeStreamed { .. } => "request_too_large",
            ProxyError::HeadersTooLarge { .. } => "request_headers_too_large",
            ProxyError::ClientBody { .. } => "bad_request_body",
            ProxyError::BodyStalled { .. } => "request_body_timeout",
            ProxyError::Unauthorized => "invalid_pare_token",
            ProxyError::TokenGuesses => "pare_token_guesses",
            ProxyError::Forbidden(Refusal::Host { .. }) => "host_not_allowed",
            ProxyError::Forbidden(Refusal::Origin { .. }) => "origin_not_allowed",
            ProxyError::Busy { .. } => "pare_busy",
            ProxyError::Loop { .. } => "upstream_loop",
            ProxyError::NotFound { .. } => "not_found",
            ProxyError::WebSocket { .. } => "websocket_not_supported",
            ProxyError::UpstreamUnreachable { .. } => "upstream_unreachable",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::Internal { .. } => "pare_internal_error",
        }
    }

    /// The OpenAI `error.type` value, naming who failed.
    pub fn kind(&self) -> &'static str {
        match self.culprit() {
            Culprit::Client => "invalid_request_error",
            Culprit::Upstream => "upstream_error",
            Culprit::Pare => "pare_error",
        }
    }

    /// `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": format!("pare: {self}"),
                "type": self.kind(),
                "code": self.code(),
            }
        })
    }

    /// Anthropic's error `type` for this error's status (its documented set: the SDKs pick their
    /// exception class by status, the type names the kind to a reader).
    pub fn anthropic_kind(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            504 => "timeout_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// `{"type": "error", "error": {"type", "message"}}`.
    pub fn anthropic_body(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "error",
            "error": { "type": self.anthropic_kind(), "message": format!("pare: {self}") },
        })
    }

    /// Google's canonical status name for this error's HTTP status (google.rpc.Code, as the Gemini
    /// API maps them).
    pub fn google_status(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "UNAUTHENTICATED",
            403 => "PERMISSION_DENIED",
            404 => "NOT_FOUND",
            408 | 504 => "DEADLINE_EXCEEDED",
            413 => "OUT_OF_RANGE",
            429 => "RESOURCE_EXHAUSTED",
            502 | 503 => "UNAVAILABLE",
            500..=599 => "INTERNAL",
            _ => "INVALID_ARGUMENT",
        }
    }

    /// `{"error": {"code", "message", "status"}}`.
    pub fn google_body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": { "code": self.status().as_u16(), "message": format!("pare: {self}"), "status": self.google_status() },
        })
    }

    /// The OpenAI-shaped response.
    pub fn to_response(&self) -> Response<Bytes> {
        self.to_response_in(Dialect::OpenAi)
    }

    /// The response in the shape `dialect`'s clients parse.
    pub fn to_response_in(&self, dialect: Dialect) -> Response<Bytes> {
        let body = match dialect {
            Dialect::OpenAi => self.body(),
            Dialect::Anthropic => self.anthropic_body(),
            Dialect::Google => self.google_body(),
        };
        let mut response = json_response(self.status(), &body);
        if let ProxyError::Busy { .. } | ProxyError::TokenGuesses = self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// A JSON response pare writes itself.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Bytes> {
    let mut body = serde_json::to_vec(value).expect("serializing a json value cannot fail");
    body.push(b'\n');
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// 405 naming the method the endpoint takes.
pub fn method_not_allowed(allow: &'static str) -> Response<Bytes> {
    let mut response = json_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &serde_json::json!({"error": {"message": format!("this endpoint takes {allow} only"), "type": "invalid_request_error"}}),
    );
    response.headers_mut().insert(http::header::ALLOW, HeaderValue::from_static(allow));
    response
}

/// The chain of causes of an error, outermost first, joined with `: ` (repeated messages skipped).
pub fn cause_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current = Some(err);
    while let Some(e) = current {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_unreachable_is_a_502_naming_the_upstream() {
        let err =
            ProxyError::UpstreamUnreachable { url: "http://127.0.0.1:9/v1".into(), cause: "connection refused".into() };
        assert_eq!(err.status(), StatusCode::BAD_GATEWAY);
        let body = err.body();
        assert_eq!(body["error"]["type"], "upstream_error");
        assert_eq!(body["error"]["code"], "upstream_unreachable");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("http://127.0.0.1:9/v1") && message.contains("connection refused"), "{message}");
    }

    /// Regression: Anthropic clients got OpenAI-shaped errors (no `"type": "error"`), which the
    /// anthropic SDK and Claude Code do not parse as intended.
    #[test]
    fn anthropic_clients_get_anthropic_shaped_errors() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(Dialect::of("/v1/chat/completions", &headers), Dialect::OpenAi);
        assert_eq!(Dialect::of("/v1/messages", &headers), Dialect::Anthropic);
        assert_eq!(Dialect::of("/v1/messages/count_tokens", &headers), Dialect::Anthropic);
        headers.insert("anthropic-version", http::HeaderValue::from_static("2023-06-01"));
        assert_eq!(Dialect::of("/v1/models", &headers), Dialect::Anthropic);
        let none = http::HeaderMap::new();
        assert_eq!(Dialect::of("/v1beta/models/gemini-2.5-pro:streamGenerateContent", &none), Dialect::Google);
        assert_eq!(Dialect::of("/v1/models/gemini-2.5-pro:countTokens", &none), Dialect::Google);
        let mut goog = http::HeaderMap::new();
        goog.insert("x-goog-api-key", http::HeaderValue::from_static("k"));
        assert_eq!(Dialect::of("/v1/chat/completions", &goog), Dialect::Google);
        let response = ProxyError::Busy { limit: 1 }.to_response_in(Dialect::Google);
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["error"]["code"], 503);
        assert_eq!(body["error"]["status"], "UNAVAILABLE");
        assert!(body["error"]["message"].as_str().unwrap().starts_with("pare: "));

        let err =
            ProxyError::UpstreamUnreachable { url: "http://127.0.0.1:9".into(), cause: "connection refused".into() };
        let response = err.to_response_in(Dialect::Anthropic);
        assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "api_error");
        assert!(body["error"]["message"].as_str().unwrap().contains("http://127.0.0.1:9"));
        let kinds = [
            (ProxyError::BodyTooLarge { size: 2, limit: 1 }, "request_too_large"),
            (ProxyError::Unauthorized, "authentication_error"),
            (ProxyError::Busy { limit: 1 }, "overloaded_error"),
            (ProxyError::UpstreamTimeout { url: "http://x".into(), secs: 1 }, "timeout_error"),
            (ProxyError::ClientBody { cause: "reset".into() }, "invalid_request_error"),
        ];
        for (err, kind) in kinds {
            assert_eq!(err.anthropic_kind(), kind, "{err}");
        }
    }

    #[test]
    fn each_culprit_maps_to_its_status_class() {
        let client = ProxyError::BodyTooLarge { size: 10, limit: 5 };
        let pare = ProxyError::Internal { cause: "boom".into() };
        let upstream = ProxyError::UpstreamTimeout { url: "http://x".into(), secs: 1 };
        assert_eq!((client.status().as_u16(), client.kind()), (413, "invalid_request_error"));
        assert_eq!((pare.status().as_u16(), pare.kind()), (500, "pare_error"));
        assert_eq!((upstream.status().as_u16(), upstream.kind()), (504, "upstream_error"));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Layer {
        text: &'static str,
        #[source]
        inner: Option<Box<Layer>>,
    }

    #[test]
    fn cause_chain_joins_sources_without_repeats() {
        let refused = Layer { text: "connection refused", inner: None };
        let repeated = Layer { text: "tcp connect error: connection refused", inner: Some(Box::new(refused)) };
        let outer = Layer { text: "client error (Connect)", inner: Some(Box::new(repeated)) };
        assert_eq!(cause_chain(&outer), "client error (Connect): tcp connect error: connection refused");
    }
}
