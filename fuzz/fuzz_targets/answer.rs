//! Fuzz what pare reads of an upstream's answer, in every format, as the proxy reads it: the event
//! stream fed in the chunks the input says (the events must be those of the whole body), the test
//! for the event that ends a stream, the answer assembled from the body (as a stream or not), the
//! neutral messages it stands for and their session keys, and its usage figures. Nothing an
//! upstream sends may panic, and assembling the same body twice gives the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pare::archive::response::{answer_messages, assemble_answer, final_event_of};
use pare::archive::sse::{Parser, each_event};
use pare::exchange::Usage;
use pare::wire::Wire;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the format and whether the answer was asked for as a stream; the second
    // how many bytes each chunk of the stream holds.
    let [head, step, body @ ..] = data else { return };
    let wire = Wire::ALL[usize::from(*head) % Wire::ALL.len()];
    let stream = head & 0x10 != 0;
    let step = usize::from(*step).max(1);

    let mut whole = Vec::new();
    each_event(body, |e| whole.push(e.clone()));
    let mut chunked = Vec::new();
    let mut parser = Parser::new();
    for chunk in body.chunks(step) {
        parser.feed(chunk, &mut |e| chunked.push(e.clone()));
    }
    parser.finish(&mut |e| chunked.push(e.clone()));
    assert_eq!(chunked, whole, "the events differ when the stream comes {step} bytes at a time");
    let is_final = final_event_of(wire);
    for event in &whole {
        is_final(event);
        event.type_name();
    }

    let Some(answer) = assemble_answer(wire, body, stream) else { return };
    assert_eq!(assemble_answer(wire, body, stream).as_ref(), Some(&answer), "assembled twice, two answers");
    for message in answer_messages(wire, &answer).into_iter().flatten() {
        pare::session::message_key_value(&message);
    }
    let usage = Usage::of_answer(wire, &answer);
    Usage::line(usage.as_ref());
    if let Some(usage) = usage {
        usage.hit_rate();
        usage.uncached();
    }
});
