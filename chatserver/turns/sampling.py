"""A conversation's generation parameters (temperature, top_p, maximum reply tokens, reasoning
effort), wire-neutral: what the person set, read from the conversation's settings.

Unset means the gateway's (or this server's) default, and nothing is sent. Reasoning effort is
kept for reasoning models only: another model would be sent a field it may refuse. How each wire
format carries them is `upstream.chat.sampling_fields` and `upstream.messages.sampling_fields`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Effort = Literal["minimal", "low", "medium", "high"]
EFFORTS: tuple[str, ...] = ("minimal", "low", "medium", "high")
KEYS = ("temperature", "top_p", "max_tokens", "reasoning_effort")


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None

    @classmethod
    def of(cls, conv_settings: dict, *, reasoning: bool) -> Sampling:
        """The parameters a turn of this conversation sends; `reasoning`: the model is a reasoning model."""
        return cls(conv_settings.get("temperature"), conv_settings.get("top_p"), conv_settings.get("max_tokens"),
                   conv_settings.get("reasoning_effort") if reasoning else None)

    def shown(self) -> dict:
        """The parameters that differ from the defaults (a reply keeps them for its footer)."""
        return {k: v for k, v in asdict(self).items() if v is not None}
