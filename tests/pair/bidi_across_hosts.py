"""Two hosts, one bidi call: run by ../shared/softroce/run-in-rxe-pair.sh on both guests.

    ../shared/softroce/run-in-rxe-pair.sh --b-listen 50051 -- \
        python3 -m tests.pair.bidi_across_hosts -- python3 -m tests.pair.bidi_across_hosts

Guest B (RXE_ROLE=b) serves an argrpc server on 0.0.0.0:50051 with no TF_RDMA_* set;
guest A calls it by B's address: the channel must choose verbs by itself, and one bidi
call streaming 30 messages of 0 B to 3 MiB must come back in order and byte-exact within
its 120 s deadline. Exit status 0 when everything held; what failed is printed.

Not in CI yet: it still fails in a third to most of the runs on the two emulated guests
(the sending queue pair stops after RC retransmissions, and the peer's keepalive ends the
call after 10 s; docs/design.md, Liveness, says what is known). It is the reproduction
for that work.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from concurrent import futures

import grpc

import argrpc

PORT = 50051
OPTS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
SIZES = [0 if i % 3 == 0 else (i * 104729) % (3 << 20) for i in range(30)]


def serve() -> None:
    def bidi(requests, context):  # type: ignore[no-untyped-def]
        for r in requests:
            yield r

    server = argrpc.server(futures.ThreadPoolExecutor(4), options=OPTS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pair.Check", {
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}),))
    server.add_insecure_port(f"0.0.0.0:{PORT}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


def client() -> int:
    with argrpc.insecure_channel(f"{os.environ['RXE_PEER_ADDR']}:{PORT}", options=OPTS) as ch:
        assert ch.unary_unary("/pair.Check/Echo")(b"hi", timeout=120, wait_for_ready=True) == b"hi"
        if ch.transport != "verbs":
            print(f"FAIL: transport {ch.transport} ({ch.fallback_reason}), not verbs", flush=True)
            return 1
        messages = [hashlib.sha256(b"%d" % i).digest() * (n // 32) + b"z" * (n % 32)
                    for i, n in enumerate(SIZES)]
        started = time.monotonic()
        try:
            got = list(ch.stream_stream("/pair.Check/Bidi")(iter(messages), timeout=120))
        except grpc.RpcError as e:
            print(f"FAIL: bidi ended {e.code().name} after {time.monotonic() - started:.1f} s: "
                  f"{e.details()}", flush=True)
            return 1
        if [bytes(g) for g in got] != messages:
            print(f"FAIL: bidi returned {len(got)} messages, not the 30 sent, in order", flush=True)
            return 1
        print(f"ok: verbs across hosts, bidi of 30 messages ({sum(SIZES)} B) in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        return 0


if __name__ == "__main__":
    if os.environ.get("RXE_ROLE") == "b":
        serve()
    else:
        sys.exit(client())
