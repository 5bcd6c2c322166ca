"""The composition root: what lifespan builds (settings, store, gateway, turn pipeline), the routers,
and the one boundary where domain errors become HTTP answers. `make run` starts it through `main()`
(by way of the root's `server.py`).

Routes live in `api/`, one router per resource; they never see a wire format or lay out a prompt.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import anyio
import httpx2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from chatserver import logs, metrics
from chatserver.accounts.auth import Accounts
from chatserver.accounts.files import FileAccountStore
from chatserver.accounts.store import AccountStore
from chatserver.api import attachments as attachment_routes
from chatserver.api import auth as auth_routes
from chatserver.api import conversations, memory, models, people, projects, quota, remote_images, sharing, site
from chatserver.api import costs as cost_routes
from chatserver.api import events as live
from chatserver.api import exchange as exchange_routes
from chatserver.api import metrics as metrics_routes
from chatserver.api import presets as preset_routes
from chatserver.api.deps import State
from chatserver.api.guard import SECURITY_HEADERS, Guard
from chatserver.attachments.blobs import Blobs, FileBlobs
from chatserver.attachments.extraction import AttachmentError
from chatserver.attachments.meta import AttachmentMeta, FileMeta
from chatserver.attachments.store import Attachments, Limits
from chatserver.config import Settings, get_settings
from chatserver.conversations import pii
from chatserver.conversations.projects import ProjectNotFound
from chatserver.costs.ledger import FileLedger, RedisLedger
from chatserver.search.follow import StillBuilding, open_search
from chatserver.store.files import Damaged, FileStore, LockLost, NotFound, Store, StoreUnavailable, TurnBusy
from chatserver.store.person_events import PersonEvents, RedisPersonEvents
from chatserver.tools import registry as tools
from chatserver.tools.mcp import McpServers
from chatserver.turns import context
from chatserver.turns.pipeline import Turns
from chatserver.upstream.catalog import GatewayCatalog
from chatserver.upstream.client import Gateway
from chatserver.upstream.failures import keep_secret
from chatserver.upstream.transport import gateway_transport

if TYPE_CHECKING:
    from chatserver.store.redis import RedisStore

log = logging.getLogger("chat.server")


def make_store(settings: Settings) -> Store:
    """The store STORE names: files under DATA_DIR (one process), or Redis (any number)."""
    return make_stores(settings).store


def make_redis_store(settings: Settings) -> RedisStore:
    from chatserver.store.redis import RedisStore

    ttl = settings.conversation_ttl_days * 86_400 if settings.conversation_ttl_days else None
    return RedisStore(settings.redis_url, ttl_seconds=ttl, lock_ttl_ms=int(settings.turn_lock_seconds * 1000),
                      heartbeat_seconds=settings.heartbeat_seconds)


def make_account_store(settings: Settings, store: Store) -> AccountStore:
    """Where accounts, sessions and the login throttle live: beside the conversations of the store
    STORE names. On Redis they share its connection and key prefix, so every server sees the same
    users, sessions and count of guesses; on files they serve one process, as the store does."""
    idle = settings.session_hours * 3600
    if settings.store == "redis":
        from chatserver.accounts.redis import RedisAccountStore

        shared = cast("RedisStore", store)  # make_store made it so for STORE=redis
        return RedisAccountStore(shared.redis, shared.prefix, idle, shared.reachable)
    return FileAccountStore(settings.data_dir, idle)


@dataclass(frozen=True, slots=True)
class Stores:
    """The store STORE names, seen as what it is: `shared` when it is Redis (which attachments'
    metadata and the cross-process hubs use too), `files` when it is the file store."""

    store: Store
    shared: RedisStore | None = None
    files: FileStore | None = None


def make_stores(settings: Settings) -> Stores:
    if settings.store == "redis":
        shared = make_redis_store(settings)
        return Stores(shared, shared=shared)
    files = FileStore(settings.data_dir)
    return Stores(files, files=files)


def make_blobs(settings: Settings) -> Blobs:
    """Where originals live: BLOB_STORE=files (under DATA_DIR/attachments) or s3."""
    if settings.blob_store == "s3":
        from chatserver.attachments.blobs import S3Blobs, S3Settings

        return S3Blobs(S3Settings(settings.s3_bucket, settings.s3_endpoint_url, settings.s3_region,
                                  settings.s3_access_key_id, settings.s3_secret_access_key))
    return FileBlobs(settings.data_dir / "attachments")


def make_attachments(settings: Settings, shared: RedisStore | None) -> Attachments:
    """Attachments with their metadata where the conversations are (Redis when shared, else
    files) and their originals where BLOB_STORE says; the passage index is this server's own."""
    meta: AttachmentMeta
    if shared is not None:
        from chatserver.attachments.meta import RedisMeta

        meta = RedisMeta(shared)
        if settings.blob_store == "files":
            log.warning("STORE=redis with BLOB_STORE=files: attachments' original bytes stay on this server's "
                        "disk, and other servers cannot download them; set BLOB_STORE=s3 to share them")
    else:
        meta = FileMeta(settings.data_dir / "attachments")
    return Attachments(settings.data_dir / "attachments", settings.index_dir, Limits(
        max_bytes=settings.max_attachment_bytes, max_pages=settings.max_attachment_pages,
        timeout=settings.extract_timeout, max_mb=settings.extract_max_mb, workers=settings.extract_workers,
        queue=settings.extract_queue, quota_bytes=settings.quota_file_bytes,
        mask_pii=settings.pii_masking == "on", max_image_pixels=settings.max_image_pixels), meta=meta, blobs=make_blobs(settings))


SHUTDOWN_STEP_SECONDS = 30.0


async def close_within(what: str, closing: Awaitable[object], seconds: float = SHUTDOWN_STEP_SECONDS) -> None:
    """Await one shutdown step for at most `seconds`; past that, log which one and go on (it is
    cancelled, not awaited: a step that ignores cancellation must not hold the process either)."""
    step = asyncio.ensure_future(closing)
    await asyncio.wait([step], timeout=seconds)
    if not step.done():
        log.error("shutting down: %s did not finish within %.0f s; stopping without it", what, seconds)
        step.cancel()
    elif not step.cancelled() and (failure := step.exception()) is not None:
        raise failure


EXPIRY_INTERVAL = 3600  # seconds between passes over the file store for CONVERSATION_TTL_DAYS


async def expire_untouched(files: FileStore, days: float, first_pass: asyncio.Future) -> None:
    """Delete conversations untouched for `days`: at start, then every EXPIRY_INTERVAL."""
    while True:
        try:
            removed = await files.expire(days)
        except Exception:
            log.exception("expiring old conversations failed; trying again later")
            removed = []
        if removed:
            log.info("deleted %d conversations untouched for %s days", len(removed), days)
        if not first_pass.done():
            first_pass.set_result(removed)
        await asyncio.sleep(EXPIRY_INTERVAL)


def create_app(settings: Settings | None = None, *, worker: int = 1) -> FastAPI:
    """The app; `worker` is its number among WORKERS processes (1 when it is the only one)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        active = settings or get_settings()
        await asyncio.to_thread(context.load_tokenizer)
        # Several processes share a Redis store, each with its own DATA_DIR; files serve one process.
        stores = make_stores(active)
        store, shared, files = stores.store, stores.shared, stores.files
        expiry = None
        await store.ping()
        if files is not None and active.conversation_ttl_days:  # Redis expires them itself (a TTL on their keys)
            app.state.expiry_pass = asyncio.get_running_loop().create_future()
            expiry = asyncio.create_task(expire_untouched(files, active.conversation_ttl_days, app.state.expiry_pass))
        # Each process keeps its own index, following every process's changes.
        index_file = exchange_routes.INDEX_FILE if files is not None else exchange_routes.SYNCED_INDEX_FILE
        app.state.search = await open_search(store, active.index_dir / index_file)
        attachments = make_attachments(active, shared)
        await attachments.start()  # S3: the bucket, created when missing
        attachments.sweep()
        if active.pii_masking == "on":
            await anyio.to_thread.run_sync(pii.prepare)  # its table, built now rather than on the first message
        timeout = httpx2.Timeout(active.upstream_timeout)
        limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=100)
        demo = None
        if active.gateway_configured:
            base_url, api_key = active.gateway_base_url, active.gateway_api_key
            keep_secret(api_key)  # gateways echo it in error bodies; it never goes further
        else:
            from gateway_sim.simulator import GatewaySimulator

            demo = GatewaySimulator(reasoning_models={m.id for m in active.lineup() if m.reasoning},
                                    models=[m.id for m in active.lineup()])
            await demo.start_async()
            base_url, api_key = demo.base_url, None
            log.warning("no GATEWAY_BASE_URL set: replies come from the built-in demo gateway (simulated)")
        async with httpx2.AsyncClient(timeout=timeout, limits=limits, transport=gateway_transport(limits)) as client:
            turns = Turns(active, Gateway(client, base_url, api_key), attachments)
            hub, events = None, PersonEvents()
            if shared is not None:
                from chatserver.turns.redis_hub import RedisTurnHub

                events = RedisPersonEvents(shared.redis, shared.prefix)  # pages hear of every process's changes
                hub = RedisTurnHub(turns, shared, events)  # Stop and re-attach reach turns running in other processes
            catalog = GatewayCatalog(turns.gateway)
            catalog.start()
            app.state.chat = State(active, store, turns, attachments, hub=hub, events=events, catalog=catalog)
            account_store = make_account_store(active, store)
            # With passwords, Accounts makes its argon2 dummy hash (a while, 64 MiB) off the event loop.
            app.state.accounts = await asyncio.to_thread(Accounts, active, account_store) \
                if active.auth == "password" else Accounts(active, account_store)
            turns.lineup = app.state.chat.lineup
            # Charges live beside the conversations: on Redis every server reads and reconciles them.
            turns.costs.ledger = RedisLedger(shared.redis, shared.prefix, shared.reachable) if shared is not None \
                else FileLedger(active.data_dir)
            turns.costs.store = store
            await turns.costs.published_prices()  # read in the background: no start waits for the gateway
            await turns.costs.resume()
            # Each process keeps its own connections; they come up in the background.
            app.state.chat.mcp = McpServers(active, store, tools.registry)
            await app.state.chat.mcp.start()
            try:
                yield
            finally:
                await close_within("the MCP servers", app.state.chat.mcp.close())
                # Running turns save what arrived before the store closes. Each step is bounded:
                # a step that hangs is logged by name and left behind, and the process still stops.
                await close_within("the turn hub", app.state.chat.hub.close())
                await close_within("the gateway's model list", catalog.close())
                await close_within("the person events", events.close())
                if expiry is not None:
                    expiry.cancel()
                await close_within("the cost reconciler", turns.costs.close())
                await close_within("the store's pending writes", store.flush())
                await close_within("the attachments", attachments.close())
                await close_within("the search index", app.state.search.close())
                await close_within("the account store", account_store.close())
                await close_within("the store", store.close())
                if demo is not None:
                    await close_within("the demo gateway", demo.stop_async())

    # No /docs or /redoc: their viewers load scripts from a CDN and run inline ones, which the page's
    # Content-Security-Policy (sent with every answer) refuses. /openapi.json stays.
    app = FastAPI(title="Chat server", version="1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    install_error_answers(app)
    document_error_answers(app)
    app.mount("/static", site.RevalidatedStatic(directory=site.STATIC, check_dir=False), name="static")
    metrics.start()
    for module in (site, auth_routes, models, preset_routes, memory, conversations, attachment_routes,
                   exchange_routes, live, quota, remote_images, projects, sharing, people, cost_routes,
                   metrics_routes):
        app.include_router(module.router)
    app.add_middleware(Guard)
    return app


# Every error this app answers, 422 included, is `{"detail": str}` (a 422 adds the field errors).
ERROR_SCHEMA = {
    "type": "object", "required": ["detail"],
    "properties": {"detail": {"type": "string"},
                   "errors": {"type": "array", "items": {"$ref": "#/components/schemas/ValidationError"}}},
}


def document_error_answers(app: FastAPI) -> None:
    """Make /openapi.json describe our 422 body rather than FastAPI's default one."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # built once, then cached by FastAPI: the patch below sticks
        schema.get("components", {}).get("schemas", {})["HTTPValidationError"] = ERROR_SCHEMA
        return schema

    app.openapi = openapi


def install_error_answers(app: FastAPI) -> None:
    """Domain errors to HTTP answers, in one place for every router."""

    def detail(status: int, text: str) -> JSONResponse:
        return JSONResponse({"detail": text}, status_code=status)

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return detail(404, "conversation not found")

    @app.exception_handler(ProjectNotFound)
    async def no_project(_: Request, exc: ProjectNotFound) -> JSONResponse:
        return detail(404, "project not found")

    @app.exception_handler(Damaged)
    async def damaged(_: Request, exc: Damaged) -> JSONResponse:
        log.error("damaged conversation file %s: %s", exc.path.name, exc.reason)
        return detail(409, f"the conversation file is damaged ({exc.reason}); it was left untouched")

    @app.exception_handler(conversations.Conflict)
    async def conflict(_: Request, exc: conversations.Conflict) -> JSONResponse:
        return detail(409, str(exc))

    @app.exception_handler(TurnBusy)
    async def busy(_: Request, exc: TurnBusy) -> JSONResponse:
        return detail(409, "a reply is still streaming on this conversation")

    @app.exception_handler(StoreUnavailable)
    async def store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        log.error("%s", exc)  # the log may say where the store is; the answer says only what is wrong
        return detail(503, "the conversation store (Redis) is unreachable; try again shortly")

    @app.exception_handler(AttachmentError)
    async def attachment_failed(_: Request, exc: AttachmentError) -> JSONResponse:
        # Reached from routes other than the attachment routes (a conversation's deletion with S3 away).
        return detail(exc.status, str(exc))

    @app.exception_handler(StillBuilding)
    async def still_building(_: Request, exc: StillBuilding) -> JSONResponse:
        return JSONResponse({"detail": f"{exc}; this server builds it from the store at start. Try again shortly."},
                            status_code=503, headers={"Retry-After": "2"})

    @app.exception_handler(LockLost)
    async def lock_lost(_: Request, exc: LockLost) -> JSONResponse:
        return detail(409, "another turn took this conversation over")

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost middleware answers with this, outside the Guard, so the security
        # headers are added here; uvicorn still logs the traceback.
        headers = {k.decode(): v.decode() for k, v in SECURITY_HEADERS}
        return JSONResponse({"detail": "internal server error; the server's log says what went wrong"},
                            status_code=500, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        message = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}" for e in errors)
        return JSONResponse({"detail": message or "invalid request", "errors": errors}, status_code=422)



def main() -> None:
    """`make run`: bind where the settings say, refusing to start on a bad configuration."""
    import sys

    import uvicorn
    from pydantic import ValidationError

    if sys.argv[1:2] == ["migrate"]:  # `python server.py migrate --from files --to redis`
        from chatserver.store import migrate

        sys.exit(migrate.main(sys.argv[2:]))
    if sys.argv[1:2] == ["user"]:  # `python server.py user add NAME [--admin]`, passwd, remove, list
        from chatserver.accounts import cli as accounts_cli

        sys.exit(accounts_cli.main(sys.argv[2:]))
    from chatserver import serving

    try:
        settings = get_settings()
    except ValidationError as exc:
        sys.exit("configuration error:\n" + "\n".join(f"  {e['msg']}" for e in exc.errors()))
    from chatserver import workers

    if problem := workers.workers_problem(settings):
        sys.exit("configuration error:\n  " + problem)
    logs.configure(settings)
    serving.raise_open_file_limit()  # before any worker is forked: each inherits it
    if settings.workers > 1:
        sys.exit(workers.serve(settings))
    app = create_app(settings)
    settle_garbage_collector()
    uvicorn.run(app, **serving.uvicorn_options(settings))


def settle_garbage_collector() -> None:
    """Keep the cyclic garbage collector from pausing every stream at once.

    Everything loaded at startup (FastAPI, pydantic, httpx: hundreds of thousands of objects)
    lives for the whole process, yet each full collection walked it: 70 ms pauses, three in
    20 s at 200 streams. Frozen, it is never walked again; and with a larger first threshold
    the young collections, each a pause for every stream, come 14 times less often. Measured at
    200 streams: p99 added time to first token 70-140 ms before, 13-25 ms after.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


if __name__ == "__main__":
    main()
