"""grpc's status codes as the engine carries them (plain ints) and grpc's own words for the
ends both front ends give, in one place: a client that matches on a detail text (many
tests and retry wrappers do) sees the same text whichever argrpc front end, transport or
side produced it."""

from __future__ import annotations

import grpc

OK = grpc.StatusCode.OK.value[0]
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
DATA_LOSS = grpc.StatusCode.DATA_LOSS.value[0]

# A call its channel's close() ended (grpc reports an in-flight call of a closed channel as
# CANCELLED with this text).
CHANNEL_CLOSED = "Channel closed!"
# A call its caller cancelled.
LOCALLY_CANCELLED = "Locally cancelled by application!"
# A handler that raised.
EXCEPTION_CALLING = "Exception calling application"
# Metadata grpc would refuse to send.
INVALID_METADATA = "Invalid metadata"
# A write or status after the call ended.
RPC_FINISHED = "RPC already finished."
# A call's iterator and read()/write() used together.
MIXED_APIS = "The iterator and read/write APIs may not be mixed on a single RPC."
# A call over the server's maximum_concurrent_rpcs.
OVER_LIMIT = "Concurrent RPC limit exceeded!"
# What grpc's own server gives the client for calls still running when stop()'s grace
# ends; on the server side those calls are cancelled (is_active() false, callbacks run).
STOP_CODE = UNAVAILABLE
STOPPED = "Cancelling all calls"
# An asyncio handler's context used after its server stopped.
SERVER_STOPPED = "Server already stopped."
