"""What a threaded channel's calls use of their channel: where the next attempt goes
(`_route`), the one fast connection read without the lock (`_fast`), the channel's
service config, send limit and retry throttle, and the places a call leaves work that
outlives its start (the done watcher, the request-feeding threads). Calls are written
against this, not against the channel class, so the channel can import the calls."""

from __future__ import annotations

from typing import Any, Optional, Protocol

from .service_config import ServiceConfig


class CallSite(Protocol):
    _fast: Any
    _closed: bool
    _target: str
    _max_send: int
    _service_config: ServiceConfig
    _throttle: Any
    _watcher: Any
    _feeders: set[Any]

    def _route(self, timeout: Optional[float], wait_for_ready: Optional[bool],
               credentials: Any = None) -> tuple[Any, Optional[float], Any]: ...
