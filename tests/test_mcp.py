"""MCP servers' tools through the real app: real MCP servers (the `mcp` SDK, tests/mcp_server.py) on a
loopback port over Streamable HTTP and over stdio, their tools in `/api/tools` as `server__tool`,
called by a scripted model on both wire formats, a server killed and restarted under a
conversation, a slow and a huge answer cut, an image a tool returns kept as the reply's
attachment, presets that do not name a server offering none of its tools, and header secrets
that never reach an answer."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time

import httpx
import pytest

from chatserver.config import Settings
from chatserver.tools import registry as tools
from chatserver.tools.mcp import IMAGES_MAX
from gateway_sim.simulator import Script, steps
from mcp_support import SECRET, SERVER, McpServer
from support import free_port, names, parse_sse, serve


@pytest.fixture
def mcp_http():
    server = McpServer(free_port(), token=SECRET)
    yield server
    server.stop()


@pytest.fixture
def settings(tmp_path, sim, mcp_http) -> Settings:
    listing = tmp_path / "mcp.json"
    listing.write_text(json.dumps([
        {"name": "demo", "url": mcp_http.url, "headers": {"X-Token": SECRET}},
        {"name": "local", "command": sys.executable, "args": [str(SERVER), "stdio"]},
    ]))
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    default_tool_runtime="local", tool_rounds_max=4, mcp_servers=listing, mcp_timeout=10)


async def wait_for(check, what: str, seconds: float = 45):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


async def server_state(client, name: str) -> dict:
    listed = (await client.get("/api/tools/servers")).json()["servers"]
    return next(s for s in listed if s["name"] == name)


async def both_connected(client) -> None:
    async def check():
        states = (await client.get("/api/tools/servers")).json()["servers"]
        return len(states) == 2 and all(s["connected"] for s in states)
    await wait_for(check, "both MCP servers connected")


async def mcp_preset(client, tools_: list[str], name: str = "with-mcp") -> None:
    created = await client.post("/api/presets", json={"name": name, "text": "You use tools.", "tools": tools_})
    assert created.status_code == 201, created.text


async def turn(client, conv_id: str, content: str) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


def tool_results(body: dict) -> list[str]:
    """The tool results in an upstream request body, either wire format."""
    out = []
    for message in body["messages"]:
        if message["role"] == "tool":
            out.append(message["content"])
        elif isinstance(message.get("content"), list):
            out += [b["content"] for b in message["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
    return out


def declared(body: dict) -> list[str]:
    return [t["function"]["name"] if "function" in t else t["name"] for t in body.get("tools", [])]


async def test_tools_of_both_servers_are_listed_as_server__tool_and_secrets_stay_here(client, app):
    await both_connected(client)
    listed = {t["name"]: t for t in (await client.get("/api/tools")).json()}
    for name in ("demo__add", "demo__echo", "local__add", "local__nap"):
        assert listed[name]["runs"] == "mcp" and listed[name]["available"] is True
    assert listed["demo__add"]["server"] == "demo"
    assert listed["demo__add"]["parameters"]["required"] == ["a", "b"]
    assert listed["demo__add"]["description"] == "Add two whole numbers."
    assert listed["remember"]["runs"] == "local"  # our own tools are still there

    servers = (await client.get("/api/tools/servers")).json()["servers"]
    demo = next(s for s in servers if s["name"] == "demo")
    assert demo["connected"] is True and demo["error"] is None and demo["failures"] == 0
    assert demo["header_names"] == ["X-Token"] and demo["source"] == "file"
    # The header's value went to the MCP server (it refuses requests without it) and nowhere else.
    for path in ("/api/tools", "/api/tools/servers", "/api/presets", "/openapi.json"):
        assert SECRET not in (await client.get(path)).text


@pytest.mark.parametrize("wire", ["chat", "messages"])
async def test_a_scripted_model_calls_an_mcp_tool_and_reads_the_result(api, client, sim, wire):
    await both_connected(client)
    await mcp_preset(client, ["demo__*", "local__echo", "remember"])
    model = None
    if wire == "messages":
        added = await client.post("/api/models", json={"id": "vendor/gw", "tier": "fast", "tool_runtime": "gateway"})
        assert added.status_code == 201
        model = "vendor/gw"
    conv = await api.new(preset="with-mcp", **({"model": model} if model else {}))
    if wire == "messages":
        await api.patch(conv["id"], settings={"web_search": True})  # the gateway's search: /v1/messages
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 19, "b": 23}, id="call_1"),
                        steps.ToolCall("local__echo", {"text": "héllo"}, id="call_2")]),
                Script([steps.Text("It is 42.")]))

    events = await turn(client, conv["id"], "What is 19 + 23?")

    assert names(events)[-1] == "done"
    first, second = sim.requests[-2:]
    assert first.path == ("/v1/messages" if wire == "messages" else "/v1/chat/completions")
    offered = declared(first.body)
    assert {"demo__add", "demo__echo", "demo__nap", "local__echo"} <= set(offered)
    assert "local__add" not in offered  # the preset names one tool of `local`, not the server
    assert tool_results(second.body) == ["42", "echo: héllo"]
    finished = [d for n, d in events if n == "tool" and d["status"] != "running"]
    assert {(d["name"], d["status"]) for d in finished} == {("demo__add", "done"), ("local__echo", "done")}
    stored = (await api.get(conv["id"]))["messages"][-1]
    trail = {s["name"]: s for s in stored["activity"] if s["kind"] == "tool"}
    assert trail["demo__add"]["status"] == "done" and trail["demo__add"]["summary"] == "42"
    assert stored["content"] == "It is 42."


async def test_a_preset_that_does_not_name_a_server_offers_none_of_its_tools(api, client, sim):
    await both_connected(client)
    conv = await api.new()  # the built-in default: our own tools only
    sim.enqueue(Script([steps.Text("Hi.")]))
    await turn(client, conv["id"], "Hello")
    offered = declared(sim.requests[-1].body)
    assert "remember" in offered and not [n for n in offered if "__" in n]

    await mcp_preset(client, ["remember", "local__*"], name="stdio-only")
    conv = await api.new(preset="stdio-only")
    sim.enqueue(Script([steps.Text("Hi.")]))
    await turn(client, conv["id"], "Hello")
    offered = declared(sim.requests[-1].body)
    assert "local__add" in offered and not [n for n in offered if n.startswith("demo__")]
    # A call to a tool the preset does not offer is refused, not run.
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 1, "b": 2}, id="c1")]), Script([steps.Text("Sorry.")]))
    await turn(client, conv["id"], "Add")
    assert "not enabled" in tool_results(sim.requests[-1].body)[-1]


async def test_killed_server_is_a_tool_error_then_works_again_after_its_restart(api, client, sim, mcp_http):
    await both_connected(client)
    await mcp_preset(client, ["demo__*"])
    conv = await api.new(preset="with-mcp")
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 1, "b": 1}, id="c1")]), Script([steps.Text("Two.")]))
    await turn(client, conv["id"], "1+1?")
    assert tool_results(sim.requests[-1].body)[-1] == "2"

    mcp_http.kill()
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 2, "b": 2}, id="c2")]),
                Script([steps.Text("The tool is down.")]))
    events = await turn(client, conv["id"], "2+2?")

    assert names(events)[-1] == "done"
    error = tool_results(sim.requests[-1].body)[-1]
    assert error.startswith("[tool error] demo__add: the MCP server demo ")
    assert (await api.get(conv["id"]))["messages"][-1]["content"] == "The tool is down."

    async def down():
        state = await server_state(client, "demo")
        return not state["connected"] and state["error"] and state["failures"] >= 1
    await wait_for(down, "/api/tools/servers shows demo down")
    listed = {t["name"]: t for t in (await client.get("/api/tools")).json()}
    assert listed["demo__add"]["available"] is False
    assert SECRET not in (await client.get("/api/tools/servers")).text

    mcp_http.start()  # the same port; our server is not restarted

    async def up():
        return (await server_state(client, "demo"))["connected"]
    await wait_for(up, "demo reconnected")
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 3, "b": 4}, id="c3")]), Script([steps.Text("Seven.")]))
    await turn(client, conv["id"], "3+4?")
    assert tool_results(sim.requests[-1].body)[-1] == "7"


async def test_a_slow_tool_and_a_huge_answer_are_cut(api, client, sim):
    await both_connected(client)
    await mcp_preset(client, ["demo__*", "local__*"])
    conv = await api.new(preset="with-mcp")
    # 10 MB over Streamable HTTP (under MCP_MAX_BYTES, 16 MB); over stdio the SDK itself takes about
    # 5 s for 10 MB, so 2 MB there.
    sim.enqueue(Script([steps.ToolCall("demo__nap", {"seconds": 120}, id="c1"),
                        steps.ToolCall("local__flood", {"megabytes": 2}, id="c2"),
                        steps.ToolCall("demo__flood", {"megabytes": 10}, id="c3")]),
                Script([steps.Text("Done.")]))
    started = time.monotonic()
    events = await turn(client, conv["id"], "Go")

    assert names(events)[-1] == "done" and time.monotonic() - started < 60
    slow, stdio_flood, http_flood = tool_results(sim.requests[-1].body)
    assert slow == "[tool error] demo__nap: timed out after 10 s (MCP_TIMEOUT)"
    for flood in (stdio_flood, http_flood):
        assert len(flood) <= tools.TOOL_RESULT_MAX_CHARS + 100
        assert flood.startswith("xxxx") and "more characters not shown]" in flood
    # A slow call is the server's fault, counted, but it stays connected.
    state = await server_state(client, "demo")
    assert state["failures"] >= 1 and state["connected"]


async def test_a_server_answering_garbage_is_a_tool_error_and_the_turn_goes_on(api, client, sim):
    await both_connected(client)
    await mcp_preset(client, ["demo__garble", "demo__add"])
    conv = await api.new(preset="with-mcp")
    sim.enqueue(Script([steps.ToolCall("demo__garble", {}, id="c1")]),
                Script([steps.ToolCall("demo__add", {"a": 2, "b": 3}, id="c2")]), Script([steps.Text("Five.")]))
    events = await turn(client, conv["id"], "Go")
    assert names(events)[-1] == "done"
    garbled, added = tool_results(sim.requests[-1].body)
    assert garbled.startswith("[tool error] demo__garble: the MCP server demo answered something that is not "
                              "a tool result")
    assert added == "5"  # the same connection still serves the next call
    assert (await server_state(client, "demo"))["connected"]


async def test_an_answer_past_mcp_max_bytes_is_refused_and_the_server_reconnects(tmp_path, sim, mcp_http):
    listing = tmp_path / "mcp.json"
    listing.write_text(json.dumps([{"name": "demo", "url": mcp_http.url, "headers": {"X-Token": SECRET}}]))
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                        default_tool_runtime="local", mcp_servers=listing, mcp_max_bytes=1024 * 1024)
    async with serve(settings) as (_, client):
        async def up():
            return (await server_state(client, "demo"))["connected"]
        await wait_for(up, "demo connected")
        await mcp_preset(client, ["demo__*"])
        conv = (await client.post("/api/conversations", json={"preset": "with-mcp"})).json()
        sim.enqueue(Script([steps.ToolCall("demo__flood", {"megabytes": 2}, id="c1")]), Script([steps.Text("Too big.")]))
        await turn(client, conv["id"], "Flood")
        assert tool_results(sim.requests[-1].body) == [
            "[tool error] demo__flood: the answer passed 1,048,576 bytes (MCP_MAX_BYTES) and was not read"]
        assert (await server_state(client, "demo"))["failures"] >= 1
        await wait_for(up, "demo reconnected")
        sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 1, "b": 2}, id="c2")]), Script([steps.Text("3.")]))
        await turn(client, conv["id"], "1+2")
        assert tool_results(sim.requests[-1].body)[-1] == "3"


async def test_an_image_a_tool_returns_is_kept_as_the_replys_attachment_and_named_to_the_model(api, client, sim):
    from PIL import Image

    await both_connected(client)
    await mcp_preset(client, ["demo__photo", "local__photo"])
    conv = await api.new(preset="with-mcp")
    sim.enqueue(Script([steps.ToolCall("demo__photo", {}, id="c1")]), Script([steps.Text("A yellow box.")]))
    events = await turn(client, conv["id"], "Take a photo")

    assert names(events)[-1] == "done"
    (attached,) = [data["attachment"] for name, data in events if name == "image"]
    assert (attached["kind"], attached["width"], attached["height"]) == ("image", 64, 48)
    assert attached["name"] == "demo__photo-image-1.png"
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert reply["attachment_ids"] == [attached["id"]] and reply["content"] == "A yellow box."
    download = await client.get(f"/api/conversations/{conv['id']}/attachments/{attached['id']}")
    assert download.status_code == 200 and download.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(download.content))
    assert dict(image.getexif()) == {} and "exif" not in image.info and b"Canon" not in download.content
    # The model reads the caption and the stored image's name, never its bytes.
    result = tool_results(sim.requests[-1].body)[-1]
    assert result == (f"A yellow box.\n[image demo__photo-image-1.png kept as attachment {attached['id']} "
                      f"(image/png, 64 × 48, {attached['bytes']:,} bytes): the person sees it under your reply]")

    # Over stdio too, and a call returning more than IMAGES_MAX keeps that many and names the rest.
    sim.enqueue(Script([steps.ToolCall("local__photo", {"count": IMAGES_MAX + 2}, id="c2")]),
                Script([steps.Text("Lots.")]))
    events = await turn(client, conv["id"], "Take many")
    kept = [data["attachment"]["id"] for name, data in events if name == "image"]
    assert len(kept) == IMAGES_MAX
    assert (await api.get(conv["id"]))["messages"][-1]["attachment_ids"] == kept
    result = tool_results(sim.requests[-1].body)[-1]
    assert all(aid in result for aid in kept) and "base64" not in result and len(result) < 2_000
    assert result.count(f"not kept: at most {IMAGES_MAX} images are kept per call]") == 2


async def test_a_damaged_image_from_a_tool_is_a_note_and_a_warning_and_the_turn_goes_on(api, client, sim):
    await both_connected(client)
    await mcp_preset(client, ["demo__chart"])
    conv = await api.new(preset="with-mcp")
    sim.enqueue(Script([steps.ToolCall("demo__chart", {}, id="c1")]), Script([steps.Text("Up 12%.")]))
    events = await turn(client, conv["id"], "Chart?")

    assert names(events)[-1] == "done" and "image" not in names(events)
    (warning,) = [data for name, data in events if name == "warning"]
    assert warning["code"] == "image_not_kept" and warning["message"].startswith(
        "The tool demo__chart returned an image that could not be kept: ")
    result = tool_results(sim.requests[-1].body)[-1]
    assert result == f"Sales rose 12% in March.\n[{warning['message']}]"
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert reply["content"] == "Up 12%." and not reply.get("attachment_ids")
    assert (await client.get(f"/api/conversations/{conv['id']}/attachments")).json() == []


async def test_bad_arguments_are_checked_against_the_servers_schema(api, client, sim):
    await both_connected(client)
    await mcp_preset(client, ["demo__add"])
    conv = await api.new(preset="with-mcp")
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": "one"}, id="c1")]), Script([steps.Text("Oops.")]))
    await turn(client, conv["id"], "Add")
    error = tool_results(sim.requests[-1].body)[-1]
    assert error.startswith("[tool error] demo__add: bad arguments: ")
    assert "'b' is a required property" in error and "'one' is not of type 'integer'" in error


async def test_a_changed_tool_list_is_picked_up_without_reconnecting(api, client, sim):
    await both_connected(client)
    await mcp_preset(client, ["demo__*"])
    conv = await api.new(preset="with-mcp")
    assert "demo__fresh" not in {t["name"] for t in (await client.get("/api/tools")).json()}
    sim.enqueue(Script([steps.ToolCall("demo__grow", {}, id="c1")]), Script([steps.Text("Grown.")]))
    await turn(client, conv["id"], "Grow")

    async def fresh():
        return "demo__fresh" in {t["name"] for t in (await client.get("/api/tools")).json()}
    await wait_for(fresh, "the new tool listed")
    assert (await server_state(client, "demo"))["failures"] == 0


async def test_admins_add_and_remove_http_servers_never_stdio_ones(client, app, settings, mcp_http):
    await both_connected(client)
    added = await client.post("/api/tools/servers", json={
        "name": "again", "url": mcp_http.url, "headers": {"X-Token": SECRET}})
    assert added.status_code == 201, added.text
    assert added.json()["header_names"] == ["X-Token"] and SECRET not in added.text
    stored = json.loads((settings.data_dir / "mcp_servers.json").read_text())
    assert stored[0]["name"] == "again"

    async def again():
        return (await server_state(client, "again"))["connected"]
    await wait_for(again, "the added server connected")
    assert "again__add" in {t["name"] for t in (await client.get("/api/tools")).json()}

    for body, status, fragment in [
        ({"name": "run", "command": "rm", "url": mcp_http.url}, 422, ""),
        ({"name": "bad__name", "url": mcp_http.url}, 422, "name"),
        ({"name": "nourl", "url": "file:///etc/passwd"}, 422, "http or https"),
        ({"name": "again", "url": mcp_http.url}, 409, "already exists"),
        ({"name": "demo", "url": mcp_http.url}, 409, "already exists"),
    ]:
        answer = await client.post("/api/tools/servers", json=body)
        assert answer.status_code == status and fragment in answer.json()["detail"], answer.text
    assert len(json.loads((settings.data_dir / "mcp_servers.json").read_text())) == 1

    assert (await client.delete("/api/tools/servers/demo")).status_code == 400
    assert (await client.delete("/api/tools/servers/again")).status_code == 204
    assert (await client.delete("/api/tools/servers/again")).status_code == 404
    listed = {t["name"] for t in (await client.get("/api/tools")).json()}
    assert "again__add" not in listed and "demo__add" in listed


async def test_an_sse_server_is_listed_called_and_followed_through_notifications(tmp_path, sim):
    """The older SSE transport (and the 2025 protocol's `tools/list_changed` notification)."""
    sse = McpServer(free_port(), transport="sse")
    try:
        listing = tmp_path / "mcp.json"
        listing.write_text(json.dumps([{"name": "old", "url": sse.url, "transport": "sse"}]))
        settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                            upstream_timeout=5, default_tool_runtime="local", mcp_servers=listing, mcp_timeout=10)
        async with serve(settings) as (_, client):
            async def up():
                return (await server_state(client, "old"))["connected"]
            await wait_for(up, "the SSE server connected")
            await mcp_preset(client, ["old__*"])
            conv = (await client.post("/api/conversations", json={"preset": "with-mcp"})).json()
            sim.enqueue(Script([steps.ToolCall("old__multiply", {"a": 6, "b": 7}, id="c1"),
                                steps.ToolCall("old__grow", {}, id="c2")]), Script([steps.Text("42.")]))
            events = await turn(client, conv["id"], "6*7?")
            assert names(events)[-1] == "done"
            assert tool_results(sim.requests[-1].body) == ["42", "grown"]

            async def fresh():
                return "old__fresh" in {t["name"] for t in (await client.get("/api/tools")).json()}
            await wait_for(fresh, "the new tool listed after the notification")
    finally:
        sse.stop()


async def test_two_servers_on_one_redis_each_connect_to_a_server_an_admin_added_on_one(tmp_path, sim, redis_server,
                                                                                       mcp_http):
    """Each process keeps its own connections; the page's list lives in the store they share."""
    from test_several_servers import two_servers

    first, second = two_servers(tmp_path, sim, redis_server)
    try:
        added = httpx.post(f"{first.base_url}/api/tools/servers", timeout=10,
                           json={"name": "shared", "url": mcp_http.url, "headers": {"X-Token": SECRET}})
        assert added.status_code == 201, added.text

        def connected_on(server) -> bool:
            states = httpx.get(f"{server.base_url}/api/tools/servers", timeout=10).json()["servers"]
            return any(s["name"] == "shared" and s["connected"] for s in states)

        deadline = time.monotonic() + 60
        while not (connected_on(first) and connected_on(second)):
            assert time.monotonic() < deadline, "the added server did not connect on both processes"
            time.sleep(0.2)
        for server in (first, second):
            listed = httpx.get(f"{server.base_url}/api/tools", timeout=10).text
            assert "shared__add" in listed and SECRET not in listed
            assert SECRET not in server.log()
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("entry, source, fragment", [
    ({"name": "a__b", "url": "http://127.0.0.1:1/mcp"}, "file", "name"),
    ({"name": "ok", "url": "ftp://host/x"}, "file", "http or https"),
    ({"name": "ok"}, "file", "either a url or a command"),
    ({"name": "ok", "url": "http://h/mcp", "command": "x"}, "file", "either a url or a command"),
    ({"name": "ok", "command": "python"}, "page", "only in the MCP_SERVERS file"),
    ({"name": "ok", "url": "http://h/mcp", "transport": "ws"}, "file", "transport"),
    ({"name": "ok", "url": "http://h/mcp", "headers": {"X-A": "one\r\nX-B: two"}}, "page", "one line"),
    ({"name": "ok", "url": "http://h/mcp", "headers": {"bad name": "v"}}, "page", "not a header name"),
    ({"name": "ok", "command": "python", "args": "-m x"}, "file", "args"),
    (["not", "an", "object"], "file", "JSON object"),
])
def test_bad_server_entries_are_refused_with_the_reason(entry, source, fragment):
    from chatserver.tools.mcp import ServerConfigError, parse_server

    with pytest.raises(ServerConfigError, match=fragment):
        parse_server(entry, source=source)


async def test_an_unreadable_mcp_servers_file_stops_the_start_with_its_name(tmp_path, sim):
    from chatserver.app import create_app
    from chatserver.tools.mcp import ServerConfigError

    listing = tmp_path / "mcp.json"
    listing.write_text('[{"name": "x", "url": "http://127.0.0.1:1/mcp"}, {"name": "x", "command": "true"}]')
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", mcp_servers=listing)
    app = create_app(settings)
    with pytest.raises(ServerConfigError, match="two servers share a name"):
        async with app.router.lifespan_context(app):
            pass
    listing.write_text("{not json")
    with pytest.raises(ServerConfigError, match=f"MCP_SERVERS={listing}: cannot be read as JSON"):
        async with app.router.lifespan_context(app):
            pass


def test_a_listed_tool_is_checked_named_and_described_within_limits(tmp_path):
    import mcp_types as types

    from chatserver.tools.mcp import DESCRIPTION_MAX_CHARS, ServerConnection, parse_server

    spec = parse_server({"name": "srv", "url": "http://127.0.0.1:1/mcp"}, source="file")
    conn = ServerConnection(spec, tools.Registry(), Settings(_env_file=None, data_dir=tmp_path))
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    good = conn._tool(types.Tool(name="find", description="word " * 500, input_schema=schema))
    assert good is not None and good.name == "srv__find" and good.server == "srv"
    assert len(good.description) == DESCRIPTION_MAX_CHARS and good.description.endswith("…")
    with pytest.raises(tools.ToolError, match="'q' is a required property"):
        good.check({})
    for bad in (types.Tool(name="odd name", input_schema=schema),
                types.Tool(name="x" * 70, input_schema=schema),
                types.Tool(name="scalar", input_schema={"type": "string"}),
                types.Tool(name="broken", input_schema={"type": "object", "properties": {"q": {"type": 5}}})):
        assert conn._tool(bad) is None, bad.name
