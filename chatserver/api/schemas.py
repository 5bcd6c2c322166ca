"""The data's shapes: request bodies (pydantic, with their limits declared on the fields) and the
stored and answered documents (TypedDicts: free at run time, so conversations stay plain dicts
that orjson writes at full speed, yet `/openapi.json` documents every answer).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from typing_extensions import NotRequired, TypedDict

Tier = Literal["fast", "balanced", "frontier"]
TIERS: tuple[Tier, ...] = ("fast", "balanced", "frontier")


# --- Stored and answered documents --------------------------------------------------------------

class Usage(TypedDict):
    """One reply's usage, normalised: `input_tokens` is the whole prompt, cached and written included."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    cost: float | None
    searches: int
    fetches: int
    estimated: bool
    # (issue 28) Where the cost came from, the least certain of its requests' sources, and each
    # request's charge (its id in the person's ledger, its cost and source).
    cost_source: NotRequired[Literal["reported", "reconciled", "priced", "estimated", "unreported"]]
    charges: NotRequired[list[ChargeEntry]]


class ChargeEntry(TypedDict):
    id: str
    cost: float | None
    source: Literal["reported", "reconciled", "priced", "estimated", "unreported"]


class Citation(TypedDict):
    url: str
    title: str


class ReplyWarning(TypedDict):
    code: str
    message: str


class ActivityStep(TypedDict):
    """One step of a reply's trail: `thinking`, `search` or `fetch` (fields by kind)."""

    kind: Literal["thinking", "search", "fetch"]
    text: NotRequired[str]
    started_at: NotRequired[float]
    ended_at: NotRequired[float]
    query: NotRequired[str]
    results: NotRequired[list[dict[str, Any]] | None]
    url: NotRequired[str]
    title: NotRequired[str | None]
    ok: NotRequired[bool]
    error: NotRequired[str]
    at: NotRequired[float]


class Message(TypedDict):
    id: str
    role: Literal["user", "assistant", "notice"]
    content: str
    created_at: str
    # The message before it on its path (None for the first); a notice's is the message it follows.
    parent_id: NotRequired[str | None]  # notices hang from the message before them and carry none
    model: NotRequired[str]
    status: NotRequired[Literal["complete", "interrupted", "streaming"]]
    activity: NotRequired[list[ActivityStep]]
    citations: NotRequired[list[Citation]]
    usage: NotRequired[Usage]
    warnings: NotRequired[list[ReplyWarning]]
    error: NotRequired[str]
    compression: NotRequired[dict[str, Any]]
    params: NotRequired[dict[str, Any]]  # the generation parameters that were not the defaults
    continued: NotRequired[int]  # how many times Continue carried it on
    edited: NotRequired[bool]  # written by the person (an edit of `edited_from`)
    edited_from: NotRequired[str]


class Totals(TypedDict):
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    searches: int
    fetches: int
    cost: float
    cost_unreported: int
    turns: int
    compression_cost: float
    compression_calls: int
    title_cost: float
    title_calls: int
    # The summarizer's tokens apart; absent from conversations whose calls predate them.
    title_input_tokens: NotRequired[int]
    title_output_tokens: NotRequired[int]
    compression_input_tokens: NotRequired[int]
    compression_output_tokens: NotRequired[int]
    # (issue 28) How much of `cost` is of each source.
    cost_sources: NotRequired[dict[str, float]]


class ContextBar(TypedDict):
    budget: int
    persona: int
    memory: int
    summary: int
    history: int
    reserve: int
    measured: bool


class RunningTurn(TypedDict):
    assistant_message_id: str
    events: int  # how many events the turn has sent so far: the last SSE id


class Conversation(TypedDict):
    id: str
    title: str
    model: str
    created_at: str
    updated_at: str
    settings: dict[str, Any]
    summary: str
    messages: list[Message]
    archive: NotRequired[list[Message]]
    last_prompt_tokens: int | None
    totals: Totals
    context: ContextBar
    streaming: bool
    # {message id: [it and its siblings, in creation order]} for each message of the current path with siblings.
    branches: dict[str, list[str]]
    pinned: bool
    archived: bool
    title_source: Literal["auto", "model", "user", "imported"]
    turn: RunningTurn | None
    project_id: NotRequired[str | None]


class ConversationEntry(TypedDict):
    id: str
    title: str
    model: str
    updated_at: str
    message_count: int
    last_message_at: str
    streaming: bool
    pinned: bool
    archived: bool
    project_id: str | None


class Project(TypedDict):
    id: str
    name: str
    instructions: str
    created_at: str
    updated_at: str


class ModelEntry(TypedDict):
    id: str
    label: str
    reasoning: bool
    custom: bool
    cache_markers: bool  # false: its server takes plain text only, so its prompt carries no cache marker
    tool_runtime: Literal["gateway", "local", "none"]
    vision: bool  # it reads images: a message's images go to it as image parts
    # (issue 28) USD per million tokens, set by an admin or published by the gateway; null: none known.
    price: NotRequired[PriceEntry | None]
    price_source: NotRequired[Literal["admin", "gateway"] | None]


class PriceEntry(TypedDict):
    input: float
    output: float
    cache_read: float | None
    cache_write: float | None


class TierEntry(TypedDict):
    tier: Tier
    models: list[ModelEntry]


class Lineup(TypedDict):
    default: str
    summarizer: str
    tiers: list[TierEntry]


class Health(TypedDict):
    ok: bool
    gateway_configured: bool
    gateway: Literal["demo", "configured"]
    gateway_reachable: bool | None
    # The search index: built from the store at start ("building"), then following it ("ready").
    search: Literal["building", "ready", "failed"]
    # Which of WORKERS processes answered (1 of 1 for a single process), and its process id.
    worker: int
    workers: int
    pid: int
    sharing: bool  # ALLOW_SHARING: the page offers Share only when true


class MemoryText(TypedDict):
    text: str


class Draft(TypedDict):
    content: str


class Preset(TypedDict):
    name: str
    text: str


# --- Request bodies ------------------------------------------------------------------------------

TRANSCRIPT_PLACEHOLDER = "{transcript}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(Strict):
    """Generation parameters (a conversation's settings, a preset's `params`); null: the default."""

    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=128_000)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class SettingsPatch(SamplingFields):
    preset: StrictStr | None = Field(None, max_length=100)
    system_prompt: StrictStr | None = Field(None, max_length=100_000)
    context_budget: StrictInt | None = Field(None, gt=0, le=10_000_000)
    web_search: StrictBool | None = None
    web_fetch: StrictBool | None = None
    approve_facts: StrictBool | None = None
    tool_instructions: StrictStr | None = Field(None, max_length=10_000)
    # The local tools this conversation enables, among its preset's (the route checks the names).
    tools: list[Annotated[StrictStr, Field(min_length=1, max_length=64)]] | None = Field(None, max_length=64)
    library: StrictBool | None = None
    # The pattern only tells OpenAPI clients (and generated tests) what the validator below checks.
    compression_prompt: StrictStr | None = Field(None, max_length=50_000,
                                                 json_schema_extra={"pattern": r"\{transcript\}"})

    @field_validator("compression_prompt")
    @classmethod
    def _keeps_transcript(cls, value: str | None) -> str | None:
        if value is not None and TRANSCRIPT_PLACEHOLDER not in value:
            raise ValueError(
                "the compression prompt must contain {transcript}, where the folded messages go"
            )
        return value


def _check_model_id(value: str) -> str:
    if not value or any(c.isspace() or ord(c) < 32 for c in value):
        raise ValueError("a model id is a non-empty string without spaces")
    return value


ModelId = Annotated[StrictStr, Field(min_length=1, max_length=200), AfterValidator(_check_model_id)]


class ConversationCreate(Strict):
    model: ModelId | None = None
    preset: StrictStr | None = Field(None, max_length=100)
    project_id: StrictStr | None = Field(None, max_length=64)  # made inside this project


class ProjectCreate(Strict):
    name: StrictStr = Field(min_length=1, max_length=200)
    instructions: StrictStr = Field("", max_length=100_000)

    @field_validator("name")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the name is empty")
        return value.strip()


class ProjectPatch(Strict):
    name: StrictStr | None = Field(None, min_length=1, max_length=200)
    instructions: StrictStr | None = Field(None, max_length=100_000)

    @field_validator("name")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the name is empty")
        return value.strip() if value is not None else None


class ConversationPatch(Strict):
    title: StrictStr | None = Field(None, min_length=1, max_length=200)
    model: ModelId | None = None
    settings: SettingsPatch | None = None
    pinned: StrictBool | None = None
    archived: StrictBool | None = None
    # A project of this person's moves the conversation into it; null moves it out (absent: unchanged).
    project_id: StrictStr | None = Field(None, max_length=64)


class MessageCreate(Strict):
    # The pattern (some non-space character) tells OpenAPI clients what `_not_blank` checks.
    content: StrictStr = Field(json_schema_extra={"pattern": r"\S"})
    # Answer from this point of the current path (edit and resend); absent: after its last message.
    parent_id: StrictStr | None = Field(None, max_length=64)
    # Files of this conversation the message is about (the route checks they exist).
    attachment_ids: list[Annotated[StrictStr, Field(min_length=1, max_length=64)]] | None = Field(None, max_length=32)

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the message is empty")
        return value


class RegenerateRequest(Strict):
    # The assistant message of the current path to answer again (absent: the answers to the last message typed).
    message_id: StrictStr | None = Field(None, min_length=1, max_length=64)
    model: ModelId | None = None  # answer with this model instead of the conversation's


class ContinueRequest(Strict):
    message_id: StrictStr | None = Field(None, min_length=1, max_length=64)


class ReplyEdit(Strict):
    content: StrictStr = Field(min_length=1, max_length=1_000_000, json_schema_extra={"pattern": r"\S"})

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the reply is empty")
        return value


class CompareRequest(MessageCreate):
    models: list[ModelId] = Field(min_length=2, max_length=3)

    @field_validator("models")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each model may be compared once")
        return value


class StopRequest(Strict):
    # Stop only this reply of a comparison (absent: the whole turn).
    assistant_message_id: StrictStr | None = Field(None, min_length=1, max_length=64)


class Empty(Strict):
    pass


class FactsReview(Strict):
    """The facts of one compression notice that memory keeps, as the person edited them."""

    notice_id: StrictStr = Field(min_length=1, max_length=64)
    keep: list[Annotated[StrictStr, Field(min_length=1, max_length=500)]] = Field(max_length=50)


class BranchSwitch(Strict):
    message_id: StrictStr = Field(min_length=1, max_length=64)


class ModelCreate(Strict):
    id: ModelId
    tier: Tier = "balanced"
    tool_runtime: Literal["gateway", "local", "none"] | None = None
    # None: as VISION_MODELS and the gateway's model list say.
    vision: StrictBool | None = None


class ModelPatch(Strict):
    vision: StrictBool | None = None


class Login(Strict):
    token: StrictStr = Field(min_length=1, max_length=1000)


class MemoryPut(Strict):
    text: StrictStr = Field(max_length=200_000)


PerMillion = Annotated[float, Field(ge=0, le=10_000, allow_inf_nan=False, strict=True)]


class PricePut(Strict):
    """A model's price, USD per million tokens; cache prices default to the input price."""

    input: PerMillion
    output: PerMillion
    cache_read: PerMillion | None = None
    cache_write: PerMillion | None = None


class BudgetPut(Strict):
    """A person's monthly budget in USD; null: no budget at all (DELETE returns them to the default)."""

    budget: Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False, strict=True)] | None
