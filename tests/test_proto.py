"""The bootstrap messages: argrpc/_proto/descriptor.py is what protoc compiles from
protos/argrpc_bootstrap.proto (run scripts/gen_proto.py after editing the .proto), and the
messages built from it work, in a pool of their own."""
from __future__ import annotations

import importlib.util
import os

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from argrpc import _proto
from argrpc._proto import descriptor
from argrpc._proto.descriptor import SERIALIZED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gen_proto() -> object:
    spec = importlib.util.spec_from_file_location("gen_proto",
                                                  os.path.join(ROOT, "scripts", "gen_proto.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_descriptor_is_the_protos() -> None:
    pytest.importorskip("grpc_tools", reason="compiling protos/ needs grpcio-tools")
    gen = _gen_proto()
    fresh = descriptor_pb2.FileDescriptorProto.FromString(gen.compiled())  # type: ignore[attr-defined]
    committed = descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED)
    assert committed == fresh, "protos/ changed: run python3 scripts/gen_proto.py"
    # And the file is exactly what the script writes (no hand edits).
    with open(descriptor.__file__) as f:  # the argrpc under test (maybe an installed one)
        assert f.read() == gen.render(SERIALIZED)  # type: ignore[attr-defined]


def test_messages_round_trip() -> None:
    request = _proto.NegotiateRequest(transports=["shm", "verbs"],
                                      host=_proto.HostIdentity(boot_id="b", pid=7, uid=1))
    back = _proto.NegotiateRequest.FromString(request.SerializeToString())
    assert back == request and list(back.transports) == ["shm", "verbs"] and back.host.pid == 7
    response = _proto.NegotiateResponse(transport="shm", compression_disabled=4,
                                        shm=_proto.ShmOffer(socket_name="s", secret=b"x" * 32))
    assert _proto.NegotiateResponse.FromString(response.SerializeToString()) == response


def test_a_users_file_of_the_same_name_does_not_collide() -> None:
    """protoc's generated modules register in the process-wide default pool, where two
    files of one name collide; argrpc's messages are in a pool of their own."""
    mine = descriptor_pb2.FileDescriptorProto(name=_proto.PROTO_NAME, package="argrpc.v1",
                                              syntax="proto3")
    mine.message_type.add(name="NegotiateRequest").field.add(
        name="other", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_proto.PROTO_NAME)
    except KeyError:
        pool.Add(mine)
    theirs = _proto.message_class(pool.FindMessageTypeByName("argrpc.v1.NegotiateRequest"))
    assert "other" in theirs.DESCRIPTOR.fields_by_name
    assert "transports" in _proto.NegotiateRequest.DESCRIPTOR.fields_by_name
