"""Request bodies, one schema per direction, with their limits declared on the fields.

Responses are the stored JSON documents themselves (docs/API.md's Conversation), so only inputs
need schemas here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

TRANSCRIPT_PLACEHOLDER = "{transcript}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SettingsPatch(Strict):
    preset: StrictStr | None = Field(None, max_length=100)
    system_prompt: StrictStr | None = Field(None, max_length=100_000)
    context_budget: StrictInt | None = Field(None, gt=0, le=10_000_000)
    web_search: StrictBool | None = None
    web_fetch: StrictBool | None = None
    tool_instructions: StrictStr | None = Field(None, max_length=10_000)
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


class ConversationPatch(Strict):
    title: StrictStr | None = Field(None, min_length=1, max_length=200)
    model: ModelId | None = None
    settings: SettingsPatch | None = None


class MessageCreate(Strict):
    # The pattern (some non-space character) tells OpenAPI clients what `_not_blank` checks.
    content: StrictStr = Field(json_schema_extra={"pattern": r"\S"})

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the message is empty")
        return value


class Empty(Strict):
    pass


class ModelCreate(Strict):
    id: ModelId
    tier: Literal["fast", "balanced", "frontier"] = "balanced"


class Login(Strict):
    token: StrictStr = Field(min_length=1, max_length=1000)


class MemoryPut(Strict):
    text: StrictStr = Field(max_length=200_000)
