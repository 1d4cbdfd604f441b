#!/usr/bin/env python3
"""Instructions a 64 B call costs a server process, counted by callgrind.

    python3 bench/server_instructions.py [--server asyncio|threaded] [--calls N]

The server (`bench/loop_pairs.py --serve`, a registered bytes echo) runs under
`valgrind --tool=callgrind` with instrumentation off; a threaded argrpc client in this
process warms the call path up, switches instrumentation on (`callgrind_control -i on`)
for N calls, and off again. Printed: the server process's instructions per call, every
thread included (the loop's poll spin too), and the callgrind file for
`callgrind_annotate`. Counts, unlike times, barely move with the machine's load, so a
change's effect shows in one run of each tree; runs of one tree differ by a few hundred.
Needs valgrind (`apt-get install valgrind`).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=("asyncio", "threaded"), default="asyncio")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (apt-get install valgrind)")
    out = Path(tempfile.mkdtemp(prefix="argrpc-cg-")) / "callgrind.out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
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
    summary = subprocess.run(["callgrind_annotate", "--inclusive=no", str(out)],
                             capture_output=True, text=True).stdout
    m = re.search(r"^\s*([\d,]+).*PROGRAM TOTALS", summary, re.M)
    if m is None:
        print(f"no totals in {out}", file=sys.stderr)
        return 1
    total = int(m.group(1).replace(",", ""))
    print(f"{a.server} server: {total // a.calls} instructions a call "
          f"({a.calls} calls; {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
