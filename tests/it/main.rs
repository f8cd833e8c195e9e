//! pare's integration tests: one binary, one module per area.

mod archive;
