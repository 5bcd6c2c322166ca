"""Failure classification as gateways really answer, and the one redaction of the gateway key."""

from __future__ import annotations

import orjson
import pytest

from chatserver.upstream import failures
from chatserver.upstream.failures import (
    DEFAULT_RETRY_AFTER,
    MESSAGE_LIMIT,
    REDACTED,
    StreamRedactor,
    classify_http,
    classify_stream_error,
    keep_secret,
    parse_duration,
    redact_json,
    redact_value,
    retry_after_seconds,
)
from gateway_sim.simulator import GatewaySimulator, Script, errors, steps
from support import names

KEY = "sk-or-v1-0123456789abcdef0123456789abcdef"


@pytest.fixture
def secret(monkeypatch):
    """The gateway key kept for this test only (the registry is process-wide)."""
    monkeypatch.setattr(failures, "_SECRETS", [])
    monkeypatch.setattr(failures, "_ENCODED", [])
    keep_secret(KEY)
    return KEY


@pytest.fixture
async def chat_conv(api):
    created = await api.new()
    await api.patch(created["id"], settings={"web_search": False, "web_fetch": False})
    return created


# --- Unknown models -------------------------------------------------------------------------

@pytest.mark.parametrize("script", [
    lambda: errors.litellm_invalid_model("openai/gpt-5-mini"),
    lambda: errors.openrouter_invalid_model("openai/gpt-5-mini"),
], ids=["litellm", "openrouter"])
async def test_unknown_model_400_from_litellm_or_openrouter_is_model_unavailable(api, sim, chat_conv, script):
    sim.enqueue(script())

    events = await api.send(chat_conv["id"], "hello")

    error = events[-1][1]
    assert names(events)[-1] == "error" and error["kind"] == "model_unavailable" and error["retryable"] is False


async def test_unknown_model_on_litellms_anthropic_route_is_model_unavailable(api, sim):
    conv = await api.new()
    await api.patch(conv["id"], settings={"web_search": True})  # the turn goes to /v1/messages
    sim.enqueue(errors.litellm_invalid_model("openai/gpt-5-mini", anthropic_route=True))

    events = await api.send(conv["id"], "hello")

    assert sim.requests[-1].path == "/v1/messages"
    assert events[-1][1]["kind"] == "model_unavailable"


def test_older_litellm_message_object_is_read_as_text():
    body = {"error": {"message": {"error": "/chat/completions: Invalid model name passed in model=x. Call "
                                           "`/v1/models` to view available models for your key."},
                      "type": "None", "param": "None", "code": "400"}}
    failure = classify_http(400, {}, body)
    assert failure.kind == "model_unavailable" and failure.message.startswith("/chat/completions: Invalid model")


# --- Rate limits always say how long --------------------------------------------------------

@pytest.mark.parametrize("script,expected", [
    (lambda: errors.litellm_rate_limit(retry_after=7), 7),
    (lambda: errors.openai_rate_limit_reset_headers(requests="1s", tokens="6m0s"), 360),
    (lambda: errors.rate_limit_without_hint(), DEFAULT_RETRY_AFTER),
], ids=["llm_provider-prefix", "reset-durations", "no-hint"])
async def test_rate_limited_always_carries_a_numeric_retry_after(api, sim, chat_conv, script, expected):
    sim.enqueue(script())

    events = await api.send(chat_conv["id"], "hello")

    error = events[-1][1]
    assert error["kind"] == "rate_limited" and error["retry_after"] == expected


async def test_rate_limit_inside_a_stream_still_says_how_long(api, sim, chat_conv):
    sim.enqueue(Script(steps=[steps.StreamError({"message": "Rate limit reached. Please try again in 6.5s.",
                                                 "code": "rate_limit_exceeded"})]))

    events = await api.send(chat_conv["id"], "hello")

    assert events[-1][1]["kind"] == "rate_limited" and events[-1][1]["retry_after"] == 6.5


@pytest.mark.parametrize("headers,message,expected", [
    ({"llm_provider-retry-after-ms": "1500"}, "", 1.5),
    ({"llm_provider-retry-after": "12"}, "", 12),
    ({"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"}, "", 360),
    ({"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s",
      "x-ratelimit-remaining-requests": "0", "x-ratelimit-remaining-tokens": "900"}, "", 1),
    ({"llm_provider-x-ratelimit-reset-tokens": "20ms"}, "", 0.02),
    ({}, "Rate limit reached. Please try again in 6.5s. Visit the docs.", 6.5),
    ({}, "try again in 1s", 1),
    ({}, "Please try again in 1m30s", 90),
    ({}, "please try again in 20 seconds", 20),
    ({"retry-after": "3"}, "try again in 9s", 3),
    ({}, "slow down", None),
])
def test_retry_after_read_from_every_place_gateways_put_it(headers, message, expected):
    assert retry_after_seconds(headers, message) == expected


@pytest.mark.parametrize("text,seconds", [("1s", 1), ("6m0s", 360), ("20ms", 0.02), ("1h2m3.5s", 3723.5),
                                          ("2.5", 2.5), ("soon", None), ("1s2x", None)])
def test_parse_duration_reads_go_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_every_rate_limited_error_has_a_retry_after_even_from_a_stream():
    assert classify_stream_error({"type": "rate_limit_error", "message": "Slow down"}).retry_after == DEFAULT_RETRY_AFTER
    assert classify_http(429, {}, "").retry_after == DEFAULT_RETRY_AFTER


# --- Malformed requests ---------------------------------------------------------------------

def test_llamacpp_dump_is_marked_malformed_and_cut():
    script = errors.llamacpp_validation_500({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are helpful. " * 40,
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "hi"}]})
    assert len(script.error_body["error"]["message"]) > 2000  # a real dump, as the issue saw 4 KB

    failure = classify_http(500, {}, script.error_body)

    assert failure.malformed_request and not failure.retryable and failure.kind == "upstream"
    assert len(failure.message) <= MESSAGE_LIMIT


@pytest.mark.parametrize("status,body", [
    (422, {"detail": [{"loc": ["body", "messages", 0, "content"], "msg": "Input should be a valid string",
                       "type": "string_type"}]}),
    (400, {"error": {"message": "1 validation error for ChatCompletionRequest\nmessages.0.content\n  Input should "
                                "be a valid string", "type": "BadRequestError", "code": 400}}),
])
def test_validation_rejections_are_malformed(status, body):
    assert classify_http(status, {}, body).malformed_request


@pytest.mark.parametrize("status,body", [
    (500, {"error": {"message": "Internal server error", "type": "api_error"}}),
    (502, {"error": {"code": 502, "message": "Provider returned error"}}),
    (400, errors.openai_context_overflow().error_body),
])
def test_other_failures_are_not_marked_malformed(status, body):
    failure = classify_http(status, {}, body)
    assert not failure.malformed_request and failure.retryable


def test_simulator_accepts_string_system_content_in_llamacpp_mode():
    import httpx

    with GatewaySimulator(string_system_only=True) as local:
        body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}]}
        ok = httpx.post(local.base_url + "/v1/chat/completions", json=body, timeout=5)
        body["messages"][0]["content"] = [{"type": "text", "text": "be brief"}]
        rejected = httpx.post(local.base_url + "/v1/chat/completions", json=body, timeout=5)
    assert ok.status_code == 200
    assert rejected.status_code == 500 and rejected.json()["error"]["type"] == "internal_server_error"


# --- Redaction ------------------------------------------------------------------------------

def test_redact_value_reaches_nested_strings_and_keys(secret):
    value = {"type": "fetch", "results": [{"error_code": f"bad key {secret}", "url": "https://x.test"}],
             secret: ("tuple", f"x{secret}y"), "n": 3}

    out = redact_value(value)

    assert secret not in orjson.dumps(out, option=orjson.OPT_PASSTHROUGH_DATACLASS).decode()
    assert out["results"][0]["error_code"] == f"bad key {REDACTED}"
    assert out[REDACTED] == ("tuple", f"x{REDACTED}y") and out["n"] == 3
    assert value["results"][0]["error_code"] == f"bad key {secret}"  # the input is not changed


def test_redact_value_returns_the_same_object_when_nothing_matches(secret):
    value = {"messages": [{"content": "hello " * 100}] * 50}
    assert redact_value(value) is value
    mixed = {"a": {"b": "clean"}, "c": [f"{secret}"]}
    out = redact_value(mixed)
    assert out["a"] is mixed["a"] and out["c"] == [REDACTED]


def test_redact_value_walks_only_values_that_hold_a_secret(monkeypatch):
    """Counted, not timed: the walk is the cost; the fast paths must never take it."""
    walks = []
    real_walk = failures._walk
    monkeypatch.setattr(failures, "_walk", lambda value: walks.append(1) or real_walk(value))
    monkeypatch.setattr(failures, "_SECRETS", [])
    monkeypatch.setattr(failures, "_ENCODED", [])
    conversation = {"messages": [{"role": "user", "content": f"message {i}"} for i in range(2_000)]}

    assert redact_value(conversation) is conversation and walks == []  # no secret kept: one truth test
    keep_secret(KEY)
    assert redact_value(conversation) is conversation and walks == []  # kept but absent: one scan
    conversation["messages"][1_500]["content"] = f"echo {KEY}"
    out = redact_value(conversation)
    assert walks and out["messages"][1_500]["content"] == f"echo {REDACTED}"
    assert out["messages"][0] is conversation["messages"][0]  # unchanged parts are shared, not copied


def test_redact_value_refuses_objects_it_cannot_rewrite(secret):
    import dataclasses

    @dataclasses.dataclass
    class Frame:
        text: str

    with pytest.raises(TypeError):
        redact_value({"frame": Frame(f"key {secret}")})


def test_redact_json_keeps_the_json_valid_even_when_a_match_starts_inside_an_escape(monkeypatch):
    monkeypatch.setattr(failures, "_SECRETS", [])
    monkeypatch.setattr(failures, "_ENCODED", [])
    keep_secret("nabcdefgh")  # "\nabcdefgh" encodes as \\nabcdefgh: the bytes hold "nabcdefgh" after a backslash
    encoded = orjson.dumps({"text": "line\nabcdefgh and nabcdefgh"})

    out = redact_json(encoded)

    assert orjson.loads(out) == {"text": f"line\nabcdefgh and {REDACTED}"}
    clean = orjson.dumps({"text": "nothing here"})
    assert redact_json(clean) is clean


def test_upstream_error_message_never_holds_the_key(secret):
    failure = classify_http(401, {}, {"error": {"message": f"Incorrect API key provided: {secret}"}})
    assert secret not in failure.message and REDACTED in failure.message


def test_stream_redactor_catches_a_key_split_across_deltas(secret):
    redactor = StreamRedactor()
    pieces = ["Your key is ", secret[:5], secret[5:20], secret[20:] + " and", " that is all."]

    sent = [redactor.feed(p) for p in pieces] + [redactor.flush()]

    assert "".join(sent) == f"Your key is {REDACTED} and that is all."
    assert not any(secret[i:i + 8] in s for s in sent for i in range(len(secret) - 7))
    assert sent[0] == "Your key is "  # nothing held back when no secret could be starting


def test_stream_redactor_releases_a_lookalike_prefix_once_it_diverges(secret):
    redactor = StreamRedactor()

    first = redactor.feed("the prefix sk-or is")
    second = redactor.feed(" not a key")

    assert first + second + redactor.flush() == "the prefix sk-or is not a key"
    assert redactor.feed("ends with sk-o") == "ends with "
    assert redactor.flush() == "sk-o"


def test_stream_redactor_output_equals_redacting_the_whole_text_for_any_split(secret):
    import random

    from chatserver.upstream.failures import redact

    rng = random.Random(11)
    text = f"a{secret}b {secret[:9]} {secret}{secret} sk- end {secret[:-1]}"
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        redactor = StreamRedactor()
        sent = [redactor.feed(p) for p in pieces] + [redactor.flush()]
        assert "".join(sent) == redact(text), pieces
        assert not any(secret in s for s in sent)
