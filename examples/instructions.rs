//! Runs one operation of the engine bench's request N times, for counting instructions with
//! callgrind: deterministic where wall time on a shared machine is not. `benches/instructions.sh`
//! runs it under valgrind for N = 1 and N = 11 and prints the difference over 10, which cancels the
//! building of the request and of the engine.
//!
//! `cargo run --release --example instructions -- OP N`, OP one of:
//! - `compact`: parse + rules + serialize on the calling thread (`CompactOptions::single_thread`);
//! - `compact-pool`: the same with the per-message work on the rayon pool (the proxy's default);
//! - `parse`: `ChatBody::parse` alone;
//! - `archive-split`: the archive's split of the body into pieces;
//! - `archive-split-along`: the same split along the spans of the proxy's parse (what the archive's
//!   writer does with a request that came through the proxy);
//! - `serde-parse`: serde_json's parse into a `Value` (and its drop), the yardstick;
//! - `serde-roundtrip`: serde_json's parse and serialize.
//!
//! Rules only, with the bytes/4 token counter: the tokenizer is measured by `benches/budget.rs`.

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::hint::black_box;

use pare::compact::{CompactOptions, Engine};
use pare::tokens::QuarterCounter;
use pare::wire::ChatBody;
use serde_json::Value;

#[path = "../benches/common/engine_request.rs"]
mod engine_request;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(op), Some(n)) = (args.next(), args.next().and_then(|n| n.parse::<usize>().ok())) else {
        eprintln!(
            "usage: instructions compact|compact-pool|parse|archive-split|archive-split-along|serde-parse|serde-roundtrip N"
        );
        std::process::exit(2);
    };
    let body = engine_request::large_request();
    let engine = Engine::default_pack();
    let spans = ChatBody::parse(&body).expect("the bench body parses").split.spans_in(&body);
    let mut total = 0usize;
    for _ in 0..n {
        let body = black_box(&body[..]);
        total += match op.as_str() {
            "compact" | "compact-pool" => {
                let options = CompactOptions { single_thread: op == "compact", ..Default::default() };
                engine_request::compact_with(&engine, body, &options, &QuarterCounter).len()
            }
            "parse" => ChatBody::parse(body).expect("the bench body parses").messages().len(),
            "archive-split" => pare::archive::body::split(body).len(),
            "archive-split-along" => pare::archive::body::split_along(body, spans.as_ref()).len(),
            "serde-parse" => usize::from(serde_json::from_slice::<Value>(body).expect("valid JSON").is_object()),
            "serde-roundtrip" => serde_json::to_vec(&serde_json::from_slice::<Value>(body).expect("valid JSON"))
                .expect("serializes")
                .len(),
            other => {
                eprintln!("unknown operation {other:?}");
                std::process::exit(2);
            }
        };
    }
    black_box(total);
}
