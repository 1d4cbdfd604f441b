#!/usr/bin/env python3
"""argrpc over verbs vs perftest (``ib_write_bw`` / ``ib_write_lat``) on Soft-RoCE, in one
guest boot.

Run it INSIDE one Soft-RoCE guest boot, from the repository root:

    softroce/guest.sh python3 bench/verbs_vs_perftest.py [--json PATH]

Per repetition (repetitions interleave the two sides, so drift of the emulated machine
hits both alike):

- perftest on rxe0 (port 1, GID index 1), server in the background and client to
  127.0.0.1 in the same guest: ``ib_write_bw`` at 1, 4 and 64 MiB and ``ib_write_lat`` at
  64 B (perftest reports half the round trip; RTT = 2 × t_typical);
- argrpc-bench through its runner API (the same code as the ``argrpc-bench`` CLI):
  bandwidth, raw mode, 1/4/64 MiB, transports verbs and grpc; latency, raw mode, 64 B,
  transports verbs, shm and grpc.

Printed: argrpc-verbs bandwidth as a fraction of ``ib_write_bw`` (goal ≥ 70 % for ≥ 4 MiB),
argrpc-verbs vs plain gRPC over the guest loopback, and argrpc-verbs 64 B p50 round trip
vs ``ib_write_lat``'s RTT (goal: ≤ 2 × (RTT + argrpc's own overhead), the overhead measured
as the shm p50 round trip in the same boot; the stricter ≤ 2 × RTT + overhead is printed
too). ``--report JSON`` reprints the table of a saved run. Medians over the repetitions, with min..max of the
per-repetition ratios. Under TCG emulation absolute numbers mean nothing; only ratios
from one boot do.

Note what each side does: ``ib_write_bw`` keeps up to 128 WRITEs in flight on one QP and
never touches the data; argrpc-bench's bandwidth is one unary call at a time (serialize,
RTS, chunked RDMA READs over TF_RDMA_QPS QPs, FIN, handler, ack), so per-call overheads
count fully.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from argrpc_bench import runner  # noqa: E402

MiB = 1 << 20
DEV, IB_PORT, GID_INDEX = "rxe0", "1", "1"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- perftest

def listening(port: int) -> bool:
    """Whether a TCP socket of this host listens on `port` (perftest's handshake port)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                return True
    return False


def _perftest(tool: str, size: int, iters: int, port: int, extra: list[str],
              timeout: float) -> list[str]:
    """Runs server + client of one perftest tool on loopback; the client's output rows."""
    common = [tool, "-d", DEV, "-i", IB_PORT, "-x", GID_INDEX, "-F", "-s", str(size),
              "-n", str(iters), "-p", str(port), *extra]
    server = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline = time.monotonic() + timeout
        # Under TCG the server takes seconds to listen, and a client that comes too early
        # fails and leaves the server waiting for ever: wait for the listening socket.
        while not listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{tool} server did not listen on {port}: "
                                   f"{server.communicate()[0] if server.poll() is not None else ''}")
            time.sleep(0.1)
        client = subprocess.run([*common, "127.0.0.1"], capture_output=True, text=True,
                                timeout=max(5.0, deadline - time.monotonic()))
        if client.returncode != 0:
            raise RuntimeError(f"{tool} -s {size} failed ({client.returncode}):\n"
                               f"{client.stdout}\n{client.stderr}")
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    rows = [ln.split() for ln in client.stdout.splitlines()]
    return [r for r in rows if r and r[0] == str(size)]


def ib_write_bw(size: int, iters: int, port: int) -> float:
    """Average bandwidth, GB/s (10^9 B/s)."""
    (row, *_) = _perftest("ib_write_bw", size, iters, port, [], 120)
    # #bytes #iterations BW_peak[MB/sec] BW_average[MB/sec] MsgRate[Mpps]; perftest's MB is
    # 2^20 B unless --report_gbits, so convert to 10^9 B like argrpc-bench.
    return float(row[3]) * MiB / 1e9


def ib_write_lat(size: int, iters: int, port: int) -> dict[str, float]:
    """Half-round-trip figures in µs as perftest prints them, plus rtt_us = 2 × typical."""
    (row, *_) = _perftest("ib_write_lat", size, iters, port, [], 120)
    # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
    t_min, t_typ, t_avg, p99 = float(row[2]), float(row[4]), float(row[5]), float(row[7])
    return {"t_min_us": t_min, "t_typical_us": t_typ, "t_avg_us": t_avg, "p99_us": p99,
            "rtt_us": 2 * t_typ}


# ------------------------------------------------------------------------------ argrpc

def argrpc_run(benchmark: str, transports: list[str], sizes: list[int], duration: float,
               warmup: int, env: dict[str, str]) -> dict[tuple[str, int], Any]:
    spec = runner.RunSpec(benchmark=benchmark, transports=transports, mode="raw",
                          sizes=sizes, duration=duration, warmup=warmup, repeats=1, env=env,
                          timeout=300)
    out = {}
    for m in runner.run(spec):
        if m.skipped:
            raise RuntimeError(f"{m.transport} skipped: {m.note}")
        out[(m.transport, m.size)] = m
    return out


# ------------------------------------------------------------------------------ report

def med(xs: list[float]) -> float:
    return statistics.median(xs)


def rng(xs: list[float]) -> str:
    return f"{min(xs):.2f}..{max(xs):.2f}"


def size_name(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n} B"


def report(doc: dict[str, Any]) -> str:
    reps = doc["reps"]
    lines = []
    lines.append(f"verbs vs perftest on {DEV} — {len(reps)} repetitions in one boot; "
                 "medians (per-repetition ratio min..max)")
    lines.append("")
    lines.append("| size | ib_write_bw MB/s | argrpc-verbs MB/s | grpc MB/s | verbs / ib_write_bw "
                 "| range | goal | verbs / grpc | range |")
    lines.append("|---:|---:|---:|---:|---:|---:|:---|---:|---:|")
    for s in doc["bw_sizes"]:
        ib = [r["ib_write_bw_gbps"][str(s)] for r in reps]
        vb = [r["bw_gbps"]["verbs"][str(s)] for r in reps]
        gr = [r["bw_gbps"]["grpc"][str(s)] for r in reps]
        f_ib = [v / i for v, i in zip(vb, ib)]
        f_gr = [v / g for v, g in zip(vb, gr)]
        goal = ""
        if s >= 4 * MiB:
            goal = "PASS ≥ 70%" if med(f_ib) >= 0.70 else \
                f"MISS ≥ 70% (short by {100 * (0.70 - med(f_ib)):.0f} points)"
        lines.append(f"| {size_name(s)} | {1e3 * med(ib):.1f} | {1e3 * med(vb):.1f} | "
                     f"{1e3 * med(gr):.1f} | {100 * med(f_ib):.0f}% | {rng(f_ib)} | {goal} | "
                     f"{med(f_gr):.2f}× | {rng(f_gr)} |")
    lines.append("")
    ls = doc["lat_size"]
    rtt = [r["ib_write_lat"]["rtt_us"] for r in reps]
    v = [r["lat_p50_us"]["verbs"] for r in reps]
    sh = [r["lat_p50_us"]["shm"] for r in reps]
    gr = [r["lat_p50_us"]["grpc"] for r in reps]
    # The issue's goal, "within 2× of ib_write_lat's round trip plus argrpc's own
    # shm-measured overhead", read as written: verbs ≤ 2 × (RTT + shm p50). The stricter
    # reading, verbs ≤ 2 × RTT + shm p50, is printed as well.
    bound = [2 * (a + b) for a, b in zip(rtt, sh)]
    strict = [2 * a + b for a, b in zip(rtt, sh)]
    lines.append(f"| {ls} B round trip | median µs | per-repetition µs |")
    lines.append("|:---|---:|:---|")
    lines.append(f"| ib_write_lat RTT (2 × t_typical) | {med(rtt):.1f} | "
                 f"{', '.join(f'{x:.1f}' for x in rtt)} |")
    lines.append(f"| argrpc-shm p50 (argrpc's own overhead) | {med(sh):.1f} | "
                 f"{', '.join(f'{x:.1f}' for x in sh)} |")
    lines.append(f"| argrpc-verbs p50 | {med(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    lines.append(f"| grpc p50 | {med(gr):.1f} | {', '.join(f'{x:.1f}' for x in gr)} |")
    lines.append(f"| goal: 2 × (RTT + shm p50) | {med(bound):.1f} | "
                 f"{', '.join(f'{x:.1f}' for x in bound)} |")
    lines.append(f"| stricter: 2 × RTT + shm p50 | {med(strict):.1f} | "
                 f"{', '.join(f'{x:.1f}' for x in strict)} |")

    def verdict(limit: list[float]) -> str:
        ratio = [a / b for a, b in zip(v, limit)]
        word = "PASS" if med(ratio) <= 1.0 else f"MISS by {med(ratio):.2f}×"
        return f"{med(ratio):.2f} (range {rng(ratio)}) → {word}"

    lines.append("")
    lines.append(f"latency: argrpc-verbs p50 / (2 × (RTT + shm p50)) = {verdict(bound)}; "
                 f"stricter, verbs p50 / (2 × RTT + shm p50) = {verdict(strict)}; "
                 f"grpc p50 / verbs p50 = {med([g / a for g, a in zip(gr, v)]):.1f}×")
    return "\n".join(lines)


# -------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--bw-sizes", default="1,4,64", help="MiB, comma list (default 1,4,64)")
    p.add_argument("--lat-size", type=int, default=64, help="bytes (default 64)")
    p.add_argument("--bw-duration", type=float, default=3.0,
                   help="argrpc-bench timed seconds per (size, transport) (default 3)")
    p.add_argument("--lat-duration", type=float, default=1.5,
                   help="argrpc-bench timed seconds per transport (default 1.5)")
    p.add_argument("--bw-mib", type=int, default=128,
                   help="ib_write_bw MiB moved per size (iterations = this / size, ≥ 5; "
                        "default 128)")
    p.add_argument("--lat-iters", type=int, default=2000, help="ib_write_lat iterations")
    p.add_argument("--buf-size", default="256M",
                   help="TF_RDMA_BUF_SIZE for the measured argrpc processes (default 256M: "
                        "the guest has 2 GiB and both ends register their pool)")
    p.add_argument("--json", help="write the raw results and the table here")
    p.add_argument("--report", metavar="JSON",
                   help="only print the table of results saved earlier with --json")
    args = p.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0

    if not Path(f"/sys/class/infiniband/{DEV}").exists():
        print(f"no {DEV}: run this inside the Soft-RoCE guest "
              "(softroce/guest.sh python3 bench/verbs_vs_perftest.py)",
              file=sys.stderr)
        return 2
    for tool in ("ib_write_bw", "ib_write_lat"):
        if not shutil.which(tool):
            print(f"{tool} (perftest) is not installed", file=sys.stderr)
            return 2

    sizes = [int(x) * MiB for x in args.bw_sizes.split(",") if x]
    env = {"TF_RDMA_BUF_SIZE": args.buf_size}
    started = time.monotonic()
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "uname": " ".join(os.uname()), "device": DEV, "bw_sizes": sizes,
                           "lat_size": args.lat_size, "argrpc_env": env,
                           "args": vars(args), "reps": []}
    port = 18515
    for rep in range(args.reps):
        r: dict[str, Any] = {"ib_write_bw_gbps": {}, "bw_gbps": {}, "lat_p50_us": {},
                             "lat": {}}
        for s in sizes:
            port += 1
            iters = max(5, args.bw_mib * MiB // s)
            r["ib_write_bw_gbps"][str(s)] = ib_write_bw(s, iters, port)
            log(f"rep {rep + 1}: ib_write_bw {size_name(s)} × {iters}: "
                f"{1e3 * r['ib_write_bw_gbps'][str(s)]:.1f} MB/s")
        port += 1
        r["ib_write_lat"] = ib_write_lat(args.lat_size, args.lat_iters, port)
        log(f"rep {rep + 1}: ib_write_lat {args.lat_size} B: {r['ib_write_lat']}")

        bw = argrpc_run("bandwidth", ["verbs", "grpc"], sizes, args.bw_duration, 2, env)
        for t in ("verbs", "grpc"):
            r["bw_gbps"][t] = {str(s): bw[(t, s)].gbps for s in sizes}
            log(f"rep {rep + 1}: argrpc-bench bandwidth {t}: " + ", ".join(
                f"{size_name(s)} {1e3 * bw[(t, s)].gbps:.1f} MB/s "
                f"({bw[(t, s)].iterations} calls)" for s in sizes))
        lat = argrpc_run("latency", ["verbs", "shm", "grpc"], [args.lat_size],
                         args.lat_duration, 20, env)
        for t in ("verbs", "shm", "grpc"):
            m = lat[(t, args.lat_size)]
            r["lat_p50_us"][t] = m.p50_us
            r["lat"][t] = {"p50_us": m.p50_us, "p99_us": m.p99_us, "mean_us": m.mean_us,
                           "iterations": m.iterations}
        log(f"rep {rep + 1}: argrpc-bench latency {args.lat_size} B p50 µs: "
            f"{r['lat_p50_us']}  ({time.monotonic() - started:.0f} s so far)")
        doc["reps"].append(r)

    doc["seconds"] = time.monotonic() - started
    table = report(doc)
    doc["table"] = table
    print(table)
    print(f"\n({doc['seconds']:.0f} s in the guest)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
