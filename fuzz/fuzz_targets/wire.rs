//! Fuzz `ChatBody::parse` (its fast scan, and serde_json behind it) against serde_json alone: arbitrary
//! bytes must be accepted exactly when serde_json reads them as an object whose `messages` (the last
//! one, as a map keeps it) is an array, and then every message and every other top-level value must be
//! the very bytes serde_json finds for it. Each message is then read with `Message::from_raw` (pare's
//! typed read, serde_json's derive behind it) and must equal the derive's reading.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use pare::neutral::Message;
use pare::wire::ChatBody;
use serde_json::value::RawValue;

fuzz_target!(|data: &[u8]| {
    let by_serde = serde_json::from_slice::<HashMap<String, &RawValue>>(data).ok().and_then(|top| {
        let messages = top.get("messages")?;
        let elements = if messages.get().starts_with('[') {
            serde_json::from_str::<Vec<&RawValue>>(messages.get()).expect("a valid array splits")
        } else {
            return None;
        };
        Some((top, elements))
    });
    match (ChatBody::parse(data), by_serde) {
        (Ok(body), Some((top, elements))) => {
            let ours: Vec<&str> = body.messages().to_vec();
            let theirs: Vec<&str> = elements.iter().map(|m| m.get()).collect();
            assert_eq!(ours, theirs, "messages differ");
            assert_eq!(body.split.array_raw, top["messages"].get(), "messages array differs");
            assert_eq!(body.split.fields.len() + 1, top.len(), "top-level keys differ");
            for (key, value) in &body.split.fields {
                assert_eq!(Some(value.get()), top.get(key).map(|v| v.get()), "value of {key:?} differs");
            }
            for raw in body.messages() {
                let (ours, members) = Message::read(raw);
                assert_eq!(ours.ok(), serde_json::from_str::<Message>(raw).ok(), "message read differs: {raw}");
                if let Some(members) = members {
                    let map = serde_json::from_str::<indexmap::IndexMap<String, &RawValue>>(raw).expect("an object");
                    let theirs: Vec<(&str, &str)> = map.iter().map(|(k, v)| (k.as_str(), v.get())).collect();
                    assert_eq!(members, theirs, "members differ: {raw}");
                }
            }
        }
        (Err(_), None) => {}
        (Ok(_), None) => panic!("accepted a body serde_json refuses or that has no messages array"),
        (Err(err), Some(_)) => panic!("refused a body serde_json reads: {err}"),
    }
});
