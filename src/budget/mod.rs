//! Token budget: counting, context windows, salience tiers and cache-stable epochs.

pub mod tokens;
