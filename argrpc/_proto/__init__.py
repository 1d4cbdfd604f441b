"""The bootstrap messages (protos/argrpc_bootstrap.proto), built at import from the file's
compiled descriptor (`descriptor.py`, written by scripts/gen_proto.py).

Not protoc's generated module: generated code is tied to the protobuf release of the
protoc that wrote it and refuses an older runtime, while a descriptor loads on every
protobuf argrpc accepts. The messages live in a pool of their own, so a user's protos
(even one named like ours) never collide with them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool, message_factory

from .descriptor import SERIALIZED

__all__ = ["HostIdentity", "NegotiateRequest", "NegotiateResponse", "ShmOffer", "VerbsEndpoint",
           "PROTO_NAME", "message_class"]

PROTO_NAME = "argrpc_bootstrap.proto"
_PACKAGE = "argrpc.v1"

_pool = descriptor_pool.DescriptorPool()
_pool.AddSerializedFile(SERIALIZED)


def message_class(descriptor: Any) -> Any:
    """The message class of a descriptor, on every protobuf argrpc accepts."""
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    # protobuf < 4.22 (its stubs know only the newer API)
    factory: Any = message_factory.MessageFactory(descriptor.file.pool)
    return factory.GetPrototype(descriptor)


def _message(name: str) -> Any:
    return message_class(_pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


HostIdentity = _message("HostIdentity")
NegotiateRequest = _message("NegotiateRequest")
NegotiateResponse = _message("NegotiateResponse")
ShmOffer = _message("ShmOffer")
VerbsEndpoint = _message("VerbsEndpoint")
