"""Stopping a background task for good.

A task cancelled while redis-py's read times out can lose the cancellation: on Python 3.11 the
read's `asyncio.timeout` may turn it into the timeout it expected and return None, so a listener
loop carries on as if nothing happened and whoever awaits it waits forever (a shutdown that hung
for minutes in CI). `stop` cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio

CANCEL_AGAIN_SECONDS = 0.5


async def stop(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again if it swallowed the request."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=CANCEL_AGAIN_SECONDS)
    if not task.cancelled() and task.exception() is not None:
        task.exception()  # retrieved: its failure was logged where it happened
