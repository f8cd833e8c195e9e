//! Token counting with tiktoken-rs, cached per message.

/// Counts tokens of request parts as the upstream would see them.
pub trait CountTokens: Send + Sync {
    /// Tokens of one message (its raw JSON), per-message overhead included.
    fn message(&self, raw_json: &str) -> u64;
    /// Tokens of the `tools` array (raw JSON), counted once per distinct schema.
    fn tools(&self, raw_json: &str) -> u64;
}
