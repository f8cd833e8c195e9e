//! The provider's own token figures for one answer: the `usage` object each answer dialect carries,
//! read into one [`Usage`] (prompt, cached, cache writes, output). A figure the upstream did not
//! report is `None`, never 0: "not reported" and "nothing cached" are different answers. A figure of
//! [`MAX_FIGURE`] tokens or more is no real answer's and reads as not reported.
//!
//! | wire | prompt | cached | cache writes | output |
//! |---|---|---|---|---|
//! | chat | `prompt_tokens` | `prompt_tokens_details.cached_tokens` (DeepSeek: `prompt_cache_hit_tokens`) | `prompt_tokens_details.cache_write_tokens` (OpenRouter) | `completion_tokens` |
//! | responses | `input_tokens` | `input_tokens_details.cached_tokens` | — | `output_tokens` |
//! | messages | `input_tokens + cache_read_input_tokens + cache_creation_input_tokens` | `cache_read_input_tokens` | `cache_creation_input_tokens` | `output_tokens` |
//! | gemini | `promptTokenCount` | `cachedContentTokenCount` | — | `candidatesTokenCount + thoughtsTokenCount` |
//!
//! Anthropic's `input_tokens` counts only the uncached input after the last cache breakpoint, so the
//! prompt is the sum of the three. A stream's usage is read from the answer its events assembled
//! (`message_start` carries the input figures, `message_delta` the output, merged by
//! [`super::messages_sse`]; a chat stream's last chunk, a Responses stream's final event).

use serde_json::Value;

use crate::exchange::Usage;
use crate::wire::Wire;

impl Usage {
    /// The figures of a `usage` object in `wire`'s dialect; `None` when it reports none of them
    /// (no object, `null`, or fields pare does not know).
    pub fn read(wire: Wire, usage: &Value) -> Option<Usage> {
        if !usage.is_object() {
            return None;
        }
        let read = match wire {
            Wire::Chat => Usage {
                prompt: count(usage, &["prompt_tokens"]),
                cached: count(usage, &["prompt_tokens_details", "cached_tokens"])
                    .or_else(|| count(usage, &["prompt_cache_hit_tokens"])),
                cache_write: count(usage, &["prompt_tokens_details", "cache_write_tokens"]),
                output: count(usage, &["completion_tokens"]),
            },
            Wire::Responses => Usage {
                prompt: count(usage, &["input_tokens"]),
                cached: count(usage, &["input_tokens_details", "cached_tokens"]),
                cache_write: None,
                output: count(usage, &["output_tokens"]),
            },
            Wire::Messages => {
                let input = count(usage, &["input_tokens"]);
                let cached = count(usage, &["cache_read_input_tokens"]);
                let cache_write = count(usage, &["cache_creation_input_tokens"]);
                Usage {
                    prompt: input.map(|input| input + cached.unwrap_or(0) + cache_write.unwrap_or(0)),
                    cached,
                    cache_write,
                    output: count(usage, &["output_tokens"]),
                }
            }
            // The other dialects count reasoning in the output; Gemini reports thoughts apart.
            Wire::Gemini => {
                let candidates = count(usage, &["candidatesTokenCount"]);
                let thoughts = count(usage, &["thoughtsTokenCount"]);
                Usage {
                    prompt: count(usage, &["promptTokenCount"]),
                    cached: count(usage, &["cachedContentTokenCount"]),
                    cache_write: None,
                    output: match (candidates, thoughts) {
                        (None, None) => None,
                        (c, t) => Some(c.unwrap_or(0) + t.unwrap_or(0)),
                    },
                }
            }
        };
        read.is_reported().then_some(read)
    }

    /// The usage of an answer assembled for the archive (its `usage` key, which every dialect's
    /// assembly sets).
    pub fn of_answer(wire: Wire, assembled: &Value) -> Option<Usage> {
        Usage::read(wire, assembled.get("usage")?)
    }

    /// One answer's usage for people: "prompt 3,000 · cached 2,048 (68.3 %) · cache write 100 ·
    /// output 9", each figure the upstream left out said so.
    pub fn line(usage: Option<&Usage>) -> String {
        let Some(usage) = usage else { return "not reported".to_owned() };
        let figure = |x: Option<u64>| {
            x.map_or_else(|| "not reported".to_owned(), |x| crate::compact::markers::group_signed(x as i64))
        };
        let rate = usage.hit_rate().map(|r| format!(" ({:.1} %)", 100.0 * r)).unwrap_or_default();
        format!(
            "prompt {} · cached {}{rate} · cache write {} · output {}",
            figure(usage.prompt),
            figure(usage.cached),
            figure(usage.cache_write),
            figure(usage.output)
        )
    }

    /// Whether any figure was reported.
    pub fn is_reported(&self) -> bool {
        self.prompt.is_some() || self.cached.is_some() || self.cache_write.is_some() || self.output.is_some()
    }

    /// Share of the prompt read from the cache, when both were reported (and the prompt is not empty).
    pub fn hit_rate(&self) -> Option<f64> {
        match (self.prompt, self.cached) {
            (Some(prompt), Some(cached)) if prompt > 0 => Some(cached as f64 / prompt as f64),
            _ => None,
        }
    }

    /// Prompt tokens the upstream computed afresh (prompt − cached), when both were reported.
    pub fn uncached(&self) -> Option<u64> {
        Some(self.prompt?.saturating_sub(self.cached?))
    }
}

/// Tokens no figure of a real answer reaches (about a trillion). A figure this large reads as not
/// reported: the archive sums a session's figures in 64-bit integers, which a few absurd ones from
/// an upstream would overflow.
pub const MAX_FIGURE: u64 = 1 << 40;

/// The non-negative integer at `path` in `value`; `None` when absent, `null`, not a count, or
/// [`MAX_FIGURE`] or more.
fn count(value: &Value, path: &[&str]) -> Option<u64> {
    path.iter().try_fold(value, |v, key| v.get(key))?.as_u64().filter(|&n| n < MAX_FIGURE)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::archive::{gemini_sse, messages_sse, response, responses_sse};

    fn usage(prompt: u64, cached: Option<u64>, cache_write: Option<u64>, output: u64) -> Usage {
        Usage { prompt: Some(prompt), cached, cache_write, output: Some(output) }
    }

    /// A chat answer as OpenAI sends it (`openai.types.CompletionUsage`), JSON and streamed: the
    /// stream's usage rides on a last chunk with no choices (`stream_options.include_usage`).
    #[test]
    fn chat_usage_from_a_json_answer_and_from_a_stream() {
        let body = json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4.1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}});
        let answer = response::assemble(body.to_string().as_bytes(), false).unwrap();
        assert_eq!(Usage::of_answer(Wire::Chat, &answer), Some(usage(2006, Some(1920), None, 300)));

        let stream = concat!(
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4.1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}],\"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4.1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4.1\",\"choices\":[],\"usage\":{\"prompt_tokens\":2006,\"completion_tokens\":3,\"total_tokens\":2009,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0}}}\n\n",
            "data: [DONE]\n\n",
        );
        let answer = response::assemble(stream.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Chat, &answer), Some(usage(2006, Some(0), None, 3)));
    }

    /// A server that reports no cache figure (llama.cpp, vLLM, the e2e stub): cached is not
    /// reported, which is not zero.
    #[test]
    fn a_chat_usage_without_cache_details_reports_no_cached_figure() {
        let read = Usage::read(Wire::Chat, &json!({"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}));
        assert_eq!(read, Some(usage(11, None, None, 4)));
        assert_eq!(read.unwrap().hit_rate(), None);
        assert_eq!(read.unwrap().uncached(), None);
    }

    /// OpenRouter's cache writes and DeepSeek's cache hits, in the chat dialect.
    #[test]
    fn chat_usage_of_openrouter_and_deepseek() {
        let openrouter = json!({"prompt_tokens": 194, "completion_tokens": 2, "total_tokens": 196, "cost": 0.95,
            "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 100, "audio_tokens": 0}});
        assert_eq!(Usage::read(Wire::Chat, &openrouter), Some(usage(194, Some(0), Some(100), 2)));
        let deepseek = json!({"prompt_tokens": 1000, "completion_tokens": 20, "total_tokens": 1020,
            "prompt_cache_hit_tokens": 896, "prompt_cache_miss_tokens": 104});
        assert_eq!(Usage::read(Wire::Chat, &deepseek), Some(usage(1000, Some(896), None, 20)));
    }

    /// A Responses answer (`openai.types.responses.ResponseUsage`): the JSON response object, and a
    /// stream whose `response.completed` carries it (`response.created` has `usage: null`).
    #[test]
    fn responses_usage_from_a_json_answer_and_from_a_stream() {
        let response = json!({"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-5",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
            "usage": {"input_tokens": 5120, "input_tokens_details": {"cached_tokens": 4864},
                "output_tokens": 42, "output_tokens_details": {"reasoning_tokens": 30}, "total_tokens": 5162}});
        let answer = responses_sse::assemble(response.to_string().as_bytes(), false).unwrap();
        let expected = usage(5120, Some(4864), None, 42);
        assert_eq!(Usage::of_answer(Wire::Responses, &answer), Some(expected));

        let created = json!({"type": "response.created", "sequence_number": 0,
            "response": {"id": "resp_1", "object": "response", "status": "in_progress", "model": "gpt-5", "output": [], "usage": null}});
        let completed = json!({"type": "response.completed", "sequence_number": 5, "response": response});
        let stream =
            format!("event: response.created\ndata: {created}\n\nevent: response.completed\ndata: {completed}\n\n");
        let answer = responses_sse::assemble(stream.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Responses, &answer), Some(expected));
        let cut = format!("event: response.created\ndata: {created}\n\n");
        let answer = responses_sse::assemble(cut.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Responses, &answer), None, "a stream cut before its usage reports none");
    }

    /// A Messages answer (`anthropic.types.Usage`): the prompt is input + cache reads + cache
    /// writes, JSON and streamed (`message_start` gives the input figures, `message_delta` the
    /// cumulative output).
    #[test]
    fn messages_usage_from_a_json_answer_and_from_a_stream() {
        let message = json!({"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 472, "cache_creation_input_tokens": 1200, "cache_read_input_tokens": 2048,
                "cache_creation": {"ephemeral_5m_input_tokens": 1200, "ephemeral_1h_input_tokens": 0},
                "output_tokens": 89, "service_tier": "standard"}});
        let answer = messages_sse::assemble(message.to_string().as_bytes(), false).unwrap();
        let expected = usage(472 + 1200 + 2048, Some(2048), Some(1200), 89);
        assert_eq!(Usage::of_answer(Wire::Messages, &answer), Some(expected));

        let mut started = message.clone();
        started["content"] = json!([]);
        started["stop_reason"] = Value::Null;
        started["usage"]["output_tokens"] = json!(1);
        let events = [
            ("message_start", json!({"type": "message_start", "message": started})),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
            ),
            ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            (
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                    "usage": {"output_tokens": 89}}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ];
        let stream: String = events.iter().map(|(name, data)| format!("event: {name}\ndata: {data}\n\n")).collect();
        let answer = messages_sse::assemble(stream.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Messages, &answer), Some(expected));
    }

    /// A `message_delta` may carry cumulative input figures too (`MessageDeltaUsage`); they win over
    /// `message_start`'s.
    #[test]
    fn messages_stream_delta_input_figures_are_cumulative() {
        let start = json!({"type": "message_start", "message": {"id": "msg_02", "type": "message", "role": "assistant",
            "model": "claude-haiku-4-5", "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 1}}});
        let delta = json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3000, "output_tokens": 7}});
        let stream = format!(
            "event: message_start\ndata: {start}\n\nevent: message_delta\ndata: {delta}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
        );
        let answer = messages_sse::assemble(stream.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Messages, &answer), Some(usage(3010, Some(3000), Some(0), 7)));
    }

    /// A Gemini stream (`google.genai.types.GenerateContentResponseUsageMetadata`): the last chunk's
    /// `usageMetadata` is cumulative; thoughts are billed as output beside the candidates.
    #[test]
    fn gemini_usage_from_a_stream_and_without_thoughts() {
        let chunks = [
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}],
                "usageMetadata": {"promptTokenCount": 4100}, "modelVersion": "gemini-2.5-pro"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]}, "finishReason": "STOP", "index": 0}],
                "usageMetadata": {"promptTokenCount": 4100, "cachedContentTokenCount": 4000, "candidatesTokenCount": 2,
                    "thoughtsTokenCount": 30, "totalTokenCount": 4132}, "modelVersion": "gemini-2.5-pro"}),
        ];
        let stream: String = chunks.iter().map(|c| format!("data: {c}\r\n\r\n")).collect();
        let answer = gemini_sse::assemble(stream.as_bytes(), true).unwrap();
        assert_eq!(Usage::of_answer(Wire::Gemini, &answer), Some(usage(4100, Some(4000), None, 32)));
        let plain = json!({"promptTokenCount": 12, "candidatesTokenCount": 5, "totalTokenCount": 17});
        assert_eq!(Usage::read(Wire::Gemini, &plain), Some(Usage { cached: None, ..usage(12, None, None, 5) }));
    }

    #[test]
    fn nothing_reported_reads_as_none() {
        for wire in Wire::ALL {
            assert_eq!(Usage::read(wire, &Value::Null), None);
            assert_eq!(Usage::read(wire, &json!({})), None);
            assert_eq!(Usage::read(wire, &json!({"total_tokens": "many"})), None);
            assert_eq!(Usage::of_answer(wire, &json!({"message": null})), None);
        }
    }

    #[test]
    fn hit_rate_is_cached_over_prompt() {
        assert_eq!(usage(1000, Some(250), None, 1).hit_rate(), Some(0.25));
        assert_eq!(usage(1000, Some(250), None, 1).uncached(), Some(750));
        assert_eq!(usage(0, Some(0), None, 1).hit_rate(), None);
    }
}
