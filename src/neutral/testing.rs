//! Test support shared by the wire module's property tests.

use proptest::prelude::*;
use serde_json::{Map, Value};

/// One small corruption of a JSON text: a byte replaced, inserted or removed, or the text cut short.
pub type Edit = (prop::sample::Index, u8, u8);

/// Up to three corruptions with bytes that matter to JSON (structure, escapes, literals, a control
/// character, DEL and a UTF-8 lead byte).
pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(
        (any::<prop::sample::Index>(), 0u8..3, prop::sample::select(b"\"\\{}[],:0-+.eEu tfn\n\x01\x7f\xc3".to_vec())),
        1..4,
    )
}

/// `bytes` with `edits` applied in order.
pub fn corrupt(mut bytes: Vec<u8>, edits: Vec<Edit>) -> Vec<u8> {
    for (at, kind, byte) in edits {
        let i = at.index(bytes.len().max(1));
        match kind {
            0 if i < bytes.len() => bytes[i] = byte,
            1 => bytes.insert(i.min(bytes.len()), byte),
            _ if i < bytes.len() => {
                bytes.remove(i);
            }
            _ => bytes.truncate(i),
        }
    }
    bytes
}

/// Any JSON value, nested up to `depth` levels (at most `width` elements or members a level), with
/// strings from `text` and object keys from the regex `keys`.
pub fn json_value(
    depth: u32,
    width: usize,
    keys: &'static str,
    text: impl Strategy<Value = String> + 'static,
) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        text.prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 8 * width as u32, width as u32, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..width).prop_map(Value::Array),
            prop::collection::vec((keys, inner), 0..width)
                .prop_map(|entries| Value::Object(entries.into_iter().collect::<Map<_, _>>())),
        ]
    })
}
