//! The Anthropic Messages API (`POST …/v1/messages`: Claude Code, the `anthropic` SDKs) as pare reads it.
//!
//! - [`cache`]: the agent's prompt-cache plan (`cache_control` marks) and where the marks stand after
//!   compaction.
//! - [`chat`]: a Messages conversation as chat messages, for export.

pub mod cache;
pub mod chat;
