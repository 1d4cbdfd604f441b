"""The event loop an asyncio benchmark process runs on: asyncio's own or uvloop.

argrpc.aio polls the engine on asyncio's own loop while it waits; uvloop does not say
when it is idle, so there every completion comes through the notifier's eventfd (a
wake-up of the loop's thread). Both processes of a pair run the same kind of loop.
"""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

from argrpc_bench import LOOPS

T = TypeVar("T")


def unavailable(loop: str) -> str | None:
    """Why `loop` cannot run here, or None."""
    if loop not in LOOPS:
        return f"unknown event loop {loop!r} (one of {', '.join(LOOPS)})"
    if loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError as e:
            return f"uvloop is not installed ({e}): pip install uvloop"
    return None


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """asyncio.run on the named loop."""
    why = unavailable(loop)
    if why is not None:
        main.close()
        raise ValueError(why)
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
