//! The integration tests: one binary, one module per area. `support` holds the stub upstream and an
//! in-process pare that other modules reuse.

mod support;

mod archive;
mod archive_pg;
mod archive_pg_edges;
mod bad_input;
mod boundaries;
mod budget;
mod cli;
mod compact;
mod cost;
mod dashboard;
mod engine;
mod eval;
mod exposure;
mod fleet;
mod gemini;
mod messages;
mod observe;
mod pg_server;
mod proxy;
mod proxy_hardening;
mod recall;
mod responses;
mod resume;
mod retrieve;
mod streams;
mod tidy;
mod transport;
mod ui;
mod usage;
