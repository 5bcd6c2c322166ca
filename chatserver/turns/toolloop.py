"""The one transport of every turn: ask the model, run the tools it calls on this server, send the
results back, and ask again, until it answers without calling (at most TOOL_ROUNDS_MAX rounds,
then once more with tools switched off and a `tool_rounds` warning). A turn without tools of ours
is the same loop's single round: a plain chat turn, or a Messages turn for the gateway's web tools
(answered as a chat turn, with a `tool_dropped` warning, when the gateway refuses them all).

Promises: one stream of `events` values for the whole loop, on either wire format (chat
completions with `tools`, or Messages with our tools next to the gateway's server tools); the
calls of one response run in parallel through `tools.Registry.run_streaming`, each announced by a
`ToolStep` (running) and ended by another (done or error, citations attached); every round that
finished (all its results in) becomes a `ToolRound`, wire-neutral, which the reply keeps as its
hidden history; a round cut short (Stop) is never kept, so no call is ever stored without its
results. Who the calls act for (`tools.ToolContext`) and whose files they see (the attachment
scope) are set only while a round's calls start, never across a `yield`. Images a tool returned
are handed to `keep_image` (the pipeline stores them as the reply's attachments) as the call
ends; its `ImageAttached` or `TurnWarning` goes out, and the result's text names each one.

It does not know conversations, storage or the prompt's layout: it is given the laid-out prompt,
the selected tools and the context, and it gives events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Literal

from chatserver import metrics
from chatserver.config import Settings
from chatserver.tools import registry as tools
from chatserver.turns.context import Prompt
from chatserver.turns.events import (
    Event,
    ImageAttached,
    ImageProduced,
    TextDelta,
    ToolCallsRequested,
    ToolRound,
    ToolStep,
    TurnWarning,
)
from chatserver.turns.sampling import Sampling
from chatserver.upstream import chat
from chatserver.upstream import messages as web
from chatserver.upstream.client import Gateway

Wire = Literal["chat", "messages"]
# Stores one image a tool returned (the tool's name says whose): the reply's attachment, or why not.
KeepImage = Callable[[ImageProduced, str], Awaitable[ImageAttached | TurnWarning]]

CONTINUE_INSTRUCTION = ("Your previous reply was cut off. Continue it exactly where it stopped, without repeating "
                        "any of it and without remarking on the interruption.")


def rounds_warning(limit: int) -> TurnWarning:
    return TurnWarning("tool_rounds", f"The model was still calling tools after {limit} rounds (TOOL_ROUNDS_MAX), "
                                      "so it was asked to answer with what it has found so far.")


def _without_trailing_space(content: str | list[dict]) -> str | list[dict]:
    """A prefill as Anthropic takes it: a final assistant message may not end with whitespace."""
    if isinstance(content, str):
        return content.rstrip()
    return [*content[:-1], {**content[-1], "text": content[-1].get("text", "").rstrip()}] if content else content


def _arguments_json(arguments: str | dict) -> str:
    """A call's arguments as JSON text fit to resend: malformed ones as {} (their tool error says why)."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        return arguments if isinstance(json.loads(arguments or "{}"), dict) else "{}"
    except ValueError:
        return "{}"


def _image_note(kept: ImageAttached | TurnWarning | None) -> str:
    """What the model reads in place of an image's bytes: the stored attachment, or why it is not kept."""
    if isinstance(kept, ImageAttached):
        meta = kept.attachment
        return (f"[image {meta['name']} kept as attachment {meta['id']} ({meta['media_type']}, "
                f"{meta.get('width')} × {meta.get('height')}, {meta['bytes']:,} bytes): the person sees it under "
                "your reply]")
    if isinstance(kept, TurnWarning):
        return f"[{kept.message}]"
    return "[an image was returned; not shown]"


class ToolLoop:
    """One turn's loop against one gateway."""

    def __init__(self, gateway: Gateway, settings: Settings, *, wire: Wire, model: str,
                 selection: tools.Selection, ctx: tools.ToolContext,
                 scope: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 registry: tools.Registry = tools.registry, plain_text: bool = False,
                 without_web: Callable[[Prompt], Prompt] = lambda prompt: prompt,
                 sampling: Sampling = Sampling(), continuing: bool = False,
                 keep_image: KeepImage | None = None) -> None:
        self.gateway = gateway
        self.plain_text = plain_text  # a server that takes plain-text content only (turns.py learns which)
        self.settings = settings
        self.wire = wire
        self.model = model
        self.selection = selection
        self.ctx = ctx
        self.scope = scope
        self.registry = registry
        # Gateway tools the gateway refused in an earlier round: not declared again.
        self.dropped: set[str] = set()
        # The prompt for a turn that lost its web tools (the budget sentence would promise searches).
        self.without_web = without_web
        self.sampling = sampling
        # The prompt ends with a reply to go on from (Continue), not with a message to answer.
        self.continuing = continuing
        self.keep_image = keep_image

    async def run(self, prompt: Prompt) -> AsyncIterator[Event]:
        limit = self.settings.tool_rounds_max
        extra: list[dict] = []
        for round_number in range(limit + 1):
            final = round_number == limit
            # Only a turn that offers our tools can run out of rounds (or needs them switched off).
            closing = final and bool(self.selection.local)
            if closing:
                yield rounds_warning(limit)
            requested: ToolCallsRequested | None = None
            text = ""
            try:
                async with contextlib.aclosing(self._request(prompt, extra, closing)) as events:
                    async for event in events:
                        if isinstance(event, ToolCallsRequested):
                            requested = event
                            continue
                        if isinstance(event, TextDelta):
                            text += event.text
                        yield event
            except web.ToolsRejected as rejected:
                if self.selection.local:
                    raise
                # The gateway refused every web tool before answering: the same turn as a chat turn.
                yield rejected.warning
                self.wire = "chat"
                async with contextlib.aclosing(self._request(self.without_web(prompt), extra, False)) as events:
                    async for event in events:
                        yield event
                return
            if requested is None or final:
                return  # an answer (a `tool_calls` finish without calls is one too)
            calls, refused = self.registry.bound(requested.calls, max_calls=self.settings.tool_calls_max,
                                                 max_argument_bytes=self.settings.tool_args_max_bytes)
            results = {result.call_id: result for result in refused}
            runnable = tuple(call for call in calls if call.id not in results)
            for call in runnable:
                yield ToolStep(tools.running_event(call))
            for result in refused:
                yield ToolStep(result.event())
            async for result in self._run_calls(runnable):
                if result.images:
                    notes = []
                    for image in result.images:
                        kept = await self._keep(image, result.name)
                        notes.append(_image_note(kept))
                        if kept is not None:
                            yield kept
                    result = dataclasses.replace(result, text="\n".join(filter(None, [result.text, *notes])),
                                                 images=())
                results[result.call_id] = result
                yield ToolStep(result.event(), result.citations)
            ordered = [results[call.id] for call in calls]
            self._count(ordered)
            yield ToolRound(self._round(text, calls, ordered))
            extra += self._wire_round(text, calls, self._kept_blocks(requested, calls), ordered)

    async def _keep(self, image: ImageProduced, tool: str) -> ImageAttached | TurnWarning | None:
        return None if self.keep_image is None else await self.keep_image(image, tool)

    async def _run_calls(self, calls: tuple[tools.Call, ...]) -> AsyncIterator[tools.ToolResult]:
        """Each call's result as it finishes; the contexts are set only while the calls start."""
        running = self.registry.run_streaming(calls, self.selection.local, self.ctx)
        async with contextlib.aclosing(running):
            # The calls start on the first step of `running`: under the attachment scope, which is
            # reset before anything is yielded from here.
            with self.scope():
                result = await anext(running, None)
            while result is not None:
                yield result
                result = await anext(running, None)

    def _request(self, prompt: Prompt, extra: list[dict], final: bool) -> AsyncIterator[Event]:
        """One request; `final`: our tools stay declared (the history names them) but may not be called."""
        choice = "none" if final else None
        messages = self._continued(prompt.messages, extra)
        max_tokens = self.sampling.max_tokens or self.settings.max_completion_tokens
        if self.wire == "chat":
            params = {**self.settings.params_for(self.model),
                      **chat.sampling_fields(self.sampling, openrouter=self.settings.gateway_is_openrouter)}
            # The walked history goes as its encoded fragments, unless Continue reshaped the prompt's end.
            sent = messages if self.plain_text or self.continuing else prompt.encodable() + extra
            body = chat.build_body(self.model, prompt.system, sent, max_tokens=max_tokens,
                                   plain_text=self.plain_text, params=params,
                                   tools=self.registry.declarations(self.selection.local, "chat"), tool_choice=choice)
            source = self.gateway.stream(chat.PATH, body, chat.auth_headers(self.gateway.api_key), chat.ChatDecoder())
        else:
            server = [n for n in self.selection.gateway if n not in self.dropped]
            declared = web.declarations(server, self.settings) + \
                self.registry.declarations(self.selection.local, "messages")
            source = web.stream(self.gateway, model=self.model, system=prompt.system, messages=messages,
                                tools=declared, max_tokens=max_tokens,
                                pause_turn_max=self.settings.pause_turn_max, tool_choice=choice,
                                dropped=self.dropped, sampling=self.sampling)
        return source

    def _continued(self, messages: list[dict], extra: list[dict]) -> list[dict]:
        """Continue: Messages takes the saved text as a prefill the model carries on from (not with
        extended thinking, which refuses one, nor after a tool round); elsewhere the saved reply is
        followed by an instruction to go on from it."""
        if not self.continuing or not messages or messages[-1]["role"] != "assistant":
            return messages + extra
        last = messages[-1]
        if self.wire == "messages" and not extra and not self.sampling.reasoning_effort:
            return [*messages[:-1], {**last, "content": _without_trailing_space(last["content"])}]
        return [*messages, {"role": "user", "content": CONTINUE_INSTRUCTION}, *extra]
    def _count(self, results: list[tools.ToolResult]) -> None:
        """/metrics: each call and each [tool error], by tool (a name the model made up counts as `unknown`)."""
        for result in results:
            tool = result.name if result.name in self.registry else "unknown"
            metrics.active.tool_calls.labels(tool).inc()
            if not result.ok:
                metrics.active.tool_errors.labels(tool).inc()

    @staticmethod
    def _round(text: str, calls: tuple[tools.Call, ...], results: list[tools.ToolResult]) -> dict:
        return {
            "text": text,
            "calls": [{"id": c.id, "name": c.name, "arguments": _arguments_json(c.arguments)} for c in calls],
            "results": [{"call_id": r.call_id, "name": r.name, "content": r.text, "is_error": not r.ok}
                        for r in results],
        }

    @staticmethod
    def _kept_blocks(requested: ToolCallsRequested, kept: tuple[tools.Call, ...]) -> list[dict]:
        """Messages: the blocks as received, less the `tool_use` blocks of calls that were dropped;
        a call kept with its arguments emptied (or its name cut) is resent that way."""
        standing = {}  # received id -> the kept calls for it, in order (a model may repeat an id)
        for original, call in zip(requested.calls, kept):
            standing.setdefault(original.id, []).append(call)
        blocks = []
        for block in requested.blocks:
            if block.get("type") != "tool_use":
                blocks.append(block)
                continue
            waiting = standing.get(str(block.get("id", "")))
            if not waiting:
                continue
            call = waiting.pop(0)
            if call.arguments == "{}" or call.name != block.get("name") or call.id != block.get("id"):
                block = {"type": "tool_use", "id": call.id, "name": call.name,
                         "input": block.get("input") if call.arguments != "{}" else {}}
            blocks.append(block)
        return blocks

    def _wire_round(self, text: str, kept: tuple[tools.Call, ...], blocks: list[dict],
                    results: list[tools.ToolResult]) -> list[dict]:
        """The call message and its results, in this wire's shape, for the next request."""
        if self.wire == "messages":
            return [{"role": "assistant", "content": blocks},
                    {"role": "user", "content": [r.messages_block() for r in results]}]
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments_json(c.arguments)}}
                 for c in kept]
        return [{"role": "assistant", "content": text or None, "tool_calls": calls},
                *(r.chat_message() for r in results)]
