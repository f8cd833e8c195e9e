//! Fuzz the Gemini adapter (`GeminiBody::parse` and its writing back): arbitrary bytes must never
//! panic; a body it accepts is a JSON object serde_json accepts with a `contents` list; its neutral
//! entries are JSON objects or opaque arrays of its own turns as sent; writing them back unchanged gives the input bytes; and a compaction
//! by the default engine either writes a body that passes the API's rules (every call answered in
//! the next turn, no response without its call) whose thought and signed parts are the input's, or
//! is refused (forwarded unchanged).
#![no_main]

mod neutral_entries;

use libfuzzer_sys::fuzz_target;
use pare::tokens::QuarterCounter;
use pare::compact::{CompactOptions, Engine};
use pare::neutral::View;
use pare::wire::{Forward, WireBody, WrittenReads};
use pare::wire::gemini::GeminiBody;
use serde_json::Value;

/// The parts of `body`'s turns that carry a thought or a signature.
fn opaque_parts(body: &Value) -> Vec<Value> {
    let turns = body.get("contents").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    turns
        .iter()
        .filter_map(|t| t.get("parts").and_then(Value::as_array))
        .flatten()
        .filter(|p| p.get("thought").is_some() || p.get("thoughtSignature").is_some())
        .cloned()
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(body) = GeminiBody::parse(data) else { return };
    let top: Value = serde_json::from_slice(data).expect("an accepted body is JSON");
    assert!(top.get("contents").is_some_and(Value::is_array), "accepted without a contents list");
    let messages = body.messages();
    neutral_entries::assert_messages_or_parts_as_sent(data, &messages);
    let (bytes, _) = body.write(&Forward::unchanged(messages.len())).expect("the neutral view written back unchanged");
    assert_eq!(bytes, data, "no rewrite must give the input bytes");
    let engine = Engine::default_pack();
    let options =
        CompactOptions { target_tokens: Some(200), single_thread: true, epoch_boundary: body.epoch_boundary(), ..Default::default() };
    neutral_entries::assert_typed_as_read(&body, &messages);
    let typed = |i: usize| body.typed(i);
    let out = engine.compact(&View { messages: &messages, tools: body.tools(), typed: Some(&typed) }, &options, &QuarterCounter);
    let reads = WrittenReads::of(out.typed);
    let forwarded = Forward::of_plan(&out.plan, out.prefix.iter().map(String::as_str), &reads, messages.len());
    if let Ok((bytes, _)) = body.write(&forwarded)
        && bytes != data
    {
        let written = GeminiBody::parse(&bytes).expect("a written body parses");
        assert!(written.check().is_ok(), "a written body breaks the API's rules: {:?}", written.check());
        let written: Value = serde_json::from_slice(&bytes).expect("a written body is JSON");
        let input = opaque_parts(&top);
        for part in opaque_parts(&written) {
            assert!(input.contains(&part), "a thought or signed part was changed: {part}");
        }
    }
});
