"""`python -m argrpc doctor`: the `argrpc` console script without installing it."""

import sys

from argrpc._cli import main

sys.exit(main())
