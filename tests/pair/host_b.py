"""Host B of the two-host tests: runs the conformance echo server and obeys host A.

    softroce/pair.sh --b-ready .pair-ctrl/ready -- \
        python3 -m tests.pair.host_b -- python3 -m pytest -q tests/pair

B serves `tests.support.echo_server` (argrpc, no TF_RDMA_* transport set, so the choice
is automatic) on 0.0.0.0:PORT. A drives B through files in a directory both guests share
(the run's working directory): A writes `cmd-<n>` holding one command, B answers with
`ack-<n>` holding JSON. Commands:

    kill9        SIGKILL the server process (mid-call, if A has one running)
    start        start a server again (after kill9)
    pool         the server's engine pool stats and connection count
    nodevice     remove rxe0 from this host (no RDMA device left) and restart the server
    device       put rxe0 back on eth0 and restart the server
    ps <args>    start examples.ps_training.trainer with these arguments (a PS task)
    pswait       wait for it to end: its exit status and the tail of its output
    busy <n>     start n processes that keep the CPU busy
    calm         stop them
    poweroff     answer, then power the whole guest off at once (sysrq 'o')
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.pair import CTRL_DIR, PORT, SERVER_ENV, burn, stop
from tests.support import stubs as stubgen
from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.procs import ServerProcess

POLL_S = 0.05


def _start(stubs_dir: Path) -> ServerProcess:
    return ServerProcess("argrpc", stubs_dir,
                         ["--host", "0.0.0.0", "--port", str(PORT), *UNLIMITED_SERVER_ARGS],
                         SERVER_ENV, start_timeout=180)


def _pool(server: ServerProcess | None) -> dict[str, Any]:
    if server is None or not server.alive():
        return {"error": "no server running"}
    server.command("pool")
    return json.loads(server.expect(("POOL",), timeout=60).split(" ", 1)[1])


def main() -> int:
    ctrl = Path(CTRL_DIR)
    ctrl.mkdir(exist_ok=True)
    for old in ctrl.iterdir():
        old.unlink()
    stubs_dir = stubgen.generate(tempfile.mkdtemp(prefix="echo-stubs-"))
    server: ServerProcess | None = _start(stubs_dir)
    burners: list[subprocess.Popen[bytes]] = []
    ps_task: subprocess.Popen[bytes] | None = None
    (ctrl / "ready").write_text(json.dumps({"pid": server.proc.pid}))
    print(f"host B serving on port {PORT} (pid {server.proc.pid})", flush=True)
    n = 0
    while True:
        cmd_file = ctrl / f"cmd-{n}"
        if not cmd_file.exists():
            time.sleep(POLL_S)
            continue
        words = cmd_file.read_text().split()
        answer: dict[str, Any] = {"cmd": words}
        try:
            if words[0] == "kill9":
                assert server is not None
                os.kill(server.proc.pid, signal.SIGKILL)
                server.proc.wait(timeout=60)
                answer["killed"] = server.proc.pid
                server = None
            elif words[0] == "start":
                server = _start(stubs_dir)
                answer["pid"] = server.proc.pid
            elif words[0] in ("nodevice", "device"):
                # A host without a usable device: the server must decline verbs and the
                # client fall back to gRPC with the reason.
                if server is not None:
                    server.kill()
                rdma = (["rdma", "link", "delete", "rxe0"] if words[0] == "nodevice" else
                        ["rdma", "link", "add", "rxe0", "type", "rxe", "netdev",
                         os.environ.get("RXE_NETDEV", "eth0")])
                subprocess.run(rdma, check=True, timeout=60)
                server = _start(stubs_dir)
                answer["pid"] = server.proc.pid
            elif words[0] == "ps":
                log = open(ctrl / "ps.log", "wb")
                env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **SERVER_ENV}
                ps_task = subprocess.Popen([sys.executable, "-m", "examples.ps_training.trainer",
                                            *words[1:]], stdout=log, stderr=subprocess.STDOUT,
                                           env=env)
                answer["pid"] = ps_task.pid
            elif words[0] == "pswait":
                assert ps_task is not None, "no PS task started"
                try:
                    answer["rc"] = ps_task.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    ps_task.kill()
                    answer["rc"] = ps_task.wait()
                answer["tail"] = (ctrl / "ps.log").read_text(errors="replace")[-3000:]
                ps_task = None
            elif words[0] == "pool":
                answer["pool"] = _pool(server)
            elif words[0] == "busy":
                burners += burn(int(words[1]))
                answer["burners"] = len(burners)
            elif words[0] == "calm":
                stop(burners)
                burners.clear()
            elif words[0] == "poweroff":
                (ctrl / f"ack-{n}").write_text(json.dumps(answer))
                time.sleep(0.2)
                # sysrq 'o': the guest's power goes at once; no process, socket or queue
                # pair gets to say goodbye.
                Path("/proc/sys/kernel/sysrq").write_text("1")
                Path("/proc/sysrq-trigger").write_text("o")
                time.sleep(60)
                return 1
            else:
                answer["error"] = f"unknown command {words[0]!r}"
        except Exception as e:  # noqa: BLE001 - reported to A, which fails the test
            answer["error"] = f"{type(e).__name__}: {e}"
        (ctrl / f"ack-{n}").write_text(json.dumps(answer))
        n += 1


if __name__ == "__main__":
    sys.exit(main())
