//! The HTTP shell: server, upstream client, streaming pass-through, pare's own endpoints and errors.
//!
//! - [`server`]: listener, connections (HTTP/1.1 + h2c), graceful shutdown; [`run`] is the entry point.
//! - [`upstream`]: path mapping, header rules, the pooled upstream client.
//! - [`handler`]: one exchange — bounded body read, chat interception through the pipeline, forwarding.
//! - [`body`]: the streamed response body and the exactly-once completion (archive sink, access log).
//! - [`guard`]: which requests pare accepts: `Host` and `Origin` (DNS rebinding, cross-site requests),
//!   which token a path needs ([`guard::Keys`]). [`token`]: the owner token, made at first start.
//! - [`limits`]: connections bounded from accept (silent, idle) and request bytes bounded across them.
//! - [`state`]: [`Proxy`], what every exchange shares.
//! - [`endpoints`]: `/_pare/…`, answered by pare and never forwarded.
//! - [`retrieve`]: hidden content back by id (`/_pare/retrieve/{id}`) and the gateway contract
//!   (`/v1/compress`, `/v1/retrieve/{hash}`). [`mcp`]: the MCP server with the `retrieve` tool.
//! - [`error`]: errors pare answers with, OpenAI-shaped, naming who failed.
//! - [`access`]: the one log line per request.
//! - [`ui_server`]: `pare ui`, the audit UI served alone.
//! - [`metrics`]: the Prometheus series behind `/_pare/metrics`.

pub mod access;
pub mod body;
pub mod endpoints;
pub mod error;
pub mod gateway;
pub mod guard;
pub mod handler;
pub mod limits;
pub mod mcp;
pub mod metrics;
pub mod paths;
pub mod retrieve;
pub mod server;
pub mod state;
pub mod token;
pub mod ui_server;
pub mod upstream;

pub use error::{Culprit, ProxyError};
pub use guard::token_matches;
pub use handler::ProxyBody;
pub use paths::PARE_PREFIX;
pub use server::{ServeError, bind, check_exposure, run, run_with_registry};
pub use state::Proxy;
pub use upstream::{PARE_TOKEN_HEADER, UpstreamBase};
