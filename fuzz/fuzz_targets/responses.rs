//! Fuzz the Responses adapter (`ResponsesBody::parse` and its writing back): arbitrary bytes must
//! never panic; a body it accepts is a JSON object serde_json accepts with an `input` list or
//! string; its neutral entries are JSON objects or opaque arrays of its own items as sent; writing
//! them back unchanged gives a body that parses to the same neutral messages and the same items; and
//! a compaction by the default engine either writes a body that passes the format's pairing check
//! or is refused (forwarded unchanged).
#![no_main]

mod neutral_entries;

use libfuzzer_sys::fuzz_target;
use pare::tokens::QuarterCounter;
use pare::compact::{CompactOptions, Engine};
use pare::neutral::View;
use pare::wire::{Forward, WireBody, WrittenReads};
use pare::wire::responses::ResponsesBody;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(body) = ResponsesBody::parse(data) else { return };
    let top: serde_json::Map<String, Value> = serde_json::from_slice(data).expect("an accepted body is a JSON object");
    assert!(matches!(top.get("input"), Some(Value::Array(_) | Value::String(_))), "accepted without an input");
    let messages = body.messages();
    neutral_entries::assert_messages_or_parts_as_sent(data, &messages);
    if let Ok((bytes, _)) = body.write(&Forward::unchanged(messages.len())) {
        let again = ResponsesBody::parse(&bytes).expect("what the adapter writes, it reads");
        assert_eq!(again.messages(), messages, "round trip changed the neutral view");
        assert_eq!(again.items(), body.items(), "round trip changed the items");
    }
    let engine = Engine::default_pack();
    let options =
        CompactOptions { target_tokens: Some(200), single_thread: true, epoch_boundary: body.epoch_boundary(), ..Default::default() };
    neutral_entries::assert_typed_as_read(&body, &messages);
    let typed = |i: usize| body.typed(i);
    let out = engine.compact(&View { messages: &messages, tools: body.tools(), typed: Some(&typed) }, &options, &QuarterCounter);
    let reads = WrittenReads::of(out.typed);
    let forwarded = Forward::of_plan(&out.plan, out.prefix.iter().map(String::as_str), &reads, messages.len());
    if let Ok((bytes, _)) = body.write(&forwarded) {
        let written = ResponsesBody::parse(&bytes).expect("a written body parses");
        assert!(written.check().is_ok(), "a written body breaks the pairing rules: {:?}", written.check());
    }
});
