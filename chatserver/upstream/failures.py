"""Upstream failures, sorted into the six kinds the page knows how to recover from.

`classify_*` read what a gateway actually sends (HTTP status plus a JSON body in one of several
vendor shapes, an error object inside a stream, a refusal finish reason, or a transport
exception) and return an `UpstreamError`. The body is read before the status: the same status
means different things on different gateways (a 429 can be a quota, a 403 a moderation flag).
A `rate_limited` error always says how long to wait; a request the gateway rejects as malformed
is marked so and is never retryable; every message is cut to what a person can read.
The gateway key is redacted here, in one place: `redact` (text), `redact_value` (JSON-like
values), `redact_json` (encoded JSON) and `StreamRedactor` (text streamed in pieces).
This module knows nothing of conversations or of how a kind is shown.
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import Literal

import httpx2
import orjson

Kind = Literal["auth", "rate_limited", "context_overflow", "refused", "model_unavailable", "upstream", "budget"]

RETRYABLE: dict[str, bool] = {
    "auth": False,
    "budget": False,  # the person's monthly budget is spent (issue 28): not until it resets or is raised
    "rate_limited": True,
    "context_overflow": True,
    "refused": False,
    "model_unavailable": False,
    "upstream": True,
}

_OVERFLOW = re.compile(
    r"maximum context length|context window|contextwindowexceeded|prompt is too long"
    r"|exceed context limit|context_length_exceeded|too many tokens",
    re.I,
)
_MODEL_MISSING = re.compile(
    r"model_not_found|not a valid model|no endpoints found|does not exist|notfounderror"
    r"|no available model|unknown model|model .* not found|invalid model name",
    re.I,
)
_AUTH = re.compile(
    r"authenticationerror|invalid api key|incorrect api key|invalid_api_key|invalid credentials"
    r"|insufficient_quota|exceeded your current quota|budgetexceeded|insufficient credits"
    r"|enforced_spend_limit_reached|permission|unauthori[sz]ed",
    re.I,
)
_REFUSED = re.compile(r"content_filter|contentpolicyviolation|content policy|moderation|flagged", re.I)


# Secrets that must never reach a message, a frame or a file: gateways and proxies echo request
# headers in errors, and a model can be coaxed into repeating its key.
_SECRETS: list[str] = []
_ENCODED: list[bytes] = []  # each secret as it appears inside a JSON string, for the bytes fast path
REDACTED = "[redacted]"
# What a person can read of an upstream message; the rest of a 4 KB validation dump is noise.
MESSAGE_LIMIT = 300


def keep_secret(value: str | None) -> None:
    """Redact `value` (the gateway key) from every message, frame and stored value from now on."""
    if value and len(value.strip()) >= 6 and value.strip() not in _SECRETS:
        _SECRETS.append(value.strip())
        # Longest first, so a secret that contains another is replaced whole.
        _SECRETS.sort(key=len, reverse=True)
        _ENCODED[:] = [orjson.dumps(secret)[1:-1] for secret in _SECRETS]


def redact(text: str) -> str:
    """`text` with every kept secret replaced; the same object when none appears."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redact_value(value: object) -> object:
    """A JSON-like value (dicts, lists, strings, nested) with every kept secret replaced.

    Unchanged values come back as the same object, not a copy. With no secret kept this is one
    truth test; otherwise one orjson encoding and a substring scan decide whether to walk at all.
    """
    if not _SECRETS:
        return value
    if isinstance(value, str):
        return redact(value)
    try:
        encoded = orjson.dumps(value)
    except TypeError:  # not plain JSON (say, int keys): the walk decides
        return _walk(value)
    return _walk(value) if any(secret in encoded for secret in _ENCODED) else value


def redact_json(encoded: bytes) -> bytes:
    """Encoded JSON with every kept secret replaced, still valid JSON; the same bytes when none appears."""
    if not any(secret in encoded for secret in _ENCODED):
        return encoded
    # Decoded and walked, not replaced in the bytes: a match could start inside an escape (`\n`).
    return orjson.dumps(_walk(orjson.loads(encoded)))


def _walk(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        out = {redact(k) if isinstance(k, str) else k: _walk(v) for k, v in value.items()}
        return value if _same_dict(out, value) else out
    if isinstance(value, (list, tuple)):
        items = [_walk(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    # A dataclass or other object could hold the secret where the walk cannot replace it.
    raise TypeError(f"redact_value takes JSON-like values, not {type(value).__name__}; "
                    "encode it and use redact_json")


def _same_dict(new: dict, old: dict) -> bool:
    return all(nk is ok and nv is ov for (nk, nv), (ok, ov) in zip(new.items(), old.items()))


class StreamRedactor:
    """Redacts text that arrives in pieces (reply or reasoning deltas), where a secret may be split.

    `feed` returns what is safe to send now and holds back only the tail that could be the start
    of a kept secret (at most its length - 1 characters, usually nothing); `flush` returns the
    rest when the stream ends. One instance per text stream.
    """

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, piece: str) -> str:
        """The part of everything fed so far that can go out now, redacted."""
        if not _SECRETS and not self._pending:
            return piece
        text = redact(self._pending + piece)
        hold = _held_tail(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """What was held back, at the end of the stream (a prefix of a secret is not the secret)."""
        rest, self._pending = self._pending, ""
        return rest


def _held_tail(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of a kept secret."""
    longest = 0
    for secret in _SECRETS:
        start = max(0, len(text) - len(secret) + 1)
        while (at := text.find(secret[0], start)) != -1:
            if secret.startswith(text[at:]):
                longest = max(longest, len(text) - at)
                break
            start = at + 1
    return longest


def readable(message: str) -> str:
    """An upstream message cut to what a person can read: whitespace collapsed, at most MESSAGE_LIMIT chars."""
    message = " ".join(message.split())
    if len(message) <= MESSAGE_LIMIT:
        return message
    return message[: MESSAGE_LIMIT - 1].rstrip() + "…"


class UpstreamError(Exception):
    """A failure of the upstream call, already classified; its message never holds a kept secret.

    `malformed_request`: the gateway rejected the request's shape (a validation error), so the
    same request can never succeed; the caller may retry once with a simpler layout.
    A `rate_limited` error always carries a `retry_after` (DEFAULT_RETRY_AFTER when none was said).
    """

    def __init__(
        self,
        kind: Kind,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = None,
        malformed_request: bool = False,
    ) -> None:
        message = readable(redact(message))
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message
        if kind == "rate_limited" and retry_after is None:
            retry_after = DEFAULT_RETRY_AFTER
        self.retry_after = retry_after
        self.status = status
        self.malformed_request = malformed_request

    @property
    def retryable(self) -> bool:
        return RETRYABLE[self.kind] and not self.malformed_request

    def __repr__(self) -> str:
        flag = ", malformed_request=True" if self.malformed_request else ""
        return f"UpstreamError({self.kind!r}, {self.message!r}, status={self.status}{flag})"


# Said when a rate limit names no wait at all: long enough not to hammer, short enough to wait out.
DEFAULT_RETRY_AFTER = 5.0
# LiteLLM passes the provider's headers on under this prefix (`llm_provider-retry-after`).
_PROVIDER_PREFIX = "llm_provider-"
# A Go-style duration, as OpenAI's x-ratelimit-reset-* headers and messages give it: "6m0s", "20ms".
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
_TRY_AGAIN = re.compile(
    r"try again in\s+((?:\d+(?:\.\d+)?(?:ms|us|µs|ns|h|m|s))+)\b"
    r"|try again in\s+(\d+(?:\.\d+)?)\s*(milliseconds?|seconds?|secs?|minutes?|mins?)\b",
    re.I,
)
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float | None:
    """Seconds in a Go-style duration ("1s", "6m0s", "1h2m3.5s", "20ms"), or a bare number of seconds."""
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def retry_after_seconds(headers: httpx2.Headers | dict, message: str = "") -> float | None:
    """How long a rate limit asks us to wait, from whichever of the known places says so.

    In order: `retry-after-ms`, `retry-after` (seconds or an HTTP date), each also under LiteLLM's
    `llm_provider-` prefix; then OpenAI's `x-ratelimit-reset-requests` / `-tokens` durations (the
    exhausted ones when `x-ratelimit-remaining-*` says which); then "try again in 1s" in the message.
    """
    lower = {k.lower(): v for k, v in dict(headers).items()}
    for prefix in ("", _PROVIDER_PREFIX):
        if (ms := lower.get(prefix + "retry-after-ms")) is not None:
            try:
                return max(0.0, float(ms) / 1000)
            except ValueError:
                pass
        if (seconds := _retry_after_header(lower.get(prefix + "retry-after"))) is not None:
            return seconds
    resets: dict[str, float] = {}
    exhausted: dict[str, float] = {}
    for prefix in ("", _PROVIDER_PREFIX):
        for limit in ("requests", "tokens"):
            value = lower.get(f"{prefix}x-ratelimit-reset-{limit}")
            if limit in resets or value is None or (seconds := parse_duration(value)) is None:
                continue
            resets[limit] = seconds
            if lower.get(f"{prefix}x-ratelimit-remaining-{limit}", "").strip() == "0":
                exhausted[limit] = seconds
    if resets:
        return max((exhausted or resets).values())
    if match := _TRY_AGAIN.search(message):
        if match[1]:
            return parse_duration(match[1])
        unit = match[3].lower()
        scale = 0.001 if unit.startswith("milli") else 60.0 if unit.startswith("min") else 1.0
        return float(match[2]) * scale
    return None


def _retry_after_header(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, parsed.timestamp() - time.time())


def _error_fields(body: object) -> tuple[str, str, str]:
    """(type, code, message) from any vendor's error body, each "" when absent."""
    if not isinstance(body, dict):
        return "", "", str(body or "")
    err = body.get("error", body)
    if isinstance(err, str):
        return "", "", err
    if not isinstance(err, dict):
        return "", "", ""
    kind = str(err.get("type") or body.get("type") or "")
    code = str(err.get("code") or "")
    message = err.get("message") or ""
    if isinstance(message, dict):  # older LiteLLM: {"message": {"error": "... Invalid model name ..."}}
        message = message.get("error") or message.get("message") or message
    message = str(message)
    metadata = err.get("metadata")
    if isinstance(metadata, dict) and metadata.get("reasons"):
        code = code or "content_filter"
        message = f"{message} (flagged: {', '.join(map(str, metadata['reasons']))})"
    details = err.get("details") or body.get("details")
    if isinstance(details, dict) and details.get("error_code"):
        code = f"{code} {details['error_code']}".strip()
    return kind, code, message


# A gateway's validation error: FastAPI/pydantic dumps (vLLM, llama-cpp-python, LiteLLM), JSON-schema
# complaints. The same request can never pass, so it is not worth a Retry.
_VALIDATION = re.compile(
    r"validation errors? |validation error for|\d+ validation errors?:|'loc': \(|\"loc\": \["
    r"|field required|input should be|extra inputs are not permitted|is not of type"
    r"|unprocessable entity|could not parse the json body",
    re.I,
)


def classify_http(status: int, headers: httpx2.Headers | dict, body: object) -> UpstreamError:
    """An HTTP error status from either endpoint, with its parsed JSON (or raw text) body."""
    kind_field, code, message = _error_fields(body)
    text = f"{kind_field} {code} {message}"
    retry_after = retry_after_seconds(headers, message)
    message = message or f"HTTP {status}"

    def err(kind: Kind) -> UpstreamError:
        return UpstreamError(kind, message, retry_after=retry_after, status=status)

    if _OVERFLOW.search(text) or status == 413 or kind_field == "request_too_large":
        return err("context_overflow")
    if kind_field in ("authentication_error", "permission_error", "billing_error"):
        return err("auth")
    if _REFUSED.search(text) and status in (400, 403):
        return err("refused")
    if status == 429:
        quota = re.search(r"insufficient_quota|exceeded your current quota|enforced_spend_limit", text, re.I)
        return err("auth") if quota else err("rate_limited")
    if kind_field == "rate_limit_error":
        return err("rate_limited")
    if status in (401, 402, 403) or _AUTH.search(text) and status < 500:
        return err("auth")
    if status == 404 or kind_field == "not_found_error" or _MODEL_MISSING.search(text):
        return err("model_unavailable")
    if status == 400 and re.search(r"unsupported (parameter|value)|unrecognized request argument", text, re.I):
        return err("auth")
    if status == 422 or status in (400, 500) and _VALIDATION.search(message):
        return UpstreamError("upstream", f"The gateway rejected the request as malformed (HTTP {status}): {message}",
                             status=status, malformed_request=True)
    return err("upstream")


def classify_stream_error(obj: dict) -> UpstreamError:
    """An error object that arrived inside a 200 stream (`data: {"error": ...}` or `event: error`)."""
    kind_field, code, message = _error_fields(obj)
    text = f"{kind_field} {code} {message}"
    message = message or "the upstream stream reported an error"
    if kind_field == "rate_limit_error" or code in ("429", "rate_limit_exceeded"):
        return UpstreamError("rate_limited", message, retry_after=retry_after_seconds({}, message))
    if _OVERFLOW.search(text):
        return UpstreamError("context_overflow", message)
    if _REFUSED.search(text):
        return UpstreamError("refused", message)
    if kind_field in ("authentication_error", "permission_error", "billing_error"):
        return UpstreamError("auth", message)
    return UpstreamError("upstream", message)


def classify_finish(reason: str, detail: str = "") -> UpstreamError | None:
    """None for a normal finish; an error for refusals, overflows and unknown reasons."""
    if reason in ("stop", "length", "end_turn", "max_tokens", "stop_sequence", "tool_calls",
                  "function_call", "tool_use", "pause_turn"):
        return None
    if reason in ("content_filter", "refusal"):
        return UpstreamError("refused", detail or "The model declined to answer this message.")
    if reason == "model_context_window_exceeded":
        return UpstreamError("context_overflow", detail or "The model's context window is full.")
    return UpstreamError("upstream", detail or f"The upstream ended with finish reason {reason!r}.")


def classify_exception(exc: BaseException) -> UpstreamError:
    """Transport faults: refused or dropped connections, timeouts, protocol errors."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, httpx2.TimeoutException):
        return UpstreamError("upstream", f"The gateway timed out ({type(exc).__name__}).")
    if isinstance(exc, httpx2.ConnectError):
        return UpstreamError("upstream", "Could not connect to the gateway.")
    if isinstance(exc, (httpx2.RemoteProtocolError, httpx2.ReadError)):
        return UpstreamError("upstream", "The gateway closed the connection mid-reply.")
    if isinstance(exc, httpx2.HTTPError):
        return UpstreamError("upstream", f"Gateway transport error ({type(exc).__name__}).")
    return UpstreamError("upstream", f"Unexpected upstream failure ({type(exc).__name__}).")
