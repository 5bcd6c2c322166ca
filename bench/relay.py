"""The ceiling: the barest relay on our stack (FastAPI + sse-starlette + httpx), nothing else.

`POST /v1/chat/completions` forwards the body to `UPSTREAM_URL` and re-emits each upstream
`data:` line as an SSE event: no store, no prompt assembly, no decoding into events, no save.
Whatever our server adds on top of this is the price of its features; whatever this adds over
the simulator alone is the price of the stack. Served by the benchmark with the same uvicorn
settings as the server (`python -m uvicorn relay:app`, one worker).
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from sse_starlette import EventSourceResponse


@asynccontextmanager
async def lifespan(app: FastAPI):
    # The same pool limits as the server's client, so both can hold the same number of streams.
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        app.state.client = client
        yield


app = FastAPI(lifespan=lifespan)


@app.post("/v1/chat/completions")
async def relay(request: Request) -> EventSourceResponse:
    body = await request.body()
    client: httpx.AsyncClient = request.app.state.client
    upstream = os.environ["UPSTREAM_URL"]

    async def events():
        async with client.stream("POST", upstream, content=body,
                                 headers={"content-type": "application/json"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield {"data": line[6:]}

    return EventSourceResponse(events())
