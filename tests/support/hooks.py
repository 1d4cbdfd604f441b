"""The engine's test hooks (the sim fabric and `_sim_pair`, a connection's fail points
and remote-access probes) exist only in an engine built with ARGRPC_TEST_HOOKS=1, as
scripts/setup.sh builds it for the suite; the wheel a user installs is built without
them, and the suite run against it (scripts/test_installed.sh) skips these tests."""
from __future__ import annotations

import pytest

from argrpc import _core

needs_test_hooks = pytest.mark.skipif(
    not getattr(_core, "test_hooks", False),
    reason="the engine was built without its test hooks (ARGRPC_TEST_HOOKS=1, as "
           "scripts/setup.sh builds it); the wheel leaves them out")
