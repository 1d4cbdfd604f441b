"""``python -m argrpc.bench``: the same as the ``argrpc-bench`` console script."""
from __future__ import annotations

import sys

from argrpc.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
