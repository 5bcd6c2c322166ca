"""The tool registry and its safety wrapper: schemas from signatures, every failure a result the model
reads (bugs also logged and counted), Stop never swallowed, parallel batches, the tool context, and
the built-in local tools against real loopback servers."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated

import pytest
from pydantic import Field

from chatserver.config import Settings
from chatserver.tools import registry as tools
from chatserver.tools.registry import Registry, ToolContext, ToolError, ToolOutput, registry, select_tools, tool_context
from chatserver.turns.events import Call
from pageserver import PageServer, hanging


def make_settings(tmp_path, **overrides) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path / "data", **overrides)


class Memory:
    """An in-memory stand-in for the store's memory file, counting writes."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.writes = 0

    async def read(self) -> str:
        return self.text

    async def write(self, text: str) -> None:
        self.text = text
        self.writes += 1


def ctx_for(settings: Settings, memory: Memory | None = None) -> ToolContext:
    memory = memory or Memory()
    return ToolContext("conv-1", settings, memory.read, memory.write, owner="alice")


@pytest.fixture
def reg() -> Registry:
    r = Registry()
    calls: list[dict] = []
    r.calls = calls  # type: ignore[attr-defined]

    @r.tool
    async def lookup(word: Annotated[str, Field(description="The word to look up.")], limit: int = 3) -> str:
        """Look a word up."""
        calls.append({"word": word, "limit": limit})
        return f"{word} x{limit}"

    @r.tool
    async def broken(reason: str) -> str:
        """Always fails: a bug."""
        return {}[reason]

    @r.tool
    async def stuck() -> str:
        """Never answers."""
        await asyncio.Event().wait()
        return "unreachable"

    @r.tool
    async def offline() -> str:
        """Fails the way a network does."""
        raise ConnectionRefusedError(111, "Connection refused")

    return r


ALL = {"lookup", "broken", "stuck", "offline"}


def test_schema_comes_from_the_signature_in_both_wire_shapes(reg):
    chat = reg.declarations(["lookup"], "chat")
    schema = {"type": "object", "additionalProperties": False, "required": ["word"], "properties": {
        "word": {"type": "string", "description": "The word to look up."},
        "limit": {"type": "integer", "default": 3}}}
    assert chat == [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                                      "parameters": schema}}]
    assert reg.declarations(["lookup", "nope"], "messages") == [
        {"name": "lookup", "description": "Look a word up.", "input_schema": schema}]


def test_registering_needs_an_async_typed_documented_function():
    r = Registry()

    def sync(x: int) -> str:
        """Sync."""
    async def untyped(x) -> str:
        """Untyped."""
    async def undocumented(x: int) -> str:
        return ""
    for fn, message in ((sync, "async"), (untyped, "annotation"), (undocumented, "docstring")):
        with pytest.raises(TypeError, match=message):
            r.register(fn)


async def test_a_good_call_runs_and_reports(reg):
    result = await reg.run("lookup", '{"word": "rain"}', ALL, call_id="call_1")
    assert (result.ok, result.text, result.call_id, result.arguments) == (True, "rain x3", "call_1", {"word": "rain"})
    assert result.duration_ms >= 0 and result.summary == "rain x3"
    assert result.event() == {"call_id": "call_1", "name": "lookup", "arguments": {"word": "rain"},
                              "status": "done", "summary": "rain x3", "duration_ms": result.duration_ms}
    assert result.chat_message() == {"role": "tool", "tool_call_id": "call_1", "content": "rain x3"}
    assert result.messages_block() == {"type": "tool_result", "tool_use_id": "call_1", "content": "rain x3"}


@pytest.mark.parametrize("name, arguments, reason", [
    ("lookup", '{"word": "rain"', "the arguments are not valid JSON (Expecting ',' delimiter at character 15)"),
    ("lookup", "[1, 2]", "the arguments must be a JSON object"),
    ("lookup", '{"word": 5}', "bad arguments: word: Input should be a valid string"),
    ("lookup", '{"word": "a", "colour": "red"}', "bad arguments: colour: Extra inputs are not permitted"),
    ("lookup", "{}", "bad arguments: word: Field required"),
    ("nope", "{}", "there is no tool by that name; you can call: broken, lookup, offline, stuck"),
])
async def test_expected_failures_become_tool_error_results_and_the_tool_never_runs(reg, name, arguments, reason):
    result = await reg.run(name, arguments, ALL, call_id="c")
    assert not result.ok
    assert result.text == f"[tool error] {name}: {reason}"
    assert result.error == reason
    assert reg.calls == []
    assert sum(reg.failures.values()) == 0  # not a bug


async def test_a_tool_the_conversation_has_not_enabled_is_refused(reg):
    result = await reg.run("lookup", '{"word": "x"}', {"broken"})
    assert result.text == "[tool error] lookup: this tool is not enabled in this conversation; you can call: broken"
    assert reg.calls == []


async def test_a_bug_becomes_a_result_and_is_logged_with_traceback_and_counted(reg, caplog):
    caplog.set_level(logging.ERROR, logger="chat.tools")
    result = await reg.run("broken", '{"reason": "boom"}', ALL)
    assert not result.ok
    assert result.text.startswith("[tool error] broken: the tool failed unexpectedly (KeyError)")
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.exc_info and isinstance(record.exc_info[1], KeyError)
    assert "tool broken failed unexpectedly" in record.getMessage()
    await reg.run("broken", '{"reason": "again"}', ALL)
    listed = {t["name"]: t for t in reg.listing(None) if t["runs"] == "local"}
    assert listed["broken"]["failures"] == 2 and listed["lookup"]["failures"] == 0


async def test_a_network_failure_is_expected_not_a_bug(reg, caplog):
    caplog.set_level(logging.ERROR, logger="chat.tools")
    result = await reg.run("offline", "", ALL)
    assert result.text.startswith("[tool error] offline: network error (ConnectionRefusedError")
    assert caplog.records == [] and reg.failures["offline"] == 0 and reg.errors["offline"] == 1


async def test_a_slow_tool_times_out_into_a_result(reg):
    result = await reg.run("stuck", "{}", ALL, timeout=0.2)
    assert result.text == "[tool error] stuck: timed out after 0.2 s"
    assert 150 <= result.duration_ms < 5000


async def test_the_timeout_comes_from_tool_timeout_in_the_context(reg, tmp_path):
    with tool_context(ctx_for(make_settings(tmp_path, tool_timeout=0.25))):
        result = await reg.run("stuck", "{}", ALL)
    assert result.text == "[tool error] stuck: timed out after 0.25 s"


async def test_stop_during_a_call_cancels_it_and_propagates():
    r = Registry()
    started, ended = asyncio.Event(), []

    @r.tool
    async def waits() -> str:
        """Waits until cancelled."""
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("cancelled")
        return "never"

    task = asyncio.create_task(r.run_batch([Call("a", "waits", "{}")], {"waits"}))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["cancelled"] and r.failures["waits"] == 0 and r.errors["waits"] == 0


async def test_a_batch_runs_in_parallel_and_answers_in_call_order():
    r = Registry()
    a_started, b_started = asyncio.Event(), asyncio.Event()

    @r.tool
    async def first() -> str:
        """Needs the second to be running."""
        a_started.set()
        await b_started.wait()  # deadlocks unless both run at once
        return "first done"

    @r.tool
    async def second() -> str:
        """Needs the first to be running."""
        b_started.set()
        await a_started.wait()
        await asyncio.sleep(0)
        return "second done"

    seen = []
    results = await asyncio.wait_for(
        r.run_batch([Call("1", "second", "{}"), Call("2", "first", ""), Call("3", "nope", "{}")],
                    {"first", "second"}, on_result=lambda res: seen.append(res.call_id)), 5)
    assert [(x.call_id, x.ok, x.text) for x in results] == [
        ("1", True, "second done"), ("2", True, "first done"),
        ("3", False, "[tool error] nope: there is no tool by that name; you can call: first, second")]
    assert sorted(seen) == ["1", "2", "3"]


async def test_long_results_are_capped_and_say_so():
    r = Registry()

    @r.tool
    async def verbose() -> ToolOutput:
        """Talks a lot."""
        return ToolOutput("a" * (tools.TOOL_RESULT_MAX_CHARS + 500), summary="lots")

    result = await r.run("verbose", "{}", {"verbose"})
    assert result.text == "a" * tools.TOOL_RESULT_MAX_CHARS + "\n[cut: 500 more characters not shown]"
    assert result.summary == "lots"


async def test_the_context_is_seen_inside_parallel_calls_and_reset_after(tmp_path):
    r = Registry()

    @r.tool
    async def whoami() -> str:
        """Who the call acts for."""
        ctx = tools.current_context()
        if ctx is None:
            raise ToolError("no active conversation")
        return f"{ctx.owner}/{ctx.conversation_id}"

    ctx = ctx_for(make_settings(tmp_path))
    with tool_context(ctx):
        results = await r.run_batch([Call("1", "whoami", ""), Call("2", "whoami", "")], {"whoami"})
    assert [x.text for x in results] == ["alice/conv-1", "alice/conv-1"]
    assert tools.current_context() is None
    outside = await r.run("whoami", "", {"whoami"})
    assert outside.text == "[tool error] whoami: no active conversation"


async def test_the_context_is_reset_even_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with tool_context(ctx_for(make_settings(tmp_path))):
            raise RuntimeError("turn failed")
    assert tools.current_context() is None


# --- remember ---------------------------------------------------------------------------------

async def test_remember_without_a_turn_says_so():
    result = await registry.run("remember", '{"fact": "Likes tea"}', {"remember"})
    assert result.text == "[tool error] remember: no active conversation, so there is no one to remember this for"


async def test_remember_appends_with_the_compression_dedup(tmp_path):
    memory = Memory("- Prefers Python\n")
    with tool_context(ctx_for(make_settings(tmp_path), memory)):
        saved = await registry.run("remember", json.dumps({"fact": "Lives in  Busan\n"}), {"remember"})
        again = await registry.run("remember", json.dumps({"fact": "- lives in BUSAN"}), {"remember"})
        known = await registry.run("remember", json.dumps({"fact": "prefers python"}), {"remember"})
    assert memory.text == "- Prefers Python\n- Lives in Busan\n"
    assert memory.writes == 1
    assert (saved.text, saved.summary) == ("Saved to memory: Lives in Busan", "remembered: Lives in Busan")
    assert again.text == "Already in memory: lives in BUSAN" and known.ok


async def test_parallel_remember_calls_keep_both_facts(tmp_path):
    memory = Memory()
    slow_read = memory.read

    async def read_slowly() -> str:
        text = await slow_read()
        await asyncio.sleep(0)  # let the other call interleave if nothing serialises them
        return text

    ctx = ToolContext("conv-1", make_settings(tmp_path), read_slowly, memory.write)
    with tool_context(ctx):
        await registry.run_batch([Call("1", "remember", '{"fact": "Has a cat"}'),
                                  Call("2", "remember", '{"fact": "Works nights"}')], {"remember"})
    assert memory.text == "- Has a cat\n- Works nights\n"


# --- web_fetch and web_search -------------------------------------------------------------------

async def test_web_fetch_tool_reads_an_allowed_page_with_a_citation(tmp_path):
    with PageServer() as server:
        server.routes["/notes"] = (200, {"Content-Type": "text/html"},
                                   b"<html><head><title>Field notes</title></head><body><article><p>"
                                   + b"Cherry blossoms open in early April in Seoul. " * 10 + b"</p></article></body></html>")
        with tool_context(ctx_for(make_settings(tmp_path, fetch_allow_hosts="127.0.0.1"))):
            result = await registry.run("web_fetch", json.dumps({"url": server.url("/notes")}), {"web_fetch"})
    assert result.ok and "Cherry blossoms open" in result.text
    assert result.text.startswith("Title: Field notes\n")
    assert result.citations == ({"url": server.url("/notes"), "title": "Field notes"},)
    assert result.summary.startswith("127.0.0.1: Field notes (")


async def test_web_fetch_tool_refusal_is_a_tool_error(tmp_path):
    with PageServer() as server:
        with tool_context(ctx_for(make_settings(tmp_path))):
            result = await registry.run("web_fetch", json.dumps({"url": server.url("/")}), {"web_fetch"})
        assert server.seen == []
    assert result.text.startswith("[tool error] web_fetch: 127.0.0.1 is refused: 127.0.0.1 is a loopback address")


async def test_web_fetch_tool_times_out_after_tool_timeout(tmp_path):
    with PageServer() as server:
        server.routes["/slow"] = hanging(server)
        settings = make_settings(tmp_path, fetch_allow_hosts="127.0.0.1", tool_timeout=0.3)
        with tool_context(ctx_for(settings)):
            result = await registry.run("web_fetch", json.dumps({"url": server.url("/slow")}), {"web_fetch"})
    assert result.text == "[tool error] web_fetch: timed out after 0.3 s"


SEARX_ANSWER = {"query": "rust async", "results": [
    {"url": "https://tokio.rs/", "title": "Tokio", "content": "An asynchronous runtime for Rust."},
    {"url": "https://rust-lang.github.io/async-book/", "title": "Async book", "content": "Asynchronous\n programming."},
]}


async def test_web_search_asks_searxng_for_json_and_lists_the_results(tmp_path):
    with PageServer() as searx:
        searx.routes["/search"] = (200, {"Content-Type": "application/json"}, json.dumps(SEARX_ANSWER).encode())
        settings = make_settings(tmp_path, searxng_url=searx.url("/"))
        assert "web_search" in registry.available(settings)
        with tool_context(ctx_for(settings)):
            result = await registry.run("web_search", '{"query": "rust async"}', {"web_search"})
        assert searx.paths() == ["/search?q=rust+async&format=json"]
    assert result.ok and result.summary == "2 results for “rust async”"
    assert result.text == ("Results for: rust async\n\n1. Tokio\n   https://tokio.rs/\n   An asynchronous runtime for Rust.\n"
                           "2. Async book\n   https://rust-lang.github.io/async-book/\n   Asynchronous programming.")
    assert result.citations == ({"url": "https://tokio.rs/", "title": "Tokio"},
                                {"url": "https://rust-lang.github.io/async-book/", "title": "Async book"})


async def test_web_search_is_not_offered_without_searxng(tmp_path):
    settings = make_settings(tmp_path)
    assert "web_search" not in registry.available(settings)
    listed = {(t["name"], t["runs"]): t for t in registry.listing(settings)}
    assert listed[("web_search", "local")]["available"] is False
    assert listed[("web_search", "gateway")]["parameters"]["required"] == ["query"]
    with tool_context(ctx_for(settings)):
        result = await registry.run("web_search", '{"query": "x"}', {"web_search"})
    assert result.text == "[tool error] web_search: this tool is not configured on this server"


async def test_a_searxng_error_is_a_tool_error(tmp_path):
    with PageServer() as searx:
        searx.routes["/search"] = (403, {"Content-Type": "text/html"}, b"format not allowed")
        with tool_context(ctx_for(make_settings(tmp_path, searxng_url=searx.url("/")))):
            result = await registry.run("web_search", '{"query": "x"}', {"web_search"})
    assert result.text == "[tool error] web_search: the search engine answered HTTP 403"


# --- What a turn offers -------------------------------------------------------------------------

def test_select_tools_narrows_by_preset_conversation_settings_and_runtime(tmp_path):
    plain = make_settings(tmp_path)
    searx = make_settings(tmp_path, searxng_url="http://127.0.0.1:8888")
    preset = ["remember", "web_fetch", "web_search"]
    assert select_tools(registry, plain, allowed=preset, chosen=None, runtime="local", web_fetch=True) == \
        tools.Selection(("web_fetch", "remember"), ())
    assert select_tools(registry, searx, allowed=preset, chosen=None, runtime="local",
                        web_search=True, web_fetch=True).local == ("web_fetch", "web_search", "remember")
    # The conversation can only narrow the preset: a tool the preset lacks is not offered.
    assert select_tools(registry, plain, allowed=["remember"], chosen=["remember", "web_fetch"], runtime="local",
                        web_fetch=True).local == ("remember",)
    # On the gateway runtime the web tools become server tools, and only when switched on.
    assert select_tools(registry, searx, allowed=preset, chosen=None, runtime="gateway", web_search=True) == \
        tools.Selection(("remember",), ("web_search",))
    assert select_tools(registry, searx, allowed=preset, chosen=None, runtime="none", web_search=True) == \
        tools.Selection((), ())


async def test_a_tool_returning_the_wrong_type_is_a_counted_bug(caplog):
    r = Registry()

    @r.tool
    async def sloppy() -> str:
        """Returns a number by mistake."""
        return 42  # type: ignore[return-value]

    caplog.set_level(logging.ERROR, logger="chat.tools")
    result = await r.run("sloppy", "{}", {"sloppy"})
    assert result.text.startswith("[tool error] sloppy: the tool failed unexpectedly (TypeError)")
    assert r.failures["sloppy"] == 1 and caplog.records[0].exc_info is not None


async def test_two_turns_at_once_each_see_only_their_own_context(tmp_path):
    r = Registry()
    both_inside = asyncio.Barrier(2)

    @r.tool
    async def whose() -> str:
        """Whose memory this call would touch."""
        await both_inside.wait()  # both turns are inside their calls at the same moment
        return tools.current_context().owner

    settings = make_settings(tmp_path)

    async def turn(owner: str) -> str:
        ctx = ToolContext(f"conv-{owner}", settings, Memory().read, Memory().write, owner=owner)
        with tool_context(ctx):
            return (await r.run("whose", "", {"whose"})).text

    assert await asyncio.wait_for(asyncio.gather(turn("alice"), turn("bob")), 5) == ["alice", "bob"]


async def test_streaming_a_batch_yields_in_finishing_order_without_leaking_the_context(tmp_path):
    r = Registry()
    release_slow = asyncio.Event()
    seen_inside = []

    @r.tool
    async def slow() -> str:
        """Finishes when released."""
        await release_slow.wait()
        seen_inside.append(tools.current_context().owner)
        return "slow"

    @r.tool
    async def quick() -> str:
        """Finishes at once."""
        seen_inside.append(tools.current_context().owner)
        return "quick"

    order, outside = [], []
    stream = r.run_streaming([Call("1", "slow", ""), Call("2", "quick", "")], {"slow", "quick"},
                             ctx_for(make_settings(tmp_path)))
    async for result in stream:
        order.append(result.call_id)
        outside.append(tools.current_context())  # the consumer between events never sees the turn's context
        release_slow.set()
    assert order == ["2", "1"] and outside == [None, None] and seen_inside == ["alice", "alice"]


async def test_cancelling_a_streamed_batch_cancels_the_running_calls(tmp_path):
    r = Registry()
    started, cancelled = asyncio.Event(), asyncio.Event()

    @r.tool
    async def waits() -> str:
        """Waits until cancelled."""
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def consume() -> None:
        async for _ in r.run_streaming([Call("1", "waits", "")], {"waits"}, ctx_for(make_settings(tmp_path))):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(cancelled.wait(), 5)


def test_tool_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FETCH_ALLOW_HOSTS", "Wiki.Corp, 127.0.0.1,")
    monkeypatch.setenv("SEARXNG_URL", "http://127.0.0.1:8888/")
    monkeypatch.setenv("TOOL_TIMEOUT", "12.5")
    settings = Settings(_env_file=None, data_dir=tmp_path)
    assert settings.fetch_allow_hosts == ["wiki.corp", "127.0.0.1"]
    assert settings.searxng_url == "http://127.0.0.1:8888" and settings.tool_timeout == 12.5
    assert (settings.tool_rounds_max, settings.fetch_max_bytes) == (8, 2_097_152)
    assert (settings.default_web_search, settings.default_web_fetch) == (False, False)
    monkeypatch.setenv("SEARXNG_URL", " ")
    assert Settings(_env_file=None, data_dir=tmp_path).searxng_url is None
