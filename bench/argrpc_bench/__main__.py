"""``python -m argrpc_bench``: the same as the ``argrpc-bench`` console script."""
from __future__ import annotations

import sys

from argrpc_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
