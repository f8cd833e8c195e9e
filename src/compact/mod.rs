//! The compaction engine: a pure, deterministic, always-valid rewrite of a request's `messages`.
//!
//! `request + policy (+ a target) → forwarded messages + report`. No I/O, no clock, no randomness;
//! it cannot fail on user data: whatever it does not understand passes through unchanged.
//!
//! The seam used by [`crate::budget`] (epochs) and `pare compact`:
//! [`Engine::compact`] returns the forwarded form of the messages *before* `boundary`; the messages
//! from `boundary` on (the protected tail) are forwarded byte-identical. That split is what lets the
//! epoch machinery keep a compacted prefix sticky and append new raw messages after it.

use crate::budget::tokens::CountTokens;
use crate::wire::ChatBody;

/// Options of one compaction.
#[derive(Debug, Clone, Default)]
pub struct CompactOptions {
    /// Token target for the whole forwarded request (messages + tools). `None`: rules only.
    pub target_tokens: Option<u64>,
}

/// What [`Engine::compact`] produces.
#[derive(Debug, Clone)]
pub struct Compacted {
    /// Index of the first raw message of the protected tail; raw messages from here on are forwarded
    /// unchanged.
    pub boundary: usize,
    /// The forwarded form of raw messages `0..boundary`, each a complete JSON message (an elided run is
    /// one marker message, so `prefix.len()` may be smaller than `boundary`).
    pub prefix: Vec<String>,
    /// What each rule did.
    pub report: serde_json::Value,
}

/// The compiled policy (rule pack + overrides, regexes compiled once).
#[derive(Debug)]
pub struct Engine {}

impl Engine {
    /// The engine with the built-in default pack.
    pub fn default_pack() -> Engine {
        Engine {}
    }

    /// Compact a request. Identity until the rules land.
    pub fn compact(&self, body: &ChatBody<'_>, _opts: &CompactOptions, _counter: &dyn CountTokens) -> Compacted {
        Compacted {
            boundary: body.messages.len(),
            prefix: body.messages.iter().map(|m| m.get().to_owned()).collect(),
            report: serde_json::Value::Null,
        }
    }
}
