//! Salience tiers and elision, used when a token target is given and the rules alone leave the
//! request over it.

use std::collections::{BTreeMap, BTreeSet};

/// Groups elided by [`fit`]: each run of elided groups is replaced by one marker message.
#[derive(Debug, Default)]
pub struct Elided {
    /// Run start (raw index) → (end, exclusive; the marker message's JSON).
    pub runs: BTreeMap<usize, (usize, String)>,
    /// Every raw message index elided.
    pub messages: BTreeSet<usize>,
    pub chars_saved: i64,
    pub tokens_saved: i64,
}
