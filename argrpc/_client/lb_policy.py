"""Which load-balancing policy a channel's calls follow, chosen as grpc chooses it: the
service config's ``loadBalancingConfig`` (its first policy grpc knows), else the
``grpc.lb_policy_name`` option, else the service config's older ``loadBalancingPolicy``,
else ``pick_first``.

argrpc balances ``pick_first`` and ``round_robin`` itself; a channel given any other policy
grpc has (``weighted_round_robin``, ``ring_hash``, ``grpclb``, ``xds``...) stays on plain
gRPC, where grpc balances it, with a reason saying so.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["PICK_FIRST", "ROUND_ROBIN", "choose"]

PICK_FIRST, ROUND_ROBIN = "pick_first", "round_robin"
_OURS = (PICK_FIRST, ROUND_ROBIN)
_SERVICE_CONFIG_KEY = "grpc.service_config"
_LB_POLICY_KEY = "grpc.lb_policy_name"


def service_config(grpc_options: Any) -> dict[str, Any]:
    """The ``grpc.service_config`` option as a dict ({} when absent or unreadable: grpc
    then fails the channel's calls itself, on the gRPC path)."""
    for key, value in tuple(grpc_options or ()):
        if key == _SERVICE_CONFIG_KEY:
            try:
                parsed = json.loads(value)
            except (TypeError, ValueError):
                return {}
            return parsed if isinstance(parsed, dict) else {}
    return {}


def choose(grpc_options: Any) -> tuple[str, str]:
    """(policy, "") for a policy argrpc balances; ("", why) for one left to grpc."""
    config = service_config(grpc_options)
    lb_configs = config.get("loadBalancingConfig")
    if isinstance(lb_configs, list):
        for entry in lb_configs:
            if isinstance(entry, dict) and len(entry) == 1:
                name = next(iter(entry))
                return _ours_or_why(name, "the service config's loadBalancingConfig")
    for key, value in tuple(grpc_options or ()):
        if key == _LB_POLICY_KEY and isinstance(value, str):
            return _ours_or_why(value, _LB_POLICY_KEY)
    old = config.get("loadBalancingPolicy")
    if isinstance(old, str):
        return _ours_or_why(old.lower(), "the service config's loadBalancingPolicy")
    return PICK_FIRST, ""


def _ours_or_why(name: str, source: str) -> tuple[str, str]:
    if name in _OURS:
        return name, ""
    return "", f"load-balancing policy '{name}' (from {source}) is balanced by grpc alone"
