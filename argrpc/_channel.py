"""``argrpc.Channel``: a ``grpc.Channel`` that uses a fast transport (shared memory,
RDMA verbs) when the server can.

The channel always holds a real grpc channel: it carries the bootstrap RPC, every call
when the fast path is not possible, and ``subscribe`` (so ``grpc.channel_ready_future``
works). The transport is negotiated lazily on the first call; the multicallables read
``_fast`` (the live fast-path connection, or None) without a lock on every call.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Literal, Optional

import grpc

from . import _config, _grpc_originals, _grpc_payloads, _metrics_hooks, _status
from ._client.balancer import Balancer
from ._client.model import client_model
from ._client.service_config import ServiceConfig, for_grpc, throttle_for
from ._client_calls import (DoneWatcher, RequestFeeder, StreamStream, StreamUnary, UnaryStream,
                            UnaryUnary)
from ._errors import local_error
from ._negotiation import GRPC, NegotiationState, encrypts
from ._subchannels import pool_key

__all__ = ["Channel", "insecure_channel", "secure_channel"]

_NEGOTIATION_TIMEOUT_S = _config.LIMITS.negotiation_timeout_s


class Channel(NegotiationState, grpc.Channel):
    """Drop-in for the channel ``grpc.insecure_channel``/``grpc.secure_channel`` return."""

    _balancer: Optional[Balancer]

    def __init__(self, target: str, credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Any = None, compression: Optional[grpc.Compression] = None) -> None:
        # Bad configuration is the caller's error, raised before anything is created.
        self._cfg = _config.load(options)
        grpc_options, _ = _config.split_options(options)
        self._service_config = ServiceConfig(grpc_options)
        self._throttle = throttle_for(target, self._service_config)
        grpc_options = for_grpc(grpc_options)
        self._secure = encrypts(credentials)
        self._grpc_args = (target, credentials, grpc_options, compression)
        self._grpc = self._new_grpc_channel()
        self._pid = os.getpid()
        # A forked child's own grpc channel for its negotiations: (pid, channel).
        self._child_grpc: Optional[tuple[int, grpc.Channel]] = None
        self._target = target
        self._max_recv = _config.max_receive_length(grpc_options)
        self._max_send = _config.max_send_length(grpc_options)
        self._pool_key = pool_key(target, credentials, grpc_options, self._cfg, self._max_recv)
        self._lock = threading.Lock()
        self._init_negotiation()
        model = client_model(target, credentials, grpc_options, self._cfg, self._max_recv,
                             self._secure, self._address_channel, lambda ch: ch.close())
        self._grpc_alone, self._balancer = model.grpc_alone, model.balancer
        self._address_options = model.address_options
        self._watcher = DoneWatcher()
        self._feeders: set[RequestFeeder] = set()  # request-iterator threads (fast path)

    # ------------------------------------------------------------------ routing
    def _route(self, timeout: Optional[float], wait_for_ready: Optional[bool],
               credentials: Any = None) -> tuple[Any, Optional[float], Any]:
        """Return (fast-path connection or None for grpc, the call's remaining timeout,
        the routing it came from: this channel, or the subchannel a balancer picked).

        Raises the UNAVAILABLE RpcError when a forced transport is impossible.
        """
        if credentials is not None or self._closed or self._state == GRPC:
            # Call credentials are grpc plugins: only the grpc path can apply them.
            return None, timeout, self
        if self._balancer is not None:
            return self._balanced(timeout, wait_for_ready)
        fast = self._fast
        if fast is not None and fast.alive:
            return fast, timeout, self
        start = time.monotonic()
        with self._lock:
            fast = self._fast
            if fast is not None and not fast.alive:
                self._drop_lost(fast)
                fast = None
            if fast is None and not self._closed and self._negotiation_due(wait_for_ready):
                self._negotiate_locked(timeout, wait_for_ready)
            fast = self._fast
            forced = self._forced_error if fast is None else ""
        if forced:
            raise local_error(grpc.StatusCode.UNAVAILABLE, forced, f"UNAVAILABLE:{forced}")
        if fast is not None and timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - start))
        return fast, timeout, self

    def _balanced(self, timeout: Optional[float], wait_for_ready: Optional[bool]
                  ) -> tuple[Any, Optional[float], Any]:
        balancer = self._balancer
        assert balancer is not None
        sub = balancer.pick()
        if sub is None:
            start = time.monotonic()
            balancer.connect(timeout, wait_for_ready)
            sub = balancer.pick()
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        balancer.refresh()
        if sub is None:
            if forced := balancer.forced_error():
                raise local_error(grpc.StatusCode.UNAVAILABLE, forced, f"UNAVAILABLE:{forced}")
            return None, timeout, self  # no replica ready: grpc balances and waits
        return sub._fast, timeout, sub

    def _address_channel(self, address: str) -> grpc.Channel:
        """A gRPC channel to one address of the target, with the target's :authority."""
        _, credentials, _, compression = self._grpc_args
        if credentials is None:
            return _grpc_originals.insecure_channel(address, self._address_options, compression)
        return _grpc_originals.secure_channel(address, credentials, self._address_options,
                                              compression)

    def _new_grpc_channel(self) -> grpc.Channel:
        target, credentials, grpc_options, compression = self._grpc_args
        if credentials is None:
            return _grpc_originals.insecure_channel(target, grpc_options, compression)
        return _grpc_originals.secure_channel(target, credentials, grpc_options, compression)

    def _bootstrap_channel(self) -> grpc.Channel:
        """The grpc channel the negotiation goes over: the channel's own, or in a forked
        child one of the child's. grpcio does not keep a channel usable across fork() (its
        threads stay in the parent): an inherited channel's calls in the child may fail or
        hang past their deadline, and the child would wait for it before falling back."""
        pid = os.getpid()
        if pid == self._pid:
            return self._grpc
        if self._child_grpc is None or self._child_grpc[0] != pid:
            self._child_grpc = (pid, self._new_grpc_channel())
        return self._child_grpc[1]

    def _negotiate_locked(self, timeout: Optional[float], wait_for_ready: Optional[bool]) -> None:
        if self._take_shared():
            return
        neg_timeout = _NEGOTIATION_TIMEOUT_S if timeout is None else timeout
        try:
            from . import _bootstrap  # late: needs the proto and engine modules

            neg = _bootstrap.negotiate(self._bootstrap_channel(), self._cfg, self._max_recv,
                                       timeout=neg_timeout, wait_for_ready=bool(wait_for_ready),
                                       secure=self._secure, target=self._target,
                                       grpc_alone=self._grpc_alone)
        except Exception as e:  # noqa: BLE001 - negotiation must never break a call
            self._settle(None, e)
            return
        self._settle(neg)

    def _ensure_negotiated(self) -> None:
        try:
            self._route(_NEGOTIATION_TIMEOUT_S, False)
        except grpc.RpcError:
            pass  # forced error: reported by fallback_reason and by every call

    @property
    def transport(self) -> str:
        """The fast transport's name ("shm", "verbs") or "grpc" (negotiates first if needed,
        at most 5 s). A balanced channel names the fast transport of its ready replicas."""
        self._ensure_negotiated()
        if self._balancer is not None:
            return self._balancer.transport()
        return self._fast_name if self._fast is not None else "grpc"

    @property
    def fallback_reason(self) -> str:
        """Why the channel is not on a fast transport ("" when it is)."""
        self._ensure_negotiated()
        return self._fallback_text()

    # ------------------------------------------------------------------ grpc.Channel
    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None],
                  try_to_connect: bool = False) -> None:
        self._grpc.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._grpc.unsubscribe(callback)

    def unary_unary(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                    response_deserializer: Optional[Callable[..., Any]] = None,
                    _registered_method: Optional[bool] = False) -> UnaryUnary:
        return UnaryUnary(self, method, request_serializer, response_deserializer,
                          self._grpc_callable(self._grpc.unary_unary, method, request_serializer,
                                              response_deserializer, _registered_method),
                          _registered_method)

    def unary_stream(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                     response_deserializer: Optional[Callable[..., Any]] = None,
                     _registered_method: Optional[bool] = False) -> UnaryStream:
        return UnaryStream(self, method, request_serializer, response_deserializer,
                           self._grpc_callable(self._grpc.unary_stream, method, request_serializer,
                                               response_deserializer, _registered_method),
                           _registered_method)

    def stream_unary(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                     response_deserializer: Optional[Callable[..., Any]] = None,
                     _registered_method: Optional[bool] = False) -> StreamUnary:
        return StreamUnary(self, method, request_serializer, response_deserializer,
                           self._grpc_callable(self._grpc.stream_unary, method, request_serializer,
                                               response_deserializer, _registered_method),
                           _registered_method)

    def stream_stream(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                      response_deserializer: Optional[Callable[..., Any]] = None,
                      _registered_method: Optional[bool] = False) -> StreamStream:
        return StreamStream(self, method, request_serializer, response_deserializer,
                            self._grpc_callable(self._grpc.stream_stream, method,
                                                request_serializer, response_deserializer,
                                                _registered_method),
                            _registered_method)

    @staticmethod
    def _grpc_callable(factory: Callable[..., Any], method: str,
                       request_serializer: Optional[Callable[..., Any]],
                       response_deserializer: Optional[Callable[..., Any]],
                       registered: Optional[bool]) -> Any:
        """grpc's own multicallable for the method (the gRPC path), which generated stubs
        mark as registered, as the metrics label them."""
        _metrics_hooks.register_client_method(method, registered)
        # grpc's channels take _registered_method positionally (generated stubs pass it);
        # grpc's type stubs do not list it.
        return factory(method, _grpc_payloads.bytes_serializer(request_serializer),
                       response_deserializer, registered)

    def close(self) -> None:
        """End this channel's calls in flight (CANCELLED), let go of its fast connection
        (closed with the last channel sharing it) and close the grpc channel."""
        with self._lock:  # waits for a negotiation in progress, so nothing is left open
            self._closed = True
            fast, self._fast = self._fast, None
        if fast is not None:
            self._let_go(fast, _status.CHANNEL_CLOSED)
        if self._balancer is not None:
            for address_channel in self._balancer.close(_status.CHANNEL_CLOSED):
                address_channel.close()
        self._watcher.close()
        # A request-iterator thread in argrpc's code ends at once now that its call has:
        # joined, so close() leaves none behind. One inside the user's iterator is not
        # waited for (grpc's close does not wait on user code either): it stops when the
        # item it is waiting for arrives, as its daemon thread would under grpc.
        deadline = time.monotonic() + 0.5  # a bound on a hang, not a wait
        for feeder in list(self._feeders):
            thread = feeder.thread
            # A call starting on another thread adds its feeder before start().
            if thread.is_alive() and not feeder.in_user_code:
                thread.join(max(0.0, deadline - time.monotonic()))
        child = self._child_grpc
        if child is not None and child[0] == os.getpid():
            child[1].close()
        self._grpc.close()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Literal[False]:
        self.close()
        return False

    def __del__(self) -> None:
        # Without close() the engine would keep the connection (and the peer's resources).
        try:
            fast = self._fast
            if fast is not None:
                self._closed = True
                self._fast = None
                self._let_go(fast, _status.CHANNEL_CLOSED)
            balancer = self._balancer
            if balancer is not None and not balancer.closed:
                balancer.close(_status.CHANNEL_CLOSED)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def insecure_channel(target: str, options: Any = None,
                     compression: Optional[grpc.Compression] = None) -> Channel:
    """Like ``grpc.insecure_channel``; TF_RDMA_* options configure argrpc."""
    return Channel(target, None, options, compression)


def secure_channel(target: str, credentials: grpc.ChannelCredentials, options: Any = None,
                   compression: Optional[grpc.Compression] = None) -> Channel:
    """Like ``grpc.secure_channel``. The fast path is used over TLS only with
    TF_RDMA_OVER_TLS=true (the shared-memory data path is not encrypted)."""
    if credentials is None:
        raise ValueError("secure_channel requires credentials (use insecure_channel)")
    return Channel(target, credentials, options, compression)
