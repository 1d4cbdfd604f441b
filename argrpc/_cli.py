"""The `argrpc` console script (`python -m argrpc` too). Subcommands: `doctor`; and
`--version`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from argrpc._config import TRANSPORT_CHOICES
from argrpc._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="argrpc", description="argrpc: shared-memory/RDMA transport for Python gRPC.")
    parser.add_argument("--version", action="version", version=f"argrpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    doctor = sub.add_parser(
        "doctor", help="why RDMA is or is not used here",
        description="Lists RDMA devices, ports, states, MTUs and GID tables, the memlock "
                    "limit, the device/port/GID argrpc would use and why, and with --target "
                    "which transport an argrpc channel to that server gets and why. Reads "
                    "the TF_RDMA_* environment like any argrpc process.")
    doctor.add_argument("--target", metavar="HOST:PORT",
                        help="an argrpc (or plain gRPC) server: negotiate with it as a channel "
                             "would and report the transport and the reason")
    doctor.add_argument("--transport", choices=TRANSPORT_CHOICES,
                        help="TF_RDMA_TRANSPORT for the --target check (default: environment)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "doctor":
        from argrpc import _doctor

        return _doctor.run(args.target, args.transport, args.json)
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
