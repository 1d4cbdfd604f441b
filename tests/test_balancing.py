"""A channel over several replicas, as grpc's client channel has it: the target resolved to
every address, round_robin (chosen by `grpc.lb_policy_name` or the service config's
loadBalancingConfig) sending each call to the next ready replica, each over the fast path
its server negotiated; a replica that stops or is killed loses only its own calls, one that
comes back is used again; a plain gRPC replica among fast ones is called over gRPC; and
targets or policies argrpc does not handle stay on plain gRPC with the reason. Every
scenario runs on grpc too: the oracle."""
from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from typing import Any, Iterator

import grpc
import pytest

import argrpc
import argrpc.aio
from argrpc._client import lb_policy
from argrpc._client.target import Resolver, addresses, parse
from argrpc._subchannels import SUBCHANNELS
from tests.support import inproc
from tests.support.hooks import needs_test_hooks

HANG_S = 30  # a bound on a hang, for a loaded machine
STACKS = ["grpc", "argrpc"]
RR_OPTION = [("grpc.lb_policy_name", "round_robin")]
RR_SERVICE_CONFIG = [("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}')]

REPLICA = r"""
import sys, time
from concurrent import futures
import grpc
mod = __import__(sys.argv[1])
name = sys.argv[2]
server = mod.server(futures.ThreadPoolExecutor(4))
def handle(request, context):
    time.sleep(float(request or b"0"))
    return f"{name}:{getattr(context, 'transport', 'grpc')}".encode()
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "r", {"Who": grpc.unary_unary_rpc_method_handler(handle)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def _handlers(name: str) -> Any:
    def who(request: bytes, context: Any) -> bytes:
        time.sleep(float(request or b"0"))
        return f"{name}:{getattr(context, 'transport', 'grpc')}".encode()
    return grpc.method_handlers_generic_handler(
        "r", {"Who": grpc.unary_unary_rpc_method_handler(who)})


def _async_handlers(name: str) -> Any:
    async def who(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(float(request or b"0"))
        return f"{name}:{getattr(context, 'transport', 'grpc')}".encode()
    return grpc.method_handlers_generic_handler(
        "r", {"Who": grpc.unary_unary_rpc_method_handler(who)})


def _serve(stack: str, name: str, port: int = 0) -> tuple[Any, int]:
    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([_handlers(name)])
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def _ipv4(ports: list[int]) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)


@pytest.fixture
def replicas(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[Any], list[int]]]:
    stack = request.param
    started = [_serve(stack, str(i)) for i in range(3)]
    servers, ports = [s for s, _ in started], [p for _, p in started]
    yield stack, servers, ports
    for s in servers:
        s.stop(None)


def _count(call: Any, n: int) -> collections.Counter[str]:
    return collections.Counter(call(b"", timeout=HANG_S).decode() for _ in range(n))


def _spread_ok(stack: str, counts: collections.Counter[str], names: list[str],
               n: int) -> None:
    """Every replica got its share (grpc's own round_robin, the oracle, is within a call
    or two of even: its picker starts before every replica is connected), and argrpc's
    calls went over shared memory."""
    by_name = collections.Counter({k.split(":")[0]: v for k, v in counts.items()})
    assert sum(by_name.values()) == n
    for name in names:
        assert by_name[name] >= n // len(names) // 2, counts
    transports = {k.split(":")[1] for k in counts}
    assert transports == ({"shm"} if stack == "argrpc" else {"grpc"}), counts


@pytest.mark.parametrize("replicas", STACKS, indirect=True)
@pytest.mark.parametrize("options", [RR_OPTION, RR_SERVICE_CONFIG], ids=["option", "config"])
def test_round_robin_spreads_calls_over_replicas(replicas: Any, options: Any) -> None:
    stack, _, ports = replicas
    with inproc.stack_module(stack).insecure_channel(_ipv4(ports), options=options) as ch:
        counts = _count(ch.unary_unary("/r/Who"), 60)
        _spread_ok(stack, counts, ["0", "1", "2"], 60)
        if stack == "argrpc":
            assert ch.transport == "shm"
            assert ch.fallback_reason == ""


@pytest.mark.parametrize("replicas", STACKS, indirect=True)
def test_pick_first_keeps_one_replica(replicas: Any) -> None:
    stack, _, ports = replicas
    with inproc.stack_module(stack).insecure_channel(_ipv4(ports)) as ch:
        counts = _count(ch.unary_unary("/r/Who"), 12)
        assert len(counts) == 1, counts
        if stack == "argrpc":
            assert next(iter(counts)).endswith(":shm")


def _replica_1_ends(who: Any, end_it: Any) -> None:
    """A call on every replica, then `end_it` ends replica 1: its call alone fails
    UNAVAILABLE, and new calls go to the other two at once."""
    # Each call lasts long after the replica ends, however long a loaded machine stalls
    # the test between starting them and ending it.
    calls = [who.future(b"3", timeout=HANG_S) for _ in range(3)]
    time.sleep(0.5)
    end_it()
    ends = []
    for f in calls:
        try:
            ends.append(f.result(timeout=HANG_S).decode().split(":")[0])
        except grpc.RpcError as e:
            ends.append(e.code().name)
    assert sorted(ends) == ["0", "2", "UNAVAILABLE"], ends
    counts = _count(who, 30)
    assert set(k.split(":")[0] for k in counts) == {"0", "2"}, counts


@pytest.mark.parametrize("replicas", STACKS, indirect=True)
def test_a_stopped_replica_loses_its_calls_and_comes_back(replicas: Any) -> None:
    stack, servers, ports = replicas
    with inproc.stack_module(stack).insecure_channel(_ipv4(ports), options=RR_OPTION) as ch:
        who = ch.unary_unary("/r/Who")
        _count(who, 6)
        _replica_1_ends(who, lambda: servers[1].stop(None).wait(HANG_S))  # without grace
        # Back on the same port: used again.
        servers[1], _ = _serve(stack, "back", ports[1])
        deadline = time.monotonic() + HANG_S
        while not who(b"", timeout=HANG_S).startswith(b"back"):
            assert time.monotonic() < deadline, "the replica that came back is not used"
            time.sleep(0.02)
        _spread_ok(stack, _count(who, 30), ["0", "back", "2"], 30)


@pytest.mark.parametrize("stack", STACKS)
def test_a_killed_replica_process_loses_only_its_calls(stack: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", REPLICA, stack, str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(3)]
    try:
        ports = [int(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        mod = inproc.stack_module(stack)
        with mod.insecure_channel(_ipv4(ports), options=RR_OPTION) as ch:
            who = ch.unary_unary("/r/Who")
            _spread_ok(stack, _count(who, 30), ["0", "1", "2"], 30)
            _replica_1_ends(who, lambda: procs[1].send_signal(signal.SIGKILL))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_plain_grpc_replica_among_fast_ones_is_called_over_grpc() -> None:
    started = [_serve("argrpc", "0"), _serve("grpc", "1"), _serve("argrpc", "2")]
    try:
        with argrpc.insecure_channel(_ipv4([p for _, p in started]), options=RR_OPTION) as ch:
            counts = _count(ch.unary_unary("/r/Who"), 60)
            assert counts["0:shm"] >= 10 and counts["2:shm"] >= 10, counts
            assert counts["1:grpc"] >= 10, counts
            assert sum(counts.values()) == 60
            assert ch.transport == "shm"
    finally:
        for s, _ in started:
            s.stop(None)


@pytest.mark.parametrize("replicas", ["argrpc"], indirect=True)
def test_balanced_channels_share_each_replicas_connection(replicas: Any) -> None:
    _, _, ports = replicas
    before = SUBCHANNELS.count()
    a = argrpc.insecure_channel(_ipv4(ports), options=RR_OPTION)
    b = argrpc.insecure_channel(_ipv4(ports), options=RR_OPTION)
    try:
        _count(a.unary_unary("/r/Who"), 6)
        _count(b.unary_unary("/r/Who"), 6)
        assert SUBCHANNELS.count() == before + 3
        # Closing one ends its own calls only; the other goes on over the same connections.
        slow = [b.unary_unary("/r/Who").future(b"0.5", timeout=HANG_S) for _ in range(3)]
        a.close()
        assert all(f.result(timeout=HANG_S).endswith(b":shm") for f in slow)
        assert SUBCHANNELS.count() == before + 3
    finally:
        a.close()
        b.close()
    assert SUBCHANNELS.count() == before


@pytest.mark.parametrize("replicas", STACKS, indirect=True)
def test_close_cancels_calls_on_every_replica(replicas: Any) -> None:
    stack, _, ports = replicas
    ch = inproc.stack_module(stack).insecure_channel(_ipv4(ports), options=RR_OPTION)
    who = ch.unary_unary("/r/Who")
    _count(who, 3)
    calls = [who.future(b"2", timeout=HANG_S) for _ in range(6)]
    time.sleep(0.3)
    ch.close()
    codes = set()
    for f in calls:
        with pytest.raises(grpc.RpcError) as e:
            f.result(timeout=HANG_S)
        codes.add(e.value.code())
    assert codes == {grpc.StatusCode.CANCELLED}


# ---------------------------------------------------------------------- asyncio

@pytest.mark.parametrize("stack", STACKS)
def test_aio_round_robin_and_a_replica_that_comes_back(stack: str) -> None:
    aio = argrpc.aio if stack == "argrpc" else grpc.aio

    async def serve(name: str, port: int = 0) -> tuple[Any, int]:
        server = aio.server()
        server.add_generic_rpc_handlers([_async_handlers(name)])
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, port

    async def main() -> None:
        started = [await serve(str(i)) for i in range(3)]
        servers, ports = [s for s, _ in started], [p for _, p in started]
        try:
            async with aio.insecure_channel(_ipv4(ports), options=RR_SERVICE_CONFIG) as ch:
                who = ch.unary_unary("/r/Who")
                counts = collections.Counter([(await who(b"", timeout=HANG_S)).decode()
                                              for _ in range(60)])
                _spread_ok(stack, counts, ["0", "1", "2"], 60)
                await servers[1].stop(None)
                counts = collections.Counter([(await who(b"", timeout=HANG_S)).decode()
                                              for _ in range(30)])
                assert set(k.split(":")[0] for k in counts) == {"0", "2"}, counts
                servers[1], _ = await serve("back", ports[1])
                deadline = time.monotonic() + HANG_S
                while not (await who(b"", timeout=HANG_S)).startswith(b"back"):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                if stack == "argrpc":
                    assert ch.transport == "shm"
        finally:
            for s in servers:
                await s.stop(None)

    asyncio.run(main())


@needs_test_hooks
@pytest.mark.parametrize("retries", ["transparent", "off"])
@pytest.mark.parametrize("api", ["threaded", "asyncio"])
def test_a_call_that_never_left_is_started_on_another_replica(api: str, retries: str) -> None:
    """One replica's connection fails between the balancer's pick and the call's start
    (the fail point `route`): the call never left, so it starts again on the next replica,
    as gRFC A6's transparent retries do (grpc's own calls cannot be stopped at that
    point: its outcome is that every call succeeds). grpc.enable_retries=0 turns them
    off: that one call ends UNAVAILABLE, as on a channel of its own."""
    options = RR_OPTION + ([("grpc.enable_retries", 0)] if retries == "off" else [])
    started = [_serve("argrpc", str(i)) for i in range(3)]
    target = _ipv4([p for _, p in started])

    def arm(ch: Any) -> None:
        subs = ch._balancer.subchannels()
        assert [s.transport() for s in subs] == ["shm"] * 3
        subs[1]._fast._probe_fail_at("route")

    def outcome(calls: list[Any]) -> collections.Counter[str]:
        return collections.Counter(c if isinstance(c, str) else c.split(":")[0]
                                   for c in calls)

    try:
        if api == "threaded":
            with argrpc.insecure_channel(target, options=options) as ch:
                who = ch.unary_unary("/r/Who")
                _count(who, 6)
                arm(ch)
                ends: list[Any] = []
                for _ in range(6):
                    try:
                        ends.append(who(b"", timeout=HANG_S).decode())
                    except grpc.RpcError as e:
                        ends.append(e.code().name)
        else:
            async def main() -> list[Any]:
                async with argrpc.aio.insecure_channel(target, options=options) as ch:
                    who = ch.unary_unary("/r/Who")
                    for _ in range(6):
                        await who(b"", timeout=HANG_S)
                    arm(ch)
                    out: list[Any] = []
                    for _ in range(6):
                        try:
                            out.append((await who(b"", timeout=HANG_S)).decode())
                        except grpc.aio.AioRpcError as e:
                            out.append(e.code().name)
                    return out
            ends = asyncio.run(main())
    finally:
        for s, _ in started:
            s.stop(None)
    counts = outcome(ends)
    if retries == "transparent":
        assert sum(counts.values()) == 6 and "UNAVAILABLE" not in counts, ends
    else:
        assert counts["UNAVAILABLE"] == 1 and sum(counts.values()) == 6, ends


# ---------------------------------------------------------------------- resolution, policy

@pytest.mark.parametrize("target, scheme, found, authority", [
    ("localhost:5", "dns", ["ipv4:127.0.0.1:5"], "localhost:5"),
    ("dns:///localhost:5", "dns", ["ipv4:127.0.0.1:5"], "localhost:5"),
    ("127.0.0.1:9", "dns", ["ipv4:127.0.0.1:9"], "127.0.0.1:9"),
    ("[::1]:9", "dns", ["ipv6:[::1]:9"], "[::1]:9"),
    ("localhost", "dns", ["ipv4:127.0.0.1:443"], "localhost"),
    ("ipv4:127.0.0.1:1,127.0.0.2:2", "ipv4", ["ipv4:127.0.0.1:1", "ipv4:127.0.0.2:2"],
     "127.0.0.1:1,127.0.0.2:2"),
    ("ipv6:[::1]:5,[::2]:6", "ipv6", ["ipv6:[::1]:5", "ipv6:[::2]:6"], "[::1]:5,[::2]:6"),
    ("unix:/tmp/s", "unix", ["unix:/tmp/s"], "localhost"),
    ("unix:///tmp/s", "unix", ["unix:/tmp/s"], "localhost"),
    ("unix-abstract:name", "unix-abstract", ["unix-abstract:name"], "localhost"),
    ("no-such-host.invalid:5", "dns", [], "no-such-host.invalid:5"),
])
def test_targets_resolve_as_grpc_resolves_them(target: str, scheme: str, found: list[str],
                                               authority: str) -> None:
    res = parse(target)
    assert (res.scheme, res.authority, res.unsupported) == (scheme, authority, "")
    got = addresses(res)
    if target.startswith("localhost"):  # /etc/hosts may add ::1
        assert found[0] in got
    else:
        assert got == found


def test_dns_is_resolved_again_no_more_often_than_grpc_allows() -> None:
    slow = Resolver(parse("localhost:5"), [])
    assert slow.resolve() and slow.again() is None  # default: 30 s apart
    fast = Resolver(parse("localhost:5"), [("grpc.dns_min_time_between_resolutions_ms", 0)])
    fast.resolve()
    assert fast.again() and fast.resolutions == 2
    static = Resolver(parse("ipv4:127.0.0.1:5"), [("grpc.dns_min_time_between_resolutions_ms", 0)])
    static.resolve()
    assert static.again() is None


@pytest.mark.parametrize("target, options, why", [
    ("xds:///service", [], "target scheme 'xds:' is resolved by grpc alone"),
    ("dns://8.8.8.8/localhost:5", [], "names DNS server 8.8.8.8"),
    ("localhost:5", [("grpc.lb_policy_name", "weighted_round_robin")],
     "load-balancing policy 'weighted_round_robin' (from grpc.lb_policy_name)"),
    ("localhost:5", [("grpc.service_config", '{"loadBalancingConfig": [{"ring_hash_experimental": {}}]}')],
     "'ring_hash_experimental' (from the service config's loadBalancingConfig)"),
])
def test_what_argrpc_does_not_resolve_or_balance_stays_on_grpc(target: str, options: Any,
                                                                why: str) -> None:
    with argrpc.insecure_channel(target, options=options) as ch:
        assert ch.transport == "grpc"
        assert why in ch.fallback_reason


def test_the_policy_is_chosen_as_grpc_chooses_it() -> None:
    sc = '{"loadBalancingConfig": [{"round_robin": {}}], "loadBalancingPolicy": "PICK_FIRST"}'
    assert lb_policy.choose([("grpc.service_config", sc),
                             ("grpc.lb_policy_name", "pick_first")]) == ("round_robin", "")
    assert lb_policy.choose([("grpc.lb_policy_name", "round_robin")]) == ("round_robin", "")
    assert lb_policy.choose([("grpc.service_config", '{"loadBalancingPolicy": "ROUND_ROBIN"}')]
                            ) == ("round_robin", "")
    assert lb_policy.choose([]) == ("pick_first", "")


@pytest.mark.parametrize("replicas", ["argrpc"], indirect=True)
def test_a_forked_child_balances_over_connections_of_its_own(replicas: Any) -> None:
    _, _, ports = replicas
    with argrpc.insecure_channel(_ipv4(ports), options=RR_OPTION) as ch:
        who = ch.unary_unary("/r/Who")
        _spread_ok("argrpc", _count(who, 30), ["0", "1", "2"], 30)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's connections are not its own
            code = 1
            try:
                counts = _count(who, 30)
                os.write(write, repr(dict(counts)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        got = os.read(read, 4096).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0, got
        _spread_ok("argrpc", collections.Counter(eval(got)), ["0", "1", "2"], 30)  # noqa: S307
        _spread_ok("argrpc", _count(who, 30), ["0", "1", "2"], 30)  # the parent's go on
