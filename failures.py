"""Upstream failures, sorted into the six kinds the page knows how to recover from.

`classify_*` read what a gateway actually sends (HTTP status plus a JSON body in one of several
vendor shapes, an error object inside a stream, a refusal finish reason, or a transport
exception) and return an `UpstreamError`. The body is read before the status: the same status
means different things on different gateways (a 429 can be a quota, a 403 a moderation flag).
This module knows nothing of conversations or of how a kind is shown.
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import Literal

import httpx

Kind = Literal["auth", "rate_limited", "context_overflow", "refused", "model_unavailable", "upstream"]

RETRYABLE: dict[str, bool] = {
    "auth": False,
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
    r"|no available model|unknown model|model .* not found",
    re.I,
)
_AUTH = re.compile(
    r"authenticationerror|invalid api key|incorrect api key|invalid_api_key|invalid credentials"
    r"|insufficient_quota|exceeded your current quota|budgetexceeded|insufficient credits"
    r"|enforced_spend_limit_reached|permission|unauthori[sz]ed",
    re.I,
)
_REFUSED = re.compile(r"content_filter|contentpolicyviolation|content policy|moderation|flagged", re.I)


# Secrets that must never reach a message: gateways and proxies echo request headers in errors.
_SECRETS: set[str] = set()
REDACTED = "[redacted]"


def keep_secret(value: str | None) -> None:
    """Redact `value` (the gateway key) from every upstream error message from now on."""
    if value and len(value.strip()) >= 6:
        _SECRETS.add(value.strip())


def redact(text: str) -> str:
    for secret in _SECRETS:
        text = text.replace(secret, REDACTED)
    return text


class UpstreamError(Exception):
    """A failure of the upstream call, already classified; its message never holds a kept secret."""

    def __init__(
        self,
        kind: Kind,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        message = redact(message)
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message
        self.retry_after = retry_after
        self.status = status

    @property
    def retryable(self) -> bool:
        return RETRYABLE[self.kind]

    def __repr__(self) -> str:
        return f"UpstreamError({self.kind!r}, {self.message!r}, status={self.status})"


def retry_after_seconds(headers: httpx.Headers | dict) -> float | None:
    """Read `retry-after-ms`, then `retry-after` (seconds or an HTTP date), as SDKs do."""
    lower = {k.lower(): v for k, v in dict(headers).items()}
    if (ms := lower.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


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
    message = str(err.get("message") or "")
    metadata = err.get("metadata")
    if isinstance(metadata, dict) and metadata.get("reasons"):
        code = code or "content_filter"
        message = f"{message} (flagged: {', '.join(map(str, metadata['reasons']))})"
    details = err.get("details") or body.get("details")
    if isinstance(details, dict) and details.get("error_code"):
        code = f"{code} {details['error_code']}".strip()
    return kind, code, message


def classify_http(status: int, headers: httpx.Headers | dict, body: object) -> UpstreamError:
    """An HTTP error status from either endpoint, with its parsed JSON (or raw text) body."""
    kind_field, code, message = _error_fields(body)
    text = f"{kind_field} {code} {message}"
    retry_after = retry_after_seconds(headers)
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
    return err("upstream")


def classify_stream_error(obj: dict) -> UpstreamError:
    """An error object that arrived inside a 200 stream (`data: {"error": ...}` or `event: error`)."""
    kind_field, code, message = _error_fields(obj)
    text = f"{kind_field} {code} {message}"
    message = message or "the upstream stream reported an error"
    if kind_field == "rate_limit_error" or code in ("429", "rate_limit_exceeded"):
        return UpstreamError("rate_limited", message)
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
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("upstream", f"The gateway timed out ({type(exc).__name__}).")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError("upstream", "Could not connect to the gateway.")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return UpstreamError("upstream", "The gateway closed the connection mid-reply.")
    if isinstance(exc, httpx.HTTPError):
        return UpstreamError("upstream", f"Gateway transport error ({type(exc).__name__}).")
    return UpstreamError("upstream", f"Unexpected upstream failure ({type(exc).__name__}).")
