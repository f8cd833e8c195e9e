//! Retry pruning: a failed call that was later retried (same tool, same key argument) with success
//! keeps only a marker with its first error line: the failure is history, the retry is what counts.

use std::collections::HashMap;

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    // For each (tool, key argument), the index of the last call whose result succeeded. A result
    // that is already a pare marker (an earlier compaction) does not count (`Outcome::succeeded`):
    // counting it would prune on the second pass what the first kept.
    let mut last_success: HashMap<(&str, &str), usize> = HashMap::new();
    for (c, call) in conv.calls.iter().enumerate() {
        let ok = call.result.and_then(|r| conv.outcomes[r].as_ref()).is_some_and(|o| o.succeeded());
        if ok {
            last_success.insert((call.name.as_str(), retry_key(call)), c);
        }
    }
    for (c, call) in conv.calls.iter().enumerate() {
        let Some(idx) = call.result else { continue };
        if idx >= conv.boundary || !edits.open(idx) {
            continue;
        }
        let failed = conv.outcomes[idx].as_ref().is_some_and(|o| !o.status.is_ok());
        let retried = last_success.get(&(call.name.as_str(), retry_key(call))).is_some_and(|&later| later > c);
        if failed && retried {
            let marker = conv.render_marker(idx, &policy.spec.retry_pruning.template);
            edits.set_marker_if_saving(conv, idx, RuleId::RetryPruning, marker);
        }
    }
}

/// What makes two calls "the same attempt": the key argument, or the whole arguments.
fn retry_key(call: &super::super::conversation::Call) -> &str {
    call.key_arg.as_deref().unwrap_or(call.arguments.as_str())
}

#[cfg(test)]
mod tests {
    use crate::compact::report::{Report, RuleId};
    use crate::compact::{CompactOptions, Engine};
    use crate::tokens::QuarterCounter;
    use crate::wire::ChatBody;

    fn compact_once(engine: &Engine, body: &[u8]) -> (Vec<u8>, Report) {
        let parsed = ChatBody::parse(body).unwrap();
        let out = engine.compact(&parsed.view(), &CompactOptions::default(), &QuarterCounter);
        let mut messages = out.prefix;
        messages.extend(parsed.messages()[out.boundary..].iter().map(|m| (*m).to_owned()));
        (parsed.to_vec_with_messages(&messages), out.report)
    }

    /// Regression (found by the idempotence property test): a failed retry folded into a
    /// duplicate marker read as a success on the next pass, so compacting the output again pruned
    /// the first failed call that the first pass had kept.
    #[test]
    fn a_marker_result_is_not_a_successful_retry() {
        // Two failed `pytest -x` runs; the second's output is the same as a later read's.
        let body = r#"{"model":"m","messages":[{"role":"system","content":"You are an agent.","x_sys":1},{"role":"user","content":"fix src/lib.rs"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","x_tc":1,"function":{"name":"browser_snapshot","arguments":"{\"command\":\"pytest -x\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"<returncode>1</returncode>\n<output>\no 0 \no 1 x\no 2 xx\no 3 xxx\n</output>","x_t":{"n":1}},{"role":"assistant","content":null,"tool_calls":[{"id":"call_2","type":"function","x_tc":2,"function":{"name":"browser_snapshot","arguments":"{\"command\":\"pytest -x\"}"}}]},{"role":"tool","tool_call_id":"call_2","content":"Traceback (most recent call last):\n  File 0 \n  File 1 x\n  File 2 xx\n  File 3 xxx\n  File 4 xxxx\n  File 5 xxxxx\n  File 6 xxxxxx\n  File 7 xxxxxxx\n  File 8 xxxxxxxx\n  File 9 xxxxxxxxx\n  File 10 xxxxxxxxxx\n  File 11 xxxxxxxxxxx\nValueError: bad","x_t":{"n":2}},{"role":"assistant","content":null,"tool_calls":[{"id":"call_3","type":"function","x_tc":3,"function":{"name":"read_file","arguments":"{\"path\":\"src/a.py\"}"}}]},{"role":"tool","tool_call_id":"call_3","content":"Traceback (most recent call last):\n  File 0 \n  File 1 x\n  File 2 xx\n  File 3 xxx\n  File 4 xxxx\n  File 5 xxxxx\n  File 6 xxxxxx\n  File 7 xxxxxxx\n  File 8 xxxxxxxx\n  File 9 xxxxxxxxx\n  File 10 xxxxxxxxxx\n  File 11 xxxxxxxxxxx\nValueError: bad","x_t":{"n":3}},{"role":"assistant","content":"done"}],"temperature":0.2}"#;
        let mut engine = Engine::default_pack();
        engine.policy.spec.protect_last_turns = 0;
        let (first, report) = compact_once(&engine, body.as_bytes());
        assert!(report.rules.contains_key(&RuleId::Duplicates), "{report:?}");
        assert!(!report.rules.contains_key(&RuleId::RetryPruning), "{report:?}");
        let (second, report) = compact_once(&engine, &first);
        assert_eq!(String::from_utf8(second).unwrap(), String::from_utf8(first).unwrap(), "{report:?}");
    }
}
