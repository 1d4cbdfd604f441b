"""How a channel's calls reach its target's servers, decided once when the channel is
made (both front ends): left to grpc (a scheme or a load-balancing policy argrpc does not
handle), one fast connection negotiated over the channel's gRPC channel (pick_first: grpc
picks the server the negotiation reaches, and the next one when it fails), or a
round-robin balancer over the target's addresses."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from .. import _config
from . import lb_policy, target as targets
from .balancer import Balancer

__all__ = ["ClientModel", "client_model"]

_AUTHORITY_KEY = "grpc.default_authority"


@dataclasses.dataclass(frozen=True)
class ClientModel:
    grpc_alone: str                # why the target is grpc's alone ("" when it is not)
    balancer: Optional[Balancer]   # None: one connection, negotiated over the gRPC channel
    address_options: list[Any]     # a subchannel's gRPC channel options (the target's :authority)


def client_model(target: str, credentials: Any, grpc_options: Any, cfg: _config.Config,
                 max_recv: int, secure: bool, make_grpc: Callable[[str], Any],
                 retire_grpc: Callable[[Any], None]) -> ClientModel:
    resolution = targets.parse(target)
    policy, why = lb_policy.choose(grpc_options)
    grpc_alone = resolution.unsupported or why
    options = list(grpc_options or ())
    if not any(k == _AUTHORITY_KEY for k, _ in options):
        options.append((_AUTHORITY_KEY, resolution.authority))
    if grpc_alone or policy != lb_policy.ROUND_ROBIN or not cfg.enabled or \
            cfg.transport == "grpc":
        return ClientModel(grpc_alone, None, options)
    resolver = targets.Resolver(resolution, grpc_options)
    return ClientModel("", Balancer(resolver, make_grpc, retire_grpc, cfg, credentials,
                                    grpc_options, max_recv, secure), options)
