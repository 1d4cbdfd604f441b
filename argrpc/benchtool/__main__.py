"""``python -m argrpc.benchtool``: the same as the ``argrpc-bench`` console script."""
from __future__ import annotations

import sys

from argrpc.benchtool.cli import main

if __name__ == "__main__":
    sys.exit(main())
