"""Starting a call's coroutine at once, in the loop callback that took the call, instead
of in a task the loop runs on its next round (asyncio's ``eager_task_factory``, which
Python 3.11 lacks). A handler that answers without waiting (most unary ones) then
finishes with no task and no extra round of the loop; one that waits becomes a task at
that point, resumed exactly where it waited."""

from __future__ import annotations

import asyncio
import contextvars
import types
from typing import Any, Coroutine, Generator, cast

__all__ = ["carry_on", "resume"]


def carry_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], yielded: Any,
             context: contextvars.Context) -> asyncio.Task[Any]:
    """The task that carries `coro` on from its first wait, where it yielded `yielded`.
    The caller took that first step itself, in `context`: `context.run(coro.send,
    None)`, whose StopIteration means the coroutine finished without waiting (its
    other exceptions propagate, as its own)."""
    task = loop.create_task(resume(coro, yielded), context=context)
    task.add_done_callback(lambda _t: _cancel_unstarted(coro, context))
    return task


def _cancel_unstarted(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> None:
    """A task cancelled before its first step never runs _resume, so the coroutine it
    carries would only be closed when collected, its `except CancelledError` skipped:
    deliver the cancellation to it here, as its task would have."""
    # an `async def`'s coroutine (the only kind started here) has cr_frame
    if cast("types.CoroutineType[Any, Any, Any]", coro).cr_frame is None:  # finished
        return
    try:
        context.run(coro.throw, asyncio.CancelledError())
    except BaseException:  # noqa: BLE001 - the cancellation (or what it raised) ends it
        return
    coro.close()  # it waited again while cancelled: nothing will resume it


@types.coroutine
def resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Generator[Any, Any, Any]:
    """Awaited, what a task does with a coroutine from the point where it first waited
    (it yielded `yielded`): hand the task each future the coroutine waits on, and the
    coroutine what the task sends or throws back (a cancellation among them); its
    result is the coroutine's."""
    while True:
        try:
            sent = yield yielded
        except BaseException as exc:  # noqa: BLE001 - the coroutine's to handle
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            yielded = coro.send(sent)
        except StopIteration as done:
            return done.value
