#!/usr/bin/env python3
"""Instructions a 64 B call costs a server process, counted by callgrind.

    python3 bench/server_instructions.py [--server asyncio|threaded] [--calls N]
    python3 bench/server_instructions.py --client asyncio|threaded [--calls N]

The server (`bench/loop_pairs.py --serve`, a registered bytes echo) runs under
`valgrind --tool=callgrind` with instrumentation off; a threaded argrpc client in this
process warms the call path up, switches instrumentation on (`callgrind_control -i on`)
for N calls, and off again. Printed: the server process's instructions per call, every
thread included (the loop's poll spin too), and the callgrind file for
`callgrind_annotate`. Counts, unlike times, barely move with the machine's load, so a
change's effect shows in one run of each tree; runs of one tree differ by a few hundred.
With `--client` the other side is counted: an argrpc.aio (or threaded) client process
under callgrind, switching its own instrumentation on around N calls, against a threaded
server. Needs valgrind (`apt-get install valgrind`).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argrpc  # noqa: E402

METHOD = "/loop_pairs.Echo/Call"

# The counted clients: argv target, calls; each warms up, then counts its own calls.
CLIENTS = {"asyncio": f"""
import asyncio, os, subprocess, sys
import argrpc.aio

async def main():
    target, n = sys.argv[1], int(sys.argv[2])
    async with argrpc.aio.insecure_channel(target) as ch:
        call = ch.unary_unary({METHOD!r}, _registered_method=True)
        for _ in range(300):
            await call(b"x" * 64, timeout=120)
        if ch.transport != "shm":
            sys.exit("the channel is on " + ch.transport)
        pid = str(os.getpid())  # valgrind runs the interpreter in its own process
        subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
        for _ in range(n):
            await call(b"x" * 64, timeout=120)
        subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)

asyncio.run(main())
""", "threaded": f"""
import os, subprocess, sys
import argrpc

target, n = sys.argv[1], int(sys.argv[2])
with argrpc.insecure_channel(target) as ch:
    call = ch.unary_unary({METHOD!r}, _registered_method=True)
    for _ in range(300):
        call(b"x" * 64, timeout=120)
    if ch.transport != "shm":
        sys.exit("the channel is on " + ch.transport)
    pid = str(os.getpid())  # valgrind runs the interpreter in its own process
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    for _ in range(n):
        call(b"x" * 64, timeout=120)
    subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
"""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=("asyncio", "threaded"), default="asyncio")
    p.add_argument("--client", choices=tuple(CLIENTS),
                   help="count this client's process instead, against a threaded server")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (apt-get install valgrind)")
    out = Path(tempfile.mkdtemp(prefix="argrpc-cg-")) / "callgrind.out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    if a.client:
        return count_client(a.client, a.calls, out, env)
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, str(ROOT / "bench" / "loop_pairs.py"), "--serve", a.server],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=env)
    assert server.stdin is not None and server.stdout is not None
    try:
        port = int(server.stdout.readline())
        pid = str(server.pid)  # valgrind runs the interpreter in its own process
        with argrpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(METHOD, _registered_method=True)
            for _ in range(300):
                call(b"x" * 64, timeout=120)
            if ch.transport != "shm":
                p.error(f"the channel is on {ch.transport}: {ch.fallback_reason}")
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True,
                           capture_output=True)
            for _ in range(a.calls):
                call(b"x" * 64, timeout=120)
            subprocess.run(["callgrind_control", "-i", "off", pid], check=True,
                           capture_output=True)
        server.stdin.close()
        server.wait(300)
    finally:
        if server.poll() is None:
            server.kill()
    return report(f"{a.server} server", a.calls, out)


def count_client(kind: str, calls: int, out: Path, env: dict[str, str]) -> int:
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "loop_pairs.py"), "--serve", "threaded"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=env)
    assert server.stdin is not None and server.stdout is not None
    try:
        port = int(server.stdout.readline())
        client = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={out}", sys.executable, "-c", CLIENTS[kind],
             f"127.0.0.1:{port}", str(calls)],
            stderr=subprocess.PIPE, text=True, env=env, timeout=1800)
        if client.returncode != 0:
            print(client.stderr[-2000:], file=sys.stderr)
            return 1
        server.stdin.close()
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
    return report(f"{kind} client", calls, out)


def report(what: str, calls: int, out: Path) -> int:
    summary = subprocess.run(["callgrind_annotate", "--inclusive=no", str(out)],
                             capture_output=True, text=True).stdout
    m = re.search(r"^\s*([\d,]+).*PROGRAM TOTALS", summary, re.M)
    if m is None:
        print(f"no totals in {out}", file=sys.stderr)
        return 1
    total = int(m.group(1).replace(",", ""))
    print(f"{what}: {total // calls} instructions a call ({calls} calls; {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
