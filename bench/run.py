"""`make bench`: the server's overhead, Stop latency, cost of long histories and memory, measured
on loopback against the gateway simulator, beside a bare relay (the ceiling) and LiteLLM's proxy
(the peer a person would otherwise put in front of a gateway).

Every party runs in a process of its own: the simulator (`gateway.py`), our server (started as
`make run` starts it: `python server.py`, one uvicorn worker, DATA_DIR in a temporary directory), the bare relay
(`relay.py`), LiteLLM's proxy (from `bench/.venv-litellm`), and, per phase, the load generator
(`load.py`). The machine has two cores, so they still compete for CPU; the direct-to-simulator
runs pay the same simulator and client costs, which is why figures are reported as time *added*
over those runs.

What is timed (all clocks are `time.monotonic()`, shared by every process on Linux):
- time to first byte (TTFB): from just before the client connects to the first event carrying
  reply text. For our server that is the first `delta` event (its `start` event comes earlier
  and is not counted); for chat-completions streams, the first chunk with non-empty
  `delta.content`. Our TTFB therefore includes committing the person's message to disk
  (an fsynced atomic write) and assembling the prompt.
- time to last byte (TTLB): to the stream's terminal event: `done` for our server (sent after the
  reply is saved, again fsynced), `data: [DONE]` for chat completions.
- added time at percentile p: p of the target's times minus p of the direct runs at the same
  concurrency (two independent samples, so a percentile of differences is not defined).

With redis-server installed, two more servers with STORE=redis share a Redis the bench starts
(a free port, a temporary directory, AOF on, stopped by its pid): one stream at a time (the added
TTFB beside the file store's), 200 streams spread over both, and Stop asked of one while the
turn runs on the other. Without redis-server those keys are empty and `redis_error` says why.
`bench/s3_bench.py` moves a 20 MiB file up to and down from a server with BLOB_STORE=s3 on a
SeaweedFS of its own (the `s3_*` keys: time and the server's peak memory, `files_*` beside them).
`bench/images_bench.py` sends 20 uploads of a 12-megapixel JPEG to one server at once (the
`images_*` keys: the server's peak memory over its base, the reading children's, the time).
Then one STORE=redis server with WORKERS=1 and then one with WORKERS=2 (`make run`'s way, in
turn): the turn starts per second each sustains with p99 added time to first token under 100 ms,
and their ratio (`phase_workers`).

`bench/render_bench.py` drives Debian's chromium over the page: a 200,000-character reply with 50
code blocks and 100 formulas drawn (`render_200k_*`), and the long tasks while a reply streams at
100 tokens/s (`stream_*`: `longtask` entries on the wall clock, and each task's CPU time from
chromium's trace).

`bench/mcp_bench.py` times a tool round through a real MCP server (Streamable HTTP and stdio)
beside one through a local tool (the `mcp_*` keys, from `results_mcp.json`).

Results go to `bench/results.json` (flat keys) and `bench/RESULTS.md`; the cache benchmark
(`bench/cache_bench.py`, another engineer's) runs last and its `results_cache.json` is merged.
Every load loop is bounded by a request count and a phase deadline, and targets only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import random
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

import gateway  # noqa: E402  (bench/ is on sys.path as the script's directory)

from chatserver.conversations.document import LOCAL_OWNER, SCHEMA_VERSION, empty_totals, new_id, now_iso  # noqa: E402

PY = sys.executable
LITELLM_VENV = BENCH / ".venv-litellm"
HOST = "127.0.0.1"

# The simulated model's pace per phase: `words` one-word chunks, `delay` seconds before each.
OVERHEAD_REPLY = {"words": 40, "delay": 0.05}  # 20 tokens/s, two seconds per reply
SUSTAIN_REPLY = {"words": 120, "delay": 0.05}  # 20 tokens/s for six seconds
STOP_REPLY = {"words": 400, "delay": 0.02}  # long enough to be stopped mid-stream
HISTORY_REPLY = {"words": 5, "delay": 0.0}
# Requests per client at each concurrency; client starts are spread over `spread` seconds so
# that the streams overlap in steady state rather than all starting in one instant.
OVERHEAD_LEVELS = {1: {"rounds": 20, "spread": 0.0}, 50: {"rounds": 2, "spread": 2.0},
                   200: {"rounds": 2, "spread": 2.0}}
SUSTAIN_STREAMS = 400
SUSTAIN_SPREAD = 1.0
STOP_SAMPLES = 60
STOP_CLIENTS = 10
STOP_AFTER = (3, 6, 10)
HISTORY_SIZES = (10, 1_000, 10_000)
NO_CHECKPOINTS = "nockpt"  # the target name of our server with CHECKPOINT_SECONDS=0 (sustain phase only)
# Its twin with checkpoints on (the default), started and loaded alike: the main server has run
# the overhead phase first and holds more in memory, which moved its p99 as much as checkpoints do.
CHECKPOINTS_ON = "ckpton"
# The 400-stream p99 moves by ±10 ms from one run to the next on this machine, as much as checkpoints
# cost; so the twins each run this many times, alternating, and their medians are compared.
CHECKPOINT_ROUNDS = 5
HISTORY_TURNS = 9  # per size, taken in rounds (phase_history)
PROFILE_TURNS = 5

HISTORY_TARGET_MS = 50.0  # over this, the longest conversation's turns are profiled
TMPFS = "/dev/shm"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Processes this run started (simulator, servers, relay, LiteLLM): their CPU is not "other load".
OWN_PIDS: list[int] = []
# LiteLLM refuses to start without a master key; a fresh one per run, never stored.
MASTER_KEY = "sk-" + secrets.token_hex(32)


# --- Processes ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (LiteLLM may fork), in MB."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total / 1024


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its living descendants (a server's WORKERS, LiteLLM's forks)."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        total += process_cpu_seconds(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Service:
    """A child process serving HTTP on loopback, logging to a file, stopped by its own pid."""

    def __init__(self, name: str, argv: list[str], port: int, ready_path: str, env: dict, cwd: Path,
                 log_dir: Path) -> None:
        self.name, self.port, self.ready_path = name, port, ready_path
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        OWN_PIDS.append(self.proc.pid)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                httpx.get(self.url + self.ready_path, timeout=1.0)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f}s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def rss_mb(self) -> float:
        return tree_rss_mb(self.proc.pid)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class Gateway:
    """The simulator process (`gateway.serve`) and the pipe that scripts it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=gateway.serve, args=(child, free_port()), name="gateway", daemon=True)
        self.proc.start()
        OWN_PIDS.append(self.proc.pid)
        if not self.conn.poll(30):
            raise RuntimeError("the gateway simulator did not start within 30s")
        self.base_url = self.conn.recv()

    def call(self, *command, timeout: float = 60.0):
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the gateway simulator did not answer {command[0]!r} within {timeout:.0f}s")
        return self.conn.recv()

    def script(self, reply: dict, count: int) -> None:
        self.call("reset")
        self.call("enqueue", reply, count)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=15)
            except (RuntimeError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def start_server(gw: Gateway, data_dir: Path, log_dir: Path, name: str = "server",
                 settings: dict[str, str] | None = None) -> Service:
    """Our server with its default settings, or with `settings` (environment names) changed."""
    # cwd is the data directory, so a developer's .env in the repository does not leak in.
    data_dir.mkdir(parents=True, exist_ok=True)
    # No titles: each first reply's title call would take a scripted reply meant for a turn.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DATA_DIR": str(data_dir), "GATEWAY_BASE_URL": gw.base_url,
           "GATEWAY_API_KEY": "", "HOST": HOST, "ACCESS_TOKEN": "", "AUTO_TITLE": "false", **(settings or {})}
    port = free_port()
    env["PORT"] = str(port)
    # Started as `make run` starts it, so the figures are those of the server a person runs.
    svc = Service(name, [PY, str(ROOT / "server.py")], port, "/healthz", env, data_dir, log_dir)
    svc.wait_ready(60)
    return svc


def start_relay(gw: Gateway, log_dir: Path) -> Service:
    env = {**os.environ, "PYTHONPATH": str(BENCH), "UPSTREAM_URL": gw.base_url + "/v1/chat/completions"}
    port = free_port()
    svc = Service("relay", [PY, "-m", "uvicorn", "relay:app", "--host", HOST, "--port", str(port),
                            "--workers", "1", "--log-level", "warning"], port, "/docs", env, log_dir, log_dir)
    svc.wait_ready(60)
    return svc


def start_litellm(gw: Gateway, log_dir: Path, master_key: str) -> Service:
    """LiteLLM's proxy, one worker, with the simulator as an OpenAI-compatible provider."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not (LITELLM_VENV / ".installed").exists():
        log = LITELLM_VENV / "install.log"
        errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("ERROR")] \
            if log.exists() else []
        raise RuntimeError("LiteLLM is not installed (`make bench` installs it into bench/.venv-litellm)"
                           + (": " + " ".join(errors)[-600:] if errors else ""))
    config = log_dir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: bench\n"
        "    litellm_params:\n"
        "      model: openai/bench\n"
        f"      api_base: {gw.base_url}/v1\n"
        "      api_key: sk-simulator\n")
    # The local cost map: the stock one is fetched from the network at start-up.
    env = {**os.environ, "LITELLM_MASTER_KEY": master_key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    port = free_port()
    svc = Service("litellm", [str(exe), "--config", str(config), "--host", HOST, "--port", str(port),
                              "--num_workers", "1"], port, "/health/liveliness", env, log_dir, log_dir)
    svc.wait_ready(120)
    return svc


# --- Load --------------------------------------------------------------------------------------

@dataclass
class Load:
    """What one load phase returned: the client's records, the watched service's peak RSS, and
    the share of the machine's CPU that processes other than the benchmark's used meanwhile."""

    records: list[dict]
    rss_mb_peak: float | None
    other_cpu: float
    cpu_seconds: float | None  # the watched service's CPU during the phase
    scrapes: list[float] = field(default_factory=list)  # seconds per GET /metrics made during the phase
    # The server's CPU ms rendering each of those (its Server-Timing header): the scrape's own cost.
    scrape_cpu: list[float] = field(default_factory=list)
    # And the CPU ms of garbage collections that fell due inside each render (counted apart).
    scrape_gc: list[float] = field(default_factory=list)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def own_busy_seconds() -> float:
    """CPU seconds used by this run: this process, its reaped children (load generators), and the
    services and simulator still running."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    return total + sum(tree_cpu_seconds(pid) for pid in OWN_PIDS)


class Quiet:
    """Waits, within a bounded budget, for other processes to leave the CPU before a measurement.

    Other people's builds and browser tests share this machine's two cores; a measurement taken
    while they run says more about them than about the server. Each wait is short and the whole
    run's waiting is capped, so a machine that never quiets down still finishes (and the tables
    say how busy it was).
    """

    threshold = 0.2  # other processes' share of all cores that counts as quiet
    per_call = 15.0
    budget = 150.0
    waited = 0.0

    @classmethod
    def wait(cls) -> None:
        deadline = time.monotonic() + min(cls.per_call, cls.budget - cls.waited)
        began = time.monotonic()
        while time.monotonic() < deadline:
            machine0, own0 = machine_busy_seconds(), own_busy_seconds()
            time.sleep(0.5)
            other = (machine_busy_seconds() - machine0) - (own_busy_seconds() - own0)
            if other / (0.5 * (os.cpu_count() or 1)) < cls.threshold:
                break
        cls.waited += time.monotonic() - began


def run_load(spec: dict, watch: Service | None, work: Path, scrape: str | None = None) -> Load:
    """Run one load phase in its own process, watching a service's memory and the machine's other load
    (and timing a GET of `scrape`, the server's /metrics, at each look while the load runs)."""
    Quiet.wait()
    spec_path, out_path = work / "spec.json", work / "records.json"
    spec_path.write_bytes(orjson.dumps(spec))
    peak = watch.rss_mb() if watch else None
    cpu0 = watch.cpu_seconds() if watch else None
    began, machine0, own0 = time.monotonic(), machine_busy_seconds(), own_busy_seconds()
    scrapes: list[float] = []
    scrape_cpu: list[float] = []
    scrape_gc: list[float] = []
    with open(spec_path, "rb") as stdin, open(out_path, "wb") as stdout:
        proc = subprocess.Popen([PY, str(BENCH / "load.py")], stdin=stdin, stdout=stdout)
        deadline = time.monotonic() + spec["phase_timeout"] + 30
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError("the load generator overran its phase deadline")
            if watch:
                peak = max(peak, watch.rss_mb())
            if scrape:
                t = time.perf_counter()
                answer = httpx.get(scrape, timeout=10).raise_for_status()
                scrapes.append(time.perf_counter() - t)
                timing = server_timing(answer)
                scrape_cpu.append(timing["render"])
                scrape_gc.append(timing["gc"])
            time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed with exit code {proc.returncode}")
    elapsed = time.monotonic() - began
    other = (machine_busy_seconds() - machine0) - (own_busy_seconds() - own0)
    cpu = watch.cpu_seconds() - cpu0 if watch else None
    return Load(orjson.loads(out_path.read_bytes()), peak, max(0.0, other) / (elapsed * (os.cpu_count() or 1)), cpu,
                scrapes, scrape_cpu, scrape_gc)


def server_timing(answer: httpx.Response) -> dict[str, float]:
    """The CPU ms the server says it spent on /metrics: `render` (its own) and `gc` (collections that
    fell due inside it), from `Server-Timing: render;dur=X, gc;dur=Y`."""
    parts = (part.strip().partition(";dur=") for part in answer.headers["server-timing"].split(","))
    return {name: float(duration) for name, _, duration in parts}


class Tags:
    """`bench-tag-N` markers, unique within a run, carried in each request's last message."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"bench-tag-{self.n}"


def chat_request(tag: str) -> dict:
    """A chat-completions request shaped like the one our server sends for a short conversation."""
    body = {
        "model": "bench",
        "messages": [
            {"role": "system", "content": [
                {"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": f"Today's date: {dt.date.today().isoformat()}"}]},
            {"role": "user", "content": f"Tell me something interesting. {tag}"},
        ],
        "max_tokens": 4096, "stream": True, "stream_options": {"include_usage": True},
    }
    return {"path": "/v1/chat/completions", "body": orjson.dumps(body).decode(), "tag": tag}


def turn_request(conv_id: str, tag: str) -> dict:
    return {"path": f"/api/conversations/{conv_id}/messages",
            "body": orjson.dumps({"content": f"Tell me something interesting. {tag}"}).decode(), "tag": tag}


def load_spec(port: int, dialect: str, clients: list[list[dict]], *, spread: float, phase_timeout: float,
              request_timeout: float, keep_gaps: bool = False, stop_after: int | None = None,
              stop_via: str = "hangup", stop_port: int | None = None) -> dict:
    # Every target is sent LiteLLM's master key; the others ignore it.
    return {"host": HOST, "port": port, "dialect": dialect, "token": MASTER_KEY, "clients": clients, "spread": spread,
            "phase_timeout": phase_timeout, "request_timeout": request_timeout, "keep_gaps": keep_gaps,
            "stop_after": stop_after, "stop_via": stop_via, "stop_port": stop_port}


def create_conversations(server: Service, n: int) -> list[str]:
    """Conversations on the chat-completions path (web tools off), as the relay and LiteLLM speak it."""
    ids = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(n):
            conv = client.post("/api/conversations", json={}).raise_for_status().json()
            client.patch(f"/api/conversations/{conv['id']}",
                         json={"settings": {"web_search": False, "web_fetch": False}}).raise_for_status()
            ids.append(conv["id"])
    return ids


# --- Statistics --------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    ttfb = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    ttlb = [r["end"] - r["start"] for r in ok]
    gaps = [g for r in ok for g in r.get("gaps", [])]
    errors = Counter(r["error"] for r in records if not r["ok"])
    return {
        "requests": len(records), "completed": len(ok), "errors": dict(errors.most_common(3)),
        "ttfb": {q: pct(ttfb, q) for q in (50, 90, 99)}, "ttlb": {q: pct(ttlb, q) for q in (50, 90, 99)},
        "gap": {q: pct(gaps, q) for q in (50, 99, 100)} if gaps else None, "gap_count": len(gaps),
    }


# --- Phases ------------------------------------------------------------------------------------

@dataclass
class Target:
    """Something to load: the simulator itself, a relay in front of it, or one of our servers."""

    name: str  # also the results.json prefix ("" for our server)
    label: str
    port: int
    dialect: str  # "chat" or "turn" (load.py)
    service: Service | None = None  # watched for memory; None for the simulator, which is not measured
    convs: list[str] = field(default_factory=list)  # our servers: conversations to run turns on

    def clients(self, tags: Tags, count: int, rounds: int) -> list[list[dict]]:
        """`count` clients of `rounds` requests; on our servers each client has its own conversation."""
        if self.dialect == "turn":
            return [[turn_request(self.convs[i], tags()) for _ in range(rounds)] for i in range(count)]
        return [[chat_request(tags()) for _ in range(rounds)] for _ in range(count)]


def phase_overhead(gw: Gateway, targets: list[Target], tags: Tags, work: Path, log) -> dict:
    """TTFB and TTLB at 1, 50 and 200 concurrent streams, for every target, interleaved per level."""
    out: dict = {}
    for level, shape in OVERHEAD_LEVELS.items():
        for target in targets:
            gw.script(OVERHEAD_REPLY, level * shape["rounds"] + 50)
            spec = load_spec(target.port, target.dialect, target.clients(tags, level, shape["rounds"]),
                             spread=shape["spread"], phase_timeout=180, request_timeout=120)
            # /metrics scraped while our server holds the most streams (issue 30: its cost then).
            scrape = f"{target.service.url}/metrics" if target.name == "ours" and level == max(OVERHEAD_LEVELS) \
                else None
            load = run_load(spec, target.service, work, scrape)
            summary = summarize(load.records)
            summary["rss_mb_peak"], summary["other_cpu"] = load.rss_mb_peak, load.other_cpu
            if load.scrapes:
                summary["scrape_ms"] = {q: ms(pct(load.scrapes, q)) for q in (50, 99)}
                summary["scrape_cpu_ms"] = {q: round(pct(load.scrape_cpu, q), 2) for q in (50, 99)}
                summary["scrape_gc_ms"] = {q: round(pct(load.scrape_gc, q), 2) for q in (50, 99, 100)}
                summary["scrapes"] = len(load.scrapes)
                # The same GET once the streams have ended: the scrape's own cost, without the wait
                # behind 200 streams' events on a loop that a busy host keeps saturated.
                idle = []
                for _ in range(20):
                    t = time.perf_counter()
                    httpx.get(scrape, timeout=10).raise_for_status()
                    idle.append(time.perf_counter() - t)
                summary["scrape_idle_ms"] = {q: ms(pct(idle, q)) for q in (50, 99)}
            summary["cpu_ms_per_stream"] = (load.cpu_seconds * 1000 / summary["requests"]
                                            if load.cpu_seconds is not None else None)
            out[(target.name, level)] = summary
            log(f"  {target.label:22s} x{level:<3d} completed {summary['completed']}/{summary['requests']} "
                f"ttfb p50 {ms(summary['ttfb'][50])} p99 {ms(summary['ttfb'][99])} ms, "
                f"ttlb p50 {ms(summary['ttlb'][50])} p99 {ms(summary['ttlb'][99])} ms"
                + (f", rss peak {summary['rss_mb_peak']:.0f} MB" if summary["rss_mb_peak"] else "")
                + (f", cpu {summary['cpu_ms_per_stream']:.1f} ms/stream" if summary["cpu_ms_per_stream"] else "")
                + f", other load {summary['other_cpu']:.0%}"
                + (f", errors {summary['errors']}" if summary["errors"] else ""))
    return out


def sustain_once(gw: Gateway, target: Target, tags: Tags, work: Path) -> dict:
    """One run of SUSTAIN_STREAMS streams at 20 tokens/s against `target`: its summary."""
    gw.script(SUSTAIN_REPLY, SUSTAIN_STREAMS + 50)
    spec = load_spec(target.port, target.dialect, target.clients(tags, SUSTAIN_STREAMS, 1), spread=SUSTAIN_SPREAD,
                     phase_timeout=150, request_timeout=140, keep_gaps=True)
    load = run_load(spec, target.service, work)
    summary = summarize(load.records)
    summary["rss_mb_peak"], summary["other_cpu"] = load.rss_mb_peak, load.other_cpu
    return summary


def phase_sustain(gw: Gateway, targets: list[Target], tags: Tags, work: Path, log) -> dict:
    """400 streams at 20 tokens/s held open together: the gaps between events as the client sees them."""
    out = {}
    n = SUSTAIN_STREAMS
    for target in targets:
        out[target.name] = summary = sustain_once(gw, target, tags, work)
        gap = summary["gap"] or {}
        log(f"  {target.label:22s} x{n} completed {summary['completed']}/{summary['requests']} "
            f"gap p50 {ms(gap.get(50))} p99 {ms(gap.get(99))} max {ms(gap.get(100))} ms, "
            f"ttfb p99 {ms(summary['ttfb'][99])} ms, other load {summary['other_cpu']:.0%}"
            + (f", errors {summary['errors']}" if summary["errors"] else ""))
    return out


def phase_checkpoint_pair(gw: Gateway, on: Target, off: Target, first: dict, tags: Tags, work: Path,
                          log) -> dict:
    """More 400-stream runs of our server with checkpoints on and off, alternating which goes first.

    `first` is the sustain phase's summary (its run counts as the first round). Returns each
    side's p99 gaps, one per round, in ms.
    """
    p99s = {side: [ms((first[t.name]["gap"] or {}).get(99))] for side, t in (("on", on), ("off", off))}
    for round_ in range(1, CHECKPOINT_ROUNDS):
        pair = ((("off", off), ("on", on)) if round_ % 2 else (("on", on), ("off", off)))
        for side, target in pair:
            p99s[side].append(ms((sustain_once(gw, target, tags, work)["gap"] or {}).get(99)))
        log(f"  round {round_ + 1}/{CHECKPOINT_ROUNDS}: p99 gap on {p99s['on'][-1]} ms, off {p99s['off'][-1]} ms")
    return p99s


def phase_stop(gw: Gateway, target: Target, tags: Tags, work: Path, log, via: str = "hangup",
               stop_port: int | None = None) -> dict:
    """Stop mid-stream; time until the simulator sees the upstream socket close.

    `via` "hangup": the client closes its socket (a server with ON_DISCONNECT=stop); "route": the
    client POSTs the stop route from another connection, as the page's Stop button does, and
    reads its stream on to `done`. Each sample uses a conversation of its own, so no sample waits
    on another's save. Stop comes after 3, 6 or 10 deltas (a third of the samples each), so stops
    land at different points. `stop_port`: the stop route is asked of that server instead (another
    process on the same Redis: the cross-process Stop).
    """
    per_variant = STOP_SAMPLES // len(STOP_AFTER)
    rounds = per_variant // STOP_CLIENTS
    gw.script(STOP_REPLY, STOP_SAMPLES + 20)
    records = []
    for k, stop_after in enumerate(STOP_AFTER):
        first = k * per_variant
        clients = [[turn_request(target.convs[first + c * rounds + r], tags()) for r in range(rounds)]
                   for c in range(STOP_CLIENTS)]
        records += run_load(load_spec(target.port, "turn", clients, spread=0.5, phase_timeout=120,
                                      request_timeout=30, stop_after=stop_after, stop_via=via,
                                      stop_port=stop_port), None, work).records
    sim: dict = {}
    for r in gw.call("records", 10.0):
        sim.setdefault(r["tag"], r)  # the turn's own request; a title call after a first turn repeats its tag
    closes = []
    for r in records:
        upstream = sim.get(r["tag"])
        if r["stopped"] is not None and upstream is not None and upstream["disconnected_at"] is not None:
            closes.append(upstream["disconnected_at"] - r["stopped"])
    out = {"samples": len(records), "closed": len(closes), "close": {q: pct(closes, q) for q in (50, 90, 99, 100)},
           "target": target.name, "label": target.label, "via": via}
    log(f"  {target.label} ({via}): {len(closes)}/{len(records)} upstream closes seen; p50 {ms(out['close'][50])} "
        f"p99 {ms(out['close'][99])} max {ms(out['close'][100])} ms")
    return out


# --- Several servers on one Redis ----------------------------------------------------------------

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_STREAMS = 200  # concurrent streams spread over the two STORE=redis processes
REDIS_KEYS = ("redis_ttfb_added_p50_ms_1", "redis_ttfb_over_files_p50_ms_1", "redis_two_process_completed",
              "redis_two_process_requested", "cross_process_stop_samples", "cross_process_stop_closed",
              "cross_process_stop_p50_ms", "cross_process_stop_p99_ms")


def start_redis(directory: Path, log_dir: Path) -> Service:
    """A redis-server of the bench's own: a free port, a temporary directory, AOF on (as deployed)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    svc = Service("redis", [REDIS_SERVER, "--port", str(port), "--bind", HOST, "--dir", str(directory),
                            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"],
                  port, "", dict(os.environ), directory, log_dir)
    deadline = time.monotonic() + 30
    while True:  # ready once PING is +PONG (not -LOADING)
        try:
            with socket.create_connection((HOST, port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return svc
        except OSError:
            pass
        if svc.proc.poll() is not None or time.monotonic() > deadline:
            svc.stop()
            raise RuntimeError(f"redis-server did not start: {svc.tail()}")
        time.sleep(0.05)


def phase_redis(gw: Gateway, overhead: dict, tags: Tags, work: Path, log) -> dict:
    """Two STORE=redis servers (started as `make run` starts one) on a Redis of the bench's own.

    One stream at a time through server A beside the simulator direct (the added TTFB, and how much
    more than the file store's figure of the overhead phase); 200 concurrent streams spread over A
    and B; Stop asked of B while the stream runs on A, timed to A's upstream socket closing.
    """
    if not Path(REDIS_SERVER).exists():
        log("  redis-server is not installed (apt-get install redis-server): the Redis figures are skipped")
        return {**dict.fromkeys(REDIS_KEYS), "redis_error": "redis-server is not installed"}
    started: list[Service] = []
    try:
        redis = start_redis(work / "redis", work)
        started.append(redis)
        settings = {"STORE": "redis", "REDIS_URL": f"redis://{HOST}:{redis.port}/0"}
        a = start_server(gw, work / "data-redis-a", work, name="server-redis-a", settings=settings)
        started.append(a)
        b = start_server(gw, work / "data-redis-b", work, name="server-redis-b", settings=settings)
        started.append(b)
        shape = OVERHEAD_LEVELS[1]
        log(f"  creating {1 + REDIS_STREAMS + STOP_SAMPLES} conversations in Redis")
        convs = create_conversations(a, 1 + REDIS_STREAMS + STOP_SAMPLES)
        on_a = Target("redis", "our server, STORE=redis", a.port, "turn", a, convs[:1])
        direct = Target("direct", "simulator direct", int(gw.base_url.rsplit(":", 1)[1]), "chat")
        single = {}
        for target in (direct, on_a):
            gw.script(OVERHEAD_REPLY, shape["rounds"] + 10)
            spec = load_spec(target.port, target.dialect, target.clients(tags, 1, shape["rounds"]), spread=0.0,
                             phase_timeout=180, request_timeout=120)
            single[target.name] = summarize(run_load(spec, target.service, work).records)
        redis_added = single["redis"]["ttfb"][50] - single["direct"]["ttfb"][50] \
            if None not in (single["redis"]["ttfb"][50], single["direct"]["ttfb"][50]) else None
        out = {"redis_ttfb_added_p50_ms_1": ms(redis_added)}
        files = overhead.get(("ours", 1))
        files_added = files["ttfb"][50] - overhead[("direct", 1)]["ttfb"][50] \
            if files and ("direct", 1) in overhead else None
        out["redis_ttfb_over_files_p50_ms_1"] = ms(redis_added - files_added) \
            if None not in (redis_added, files_added) else None
        log(f"  one stream through STORE=redis: ttfb added p50 {out['redis_ttfb_added_p50_ms_1']} ms "
            f"({out['redis_ttfb_over_files_p50_ms_1']} ms over the file store's)")

        gw.script(OVERHEAD_REPLY, REDIS_STREAMS + 20)
        clients = [[{**turn_request(conv_id, tags()), "port": (a.port, b.port)[i % 2]}]
                   for i, conv_id in enumerate(convs[1:1 + REDIS_STREAMS])]
        spread = summarize(run_load(load_spec(a.port, "turn", clients, spread=2.0, phase_timeout=180,
                                              request_timeout=120), None, work).records)
        out["redis_two_process_completed"], out["redis_two_process_requested"] = spread["completed"], spread["requests"]
        log(f"  {REDIS_STREAMS} streams over two processes: {spread['completed']}/{spread['requests']} completed"
            + (f", errors {spread['errors']}" if spread["errors"] else ""))

        stopping = Target("redis", "our server, STORE=redis, Stop on the other process", a.port, "turn", a,
                          convs[1 + REDIS_STREAMS:])
        stop = phase_stop(gw, stopping, tags, work, log, via="route", stop_port=b.port)
        out["cross_process_stop_samples"], out["cross_process_stop_closed"] = stop["samples"], stop["closed"]
        out["cross_process_stop_p50_ms"], out["cross_process_stop_p99_ms"] = ms(stop["close"][50]), ms(stop["close"][99])
        return out
    finally:
        for svc in reversed(started):
            svc.stop()  # by its own pid, Redis last


# --- WORKERS=2 beside WORKERS=1 ------------------------------------------------------------------

WORKERS_REPLY = {"words": 10, "delay": 0.05}  # half a second of reply: the phase measures turn starts
WORKERS_STEP_SECONDS = 6.0  # each rate of turn starts is held this long (starts evenly spaced)
WORKERS_FIRST_RATE = 20.0  # turn starts per second tried first; then ×1.5 until one misses
WORKERS_MAX_RATE = 400.0
WORKERS_BISECTIONS = 2  # between the last rate met and the first missed
WORKERS_P99_LIMIT_MS = 100.0  # p99 added time to first token a rate must stay under
# Other people's builds and tests on the shared cores decide this phase's figures more than anything: it
# waits longer for quiet (per step, and in all) than the other phases do.
WORKERS_QUIET_PER_STEP = 30.0
WORKERS_QUIET_BUDGET = 600.0
WORKERS_KEYS = ("workers_turn_rate_1", "workers_turn_rate_2", "workers_turn_rate_ratio",
                "workers_ttfb_added_p99_ms_1", "workers_ttfb_added_p99_ms_2", "workers_cpu_ms_per_turn_1",
                "workers_cpu_ms_per_turn_2", "workers_machine_ms_per_turn_2", "workers_ceiling_ratio")


def wait_for_workers(server: Service, workers: int, timeout: float = 60) -> None:
    """Until /healthz over fresh connections has been answered by every one of the server's workers."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: only workers {sorted(seen)} of {workers} answered: {server.tail()}")
        try:
            seen.add(httpx.get(server.url + "/healthz", timeout=2).json()["worker"])
        except httpx.HTTPError:
            time.sleep(0.1)


class RateSearch:
    """The highest rate of turn starts one server sustains: ×1.5 from WORKERS_FIRST_RATE until a rate
    misses, then WORKERS_BISECTIONS bisections between the last rate met and the first missed."""

    def __init__(self) -> None:
        self.rate: float | None = WORKERS_FIRST_RATE  # the next rate to try; None when done
        self.best: float | None = None
        self.best_added: float | None = None
        self.missed: float | None = None
        self.bisections = 0

    def record(self, met: bool, added: float | None) -> None:
        rate = self.rate
        assert rate is not None
        if met:
            self.best, self.best_added = rate, added
        else:
            self.missed = rate
        if self.missed is None:
            grown = round(rate * 1.5, 1)
            self.rate = grown if grown <= WORKERS_MAX_RATE else None
        elif self.best is None or self.bisections >= WORKERS_BISECTIONS:
            self.rate = None
        else:
            self.bisections += 1
            self.rate = round((self.best + self.missed) / 2, 1)


def phase_workers(gw: Gateway, tags: Tags, work: Path, log) -> dict:
    """Turn starts per second a STORE=redis server sustains with WORKERS=1 and with WORKERS=2.

    At each rate, `rate × WORKERS_STEP_SECONDS` turns (each on a conversation of its own, one
    connection each) start evenly spaced; the rate is met when every turn completes and the p99
    time to first token exceeds the simulator's own (direct, at the same rate) by under
    WORKERS_P99_LIMIT_MS. Each server's rate is searched as `RateSearch` says. Both servers
    (started as `make run` starts them, on one Redis, a database each) stay up and are loaded in
    turn, one step each, so other load on the shared machine falls on both alike; a missed rate
    is tried once more before it counts, for the same reason. The simulator, Redis and the load
    generator share the machine's cores with the server measured.
    """
    if not Path(REDIS_SERVER).exists():
        log("  redis-server is not installed (apt-get install redis-server): the WORKERS figures are skipped")
        return {**dict.fromkeys(WORKERS_KEYS), "workers_error": "redis-server is not installed"}
    direct_port = int(gw.base_url.rsplit(":", 1)[1])
    direct_p99: dict[float, float | None] = {}  # rate -> the simulator's own p99 TTFB, measured once per rate
    out: dict = {}
    started: list[Service] = []
    quiet = (Quiet.per_call, Quiet.budget)
    Quiet.per_call, Quiet.budget = WORKERS_QUIET_PER_STEP, Quiet.waited + WORKERS_QUIET_BUDGET
    try:
        redis = start_redis(work / "redis-workers", work)
        started.append(redis)
        servers: dict[int, Service] = {}
        for database, workers in enumerate((1, 2)):
            settings = {"STORE": "redis", "REDIS_URL": f"redis://{HOST}:{redis.port}/{database}",
                        "WORKERS": str(workers)}
            servers[workers] = start_server(gw, work / f"data-workers-{workers}", work,
                                            name=f"server-workers-{workers}", settings=settings)
            started.append(servers[workers])
            wait_for_workers(servers[workers], workers)
        convs: dict[int, list[str]] = {workers: [] for workers in servers}
        cpu_ms: dict[int, list[float | None]] = {workers: [] for workers in servers}  # per step: server CPU per turn
        # Per step: (rate, server CPU per turn, every process's CPU per turn), for the machine's ceiling.
        steps: dict[int, list[tuple[float, float | None, float]]] = {workers: [] for workers in servers}

        def step(workers: int, rate: float) -> tuple[bool, float | None]:
            server, n = servers[workers], int(round(rate * WORKERS_STEP_SECONDS))
            if len(convs[workers]) < n:
                convs[workers].extend(create_conversations(server, n - len(convs[workers])))
            if rate not in direct_p99:
                gw.script(WORKERS_REPLY, n + 20)
                spec = load_spec(direct_port, "chat", [[chat_request(tags())] for _ in range(n)],
                                 spread=WORKERS_STEP_SECONDS, phase_timeout=120, request_timeout=60)
                direct_p99[rate] = summarize(run_load(spec, None, work).records)["ttfb"][99]
            gw.script(WORKERS_REPLY, n + 20)
            spec = load_spec(server.port, "turn", [[turn_request(c, tags())] for c in convs[workers][:n]],
                             spread=WORKERS_STEP_SECONDS, phase_timeout=120, request_timeout=60)
            busy = machine_busy_seconds()
            load = run_load(spec, server, work)
            machine = (machine_busy_seconds() - busy) * 1000 / n
            summary = summarize(load.records)
            cpu_ms[workers].append(load.cpu_seconds * 1000 / n if load.cpu_seconds is not None else None)
            steps[workers].append((rate, cpu_ms[workers][-1], machine))
            ours, base = summary["ttfb"][99], direct_p99[rate]
            added = ours - base if None not in (ours, base) else None
            met = summary["completed"] == n and added is not None and added * 1000 < WORKERS_P99_LIMIT_MS
            log(f"  WORKERS={workers} at {rate:5.1f} turn starts/s: {summary['completed']}/{n} completed, "
                f"p99 ttfb added {ms(added)} ms, server cpu {fmt(cpu_ms[workers][-1])} ms/turn, "
                f"other load {load.other_cpu:.0%}: {'met' if met else 'missed'}"
                + (f", errors {summary['errors']}" if summary["errors"] else ""))
            return met, added

        searches = {workers: RateSearch() for workers in servers}
        while any(search.rate is not None for search in searches.values()):
            for workers, search in searches.items():
                if search.rate is None:
                    continue
                met, added = step(workers, search.rate)
                if not met:
                    met, added = step(workers, search.rate)  # once more: a miss may be another process's doing
                search.record(met, added)
        for workers, search in searches.items():
            out[f"workers_turn_rate_{workers}"] = search.best
            out[f"workers_ttfb_added_p99_ms_{workers}"] = ms(search.best_added)
            measured = [v for v in cpu_ms[workers] if v is not None]
            out[f"workers_cpu_ms_per_turn_{workers}"] = round(statistics.median(measured), 2) if measured else None
            log(f"  WORKERS={workers}: sustains {search.best} turn starts/s (p99 ttfb added {ms(search.best_added)} ms, "
                f"median server cpu {fmt(out[f'workers_cpu_ms_per_turn_{workers}'])} ms/turn)"
                + (f"; {search.missed} missed" if search.missed is not None else ""))
        one, two = out.get("workers_turn_rate_1"), out.get("workers_turn_rate_2")
        out["workers_turn_rate_ratio"] = round(two / one, 2) if one and two else None
        log(f"  WORKERS=2 over WORKERS=1: {out['workers_turn_rate_ratio']}x")
        # The most the machine allows, every core busy: one worker is held to one core by its server's
        # CPU per turn; two share all the cores with the simulator, Redis and the load generator, so
        # their bound is the cores over what every process spends per turn. Both read at the rates
        # that saturate (the best one met and above), where a turn costs least.
        def saturated(workers: int, index: int) -> float | None:
            best = searches[workers].best or 0.0
            values = [step[index] for step in steps[workers] if step[0] >= best and step[index] is not None]
            return statistics.median(values) if values else None

        server_one, machine_two = saturated(1, 1), saturated(2, 2)
        cores = os.cpu_count() or 1
        out["workers_machine_ms_per_turn_2"] = round(machine_two, 2) if machine_two else None
        out["workers_ceiling_ratio"] = round(cores * server_one / machine_two, 2) if server_one and machine_two else None
        log(f"  the machine's ceiling: WORKERS=1 at most {fmt(1000 / server_one if server_one else None)} turns/s "
            f"(one core, {fmt(server_one)} ms/turn), WORKERS=2 at most "
            f"{fmt(cores * 1000 / machine_two if machine_two else None)} ({cores} cores, {fmt(machine_two)} ms/turn "
            f"in every process): {fmt(out['workers_ceiling_ratio'])}x")
        return out
    finally:
        Quiet.per_call, Quiet.budget = quiet[0], max(quiet[1], Quiet.waited)
        for svc in reversed(started):
            svc.stop()


WORDS = ("the of and to in is that for it as with was on be by this are from or at an not have but which we "
         "can you they all their has more one will if about would there use when so what some out up into them "
         "than other only new time these could may most also any then first like over such our very python "
         "server stream token cache model gateway budget summary memory browser request reply").split()


def prose(rng: random.Random, chars: int) -> str:
    words, size = [], 0
    while size < chars:
        word = rng.choice(WORDS) + rng.choice(("", "", "", "s", ",", "."))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def write_history(data_dir: Path, template: dict, n: int) -> tuple[str, float]:
    """A conversation of `n` messages in the stored format, written straight into DATA_DIR.

    Person ~300 characters, reply ~1,200, each reply with measured usage, as a conversation
    that grew turn by turn would have. The budget is raised so that no compression runs:
    this measures carrying the history, not folding it. Returns (id, file size in MB).
    """
    rng = random.Random(n)
    messages, prompt = [], 0
    for i in range(n):
        created = now_iso()
        if i % 2 == 0:
            messages.append({"id": new_id(), "role": "user", "content": prose(rng, 300), "created_at": created})
        else:
            content = prose(rng, 1200)
            usage = {"input_tokens": prompt, "output_tokens": len(content) // 4, "cached_tokens": int(prompt * 0.9),
                     "cache_write_tokens": 0, "cost": 0.0001, "searches": 0, "fetches": 0, "estimated": False}
            messages.append({"id": new_id(), "role": "assistant", "content": content, "created_at": created,
                             "model": template["model"], "status": "complete", "activity": [], "citations": [],
                             "usage": usage})
        prompt += len(messages[-1]["content"]) // 4 + 4
    conv_id = new_id()
    totals = {**empty_totals(), "turns": n // 2}
    conv = {"schema_version": SCHEMA_VERSION, "id": conv_id, "owner": LOCAL_OWNER, "title": f"History of {n} messages",
            "model": template["model"], "created_at": now_iso(), "updated_at": now_iso(),
            "settings": {**template["settings"], "context_budget": 10_000_000}, "summary": "",
            "messages": messages, "last_prompt_tokens": prompt, "totals": totals}
    path = data_dir / "conversations" / f"{conv_id}.json"
    path.write_bytes(orjson.dumps(conv, option=orjson.OPT_INDENT_2) + b"\n")
    return conv_id, path.stat().st_size / 1e6


def timed_turns(gw: Gateway, server: Service, conv_id: str, tags: Tags, work: Path, turns: int) -> list[dict]:
    """Sequential turns; server time = wall time minus the span the simulator spent answering."""
    gw.script(HISTORY_REPLY, turns + 5)
    records = run_load(load_spec(server.port, "turn", [[turn_request(conv_id, tags()) for _ in range(turns)]],
                                    spread=0, phase_timeout=240, request_timeout=60), None, work).records
    sim = {r["tag"]: r for r in gw.call("records", 10.0)}
    out = []
    for r in records:
        upstream = sim.get(r["tag"])
        if not r["ok"] or upstream is None or upstream["finished_at"] is None:
            out.append({"ok": False, "error": r["error"]})
            continue
        wall = r["end"] - r["start"]
        gateway_span = upstream["finished_at"] - upstream["started_at"]
        out.append({"ok": True, "wall": wall, "server": wall - gateway_span, "ttfb": r["first"] - r["start"],
                    "before_upstream": upstream["started_at"] - r["start"],
                    "after_upstream": r["end"] - upstream["finished_at"]})
    return out


def phase_history(gw: Gateway, server: Service, data_dir: Path, template: dict, tags: Tags, work: Path,
                  log) -> dict:
    """Per-turn server time for conversations of each size in HISTORY_SIZES (medians of a few turns).

    The sizes take turns, one turn each per round: the host's drift over the phase (other work,
    the disk's background flushing) then falls on every size alike instead of on whichever ran
    last, and the difference between sizes is what the phase reports.
    """
    convs = {}
    for n in HISTORY_SIZES:
        conv_id, size_mb = write_history(data_dir, template, n)
        # The page opens a conversation before its first turn; that read (and parse) is not the turn's.
        httpx.get(f"{server.url}/api/conversations/{conv_id}", timeout=60).raise_for_status()
        # Nor is the search index's one-time take-up of a file written behind the server's back: one
        # untimed turn has it indexed, and a search waits for the index's queued writes.
        timed_turns(gw, server, conv_id, tags, work, 1)
        httpx.get(f"{server.url}/api/search", params={"q": "bench"}, timeout=120).raise_for_status()
        convs[n] = (conv_id, size_mb)
    turns: dict[int, list[dict]] = {n: [] for n in HISTORY_SIZES}
    for _ in range(HISTORY_TURNS):
        for n in HISTORY_SIZES:
            turns[n] += timed_turns(gw, server, convs[n][0], tags, work, 1)
    out = {}
    for n in HISTORY_SIZES:
        (conv_id, size_mb), good = convs[n], [t for t in turns[n] if t["ok"]]
        out[n] = {"id": conv_id, "file_mb": size_mb, "turns": len(turns[n]), "ok": len(good),
                  **{k: pct([t[k] for t in good], 50) for k in ("server", "wall", "ttfb", "before_upstream",
                                                                 "after_upstream")}}
        log(f"  {n:>6d} messages ({size_mb:.1f} MB): {len(good)}/{len(turns[n])} turns, server p50 "
            f"{ms(out[n]['server'])} ms (before upstream {ms(out[n]['before_upstream'])}, after "
            f"{ms(out[n]['after_upstream'])}), wall {ms(out[n]['wall'])} ms, ttfb {ms(out[n]['ttfb'])} ms")
    return out


def profile_history(gw: Gateway, server: Service, conv_id: str, tags: Tags, work: Path, log) -> list[tuple]:
    """py-spy over a few turns of the longest conversation: ("ours"|"leaf", share of busy samples, frame)."""
    py_spy = Path(PY).parent / "py-spy"
    if not py_spy.exists():
        log("  py-spy is not installed (`make bench` installs it): no profile")
        return []
    raw = work / "profile.txt"
    spy = subprocess.Popen([str(py_spy), "record", "--pid", str(server.proc.pid), "--format", "raw",
                            "--output", str(raw), "--rate", "1000", "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the first turn starts
    timed_turns(gw, server, conv_id, tags, work, PROFILE_TURNS)
    spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
    if not raw.exists():
        log("  py-spy wrote no profile")
        return []
    inclusive: Counter = Counter()
    leaf: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        leaf[stack.split(";")[-1]] += int(count)  # with its line: which call of the function
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        # The project's own functions (bare file names; libraries show their package path), each
        # counted once per sample however deep it recurs.
        for frame in {f for f in frames if re.search(r"\((\w+)\.py\)$", f)}:
            inclusive[frame] += int(count)
    if not total:
        return []
    shutil.copy(raw, BENCH / "profile_history_10k.txt")
    return ([("ours", round(c / total * 100, 1), f) for f, c in inclusive.most_common(12)]
            + [("leaf", round(c / total * 100, 1), f) for f, c in leaf.most_common(8)])


# --- Reporting ---------------------------------------------------------------------------------

def disk_write_ms(directory: Path, writes: int = 100) -> tuple[float, float]:
    """p50 and p99 of the store's own atomic write of a 4 KB file in `directory`, in ms."""
    from chatserver.store.files import atomic_write

    times = []
    for _ in range(writes):
        t = time.perf_counter()
        atomic_write(directory / "probe.json", b"x" * 4096)
        times.append(time.perf_counter() - t)
    (directory / "probe.json").unlink()
    return ms(pct(times, 50)), ms(pct(times, 99))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "kernel": platform.release(), "mem_gb": round(int(mem.group(1)) / 1024 / 1024, 1) if mem else None,
            "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def litellm_version() -> str | None:
    try:
        out = subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def prefix(name: str) -> str:
    """results.json prefix of a target: our server's keys are bare, the others' carry its name."""
    return "" if name == "ours" else f"{name}_"


def flatten(overhead: dict, sustain: dict, stops: dict, history: dict | None, rss_idle: float) -> dict:
    """The flat `results.json` keys."""
    r: dict = {}
    for (name, level), s in overhead.items():
        p = prefix(name)
        r[f"{p}streams_completed_{level}"] = s["completed"]
        r[f"{p}streams_requested_{level}"] = s["requests"]
        base = overhead.get(("direct", level))
        for metric in ("ttfb", "ttlb"):
            for q in (50, 99):
                if name == "direct":
                    r[f"direct_{metric}_p{q}_ms_{level}"] = ms(s[metric][q])
                elif base is not None and None not in (s[metric][q], base[metric][q]):
                    r[f"{p}{metric}_added_p{q}_ms_{level}"] = ms(s[metric][q] - base[metric][q])
                else:
                    r[f"{p}{metric}_added_p{q}_ms_{level}"] = None
        if s.get("rss_mb_peak") is not None:
            r[f"{p}rss_mb_{level}"] = round(s["rss_mb_peak"], 1)
        if s.get("cpu_ms_per_stream") is not None:
            r[f"{p}cpu_ms_per_stream_{level}"] = round(s["cpu_ms_per_stream"], 2)
        if s.get("scrape_ms"):
            r[f"{p}metrics_scrape_p50_ms_{level}"] = s["scrape_ms"][50]
            r[f"{p}metrics_scrape_p99_ms_{level}"] = s["scrape_ms"][99]
            r[f"{p}metrics_scrapes_{level}"] = s["scrapes"]
            r[f"{p}metrics_scrape_cpu_p50_ms_{level}"] = s["scrape_cpu_ms"][50]
            r[f"{p}metrics_scrape_cpu_p99_ms_{level}"] = s["scrape_cpu_ms"][99]
            r[f"{p}metrics_scrape_gc_p99_ms_{level}"] = s["scrape_gc_ms"][99]
            r[f"{p}metrics_scrape_gc_max_ms_{level}"] = s["scrape_gc_ms"][100]
            r[f"{p}metrics_scrape_after_p50_ms_{level}"] = s["scrape_idle_ms"][50]
            r[f"{p}metrics_scrape_after_p99_ms_{level}"] = s["scrape_idle_ms"][99]
    for level in OVERHEAD_LEVELS:
        # Issue 30's aim: our CPU per turn at most 1.3x the bare relay's.
        ours, relay = r.get(f"cpu_ms_per_stream_{level}"), r.get(f"relay_cpu_ms_per_stream_{level}")
        r[f"cpu_ratio_to_relay_{level}"] = round(ours / relay, 2) if ours and relay else None
        for metric in ("ttfb", "ttlb"):
            ours, theirs = r.get(f"{metric}_added_p50_ms_{level}"), r.get(f"litellm_{metric}_added_p50_ms_{level}")
            # Our added time as a share of LiteLLM's (below 1: we add less). Undefined when LiteLLM adds nothing.
            r[f"{metric}_ratio_to_litellm_p50_{level}"] = (
                round(ours / theirs, 3) if ours is not None and theirs is not None and theirs > 0 else None)
    n = SUSTAIN_STREAMS
    for name, s in sustain.items():
        if name == "checkpoint_rounds":
            continue
        p = prefix(name)
        r[f"{p}streams_completed_{n}"] = s["completed"]
        gap = s["gap"] or {}
        r[f"{p}gap_p50_ms_{n}"], r[f"{p}gap_p99_ms_{n}"], r[f"{p}gap_max_ms_{n}"] = (
            ms(gap.get(50)), ms(gap.get(99)), ms(gap.get(100)))
        if s.get("rss_mb_peak") is not None:
            r[f"{p}rss_mb_{n}"] = round(s["rss_mb_peak"], 1)
    r["rss_mb_idle"] = round(rss_idle, 1)
    for stop in stops.values():
        p = prefix(stop["target"]) + ("stop_route" if stop["via"] == "route" else "stop")
        r[f"{p}_samples"], r[f"{p}_closed"] = stop["samples"], stop["closed"]
        for q, key in ((50, "p50"), (99, "p99"), (100, "max")):
            r[f"{p}_close_{key}_ms"] = ms(stop["close"][q])
    on, off = r.get(f"{prefix(CHECKPOINTS_ON)}gap_p99_ms_{n}"), r.get(f"{prefix(NO_CHECKPOINTS)}gap_p99_ms_{n}")
    # The p99 gap with checkpoints on (the default) over the same with them off, twin servers in the
    # same run: the medians of CHECKPOINT_ROUNDS alternating runs when there are, else the one pair.
    rounds = sustain.get("checkpoint_rounds") if isinstance(sustain.get("checkpoint_rounds"), dict) else None
    if rounds and None not in rounds["on"] + rounds["off"]:
        on, off = statistics.median(rounds["on"]), statistics.median(rounds["off"])
        r[f"checkpoint_gap_p99_on_runs_{n}"], r[f"checkpoint_gap_p99_off_runs_{n}"] = rounds["on"], rounds["off"]
    r[f"checkpoint_gap_p99_ratio_{n}"] = round(on / off, 3) if on is not None and off else None
    if history:
        names = {10: "10", 1_000: "1k", 10_000: "10k"}
        for size, h in history.items():
            r[f"turn_server_ms_{names[size]}"] = ms(h["server"])
            r[f"turn_wall_ms_{names[size]}"] = ms(h["wall"])
            r[f"turn_ttfb_ms_{names[size]}"] = ms(h["ttfb"])
            r[f"history_file_mb_{names[size]}"] = round(h["file_mb"], 2)
        for size in HISTORY_SIZES[1:]:
            if history[size]["server"] is not None and history[10]["server"] is not None:
                r[f"turn_added_ms_{names[size]}"] = ms(history[size]["server"] - history[10]["server"])
    return r


def fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def verdict(results: dict) -> list[str]:
    lines = []
    litellm = results.get("litellm_ttfb_added_p50_ms_1")
    checks = [
        ("p50 added TTFB at 1 stream ≤ 3 ms", results.get("ttfb_added_p50_ms_1"), lambda v: v <= 3.0),
        ("p50 tool round added < 2 ms", results.get("tool_round_added_ms_p50"), lambda v: v < 2.0),
        ("p50 MCP round (Streamable HTTP, loopback) adds < 10 ms over a local tool's",
         results.get("mcp_http_round_added_ms_p50"), lambda v: v < 10.0),
        ("p50 added TTFB at 1 stream below LiteLLM's", results.get("ttfb_added_p50_ms_1"),
         (lambda v: v < litellm) if litellm is not None else None),
        ("every stream completes at 200", results.get("streams_completed_200"),
         lambda v: v == results.get("streams_requested_200")),
        ("p99 added TTFB at 200 streams < 100 ms", results.get("ttfb_added_p99_ms_200"), lambda v: v < 100.0),
        ("p99 added TTLB at 200 streams < 100 ms", results.get("ttlb_added_p99_ms_200"), lambda v: v < 100.0),
        (f"{SUSTAIN_STREAMS} streams at 20 tokens/s all complete", results.get(f"streams_completed_{SUSTAIN_STREAMS}"),
         lambda v: v == SUSTAIN_STREAMS),
        (f"p99 gap between events at {SUSTAIN_STREAMS} streams < 150 ms", results.get("gap_p99_ms_400"),
         lambda v: v < 150.0),
        (f"p99 gap at {SUSTAIN_STREAMS} streams with checkpoints on within 10% of off (ratio)",
         results.get(f"checkpoint_gap_p99_ratio_{SUSTAIN_STREAMS}"), lambda v: v <= 1.10),
        ("Stop (ON_DISCONNECT=stop): p99 browser disconnect → upstream close < 100 ms", results.get("stop_close_p99_ms"),
         lambda v: v < 100.0),
        ("Stop route: p99 POST stop → upstream close < 100 ms", results.get("stop_route_close_p99_ms"),
         lambda v: v < 100.0),
        ("10,000-message turn adds < 50 ms over a 10-message one", results.get("turn_added_ms_10k"),
         lambda v: v < 50.0),
        ("10,000-message turn adds < 10 ms over a 10-message one (issue 30)", results.get("turn_added_ms_10k"),
         lambda v: v < 10.0),
        ("CPU per turn at 200 streams ≤ 1.3x the bare relay's (issue 30)", results.get("cpu_ratio_to_relay_200"),
         lambda v: v <= 1.3),
        ("GET /metrics with 200 streams open: p99 of its render's CPU < 5 ms (issue 30; a garbage collection "
         "that fell due inside the render is counted apart, next row)",
         results.get("metrics_scrape_cpu_p99_ms_200"), lambda v: v < 5.0),
        ("GET /metrics with 200 streams open: the most CPU a garbage collection took inside one render (ms; "
         "the cost of every allocation since the last collection, whichever code it lands in)",
         results.get("metrics_scrape_gc_max_ms_200"), None),
        ("GET /metrics with 200 streams open: p99 answered < 5 ms (waits behind the streams' events)",
         results.get("metrics_scrape_p99_ms_200"), lambda v: v < 5.0),
        ("RSS with 200 open streams < 200 MB", results.get("rss_mb_200"), lambda v: v < 200.0),
        ("STORE=redis: p50 added TTFB at 1 stream within 1 ms of the file store's",
         results.get("redis_ttfb_over_files_p50_ms_1"), lambda v: v <= 1.0),
        (f"STORE=redis: {REDIS_STREAMS} streams over two processes all complete",
         results.get("redis_two_process_completed"), lambda v: v == results.get("redis_two_process_requested")),
        ("STORE=redis: p99 POST stop on B → A's upstream close < 100 ms", results.get("cross_process_stop_p99_ms"),
         lambda v: v < 100.0),
        (f"WORKERS=2: turn starts/s sustained (p99 added TTFB < {WORKERS_P99_LIMIT_MS:.0f} ms) ≥ 1.6× WORKERS=1's",
         results.get("workers_turn_rate_ratio"), lambda v: v >= 1.6),
        ("WORKERS: the most this machine allows, every core busy (2 workers' bound over 1's; the 1.6x above "
         "cannot be met where this is under it)", results.get("workers_ceiling_ratio"), None),
    ]
    for label, value, test in checks:
        state = "n/a" if value is None or test is None else ("met" if test(value) else "**MISSED**")
        lines.append(f"| {label} | {fmt(value)} | {state} |")
    return lines


def write_markdown(results: dict, labels: dict[str, str], overhead: dict, sustain: dict, stops: dict,
                   history: dict | None, profile: list[tuple], litellm_error: str | None) -> None:
    m = results
    order = list(labels)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run.py`; `--no-litellm`, `--no-tmpfs` and `--skip PHASE` shorten a run); "
        "every figure below is from the run on the machine named here. Hand-written findings follow the generated "
        "part and are kept across runs.",
        "",
        f"- Machine: {m['nproc']} cores, {m['cpu_model']}, {m['mem_gb']} GiB, Linux {m['kernel']}",
        f"- Python {m['python']} (server, relay, load generator, simulator); LiteLLM {m.get('litellm_version') or 'n/a'}",
        f"- Date: {m['date']}; wall time of the run: {m['bench_seconds']:.0f} s, of which {m['quiet_wait_seconds']:.0f} s "
        "waiting for other processes to leave the CPU before a measurement",
        "- Every party is its own process on the same 2 cores: simulator, server(s), relay, LiteLLM, load generator.",
        f"- Disk under DATA_DIR: one 4 KB atomic write (write, fsync, rename, directory fsync) took p50 "
        f"{fmt(m['disk_write_p50_ms'])} ms, p99 {fmt(m['disk_write_p99_ms'])} ms just before the run.",
        f"- Other load: load average {m['loadavg_start']} at the start. The *other load* columns give the share of "
        "the machine's CPU that processes outside this benchmark (other people's builds and tests, browsers) used "
        "during that measurement; figures taken under other load are slower than the machine can do.",
        "",
        "## Targets",
        "",
        "| target | measured | |",
        "|---|---|---|",
        *verdict(results),
        "",
        "## Overhead: time added over the simulator alone",
        "",
        f"Reply: {OVERHEAD_REPLY['words']} one-token chunks, {OVERHEAD_REPLY['delay'] * 1000:.0f} ms before each "
        f"(20 tokens/s, {OVERHEAD_REPLY['words'] * OVERHEAD_REPLY['delay']:.0f} s). Requests per client, back to back: "
        + ", ".join(f"{lvl} stream{'s' if lvl > 1 else ''} × {s['rounds']}" for lvl, s in OVERHEAD_LEVELS.items())
        + f"; client starts spread over {OVERHEAD_LEVELS[200]['spread']:.0f} s (one reply's length), so the "
          "concurrency holds near the level (at 200 streams, about 100 new turns a second). Each request opens a new "
          "connection. TTFB = to the first text event (our `delta`, not `start`); TTLB = to the terminal event (our "
          "`done`, sent after the reply is fsynced; `[DONE]` elsewhere). Added = the target's percentile − the "
          "direct percentile at the same concurrency. CPU per stream = the process's CPU time over the "
          "measurement divided by the streams (less sensitive to other load than the latencies; at 1 stream the "
          "process's idle housekeeping over the whole measurement dominates it). All times in ms.",
        "",
        "| streams | target | completed | TTFB p50 | TTFB p99 | added TTFB p50 | added TTFB p99 | TTLB p50 | TTLB p99 "
        "| added TTLB p50 | added TTLB p99 | CPU ms per stream | peak RSS MB | other load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, level), s in sorted(overhead.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        base = overhead.get(("direct", level))

        def added(metric, q, s=s, base=base, name=name):
            if name == "direct":
                return ""
            if base is None or None in (s[metric][q], base[metric][q]):
                return "n/a"
            return fmt(ms(s[metric][q] - base[metric][q]))

        lines.append(
            f"| {level} | {labels[name]} | {s['completed']}/{s['requests']} | {fmt(ms(s['ttfb'][50]))} | "
            f"{fmt(ms(s['ttfb'][99]))} | {added('ttfb', 50)} | {added('ttfb', 99)} | {fmt(ms(s['ttlb'][50]))} | "
            f"{fmt(ms(s['ttlb'][99]))} | {added('ttlb', 50)} | {added('ttlb', 99)} | "
            f"{fmt(round(s['cpu_ms_per_stream'], 2)) if s.get('cpu_ms_per_stream') else ''} | "
            f"{fmt(round(s['rss_mb_peak'], 1)) if s.get('rss_mb_peak') else ''} | {s['other_cpu']:.0%} |")
    lines += ["", "Our added p50 as a share of LiteLLM's (below 1: we add less). TTFB: "
              + ", ".join(f"{lvl} streams {fmt(m.get(f'ttfb_ratio_to_litellm_p50_{lvl}'))}" for lvl in OVERHEAD_LEVELS)
              + "; TTLB: "
              + ", ".join(f"{lvl} streams {fmt(m.get(f'ttlb_ratio_to_litellm_p50_{lvl}'))}" for lvl in OVERHEAD_LEVELS)
              + "."]
    if litellm_error:
        lines += ["", f"LiteLLM was not measured in this run: {litellm_error}"]
    lines += [
        "",
        f"## {SUSTAIN_STREAMS} streams held open at 20 tokens/s",
        "",
        f"Reply: {SUSTAIN_REPLY['words']} chunks, {SUSTAIN_REPLY['delay'] * 1000:.0f} ms apart (ideal gap 50 ms); "
        f"all {SUSTAIN_STREAMS} streams started within {SUSTAIN_SPREAD:.0f} s. Gap = time between consecutive text "
        "events of one stream, at the client. All times in ms.",
        "",
        "| target | completed | gap p50 | gap p99 | gap max | TTFB p99 | peak RSS MB | other load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in order:
        if name not in sustain:
            continue
        s = sustain[name]
        gap = s["gap"] or {}
        lines.append(f"| {labels[name]} | {s['completed']}/{s['requests']} | {fmt(ms(gap.get(50)))} | "
                     f"{fmt(ms(gap.get(99)))} | {fmt(ms(gap.get(100)))} | {fmt(ms(s['ttfb'][99]))} | "
                     f"{fmt(round(s['rss_mb_peak'], 1)) if s.get('rss_mb_peak') else ''} | {s['other_cpu']:.0%} |")
    n = SUSTAIN_STREAMS
    if m.get(f"checkpoint_gap_p99_on_runs_{n}"):
        on, off = m[f"checkpoint_gap_p99_on_runs_{n}"], m[f"checkpoint_gap_p99_off_runs_{n}"]
        lines += ["", f"Checkpoints on and off, {len(on)} alternating runs each at {n} streams, p99 gap (ms): on "
                  f"{', '.join(map(fmt, on))}; off {', '.join(map(fmt, off))}. Medians {fmt(statistics.median(on))} "
                  f"and {fmt(statistics.median(off))}: ratio {fmt(m.get(f'checkpoint_gap_p99_ratio_{n}'))}."]
    if stops:
        lines += [
            "", "## Stop", "",
            f"{STOP_SAMPLES} turns per server, {STOP_CLIENTS} at a time, each stopped by the client after 3, 6 or 10 "
            f"deltas (reply chunks every {STOP_REPLY['delay'] * 1000:.0f} ms), in one of two ways: *hang-up*, the "
            "client closes its socket (a server with ON_DISCONNECT=stop; by default a hang-up no longer stops a "
            "turn), or *route*, the client POSTs `/api/conversations/{id}/stop` on another connection, as the "
            "page's Stop button does. Measured: from the client's Stop (its `time.monotonic()`, before connecting "
            "for the POST) to the simulator recording the upstream connection's hang-up (`disconnected_at`, the "
            "same clock).",
            "",
            "| server | stop | upstream closes seen | p50 ms | p90 ms | p99 ms | max ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for stop in stops.values():
            c = stop["close"]
            lines.append(f"| {stop['label']} | {stop['via']} | {stop['closed']}/{stop['samples']} | {fmt(ms(c[50]))} | "
                         f"{fmt(ms(c[90]))} | {fmt(ms(c[99]))} | {fmt(ms(c[100]))} |")
    if history:
        lines += [
            "", "## Per-turn cost with long histories", "",
            "Conversation files written straight into DATA_DIR (person ~300 characters, reply ~1,200, measured usage "
            "on every reply, budget raised so nothing is compressed), opened once with GET as the page does, then "
            f"{HISTORY_TURNS} turns each with a {HISTORY_REPLY['words']}-chunk reply, the sizes taking turns (one turn "
            "of each size per round, so the host's drift falls on every size alike). Server time = the turn's "
            "wall time (POST to `done`) minus the span the simulator spent on the request (its `started_at` to "
            "`finished_at`), so the simulator's own handling of a large prompt is not counted; before/after upstream "
            "split it at those two instants. Medians over the turns.",
            "",
            "| messages | file MB | server ms | before upstream ms | after upstream ms | wall ms | TTFB ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for size, h in history.items():
            lines.append(f"| {size:,} | {h['file_mb']:.1f} | {fmt(ms(h['server']))} | {fmt(ms(h['before_upstream']))} | "
                         f"{fmt(ms(h['after_upstream']))} | {fmt(ms(h['wall']))} | {fmt(ms(h['ttfb']))} |")
        lines += ["", f"Added by 10,000 messages over 10: {fmt(m.get('turn_added_ms_10k'))} ms "
                      f"(1,000: {fmt(m.get('turn_added_ms_1k'))} ms)."]
    if profile:
        lines += ["", "### Where a 10,000-message turn spends its time", "",
                  f"py-spy at 1 kHz over {PROFILE_TURNS} turns; shares of the samples in which the server was busy. "
                  "Our functions, inclusive (callees counted):", "", "| share | function |", "|---|---|"]
        lines += [f"| {share}% | `{func}` |" for kind, share, func in profile if kind == "ours"]
        lines += ["", "Where the time is actually spent (innermost frame; C calls such as `os.fsync` or a socket "
                  "write are charged to the Python line that made them):", "", "| share | function |", "|---|---|"]
        lines += [f"| {share}% | `{func}` |" for kind, share, func in profile if kind == "leaf"]
        lines += ["", "Raw stacks: `bench/profile_history_10k.txt` (collapsed format, for a flame graph)."]
    cache_keys = [k for k in results if k.startswith(("cache_", "cost_ratio", "compressions_"))]
    if cache_keys:
        lines += ["", "## Prompt cache (from `bench/cache_bench.py`)", "", "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {fmt(results[k])} |" for k in cache_keys]
    search_keys = [k for k in results if k.startswith(("search_", "index_"))]
    if search_keys:
        lines += ["", "## Search (from `bench/search_bench.py`)", "",
                  "Targets: `search_p50_ms` < 50 over 1,000 conversations / 100,000 messages; "
                  "`index_update_p50_ms` (a turn's save) < 2.", "", "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {fmt(results[k])} |" for k in search_keys]
    mcp_keys = [k for k in results if k.startswith("mcp_")]
    if mcp_keys:
        lines += ["", "## MCP tool rounds (from `bench/mcp_bench.py`)", "",
                  "A round through a real MCP server on loopback (Streamable HTTP, stdio) beside one through a "
                  "local tool, turns alternating; `*_added_ms_p50` is the difference of the medians.", "",
                  "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {fmt(results[k])} |" for k in mcp_keys]
    lines += ["", f"Idle server RSS before load: {fmt(m.get('rss_mb_idle'))} MB. All keys: `bench/results.json`.", ""]
    generated = "\n".join(lines)
    path = BENCH / "RESULTS.md"
    kept = ""
    if path.exists():
        old = path.read_text()
        marker = old.find(FINDINGS_HEADING)
        kept = old[marker:] if marker >= 0 else ""
    path.write_text(generated + "\n" + (kept or FINDINGS_HEADING + "\n\n(none yet)\n"))


FINDINGS_HEADING = "## Findings (hand-written, kept across runs)"


def run_cache_bench(log) -> dict:
    """The prompt-cache benchmark, when its author has added it; its own results file is merged."""
    script = BENCH / "cache_bench.py"
    if script.exists():
        log("cache benchmark (bench/cache_bench.py)")
        try:
            done = subprocess.run([PY, str(script)], cwd=ROOT, timeout=600)
            if done.returncode != 0:
                log(f"  cache_bench.py exited with {done.returncode}")
        except subprocess.TimeoutExpired:
            log("  cache_bench.py ran over 600 s and was stopped")
    path = BENCH / "results_cache.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not isinstance(v, (dict, list))}


# The search benchmark's keys as results.json names them (its own file keeps its names).
SEARCH_KEYS = {"build_s": "search_index_build_s", "index_mb": "search_index_mb",
               "queries_with_hits": "search_queries_with_hits", "conversations": "search_conversations",
               "messages": "search_messages"}


def run_search_bench(log) -> dict:
    """The search index over 1,000 conversations / 100,000 messages (`bench/search_bench.py`):
    `search_p50_ms` and the time a turn's save spends updating the index (`index_update_p50_ms`)."""
    script = BENCH / "search_bench.py"
    log("search benchmark (bench/search_bench.py)")
    try:
        done = subprocess.run([PY, str(script)], cwd=ROOT, timeout=900, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            log(f"  search_bench.py exited with {done.returncode}")
            return {"search_error": f"search_bench.py exited with {done.returncode}"}
    except subprocess.TimeoutExpired:
        log("  search_bench.py ran over 900 s and was stopped")
        return {"search_error": "search_bench.py ran over 900 s"}
    data = json.loads((BENCH / "results_search.json").read_text())
    return {SEARCH_KEYS.get(k, k): v for k, v in data.items() if not isinstance(v, (dict, list))}

def run_results_script(log, script: str, results: str, what: str) -> dict:
    """A benchmark script that writes its flat keys to bench/`results`, run in a process of its own."""
    log(f"{what} (bench/{script})")
    try:
        done = subprocess.run([PY, str(BENCH / script)], cwd=ROOT, timeout=600, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            log(f"  {script} exited with {done.returncode}")
    except subprocess.TimeoutExpired:
        log(f"  {script} ran over 600 s and was stopped")
    path = BENCH / results
    return json.loads(path.read_text()) if path.exists() else {}


def run_stdout_script(log, script: str, what: str, *, timeout: int = 600, flat: bool = True) -> dict:
    """A benchmark script that prints its JSON answer, run in a process of its own; `flat`: only its
    scalar keys go into results.json (the script's own file keeps the rest)."""
    name = script.removesuffix("_bench.py")
    log(f"{what} (bench/{script})")
    try:
        done = subprocess.run([PY, str(BENCH / script)], cwd=ROOT, timeout=timeout,
                              stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        log(f"  {script} ran over {timeout} s and was stopped")
        return {f"{name}_error": f"{script} ran over {timeout} s"}
    if done.returncode != 0:
        log(f"  {script} exited with {done.returncode}")
        return {f"{name}_error": f"{script} exited with {done.returncode}"}
    data = json.loads(done.stdout)
    return {k: v for k, v in data.items() if not isinstance(v, (dict, list))} if flat else data


def run_tool_bench(log) -> dict:
    """The tool-round benchmark (bench/tool_bench.py): what a tool round adds before the next request."""
    return run_results_script(log, "tool_bench.py", "results_tools.json", "tool-round benchmark")


def run_mcp_bench(log) -> dict:
    """The MCP tool-round benchmark (bench/mcp_bench.py): what a round through an MCP server (over
    Streamable HTTP, over stdio) adds over a round through a local tool."""
    return run_results_script(log, "mcp_bench.py", "results_mcp.json", "MCP tool-round benchmark")


def run_answers_bench(log) -> dict:
    """The Compare benchmark (bench/answers_bench.py): three models at once beside one after another."""
    log("compare benchmark (bench/answers_bench.py)")
    try:
        done = subprocess.run([PY, str(BENCH / "answers_bench.py")], cwd=ROOT, timeout=600, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            log(f"  answers_bench.py exited with {done.returncode}")
            return {"answers_error": f"answers_bench.py exited with {done.returncode}"}
    except subprocess.TimeoutExpired:
        log("  answers_bench.py ran over 600 s and was stopped")
        return {"answers_error": "answers_bench.py ran over 600 s"}
    return json.loads((BENCH / "results_answers.json").read_text())


def run_costs_bench(log) -> dict:
    """The costs benchmark (bench/costs_bench.py): what charging adds to a turn; the usage report and
    the budget check over a month of charges."""
    return run_results_script(log, "costs_bench.py", "results_costs.json", "costs benchmark")


def run_attachments_bench(log) -> dict:
    """The attachment benchmark (bench/attachments_bench.py): a 300-page PDF's ingest rate beside the
    raw library's, search over 10,000 passages, and the gaps of 50 streams while that PDF uploads."""
    return run_stdout_script(log, "attachments_bench.py", "attachment benchmark")


def run_vision_bench(log) -> dict:
    """The vision benchmark (bench/vision_bench.py): what a 12-megapixel JPEG (scaled to
    IMAGE_MAX_EDGE on the way) adds to a turn's time to first token, and to the server's CPU."""
    log("vision benchmark (bench/vision_bench.py)")
    try:
        done = subprocess.run([PY, str(BENCH / "vision_bench.py")], cwd=ROOT, timeout=600, stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        log("  vision_bench.py ran over 600 s and was stopped")
        return {"vision_error": "vision_bench.py ran over 600 s"}
    if done.returncode != 0:
        log(f"  vision_bench.py exited with {done.returncode}")
        return {"vision_error": f"vision_bench.py exited with {done.returncode}"}
    return json.loads((BENCH / "results_images_vision.json").read_text())


def run_s3_bench(log) -> dict:
    """The S3 benchmark (bench/s3_bench.py): a 20 MiB file up to and down from a server with
    BLOB_STORE=s3 on SeaweedFS, its time and the server's peak memory, beside BLOB_STORE=files."""
    return run_stdout_script(log, "s3_bench.py", "S3 benchmark", timeout=300, flat=False)


def run_images_bench(log) -> dict:
    """The images benchmark (bench/images_bench.py): 20 uploads of a 12-megapixel JPEG arriving
    together, the server's peak memory while they are read (in children) and the time they take."""
    return run_stdout_script(log, "images_bench.py", "images benchmark")


def run_render_bench(log) -> dict:
    """The rendering benchmark in chromium (bench/render_bench.py): a 200,000-character reply with 50
    code blocks and 100 formulas drawn, and the long tasks while a reply streams at 100 tokens/s."""
    log("rendering benchmark (bench/render_bench.py)")
    try:
        done = subprocess.run([PY, str(BENCH / "render_bench.py")], cwd=ROOT, timeout=600,
                              stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        log("  render_bench.py ran over 600 s and was stopped")
        return {"render_error": "render_bench.py ran over 600 s"}
    if done.returncode != 0:
        log(f"  render_bench.py exited with {done.returncode}")
        return {"render_error": f"render_bench.py exited with {done.returncode}"}
    data = json.loads((BENCH / "results_render.json").read_text())
    return {k: v for k, v in data.items() if not isinstance(v, (dict, list))}


# --- Main --------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    parser.add_argument("--no-tmpfs", action="store_true", help="skip the diagnostic server with DATA_DIR on tmpfs")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["overhead", "sustain", "checkpoints", "stop", "history", "redis", "workers", "cache", "search",
                                 "tools", "mcp", "attachments", "s3", "images", "vision", "render", "answers", "costs"],
                        help="skip a phase (repeatable)")
    args = parser.parse_args()
    began = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - began:6.1f}s] {message}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="chat-bench-"))
    scratch = [work]
    services: list[Service] = []
    gw = None
    results: dict = {**machine()}
    litellm_error = None
    no_checkpoints = None
    overhead: dict = {}
    sustain: dict = {}
    stops: dict = {}
    history = None
    profile: list = []
    targets: list[Target] = []
    try:
        gw = Gateway()
        log(f"simulator at {gw.base_url}")
        targets = [Target("direct", "simulator direct", int(gw.base_url.rsplit(":", 1)[1]), "chat")]
        relay = start_relay(gw, work)
        services.append(relay)
        targets.append(Target("relay", "bare relay (ceiling)", relay.port, "chat", relay))
        data_dir = work / "data"
        data_dir.mkdir()
        results["disk_write_p50_ms"], results["disk_write_p99_ms"] = disk_write_ms(data_dir)
        server = start_server(gw, data_dir, work)
        services.append(server)
        ours = Target("ours", "our server", server.port, "turn", server)
        targets.append(ours)
        if not args.no_tmpfs and Path(TMPFS).is_dir():
            # The same server with fsync made free: what the disk costs, not a way to deploy.
            tmp = Path(tempfile.mkdtemp(prefix="chat-bench-", dir=TMPFS))
            scratch.append(tmp)
            tmpfs_server = start_server(gw, tmp / "data", work, name="server-tmpfs")
            services.append(tmpfs_server)
            targets.append(Target("tmpfs", "our server, tmpfs (diag.)", tmpfs_server.port, "turn", tmpfs_server))
        # Servers measured in one phase only: checkpoints off (beside ours in the sustain phase, so the
        # cost of checkpoints is read within one run), and hang-up-stops (the hang-up Stop phase).
        no_checkpoints = checkpoints_on = hangup = None
        if "sustain" not in args.skip:
            svc = start_server(gw, work / "data-nockpt", work, name="server-nockpt", settings={"CHECKPOINT_SECONDS": "0"})
            services.append(svc)
            no_checkpoints = Target(NO_CHECKPOINTS, "our server, checkpoints off", svc.port, "turn", svc)
            svc = start_server(gw, work / "data-ckpton", work, name="server-ckpton")
            services.append(svc)
            checkpoints_on = Target(CHECKPOINTS_ON, "its twin, checkpoints on", svc.port, "turn", svc)
        if "stop" not in args.skip:
            svc = start_server(gw, work / "data-hangup", work, name="server-hangup", settings={"ON_DISCONNECT": "stop"})
            services.append(svc)
            hangup = Target("ours", "our server, ON_DISCONNECT=stop", svc.port, "turn", svc)
        if args.no_litellm:
            litellm_error = "skipped (--no-litellm)"
        else:
            try:
                litellm = start_litellm(gw, work, MASTER_KEY)
                services.append(litellm)
                targets.append(Target("litellm", "LiteLLM proxy", litellm.port, "chat", litellm))
                results["litellm_version"] = litellm_version()
            except RuntimeError as exc:
                litellm_error = str(exc)
                log(f"LiteLLM unavailable: {exc}")
        results["litellm_error"] = litellm_error
        rss_idle = server.rss_mb()
        twins = [t for t in (checkpoints_on, no_checkpoints) if t]
        for target in targets + twins:
            if target.dialect == "turn":
                log(f"creating {SUSTAIN_STREAMS} conversations on {target.label}")
                target.convs = create_conversations(target.service, SUSTAIN_STREAMS)
        if hangup is not None:
            hangup.convs = create_conversations(hangup.service, STOP_SAMPLES)
        sustained = list(targets)
        sustained[sustained.index(ours) + 1:sustained.index(ours) + 1] = twins  # back to back
        template = httpx.get(f"{server.url}/api/conversations/{ours.convs[0]}", timeout=30).json()
        tags = Tags()

        def attempt(phase: str, title: str, run):
            """Run one phase; a phase that breaks is reported and the others still run."""
            if phase in args.skip:
                return None
            log(title)
            try:
                return run()
            except (RuntimeError, OSError, httpx.HTTPError) as exc:
                log(f"  {phase} failed: {exc}")
                results[f"{phase}_error"] = str(exc)
                return None

        overhead = attempt("overhead", "overhead at " + ", ".join(map(str, OVERHEAD_LEVELS)) + " streams",
                           lambda: phase_overhead(gw, targets, tags, work, log)) or {}
        sustain = attempt("sustain", f"{SUSTAIN_STREAMS} streams at 20 tokens/s",
                          lambda: phase_sustain(gw, sustained, tags, work, log)) or {}
        if len(twins) == 2 and {t.name for t in twins} <= sustain.keys():
            sustain["checkpoint_rounds"] = attempt(
                "checkpoints", f"checkpoints on and off, {CHECKPOINT_ROUNDS} alternating rounds of "
                f"{SUSTAIN_STREAMS} streams", lambda: phase_checkpoint_pair(gw, checkpoints_on, no_checkpoints,
                                                                             sustain, tags, work, log))

        def stop_phases() -> dict:
            out = {"hangup": phase_stop(gw, hangup, tags, work, log, via="hangup")}
            for t in targets:
                if t.dialect == "turn":
                    out[f"{t.name}-route"] = phase_stop(gw, t, tags, work, log, via="route")
            return out

        stops = attempt("stop", "stop", stop_phases) or {}
        history = attempt("history", "long histories",
                          lambda: phase_history(gw, server, data_dir, template, tags, work, log))
        if history and None not in (history[HISTORY_SIZES[-1]]["server"], history[HISTORY_SIZES[0]]["server"]):
            added = history[HISTORY_SIZES[-1]]["server"] - history[HISTORY_SIZES[0]]["server"]
            if added * 1000 >= HISTORY_TARGET_MS:
                longest = history[HISTORY_SIZES[-1]]["id"]
                profile = attempt("profile", f"  over the {HISTORY_TARGET_MS:.0f} ms target: profiling the longest "
                                  "conversation's turns with py-spy",
                                  lambda: profile_history(gw, server, longest, tags, work, log)) or []
        results.update(flatten(overhead, sustain, stops, history, rss_idle))
        results.update(attempt("redis", "two STORE=redis servers on one Redis",
                               lambda: phase_redis(gw, overhead, tags, work, log)) or {})
        results.update(attempt("workers", "WORKERS=2 beside WORKERS=1 (STORE=redis): turn starts per second sustained",
                               lambda: phase_workers(gw, tags, work, log)) or {})
        if litellm_error:
            # Unmeasured, not zero: the keys are there, empty, and `litellm_error` says why.
            for level in OVERHEAD_LEVELS:
                for key in ("ttfb_added_p50_ms", "ttfb_added_p99_ms", "ttlb_added_p50_ms", "streams_completed"):
                    results[f"litellm_{key}_{level}"] = None
            results[f"litellm_gap_p99_ms_{SUSTAIN_STREAMS}"] = None
    finally:
        for svc in reversed(services):
            svc.stop()
        if gw is not None:
            gw.stop()
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
    if "cache" not in args.skip:
        results.update(run_cache_bench(log))
    if "search" not in args.skip:
        results.update(run_search_bench(log))
    if "tools" not in args.skip:
        results.update(run_tool_bench(log))
    if "costs" not in args.skip:
        results.update(run_costs_bench(log))
    if "mcp" not in args.skip:
        results.update(run_mcp_bench(log))
    if "attachments" not in args.skip:
        results.update(run_attachments_bench(log))
    if "answers" not in args.skip:
        results.update(run_answers_bench(log))
    if "s3" not in args.skip:
        results.update(run_s3_bench(log))
    if "images" not in args.skip:
        results.update(run_images_bench(log))
    if "vision" not in args.skip:
        results.update(run_vision_bench(log))
    if "render" not in args.skip:
        results.update(run_render_bench(log))
    results["bench_seconds"] = round(time.monotonic() - began, 1)
    results["quiet_wait_seconds"] = round(Quiet.waited, 1)
    (BENCH / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    labels = {t.name: t.label for t in targets + twins}
    write_markdown(results, labels, overhead, sustain, stops, history, profile, litellm_error)
    log("wrote bench/results.json and bench/RESULTS.md")


if __name__ == "__main__":
    main()
