//! The price table: parsing the compiled-in `data/prices.json` (once per process, at its first use:
//! the start-up line), and the per-request price of a model once resolved (one lookup in the
//! resolved-price cache).
//!
//! `cargo bench --bench prices`

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pare::budget::price::{PriceTable, Prices, TABLE_JSON};

fn prices(c: &mut Criterion) {
    c.bench_function("parse_the_price_table", |b| b.iter(|| PriceTable::parse(black_box(TABLE_JSON)).unwrap()));
    let prices = Prices::builtin();
    let names = ["claude-sonnet-4-5", "gpt-4o", "anthropic/claude-sonnet-4.5", "my-local-model"];
    for name in names {
        prices.of(name);
    }
    c.bench_function("price_of_a_resolved_model", |b| {
        let mut idx = 0;
        b.iter(|| {
            idx = (idx + 1) % names.len();
            prices.of(black_box(names[idx]))
        })
    });
}

criterion_group!(benches, prices);
criterion_main!(benches);
