"""grpc's own constructors, taken when argrpc is first imported.

argrpc builds a real grpc server and channel under each of its own. A program may switch
a library that builds its servers or channels itself by replacing grpc's functions with
argrpc's (``grpc.aio.server = argrpc.aio.server``); argrpc must then still reach grpc's,
not call itself.
"""

from __future__ import annotations

import grpc
from grpc import aio

server = grpc.server
insecure_channel = grpc.insecure_channel
secure_channel = grpc.secure_channel
aio_server = aio.server
aio_insecure_channel = aio.insecure_channel
aio_secure_channel = aio.secure_channel
