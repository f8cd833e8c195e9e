//! The paths pare answers itself: its own endpoints under `/_pare`, and the gateway endpoints a
//! gateway's guardrail calls. Every layer of the proxy that routes or guards by path reads them here.

/// The prefix of pare's own endpoints; nothing under it is forwarded.
pub const PARE_PREFIX: &str = "/_pare";

/// The one endpoint answered without the owner token (process supervisors probe it).
pub const HEALTH_PATH: &str = "/_pare/health";

/// Prometheus' scrape path.
pub const METRICS_PATH: &str = "/_pare/metrics";

/// The MCP server's endpoint.
pub const MCP_PATH: &str = "/_pare/mcp";

/// `GET /_pare/retrieve/{id}`: the content a marker's id names.
pub const RETRIEVE_PREFIX: &str = "/_pare/retrieve/";

/// The gateway's compress endpoint (LiteLLM's Headroom guardrail).
pub const COMPRESS_PATH: &str = "/v1/compress";

/// The gateway's retrieval endpoint (`GET /v1/retrieve/{hash}`).
pub const GATEWAY_RETRIEVE_PREFIX: &str = "/v1/retrieve/";

/// Whether `path` is one of pare's own endpoints (`/_pare` and below).
pub fn is_pare_path(path: &str) -> bool {
    path == PARE_PREFIX || path.strip_prefix(PARE_PREFIX).is_some_and(|rest| rest.starts_with('/'))
}

/// Whether `path` is one of the gateway endpoints pare answers itself (not under `/_pare/`).
pub fn is_gateway(path: &str) -> bool {
    path == COMPRESS_PATH || path.starts_with(GATEWAY_RETRIEVE_PREFIX)
}
