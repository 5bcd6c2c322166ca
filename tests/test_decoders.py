"""The pure parts of the upstream client: the SSE decoder and the two wire-format decoders, fed
records directly (no HTTP), and a badly shaped chunk through the real app."""

from __future__ import annotations

import logging

import pytest

from chatserver.turns.events import ReasoningDelta, TextDelta, UsageReport
from chatserver.upstream.chat import ChatDecoder
from chatserver.upstream.failures import UpstreamError
from chatserver.upstream.messages import MessagesDecoder
from chatserver.upstream.sse import SSEDecoder, SSERecord
from gateway_sim.simulator import Script, steps
from support import names


def test_a_last_record_without_its_blank_line_is_dropped_at_end_of_stream():
    decoder = SSEDecoder()
    records = decoder.feed(b"event: a\ndata: 1\n\nevent: b\ndata: 2\n")

    assert records == [SSERecord("a", "1")]
    assert decoder.feed(b"") == [], "an unterminated record is never dispatched"


@pytest.mark.parametrize("size", [1, 2, 5])
def test_records_and_characters_split_anywhere_come_out_whole(size):
    body = "event: delta\r\ndata: {\"text\": \"한국어 ✓\"}\r\n\r\n: comment\n\ndata: [DONE]\n\n".encode()
    decoder = SSEDecoder()
    records = [r for i in range(0, len(body), size) for r in decoder.feed(body[i:i + size])]

    assert records == [SSERecord("delta", '{"text": "한국어 ✓"}'), SSERecord("message", "[DONE]")]


def chat_events(*chunks: str) -> list:
    decoder = ChatDecoder()
    events = [e for chunk in chunks for e in decoder.feed(SSERecord("message", chunk))]
    return events + decoder.end()


@pytest.mark.parametrize("chunk, named", [
    ('{"choices": "nope"}', "choices is str, not a list"),
    ('{"choices": [{"delta": ["a"]}]}', "delta is list, not an object"),
    ('{"choices": [], "usage": "lots"}', "usage is str, not an object"),
    ('{"choices": [{"delta": {"content": 5}}]}', "delta.content is int, not a string"),
    ('{"choices": [7]}', "a choice is not an object"),
])
def test_chat_chunks_of_the_wrong_shape_end_the_turn_naming_what_was_wrong(chunk, named):
    with pytest.raises(UpstreamError) as caught:
        chat_events(chunk)

    assert caught.value.kind == "upstream" and named in caught.value.message


def test_chat_decoder_reads_both_reasoning_names_usage_and_the_finish():
    events = chat_events('{"choices": [{"delta": {"reasoning": "hm"}}]}',
                         '{"choices": [{"delta": {"reasoning_content": "hm2", "content": "Hi"}}]}',
                         '{"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": null}',
                         '{"choices": [], "usage": {"prompt_tokens": 3}}', "[DONE]")

    assert [type(e).__name__ for e in events] == ["ReasoningDelta", "ReasoningDelta", "TextDelta",
                                                  "UsageReport", "Finished"]
    assert events[1] == ReasoningDelta("hm2") and events[2] == TextDelta("Hi") and events[3] == UsageReport(
        {"prompt_tokens": 3})


def test_chat_stream_without_a_finish_is_unfinished():
    with pytest.raises(UpstreamError, match="ended before the reply was finished"):
        chat_events('{"choices": [{"delta": {"content": "Hi"}}]}')


@pytest.mark.parametrize("data, named", [
    ('{"type": "content_block_start", "index": 0, "content_block": "nope"}', "content_block is str, not dict"),
    ('{"type": "content_block_delta", "index": 0, "delta": ["x"]}', "delta is list, not dict"),
    ('{"type": "content_block_delta", "index": "0", "delta": {}}', "index is str, not int"),
    ('{"type": "message_start", "message": {"usage": 5}}', "message.usage is int, not dict"),
    ('{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}}',
     "text_delta.text is int, not str"),
])
def test_messages_events_of_the_wrong_shape_end_the_turn_naming_what_was_wrong(data, named):
    with pytest.raises(UpstreamError) as caught:
        MessagesDecoder().feed(SSERecord("message", data))

    assert caught.value.kind == "upstream" and named in caught.value.message


async def test_a_chunk_of_the_wrong_shape_reaches_the_page_as_a_named_failure_without_a_traceback(api, sim, caplog):
    conv = await api.new()
    await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
    sim.enqueue(Script(steps=[steps.Text("Partial"), steps.Raw(b'data: {"choices": "nope"}\n\n')]))

    with caplog.at_level(logging.INFO):
        events = await api.send(conv["id"], "hello")

    assert names(events) == ["start", "delta", "error"]
    assert "choices is str, not a list" in events[-1][1]["message"]
    assert not [r for r in caplog.records if r.exc_info], "a handled fault must not log a traceback"
