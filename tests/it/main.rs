//! The integration tests: one binary, one module per area.

mod budget;
mod eval;
