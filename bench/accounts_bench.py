"""What accounts cost per request on each store (issue 23): `Accounts.authenticate` for a password
session, and the throttle's work for one wrong guess (reserve + fail, argon2 left out), on the file
store (a dict in memory) and on Redis (one Lua round trip to a local redis-server per request).

    .venv/bin/python bench/accounts_bench.py

Not part of `make bench`; it starts a redis-server of its own (Debian's) on a free port.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from argon2 import PasswordHasher  # noqa: E402

from chatserver.accounts.auth import SESSION_COOKIE, Accounts  # noqa: E402
from chatserver.app import make_account_store, make_store  # noqa: E402
from chatserver.config import Settings  # noqa: E402
from redis_support import RedisServer  # noqa: E402

FAST = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)  # the hash is not what is measured
RUNS, REQUESTS, GUESSES = 5, 3000, 1000


async def measure(settings: Settings) -> dict[str, float]:
    store = make_store(settings)
    accounts = Accounts(settings, make_account_store(settings, store), hasher=FAST)
    try:
        await accounts.store.add_user("alice", FAST.hash("long enough pw"), True, time.time())
        session = await accounts.login("alice", "long enough pw", "127.0.0.1")
        headers, scope = {"cookie": f"{SESSION_COOKIE}={session}"}, {"headers": [], "client": ("127.0.0.1", 1)}
        runs = []
        for _ in range(RUNS):
            started = time.perf_counter()
            for _ in range(REQUESTS):
                assert await accounts.authenticate(scope, headers) is not None
            runs.append((time.perf_counter() - started) / REQUESTS * 1e6)
        throttle = accounts.store.throttle
        started = time.perf_counter()
        for i in range(GUESSES):
            attempt = await throttle.reserve([(f"user:x address:{i}", 5), (f"address:{i}", 20), ("user:x", None)],
                                             time.time())
            await throttle.fail(attempt, f"guess {i}", time.time())
        guess = (time.perf_counter() - started) / GUESSES * 1e6
        return {"authenticate_us_median": statistics.median(runs), "authenticate_us_min": min(runs),
                "wrong_guess_throttle_us": guess}
    finally:
        await store.close()


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            files = await measure(Settings(_env_file=None, data_dir=Path(tmp) / "f", auth="password"))
            on_redis = await measure(Settings(_env_file=None, data_dir=Path(tmp) / "r", auth="password",
                                              store="redis", redis_url=redis.url))
        finally:
            redis.stop()
    for name, figures in (("files", files), ("redis", on_redis)):
        print(f"{name:5}  authenticate {figures['authenticate_us_median']:7.1f} us/request (best of {RUNS}: "
              f"{figures['authenticate_us_min']:.1f})  throttle per wrong guess {figures['wrong_guess_throttle_us']:7.1f} us")


if __name__ == "__main__":
    asyncio.run(main())
