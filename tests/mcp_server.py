"""A real MCP server for the tests and the benchmark, built with the `mcp` SDK.

    python tests/mcp_server.py http PORT     Streamable HTTP on 127.0.0.1:PORT/mcp
    python tests/mcp_server.py sse PORT      the older SSE transport on 127.0.0.1:PORT/sse
    python tests/mcp_server.py stdio         over stdin/stdout

With MCP_DEMO_TOKEN set, HTTP requests must carry `X-Token: <that value>` (a secret header the
chat server sends and never shows). Over HTTP, a call of `garble` is answered with a result that
is not an MCP result (a server answering garbage).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ImageContent, TextContent

server = MCPServer("demo")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    return str(a + b)


@server.tool()
def multiply(a: int, b: int) -> str:
    """Multiply two whole numbers."""
    return str(a * b)


@server.tool()
def upper(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"echo: {text}"


@server.tool()
async def nap(seconds: float) -> str:
    """Sleep for some seconds, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds} s"


@server.tool()
def flood(megabytes: int) -> list:
    """Return that many megabytes of text (as content only: a str would be sent twice, as structured content too)."""
    return [TextContent(type="text", text="x" * (megabytes * 1024 * 1024))]


@server.tool()
def chart() -> list:
    """Draw a chart: a caption and a PNG."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    return [TextContent(type="text", text="Sales rose 12% in March."),
            ImageContent(type="image", data=png, mime_type="image/png")]


@server.tool()
def photo(count: int = 1) -> list:
    """Take photos: a caption and `count` PNGs (64 × 48, yellow) that carry a camera's EXIF."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x010F] = "Canon"  # Make
    exif[0x0110] = "EOS 5D Mark IV"  # Model
    out = io.BytesIO()
    Image.new("RGB", (64, 48), "yellow").save(out, format="PNG", exif=exif)
    png = base64.b64encode(out.getvalue()).decode()
    return [TextContent(type="text", text="A yellow box."),
            *(ImageContent(type="image", data=png, mime_type="image/png") for _ in range(count))]


@server.tool()
def garble() -> str:
    """Answer (over HTTP the answer is replaced by garbage on its way out)."""
    return "fine"


@server.tool()
async def grow(ctx: Context) -> str:
    """Add a tool named `fresh` and tell the client the list changed."""
    server.add_tool(lambda: "fresh and new", name="fresh", description="A tool added while connected.")
    await ctx.notify_tools_changed()
    return "grown"


def garbling(app):
    """The app, except that a call of `garble` gets a JSON-RPC answer whose result is malformed."""
    async def garbled(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body or b"{}")
        if isinstance(request, dict) and request.get("method") == "tools/call" and \
                request.get("params", {}).get("name") == "garble":
            answer = json.dumps({"jsonrpc": "2.0", "id": request["id"],
                                 "result": {"content": "not a list", "isError": "perhaps"}}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": answer})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await app(scope, replay, send)
    return garbled


def checked(app, token: str):
    """The app behind a header check, as an MCP server behind a gateway that wants a key."""
    async def guarded(scope, receive, send):
        if scope["type"] == "http" and dict(scope["headers"]).get(b"x-token", b"").decode() != token:
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"missing or wrong X-Token"})
            return
        await app(scope, receive, send)
    return guarded


def main() -> None:
    if sys.argv[1] == "stdio":
        server.run()
        return
    import uvicorn

    app = server.sse_app(host="127.0.0.1") if sys.argv[1] == "sse" else garbling(server.streamable_http_app(host="127.0.0.1"))
    token = os.environ.get("MCP_DEMO_TOKEN")
    uvicorn.run(checked(app, token) if token else app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
                lifespan="on")


if __name__ == "__main__":
    main()
