"""`tasks.stop`: a background loop that swallowed a cancellation (as redis-py's timed read can on
Python 3.11) still ends, where cancel-then-await waited forever."""

from __future__ import annotations

import asyncio

import pytest

from chatserver import tasks


async def swallows_one_cancellation(started: asyncio.Event) -> None:
    started.set()
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # taken for the read's own timeout, as the client library may do


async def test_stop_ends_a_loop_that_swallowed_its_first_cancellation():
    started = asyncio.Event()
    task = asyncio.create_task(swallows_one_cancellation(started))
    await started.wait()

    await asyncio.wait_for(tasks.stop(task), 5)

    assert task.cancelled()


async def test_cancel_then_await_is_what_hung():
    started = asyncio.Event()
    task = asyncio.create_task(swallows_one_cancellation(started))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), 0.5)
    await tasks.stop(task)


async def test_stop_takes_none_and_finished_tasks():
    await tasks.stop(None)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await tasks.stop(done)
    assert done.done() and not done.cancelled()


async def test_a_shutdown_step_that_hangs_is_left_behind_and_named(caplog):
    from chatserver.app import close_within

    started = asyncio.Event()
    stuck = asyncio.create_task(swallows_one_cancellation(started))
    await started.wait()

    await asyncio.wait_for(close_within("the stuck part", asyncio.shield(stuck), seconds=0.2), 5)

    assert "the stuck part did not finish within" in caplog.text
    await tasks.stop(stuck)


async def test_a_shutdown_step_that_fails_still_raises():
    from chatserver.app import close_within

    async def broken() -> None:
        raise RuntimeError("broken on close")

    with pytest.raises(RuntimeError, match="broken on close"):
        await close_within("the broken part", broken())
