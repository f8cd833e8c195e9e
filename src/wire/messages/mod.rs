//! The Anthropic Messages API (`POST …/v1/messages`: Claude Code, the `anthropic` SDKs) as pare reads it.
//!
//! - [`cache`]: the agent's prompt-cache plan (`cache_control` marks) and where the marks stand after
//!   compaction.
//! - [`convert`]: a Messages conversation as chat messages (for export), and a chat request as the
//!   Messages request Claude Code would have sent (for tests and evaluation).

pub mod cache;
pub mod convert;
