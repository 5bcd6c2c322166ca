"""Settings from `.env` and the environment (the environment wins), and the model lineup.

Nothing is read at import time: `get_settings()` builds a `Settings` when the app starts, so
tests can build their own. This module knows names and defaults, not how they are used.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated

from chatserver.api.schemas import TIERS

PACKAGE = Path(__file__).resolve().parent  # the page, the prompts and the built-in presets
ROOT = PACKAGE.parent  # the checkout, where .env.example is

# The seven-model lineup a newcomer starts with (OpenRouter-style ids), cheapest tier first.
DEFAULT_MODELS = (
    "fast:openai/gpt-5-nano,"
    "fast:google/gemini-2.5-flash-lite,"
    "balanced:openai/gpt-5-mini,"
    "balanced:deepseek/deepseek-r1,"
    "balanced:anthropic/claude-haiku-4.5,"
    "frontier:anthropic/claude-sonnet-4.5,"
    "frontier:openai/gpt-5"
)
# Measured in the source: reasoning_effort "minimal" cut cost 91-97% on chat models.
DEFAULT_MODEL_PARAMS = {
    "openai/gpt-5-nano": {"reasoning_effort": "minimal"},
    "openai/gpt-5-mini": {"reasoning_effort": "minimal"},
}
# Off loopback the token faces every guesser on the network: long and not one repeated character.
MIN_TOKEN_CHARS = 20
MIN_TOKEN_DISTINCT = 6
# Only models seen streaming reasoning text get a live Thinking panel.
DEFAULT_REASONING_MODELS = "deepseek/deepseek-r1,anthropic/claude-sonnet-4.5"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    tier: str
    reasoning: bool = False
    custom: bool = False
    # It reads images: a message's images go to it as image parts (never to a model without it).
    vision: bool = False
    # Where its tools run: "gateway" (server tools on /v1/messages), "local" (our loop), "none".
    tool_runtime: str = "gateway"

    @property
    def label(self) -> str:
        return self.id.rsplit("/", 1)[-1]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    gateway_base_url: str | None = None
    gateway_api_key: str | None = Field(default=None, repr=False)
    data_dir: Path = Path(".data")

    models: str = DEFAULT_MODELS
    default_model: str = "openai/gpt-5-mini"
    summarizer_model: str = "openai/gpt-5-nano"
    model_params: Annotated[dict[str, dict], NoDecode] = Field(
        default_factory=lambda: dict(DEFAULT_MODEL_PARAMS)
    )
    reasoning_models: str = DEFAULT_REASONING_MODELS
    # Models whose server takes only a string as a message's content (no layered system blocks, so
    # no cache markers): llama-cpp-python's server, for one. Others are learned from their first refusal.
    plain_text_models: str = ""
    # Models that read images (besides those the gateway's model list says take "image" input).
    vision_models: str = ""
    # What `analyze_image` asks about an image for a model without vision; unset, the tool is off.
    vision_model: str | None = None
    # An image's long edge as sent upstream, in pixels (cost and request size grow with its area).
    image_max_edge: int = Field(1568, ge=64, le=8192)

    context_budget_tokens: int = Field(102_400, gt=0)
    keep_recent_messages: int = Field(8, ge=2)
    max_completion_tokens: int = Field(4096, gt=0)
    summary_max_tokens: int = Field(2048, gt=0)
    # New conversations ask before a compression's facts reach memory.md (they can come from fetched pages).
    approve_facts: bool = False
    # After a conversation's first reply, one small SUMMARIZER_MODEL call names it.
    auto_title: bool = True
    # Read-only copies of a conversation at an unguessable link, readable without an account.
    allow_sharing: bool = True
    cache_ttl: Literal["5m", "1h"] = "5m"
    cache_history_breakpoint: bool = True

    # Costs (issue 28): how a missing or estimated cost is asked of the gateway's own bill, and the
    # monthly budget (USD) of a person an admin gave none; unset: no budget.
    cost_reconcile: Literal["auto", "openrouter", "litellm", "off"] = "auto"
    default_monthly_budget: float | None = Field(None, ge=0)

    search_max_uses: int = Field(3, ge=0)
    fetch_max_uses: int = Field(2, ge=0)
    pause_turn_max: int = Field(3, ge=0)
    web_search_tool_type: str = "web_search_20250305"
    web_fetch_tool_type: str = "web_fetch_20250910"

    upstream_timeout: float = Field(60.0, gt=0)
    # What a dropped page connection does to its turn: nothing (it runs to its end) or Stop.
    on_disconnect: Literal["continue", "stop"] = "continue"
    # How often a streaming reply's partial text is written to the store; 0 turns checkpoints off.
    checkpoint_seconds: float = Field(1.0, ge=0)
    # A stream whose reader takes longer than this to accept one event is dropped.
    stream_send_timeout: float = Field(30.0, gt=0)

    host: str = "127.0.0.1"
    port: int = 8000
    # Server processes accepting on one port (`python server.py`, `make run`); above 1 needs STORE=redis.
    workers: int = Field(1, ge=1, le=256)
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    access_token: str | None = Field(default=None, repr=False)
    # GET /metrics: readable by admins, or by a scraper sending `Authorization: Bearer <METRICS_TOKEN>`.
    metrics_token: str | None = Field(default=None, repr=False)
    # The log's lines: `text` for people, `json` (one object a line) for log shippers.
    log_format: Literal["text", "json"] = "text"
    max_request_bytes: int = Field(2_097_152, gt=0)
    # Open client connections (lowered to fit the open-file limit) and the seconds a connection
    # may take to send its request head; see serving.py.
    max_connections: int = Field(1000, ge=1)
    header_timeout: float = Field(10.0, gt=0)
    # Seconds a request may take to send its whole body once its head is in (408 after); see security.py.
    body_timeout: float = Field(30.0, gt=0)
    max_message_chars: int = Field(200_000, gt=0)
    max_attachment_bytes: int = Field(20_971_520, gt=0)
    max_attachment_pages: int = Field(1000, gt=0)
    # Files are read in a child process limited to this much memory and time, then killed.
    extract_max_mb: int = Field(512, ge=64)
    extract_timeout: float = Field(30.0, gt=0)
    # Children reading at once (one per person at a time), and reads allowed to wait before 429.
    extract_workers: int = Field(2, ge=1)
    extract_queue: int = Field(8, ge=0)
    # An image larger than this (width x height) is refused from its header, before it is decoded.
    max_image_pixels: int = Field(50_000_000, gt=0)
    # Per person: the bytes of all their files (conversations' and library) and their conversations.
    quota_file_bytes: int = Field(2**30, gt=0)
    quota_conversations: int = Field(10_000, gt=0)

    # Where conversations live: files under DATA_DIR (one process) or Redis (several).
    store: Literal["files", "redis"] = "files"
    redis_url: str = Field("redis://127.0.0.1:6379/0", repr=False)
    conversation_ttl_days: float | None = Field(None, gt=0)
    # STORE=redis: a turn lock its process stopped renewing (it died) frees the conversation this soon.
    turn_lock_seconds: float = Field(30.0, ge=0.3)
    # STORE=redis: a running turn's heartbeat; three missed and other servers end its followers as interrupted.
    heartbeat_seconds: float = Field(1.0, ge=0.1, le=60)
    # Where attachments' original bytes live: files under DATA_DIR (beside their metadata), or an
    # S3-compatible bucket (AWS S3, MinIO, R2, SeaweedFS) shared by every server. Metadata and text
    # follow STORE. Without S3_ACCESS_KEY_ID the client's usual credential chain applies (AWS_*
    # variables, an instance role).
    blob_store: Literal["files", "s3"] = "files"
    s3_endpoint_url: str | None = None
    s3_bucket: str = "chat-attachments"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = Field(default=None, repr=False)
    s3_secret_access_key: str | None = Field(default=None, repr=False)
    # This server's own search indexes (conversations, attachment passages): a cache on local disk,
    # never shared between servers, rebuilt from the store when missing. Default: DATA_DIR/index.
    search_index_dir: Path | None = None

    auth: Literal["none", "password", "header"] = "none"
    auth_header: str = "X-Forwarded-User"
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    admin_users: Annotated[list[str], NoDecode] = Field(default_factory=list)
    session_hours: float = Field(168, gt=0)
    pii_masking: Literal["off", "on"] = "off"

    # Tools that run on this server (tools.py, webfetch.py).
    tool_rounds_max: int = Field(8, ge=1)
    # One model response may ask for at most this many calls, each with at most this much JSON;
    # the rest are answered as tool errors (and never stored or resent whole).
    tool_calls_max: int = Field(16, ge=1)
    tool_args_max_bytes: int = Field(65_536, ge=2)
    tool_timeout: float = Field(30.0, gt=0)
    searxng_url: str | None = None
    fetch_max_bytes: int = Field(2_097_152, gt=0)
    fetch_allow_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    default_web_search: bool = False
    default_web_fetch: bool = False
    # Per model id: "gateway" | "local" | "none"; models not named get DEFAULT_TOOL_RUNTIME.
    tool_runtimes: Annotated[dict[str, Literal["gateway", "local", "none"]], NoDecode] = Field(default_factory=dict)
    default_tool_runtime: Literal["gateway", "local", "none"] = "gateway"
    # MCP servers (tools/mcp.py): a JSON file listing them (admins add HTTP ones in Settings too),
    # how long one call may take, and the most one answer may carry (a bigger one is refused).
    mcp_servers: Path | None = None
    mcp_timeout: float = Field(30.0, gt=0)
    mcp_max_bytes: int = Field(16 * 1024 * 1024, gt=0)

    @field_validator("gateway_base_url", "gateway_api_key", "access_token", "metrics_token", "searxng_url",
                     "conversation_ttl_days", "search_index_dir", "s3_endpoint_url", "s3_access_key_id",
                     "s3_secret_access_key", "vision_model", "mcp_servers", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("gateway_base_url", "searxng_url")
    @classmethod
    def _gateway_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host; without a scheme every turn would fail, so refuse to start."""
        if value is None:
            return None
        value = value.strip().rstrip("/")
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            bare = value.split("://", 1)[-1].strip("/") or "your-gateway.example/api"
            raise ValueError(
                f"GATEWAY_BASE_URL={value!r} must be a full URL starting with https:// or http://, "
                f"e.g. GATEWAY_BASE_URL=https://{bare} (http:// only for a server on your own machine or network)"
            )
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().rstrip("/")
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"S3_ENDPOINT_URL={value!r} must be a full URL starting with https:// or http://")
        return value

    @field_validator("s3_bucket")
    @classmethod
    def _s3_bucket(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", value):
            raise ValueError(f"S3_BUCKET={value!r} must be 3-63 lower-case letters, digits, dots and hyphens")
        return value

    @field_validator("model_params", "tool_runtimes", mode="before")
    @classmethod
    def _parse_params(cls, value: object) -> object:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value

    @field_validator("allowed_hosts", "admin_users", "fetch_allow_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return [h.strip().lower() for h in value.split(",") if h.strip()]
        return value

    @field_validator("default_monthly_budget", mode="before")
    @classmethod
    def _no_budget_when_empty(cls, value: object) -> object:
        """`DEFAULT_MONTHLY_BUDGET=` (as .env.example has it) means no budget."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _split_proxies(cls, value: object) -> object:
        if isinstance(value, str):
            value = [p.strip() for p in value.split(",") if p.strip()]
        for entry in value if isinstance(value, list) else []:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"TRUSTED_PROXIES: {entry!r} is not an IP address or CIDR range") from None
        return value

    @model_validator(mode="after")
    def _token_off_loopback(self) -> "Settings":
        if self.auth == "none" and not self.is_loopback and not self.access_token:
            raise ValueError(
                f"HOST={self.host} is reachable from other machines: set ACCESS_TOKEN in .env "
                "so that only people with the token can use this server (or bind to 127.0.0.1), "
                "or switch on accounts with AUTH=password."
            )
        if self.auth == "none" and not self.is_loopback and (problem := weak_token(self.access_token or "")):
            raise ValueError(f"HOST={self.host} is reachable from other machines and ACCESS_TOKEN {problem}.")
        if self.auth == "header" and not self.trusted_proxies:
            raise ValueError("AUTH=header needs TRUSTED_PROXIES: the addresses of the proxy allowed to name the user.")
        return self

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":  # "" binds every interface, like 0.0.0.0
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False

    @property
    def index_dir(self) -> Path:
        return self.search_index_dir or self.data_dir / "index"

    @property
    def gateway_configured(self) -> bool:
        return self.gateway_base_url is not None

    @property
    def gateway_is_openrouter(self) -> bool:
        """OpenRouter takes reasoning effort in its own form (`reasoning: {effort}`)."""
        host = urlsplit(self.gateway_base_url or "").hostname or ""
        return host == "openrouter.ai" or host.endswith(".openrouter.ai")

    def lineup(self) -> list[ModelInfo]:
        """The built-in models from MODELS, in order, then DEFAULT_MODEL, SUMMARIZER_MODEL and
        VISION_MODEL where MODELS leaves them out."""
        reasoning = {m.strip() for m in self.reasoning_models.split(",") if m.strip()}
        out: list[ModelInfo] = []
        for entry in self.models.split(","):
            entry = entry.strip()
            if not entry:
                continue
            tier, sep, model_id = entry.partition(":")
            if not sep or tier not in TIERS:
                tier, model_id = "balanced", entry
            out.append(ModelInfo(model_id, tier, model_id in reasoning, tool_runtime=self.runtime_for(model_id),
                                 vision=model_id in self.vision_ids))
        # The models the server itself calls are always in it, whether or not MODELS names them; the
        # vision model reads images by definition.
        needed = [(self.default_model, "balanced"), (self.summarizer_model, "fast")]
        if self.vision_model:
            needed.append((self.vision_model, "balanced"))
        for needed_id, tier in needed:
            if all(m.id != needed_id for m in out):
                out.append(ModelInfo(needed_id, tier, needed_id in reasoning, tool_runtime=self.runtime_for(needed_id),
                                     vision=needed_id in self.vision_ids))
        return out

    @property
    def vision_ids(self) -> frozenset[str]:
        """The models VISION_MODELS names, and VISION_MODEL (it is asked about images)."""
        named = {m.strip() for m in self.vision_models.split(",") if m.strip()}
        return frozenset(named | {self.vision_model} if self.vision_model else named)

    def runtime_for(self, model_id: str) -> str:
        """Where a model's tools run when nothing more specific (a custom model's own choice) says."""
        return self.tool_runtimes.get(model_id, self.default_tool_runtime)

    def params_for(self, model_id: str) -> dict:
        """Extra request parameters for one model (e.g. reasoning_effort)."""
        return dict(self.model_params.get(model_id, {}))


def weak_token(token: str) -> str | None:
    """Why an ACCESS_TOKEN is too weak to face a network, or None when it is strong enough."""
    if len(token) < MIN_TOKEN_CHARS:
        return (f"is shorter than {MIN_TOKEN_CHARS} characters; make one with: "
                "python -c \"import secrets; print(secrets.token_urlsafe(24))\"")
    if len(set(token)) < MIN_TOKEN_DISTINCT:
        return f"uses fewer than {MIN_TOKEN_DISTINCT} different characters"
    return None


def get_settings() -> Settings:
    return Settings()
