"""``argrpc.aio.Channel``: a ``grpc.aio.Channel`` that uses a fast transport (shared
memory, RDMA verbs) when the server can, as ``argrpc.Channel`` does for the threaded API.

The channel always holds a real ``grpc.aio`` channel: it carries the bootstrap RPC and
every call when the fast path is not possible. The transport is negotiated on the first
call (or ``await channel_ready()``); calls made while that runs wait for it
(``_pending.py``), later ones go straight to the fast connection or to grpc.aio.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any, Callable, Optional, cast

import grpc
from grpc import aio

from .. import (_bootstrap, _config, _grpc_log, _grpc_originals, _grpc_payloads, _metrics_hooks,
                _status)
from .._bases import (AioStreamStreamBase, AioStreamUnaryBase, AioUnaryStreamBase,
                      AioUnaryUnaryBase)
from .._engine import get_engine
from .._metadata import InvalidMetadataError, to_core
from .._errors import codec_failed
from .._grpc_payloads import nbytes as _nbytes
from .._client.balancer import Balancer
from .._client.model import client_model
from .._client.service_config import HedgingPolicy, ServiceConfig, for_grpc, throttle_for
from .._client.subchannel import Subchannel
from .._negotiation import GRPC, NEW, NegotiationState, encrypts
from .._subchannels import pool_key
from . import _attempts, _call, _interceptors

try:
    # What its calls read and count on every call, in C (aio_loop_state.cc), and the
    # unary-unary multicallable's call (aio_unary_callable.cc).
    from .._core import ChannelState, UnaryCallableState
except ImportError:  # no engine: every call is grpc.aio's
    class ChannelState:  # type: ignore[no-redef]
        pass

    class UnaryCallableState:  # type: ignore[no-redef]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self._call_general(*args, **kwargs)  # type: ignore[attr-defined]
from ._loop import bridge
from ._pending import PendingCall

__all__ = ["Channel", "insecure_channel", "secure_channel"]

_LOGGER = logging.getLogger("argrpc")
_running_loop = asyncio._get_running_loop  # None outside a loop (asks getpid() each time)
_thread_ident = threading.get_ident

_NEGOTIATION_TIMEOUT_S = _config.LIMITS.negotiation_timeout_s



class Channel(NegotiationState, ChannelState, aio.Channel):
    """Drop-in for what ``grpc.aio.insecure_channel``/``secure_channel`` return."""

    _balancer: Optional[Balancer]
    inflight: int
    closing: bool

    def __init__(self, target: str, credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Any = None, compression: Optional[grpc.Compression] = None,
                 interceptors: Any = None) -> None:
        self._cfg = _config.load(options)
        grpc_options, _ = _config.split_options(options)
        self._service_config = ServiceConfig(grpc_options)
        self._throttle = throttle_for(target, self._service_config)
        grpc_options = for_grpc(grpc_options)
        self._secure = encrypts(credentials)
        # The inner channel has no interceptors: they run above both paths (the bootstrap
        # RPC is not theirs to see).
        if credentials is None:
            self._grpc = _grpc_originals.aio_insecure_channel(target, grpc_options, compression)
        else:
            self._grpc = _grpc_originals.aio_secure_channel(target, credentials, grpc_options,
                                                            compression)
        self._interceptors = _interceptors.split(interceptors)
        # grpc.aio binds a channel to the loop it was made on (or the thread's default
        # loop) and its calls fail on any other; so do the fast path's, by going where
        # grpc.aio's error comes from.
        self._loop: Optional[asyncio.AbstractEventLoop] = getattr(self._grpc, "_loop", None)
        self._target = target
        self._max_recv = _config.max_receive_length(grpc_options)
        self._max_send = _config.max_send_length(grpc_options)
        self._pool_key = pool_key(target, credentials, grpc_options, self._cfg, self._max_recv)
        self._init_negotiation()
        self._grpc_args = (credentials, compression)
        model = client_model(target, credentials, grpc_options, self._cfg, self._max_recv,
                             self._secure, self._address_channel, _retire)
        self._grpc_alone, self._balancer = model.grpc_alone, model.balancer
        self._address_options = model.address_options
        self._negotiation: Optional[asyncio.Task[Any]] = None
        self.inflight = 0  # fast-path calls not ended (close(grace) waits for them)
        self.closing = False  # close() began: no new fast-path calls
        self._closing_fast: Any = None  # the connection close() ends after the grace
        self._drained: Optional[asyncio.Future[Any]] = None

    # ------------------------------------------------------------------ routing
    def _closing(self) -> bool:
        return self.closing

    def _settled(self, wait_for_ready: Optional[bool]) -> bool:
        """Whether a call can be routed now, without negotiating first."""
        if self.closing or self._state == GRPC:
            return True
        if self._balancer is not None:
            return self._balancer.settled(wait_for_ready)
        fast = self._fast
        if fast is not None:
            if fast.alive:
                return True
            self._drop_lost(fast)
        return not self._negotiation_due(wait_for_ready)

    async def _negotiate(self, timeout: Optional[float], wait_for_ready: Optional[bool]) -> None:
        if self._settled(wait_for_ready):
            return
        task = self._negotiation
        if task is None or task.done():
            task = self._negotiation = asyncio.get_running_loop().create_task(
                self._negotiate_once(timeout, wait_for_ready))
        await asyncio.shield(task)

    async def _negotiate_once(self, timeout: Optional[float],
                              wait_for_ready: Optional[bool]) -> None:
        if self._balancer is not None:
            await self._balancer.connect_async(timeout, wait_for_ready)
            return
        if self._take_shared():
            return
        neg_timeout = _NEGOTIATION_TIMEOUT_S if timeout is None else timeout
        try:
            neg = await _bootstrap.negotiate_async(
                self._grpc, self._cfg, self._max_recv, timeout=neg_timeout,
                wait_for_ready=bool(wait_for_ready), secure=self._secure, target=self._target,
                grpc_alone=self._grpc_alone)
        except Exception as e:  # noqa: BLE001 - negotiation must never break a call
            self._settle(None, e)
            return
        self._settle(neg)

    def _address_channel(self, address: str) -> aio.Channel:
        """A grpc.aio channel to one address of the target, with the target's :authority."""
        credentials, compression = self._grpc_args
        if credentials is None:
            return _grpc_originals.aio_insecure_channel(address, self._address_options, compression)
        return _grpc_originals.aio_secure_channel(address, credentials, self._address_options,
                                         compression)

    def pick(self) -> tuple[Any, Any]:
        """(the fast connection a call starts on, or None for gRPC; the routing it came
        from: this channel, or the subchannel the balancer picked)."""
        balancer = self._balancer
        if balancer is None:
            return self._fast, self
        sub = balancer.pick()
        if _running_loop() is not None:
            balancer.refresh_async()
        if sub is None:
            return None, self  # no replica ready: grpc.aio balances and waits
        return sub._fast, sub

    def foreign_loop(self) -> bool:
        """Not on the loop this channel belongs to (grpc.aio's calls fail there)."""
        loop = self._loop
        return loop is not None and _running_loop() is not loop

    def _forced_failure(self) -> Optional[aio.AioRpcError]:
        forced = self._forced_error if self._balancer is None else \
            self._balancer.forced_error()
        if self._fast is None and forced and not self.closing:
            return _call.rpc_error(grpc.StatusCode.UNAVAILABLE, forced)
        return None

    @property
    def transport(self) -> str:
        """The fast transport's name ("shm", "verbs"), "grpc", or "pending" before the
        first call or ``await channel_ready()`` negotiated."""
        if self._fast is not None:
            return self._fast_name
        balancer = self._balancer
        if balancer is not None and balancer.tried() and not self.closing:
            return balancer.transport()
        return "pending" if self._state == NEW and not self.closing else "grpc"

    @property
    def fallback_reason(self) -> str:
        """Why the channel is not on a fast transport ("" when it is, or before it
        negotiated)."""
        return self._fallback_text()

    # ------------------------------------------------------------------ grpc.aio.Channel
    async def __aenter__(self) -> "Channel":
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self._close(None)

    async def close(self, grace: Optional[float] = None) -> None:
        await self._close(grace)

    async def _close(self, grace: Optional[float]) -> None:
        if self._closed:
            return
        if grace and grace < 0:
            raise ValueError(f"grace must be non-negative, got {grace}.")
        # New calls go to the inner channel, which refuses them from now on.
        self.closing = True
        if self._fast is not None:
            self._closing_fast, self._fast = self._fast, None
        # Calls in flight on both paths get the same grace to finish, as grpc.aio's
        # close(grace) gives; then those left are cancelled. A second close() during
        # the grace cuts it short, as in grpc.aio.
        grpc_closes = [self._grpc.close(grace)]
        if self._balancer is not None:
            grpc_closes += [c.close(grace) for c in self._balancer.grpc_channels()]
        try:
            if grace and self.inflight > 0:
                if self._drained is None:
                    self._drained = asyncio.get_running_loop().create_future()
                await asyncio.gather(asyncio.wait([self._drained], timeout=grace),
                                     *grpc_closes)
            else:
                await asyncio.gather(*grpc_closes)
        finally:
            self._closed = True
            fast, self._closing_fast = self._closing_fast, None
            if fast is not None:
                self._let_go(fast, _status.CHANNEL_CLOSED)
            if self._balancer is not None:
                self._balancer.close(_status.CHANNEL_CLOSED)  # their gRPC channels closed above

    def call_ended(self) -> None:
        """A fast-path call ended while close(grace) waits for them."""
        drained = self._drained
        if self.inflight <= 0 and drained is not None and not drained.done():
            drained.set_result(None)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._grpc.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._grpc.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        """Waits until the gRPC channel is READY, then negotiates the transport."""
        await self._grpc.channel_ready()
        await self._negotiate(None, True)

    def unary_unary(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                    response_deserializer: Optional[Callable[..., Any]] = None,
                    _registered_method: Optional[bool] = False) -> "UnaryUnaryMultiCallable":
        return UnaryUnaryMultiCallable(self, method, request_serializer, response_deserializer,
                                       _registered_method)

    def unary_stream(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                     response_deserializer: Optional[Callable[..., Any]] = None,
                     _registered_method: Optional[bool] = False) -> "UnaryStreamMultiCallable":
        return UnaryStreamMultiCallable(self, method, request_serializer, response_deserializer,
                                        _registered_method)

    def stream_unary(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                     response_deserializer: Optional[Callable[..., Any]] = None,
                     _registered_method: Optional[bool] = False) -> "StreamUnaryMultiCallable":
        return StreamUnaryMultiCallable(self, method, request_serializer, response_deserializer,
                                        _registered_method)

    def stream_stream(self, method: str, request_serializer: Optional[Callable[..., Any]] = None,
                      response_deserializer: Optional[Callable[..., Any]] = None,
                      _registered_method: Optional[bool] = False) -> "StreamStreamMultiCallable":
        return StreamStreamMultiCallable(self, method, request_serializer,
                                         response_deserializer, _registered_method)

    def __del__(self) -> None:
        try:
            for fast in (self._fast, self._closing_fast):
                if fast is not None:
                    self.closing = self._closed = True
                    self._let_go(fast, _status.CHANNEL_CLOSED)
            self._fast = self._closing_fast = None
            balancer = self._balancer
            if balancer is not None and not balancer.closed:
                balancer.close(_status.CHANNEL_CLOSED)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _retire(grpc_channel: Any) -> None:
    """Closes the grpc.aio channel of an address the target no longer names."""
    try:
        asyncio.get_running_loop().create_task(grpc_channel.close())
    except RuntimeError:
        pass  # no loop: it closes when collected


# ---------------------------------------------------------------------- multicallables

def _core_metadata(metadata: Any) -> list[Any]:
    md = to_core(tuple(metadata) if metadata is not None else None)
    # grpc drops a call's own user-agent: the server sees the channel's.
    return [kv for kv in md if kv[0] != "user-agent"] if md else md


class _MultiCallable:
    _kind = ""

    def __init__(self, channel: Channel, method: str, request_serializer: Optional[Callable[..., Any]],
                 response_deserializer: Optional[Callable[..., Any]], registered: Optional[bool]) -> None:
        self._channel = channel
        self._method = method
        self._serializer = request_serializer
        self._deserializer = response_deserializer
        factory = getattr(channel._grpc, self._kind)
        self._grpc = factory(method, _grpc_payloads.bytes_serializer(request_serializer),
                             response_deserializer, registered)
        self._registered = registered
        # The method's service config (timeout, waitForReady), None when it has none.
        mc = channel._service_config.method(method)
        self._mc = mc or None
        self._max_send = channel._max_send  # -1: no limit
        if mc.max_request is not None:
            self._max_send = mc.max_request if self._max_send < 0 else \
                min(self._max_send, mc.max_request)
        _metrics_hooks.register_client_method(method, registered)
        self._intercepted = channel._interceptors.get(self._kind, ())
        # The channel's loop and its bridge, once a fast-path call was made on it.
        self._loop: Any = None
        self._loop_bridge: Any = None
        # The loop says which thread runs it (asyncio's own loops: `_thread_id`, None
        # while stopped), so a call finds out that it runs on that loop without asking
        # asyncio, which makes a system call of it.
        self._loop_says_thread = False

    def __call__(self, request: Any = None, *, timeout: Optional[float] = None,
                 metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
                 wait_for_ready: Optional[bool] = None,
                 compression: Optional[grpc.Compression] = None) -> Any:
        if timeout is not None:
            time.time() + timeout  # grpc.aio's TypeError, at the call, for no number
        if self._intercepted:
            return _interceptors.intercept(self, request, timeout, metadata, credentials,
                                           wait_for_ready, compression)
        return self.invoke(request, timeout, metadata, credentials, wait_for_ready, compression)

    def invoke(self, request: Any, timeout: Optional[float], metadata: Any, credentials: Any,
               wait_for_ready: Optional[bool], compression: Any) -> Any:
        """The call itself, below any interceptor."""
        channel = self._channel
        mc = self._mc
        if mc is not None:
            timeout, wait_for_ready = mc.call_options(timeout, wait_for_ready)
        return self._route(request, timeout, metadata, credentials, wait_for_ready,
                           compression, channel._service_config.unsent_retries)

    def _route(self, request: Any, timeout: Optional[float], metadata: Any, credentials: Any,
               wait_for_ready: Optional[bool], compression: Any, tries: int) -> Any:
        """The call where the channel routes it, once it is negotiated."""
        channel = self._channel
        if credentials is not None or channel.foreign_loop() or channel._settled(wait_for_ready):
            return self._start(request, timeout, metadata, credentials, wait_for_ready,
                               compression, tries)
        start = time.monotonic()

        async def routed() -> Any:
            await channel._negotiate(timeout, wait_for_ready)
            if channel.closing:  # made before close(), which cancels it in grpc.aio
                return _call.FailedCall.cancelled_call(self._kind)
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            return self._start(request, left, metadata, credentials, wait_for_ready,
                               compression, tries)

        return PendingCall.make(self._kind, routed())

    def _start(self, request: Any, timeout: Optional[float], metadata: Any, credentials: Any,
               wait_for_ready: Optional[bool], compression: Any, tries: int) -> Any:
        """The call on the route chosen now. One that ended UNAVAILABLE without leaving
        the process (its connection failed after the channel chose it) is routed again,
        as gRFC A6's transparent retries are, up to `tries` times."""
        try:
            return self._start_once(request, timeout, metadata, credentials, wait_for_ready,
                                    compression, tries > 0)
        except _call.Unsent:
            return self._route(request, timeout, metadata, credentials, wait_for_ready,
                               compression, tries - 1)

    def _start_once(self, request: Any, timeout: Optional[float], metadata: Any,
                    credentials: Any, wait_for_ready: Optional[bool], compression: Any,
                    retry_unsent: bool) -> Any:
        channel = self._channel
        fast, via = (None, channel) if credentials is not None else channel.pick()
        if fast is None and via is channel:
            failure = channel._forced_failure()
            if failure is not None:
                return _call.FailedCall.make(self._kind, failure)
        b = None if fast is None else self._bridge()
        if b is not None:
            if compression is not None and (refused := via._refused_compression(compression)):
                return _call.FailedCall.make(self._kind, _call.rpc_error(
                    grpc.StatusCode.UNIMPLEMENTED, refused))
            try:
                md = _core_metadata(metadata)
            except InvalidMetadataError as e:
                _grpc_log.AIO.error("%s", e)
                return _call.FailedCall.make(self._kind, _call.rpc_error(
                    grpc.StatusCode.INTERNAL, _status.INVALID_METADATA))
            except TypeError:
                b = None  # grpc.aio's own TypeError, raised where the call is awaited
            else:
                return self._fast_call(b, fast, md, timeout, request, retry_unsent)
        multicallable = self._grpc if via is channel else cast(Subchannel, via).multicallable(
            self._kind, self._method, self._serializer, self._deserializer, self._registered)
        call = multicallable(request, timeout=timeout, metadata=metadata,
                             credentials=credentials, wait_for_ready=wait_for_ready,
                             compression=compression)
        observer = _metrics_hooks.sink()
        if observer is not None:
            _metrics_hooks.watch_aio_call(observer, self._method, channel._target, call)
        return call

    def _bridge(self) -> Any:
        """The running loop's bridge; None if that is not the channel's loop."""
        loop = _running_loop()
        if loop is not self._loop:
            if loop is None or self._channel.foreign_loop():
                return None
            self._loop = loop
            self._loop_bridge = bridge(get_engine(self._channel._cfg))
            self._loop_says_thread = hasattr(loop, "_thread_id")
        return self._loop_bridge

    def _fast_call(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                   request: Any, retry_unsent: bool) -> Any:
        """The call on the fast path; raises _call.Unsent (`retry_unsent`) if it never
        left the process."""
        raise NotImplementedError

    def _too_large(self, payload: Any) -> Optional[Any]:
        """The failed call grpc.aio gives for a request over the send limit, or None."""
        if self._max_send < 0:
            return None
        try:
            n = _nbytes(payload)
        except TypeError:
            return None  # not a buffer: the call reports it
        if n <= self._max_send:
            return None
        return _call.FailedCall.make(self._kind, _call.rpc_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED, _call.too_large_details(n, self._max_send)))

    def _unary_request(self, fast: Any, md: list[Any], timeout: Optional[float],
                       request: Any, make: Callable[..., Any], streaming: bool,
                       retry_unsent: bool) -> Any:
        """A unary-request call on the fast path: `make(conn, method, metadata, timeout,
        payload, deserializer)` builds one attempt; the method's retry or hedging policy
        decides how many."""
        payload = _call.serialize(self._serializer, request)
        if (failed := self._too_large(payload)) is not None:
            return failed

        def start(conn: Any, metadata: list[Any], left: Optional[float],
                  retry_unsent: bool = False) -> Any:
            return self._limited(make(conn, self._method, metadata, left, payload,
                                      self._deserializer, retry_unsent))

        mc = self._mc
        if mc is not None and self._channel._service_config.buffers(payload):
            async def launch(conn: Any, metadata: list[Any], left: Optional[float]) -> Any:
                return start(conn, metadata, left)

            if mc.retry is not None:
                return PendingCall.make(self._kind, _attempts.retried(
                    self._channel, fast, md, timeout, mc.retry, launch, streaming))
            if mc.hedging is not None:
                return PendingCall.make(self._kind, _attempts.hedged(
                    self._channel, fast, md, timeout, mc.hedging, launch, streaming))
        return start(fast, md, timeout, retry_unsent)

    def _request_stream(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                        request_iterator: Any, make: Callable[..., Any],
                        retry_unsent: bool) -> Any:
        """A request-stream call on the fast path: `make(channel, bridge, conn, method,
        metadata, timeout, request_iterator, serializer, deserializer, retry_unsent)`
        builds one attempt; the method's retry or hedging policy decides how many, fed
        through a RequestFeed."""
        mc = self._mc
        if mc is None or (mc.retry is None and mc.hedging is None):
            return self._limited(make(self._channel, b, fast, self._method, md, timeout,
                                      request_iterator, self._serializer, self._deserializer,
                                      retry_unsent))
        channel = self._channel
        feed = _attempts.RequestFeed(channel._service_config.buffer_limit, self._serializer,
                                     self._max_send)
        launch = feed.launcher(lambda conn, metadata, left: self._limited(make(
            channel, b, conn, self._method, metadata, left, None, None, self._deserializer)))
        streaming = self._kind == "stream_stream"
        if mc.retry is not None:
            drive = functools.partial(_attempts.retried, channel, fast, md, timeout, mc.retry,
                                      launch, streaming, feed)
        else:
            drive = functools.partial(_attempts.hedged, channel, fast, md, timeout,
                                      cast(HedgingPolicy, mc.hedging), launch, streaming)
        return _attempts.fed_call(self._kind, feed, drive, request_iterator)

    def _limited(self, call: Any) -> Any:
        """The call with its method's message limits."""
        call.max_send = self._max_send
        mc = self._mc
        if mc is not None and mc.max_response is not None:
            call.max_response = mc.max_response
        return call


class UnaryUnaryMultiCallable(UnaryCallableState, _MultiCallable, AioUnaryUnaryBase):
    """Called in C (its first base, whose __call__ comes first in the class's MRO): the
    common call (no metadata, credentials, compression, interceptors or method config,
    on the channel's loop, over a live fast connection) is made by
    _core.make_unary_call's steps without a Python frame; every other goes to
    _call_general with the caller's arguments."""

    _kind = "unary_unary"
    # What the C call uses beside its fields.
    _call_type = _call.UnaryUnaryCall
    _unsent = _call.Unsent
    _call_general = _MultiCallable.__call__
    _serialize_failed = functools.partial(codec_failed, "serializing")

    def _fast_call(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                   request: Any, retry_unsent: bool) -> Any:
        return self._unary_request(fast, md, timeout, request, functools.partial(
            _call.UnaryUnaryCall, self._channel, b), False, retry_unsent)


class UnaryStreamMultiCallable(_MultiCallable, AioUnaryStreamBase):
    _kind = "unary_stream"

    def _fast_call(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                   request: Any, retry_unsent: bool) -> Any:
        return self._unary_request(fast, md, timeout, request, functools.partial(
            _call.UnaryStreamCall, self._channel, b), True, retry_unsent)


class StreamUnaryMultiCallable(_MultiCallable, AioStreamUnaryBase):
    _kind = "stream_unary"

    def __call__(self, request_iterator: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().__call__(request_iterator, **kwargs)

    def _fast_call(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                   request: Any, retry_unsent: bool) -> Any:
        return self._request_stream(b, fast, md, timeout, request, _call.StreamUnaryCall,
                                    retry_unsent)


class StreamStreamMultiCallable(_MultiCallable, AioStreamStreamBase):
    _kind = "stream_stream"

    def __call__(self, request_iterator: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().__call__(request_iterator, **kwargs)

    def _fast_call(self, b: Any, fast: Any, md: list[Any], timeout: Optional[float],
                   request: Any, retry_unsent: bool) -> Any:
        return self._request_stream(b, fast, md, timeout, request, _call.StreamStreamCall,
                                    retry_unsent)


def insecure_channel(target: str, options: Any = None,
                     compression: Optional[grpc.Compression] = None,
                     interceptors: Any = None) -> Channel:
    """Like ``grpc.aio.insecure_channel``; TF_RDMA_* options configure argrpc."""
    return Channel(target, None, options, compression, interceptors)


def secure_channel(target: str, credentials: grpc.ChannelCredentials, options: Any = None,
                   compression: Optional[grpc.Compression] = None,
                   interceptors: Any = None) -> Channel:
    """Like ``grpc.aio.secure_channel``. The fast path is used over TLS only with
    TF_RDMA_OVER_TLS=true (the shared-memory data path is not encrypted)."""
    if credentials is None:
        raise ValueError("secure_channel requires credentials (use insecure_channel)")
    return Channel(target, credentials, options, compression, interceptors)
