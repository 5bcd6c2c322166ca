"""The server's log lines: text for people, or one JSON object a line for log shippers (LOG_FORMAT).

Either way every line passes `failures.redact` last, so a kept secret (the gateway key, the
access and metrics tokens) never reaches the log, whatever a message or a traceback quoted.
"""

from __future__ import annotations

import datetime as dt
import logging

import orjson

from chatserver.config import Settings
from chatserver.upstream.failures import keep_secret, redact

TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message"}`, plus `worker` under WORKERS and `exception` with a traceback."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict = {"time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
                      "level": record.levelname, "logger": record.name, "message": redact(record.getMessage())}
        if self.worker is not None:
            line["worker"] = self.worker
        if record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exception"] = redact(record.exc_text)
        return orjson.dumps(line).decode()


def configure(settings: Settings, worker: int | None = None) -> None:
    """The root logger writes to stderr in LOG_FORMAT; `worker` names the process under WORKERS."""
    for secret in (settings.gateway_api_key, settings.access_token, settings.metrics_token):
        keep_secret(secret)
    handler = logging.StreamHandler()
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        handler.setFormatter(TextFormatter(f"[worker {worker}] {TEXT_FORMAT}" if worker is not None else TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    for name in ("httpx", "httpx2"):  # one line per upstream (httpx2) or tool (httpx) request is noise
        logging.getLogger(name).setLevel(logging.WARNING)
