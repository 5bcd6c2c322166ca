"""WORKERS=N: N server processes accepting on one port, each doing what a separate server does.

The parent binds the port once, then forks N workers that all accept on that one listening
socket; it serves nothing itself. Each worker builds its own app (its own turn hub, Redis
subscriptions, search index follower) and runs uvicorn's server on the inherited socket with
the same options as a single process (`serving.uvicorn_options`: the connection cap and the
request-head timer, per worker). The open-file limit is raised in the parent, so every worker
inherits it; the garbage collector is frozen in the parent before the fork (the modules loaded by
then are shared copy-on-write and never walked) and settled again in each worker once its app
is built.

Why not uvicorn's own `workers=`: it spawns fresh interpreters that receive the config by
pickling (our HTTP protocol class is built per server and cannot be pickled, and every worker
would import everything again), and it cannot tell a worker which one it is. Here worker k
always keeps its search indexes in SEARCH_INDEX_DIR/worker-k, so no two processes ever write one
index file, and a worker that dies (killed, out of memory) is replaced in its own slot, reusing
its index. Why not SO_REUSEPORT sockets, one per worker: the kernel then deals connections out
by address hash, to a busy worker as readily as to an idle one, and the connections waiting in
a dead worker's queue are reset; with one shared socket an idle worker takes the next
connection, and what was queued stays queued for the others.

Only with STORE=redis: with STORE=files one process owns the conversation files.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable

from chatserver import logs, metrics
from chatserver.config import Settings

log = logging.getLogger("chat.workers")

# A worker that dies is started again in its slot; one that keeps dying waits longer each time.
RESTART_DELAYS = (0.0, 1.0, 2.0, 5.0, 10.0)
# A worker that ran this long before dying counts as healthy: its next restart is immediate again.
HEALTHY_SECONDS = 30.0
# On SIGTERM/SIGINT, how long the workers get to save their running turns before they are killed.
STOP_WAIT = 30.0
STARTUP_FAILURE = 3  # uvicorn's exit code when the app's start-up failed


def workers_problem(settings: Settings) -> str | None:
    """Why these settings cannot run WORKERS processes, or None when they can."""
    if settings.workers > 1 and settings.store != "redis":
        return (f"WORKERS={settings.workers} needs STORE=redis: with STORE=files one process owns the "
                "conversation files under DATA_DIR, and a second one would overwrite its changes. "
                "Set STORE=redis and REDIS_URL (README: Several servers, several machines), or WORKERS=1.")
    return None


def worker_settings(settings: Settings, worker: int) -> Settings:
    """Worker `worker`'s settings: its own search index directory, the rest shared."""
    return settings.model_copy(update={"search_index_dir": settings.index_dir / f"worker-{worker}"})


def _die_with_parent(parent: int) -> None:
    """Linux: this worker gets SIGTERM (a graceful stop) if the parent dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that was asked
        os.kill(os.getpid(), signal.SIGTERM)


def _run_worker(settings: Settings, worker: int, sock: socket.socket) -> int:
    """In the forked child: build this worker's app and serve the shared socket until told to stop."""
    import uvicorn

    from chatserver import serving
    from chatserver.app import create_app, settle_garbage_collector

    logs.configure(settings, worker)
    app = create_app(worker_settings(settings, worker), worker=worker)
    settle_garbage_collector()
    server = uvicorn.Server(uvicorn.Config(app, **serving.uvicorn_options(settings)))
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0 if server.started else STARTUP_FAILURE


class Supervisor:
    """The parent: forks the workers, starts a dead one again in its slot, stops them all on a signal."""

    def __init__(self, settings: Settings, sock: socket.socket,
                 run_worker: Callable[[Settings, int, socket.socket], int] = _run_worker) -> None:
        self.settings, self.sock = settings, sock
        self.run_worker = run_worker
        self.slots: dict[int, int] = {}  # pid -> worker number
        self.started_at: dict[int, float] = {}  # worker number -> when its current process started
        self.failures: dict[int, int] = {}  # worker number -> deaths in a row, each soon after its start
        self.first: set[int] = set()  # workers whose current process is the slot's first
        self.stopping = False

    def _fork(self, worker: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)  # the parent's handlers are not this process's; uvicorn sets its own
            code = 1
            try:
                _die_with_parent(parent)
                code = self.run_worker(self.settings, worker, self.sock)
            except BaseException:
                logging.getLogger("chat.workers").exception("worker %d failed", worker)
            finally:
                logging.shutdown()
                os._exit(code)
        self.slots[pid] = worker
        self.started_at[worker] = time.monotonic()

    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _stop(self, _sig: int, _frame: object) -> None:
        if not self.stopping:
            log.info("stopping %d workers", len(self.slots))
            signal.signal(signal.SIGALRM, self._kill_late)
            signal.alarm(int(STOP_WAIT))
        self.stopping = True
        self._signal(list(self.slots), signal.SIGTERM)

    def _kill_late(self, _sig: int, _frame: object) -> None:
        log.warning("%d workers did not stop within %g s; killing them", len(self.slots), STOP_WAIT)
        self._signal(list(self.slots), signal.SIGKILL)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for worker in range(1, self.settings.workers + 1):
            self.first.add(worker)
            self._fork(worker)
        code = 0
        while self.slots:
            pid, status = os.wait()
            worker = self.slots.pop(pid, 0)  # 0: not a worker (none is numbered 0)
            if worker:
                metrics.worker_gone(pid)
            if not worker or self.stopping:
                continue
            first, ran = worker in self.first, time.monotonic() - self.started_at[worker]
            self.first.discard(worker)
            if first and os.WIFEXITED(status) and os.WEXITSTATUS(status) == STARTUP_FAILURE:
                # It never got going (the store unreachable, the index directory unwritable): the server
                # refuses to start, as a single process does; its log said why.
                log.error("worker %d could not start; stopping the server", worker)
                code = STARTUP_FAILURE
                self._stop(signal.SIGTERM, None)
                continue
            how = (f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exited with code {os.WEXITSTATUS(status)}")
            self.failures[worker] = 0 if ran >= HEALTHY_SECONDS else self.failures.get(worker, 0) + 1
            delay = RESTART_DELAYS[min(max(0, self.failures[worker] - 1), len(RESTART_DELAYS) - 1)]
            log.warning("worker %d (pid %d) %s after %.1f s; starting another in its place%s", worker, pid, how,
                        ran, f" in {delay:g} s" if delay else "")
            if delay and self._pause(delay):
                continue
            self._fork(worker)
        signal.alarm(0)
        return code

    def _pause(self, seconds: float) -> bool:
        """Wait before a restart, unless a stop comes first; True when it did."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))
        return self.stopping


def serve(settings: Settings) -> int:
    """Bind the port, run `settings.workers` workers on it until a signal; the exit code."""
    import uvicorn

    sock = uvicorn.Config("server:app", host=settings.host, port=settings.port).bind_socket()
    log.info("serving http://%s:%d with %d worker processes (parent pid %d)", settings.host, settings.port,
             settings.workers, os.getpid())
    # /metrics adds up every worker's numbers from files in a directory of this start's own (removed at
    # the end, so a restart never counts the last run's turns).
    directory = metrics.fresh_directory()
    os.environ[metrics.MULTIPROC_ENV] = str(directory)
    gc.collect()
    gc.freeze()  # what is loaded now is shared with every worker, copy-on-write: never walked again
    try:
        return Supervisor(settings, sock).run()
    finally:
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)
        sys.stdout.flush()
