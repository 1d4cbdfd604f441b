"""Writes argrpc/_proto/descriptor.py from protos/argrpc_bootstrap.proto: the file's
FileDescriptorProto, serialized, from which argrpc builds its bootstrap messages at import.

argrpc ships this instead of protoc's *_pb2.py because generated code is tied to the
protobuf release of the protoc that wrote it (newer gencode refuses an older runtime),
while a descriptor loads on every protobuf argrpc accepts. Run after editing the .proto
(tests/test_proto.py fails until the two agree):

    python3 scripts/gen_proto.py
"""
from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = "argrpc_bootstrap.proto"
OUT = os.path.join(ROOT, "argrpc", "_proto", "descriptor.py")


def compiled(proto_dir: str = os.path.join(ROOT, "protos")) -> bytes:
    """The .proto's FileDescriptorProto as protoc serializes it (no source info)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}",
                          os.path.join(proto_dir, PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed (exit {rc}) on {PROTO}")
        with open(out, "rb") as f:
            files = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    (only,) = files
    return only.SerializeToString(deterministic=True)


def render(serialized: bytes) -> str:
    lines = [serialized[i:i + 64] for i in range(0, len(serialized), 64)]
    body = "\n".join(f"    {chunk!r}" for chunk in lines)
    return (f'"""protos/{PROTO}, compiled: its FileDescriptorProto, serialized. Written by\n'
            f'scripts/gen_proto.py; do not edit."""\n\n'
            f"SERIALIZED = (\n{body}\n)\n")


def main() -> int:
    text = render(compiled())
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
