"""The stub's Responses and Messages answers validate against the official SDKs' own types (strict
pydantic validation, not the SDKs' lenient parsing), so the other tests exercise real wire shapes."""

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

import stub_messages
import stub_responses

RESPONSES_BODIES = [
    {"model": "stub-model", "input": "hi"},
    {"model": "stub-model", "input": "hi", "tools": [stub_responses.SHELL_TOOL]},
]
MESSAGES_BODIES = [
    {"model": "claude-stub-4", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "claude-stub-4", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}],
        "tools": [stub_messages.SHELL_TOOL], "thinking": {"type": "enabled", "budget_tokens": 1024},
    },
]


@pytest.mark.parametrize("body", RESPONSES_BODIES)
def test_responses_shapes(body):
    Response.model_validate(stub_responses.respond(body))
    events = pydantic.TypeAdapter(ResponseStreamEvent)
    for kind, event in stub_responses.stream_events(body):
        assert events.validate_python(event).type == kind


@pytest.mark.parametrize("body", MESSAGES_BODIES)
def test_messages_shapes(body):
    Message.model_validate(stub_messages.respond(body))
    events = pydantic.TypeAdapter(RawMessageStreamEvent)
    streamed = list(stub_messages.stream_events(body))
    assert [kind for kind, _ in streamed].count("ping") == 1
    for kind, event in streamed:
        if kind != "ping":  # the API sends pings; the SDK's event union leaves them out
            assert events.validate_python(event).type == kind
