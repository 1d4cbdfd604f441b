"""The engine's messages go through Python's logging (argrpc/_log.py, csrc/common/log.h):
the ``argrpc.engine`` logger, at the engine's level, controlled by the standard logging
configuration; never straight to stderr once the process takes them; bounded when
nobody keeps up; a forked child takes its own. Each case runs in a fresh interpreter
(the taker is per process)."""
from __future__ import annotations

import json
import textwrap

from tests.support.procs import run_python
from tests.support.hooks import needs_test_hooks

# Starts the engine the facade's way, which starts the taker, and records what the
# "argrpc.engine" logger emits.
PRELUDE = textwrap.dedent("""
    import json, logging, os, sys, threading, time
    from argrpc import _core, _engine
    from argrpc import _config
    records = []
    class Keep(logging.Handler):
        def emit(self, r):
            records.append((r.name, r.levelno, r.getMessage()))
    logging.getLogger("argrpc").addHandler(Keep())
    logging.getLogger("argrpc").setLevel(logging.DEBUG)
    _engine.get_engine(_config.load())
    def wait_for(pred, s=10.0):
        end = time.monotonic() + s
        while not pred() and time.monotonic() < end:
            time.sleep(0.01)
        return pred()
""")


def run(body: str) -> tuple[dict, str]:
    proc = run_python(PRELUDE + textwrap.dedent(body))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


def test_engine_messages_reach_the_argrpc_engine_logger_at_their_level() -> None:
    result, stderr = run("""
        for level in (10, 20, 30, 40):
            _core._log_for_test(level, f"message at {level} \\xff")
        ok = wait_for(lambda: len(records) >= 4)
        print("RESULT " + json.dumps({"ok": ok, "records": records}))
    """)
    assert result["ok"], result
    assert result["records"] == [["argrpc.engine", lvl, f"message at {lvl} \xff"]
                                 for lvl in (10, 20, 30, 40)]
    # Taken by logging, so not printed by the engine as well.
    assert "message at 30" not in stderr and "message at 40" not in stderr, stderr


def test_the_logging_configuration_decides_what_is_shown() -> None:
    # No handler of the application's: Python's last resort prints warnings and errors
    # to stderr; a level set on the "argrpc" logger silences the engine too.
    script = textwrap.dedent("""
        import logging, sys, time
        from argrpc import _core, _engine
        from argrpc import _config
        if sys.argv[-1] == "quiet":
            logging.getLogger("argrpc").setLevel(logging.CRITICAL)
        _engine.get_engine(_config.load())
        _core._log_for_test(20, "just info")
        _core._log_for_test(30, "a warning from the engine")
        time.sleep(0.5)
    """)
    loud = run_python(script + "\n")
    assert loud.returncode == 0, loud.stderr
    assert "a warning from the engine" in loud.stderr and "just info" not in loud.stderr
    quiet = run_python(script.replace('sys.argv[-1] == "quiet"', "True"))
    assert quiet.returncode == 0, quiet.stderr
    assert "a warning from the engine" not in quiet.stderr, quiet.stderr


def test_without_a_taker_warnings_still_reach_stderr() -> None:
    # A process that never started the facade's engine (a C++-only user of _core, or a
    # child that has not made its own yet) still sees warnings and errors.
    proc = run_python(textwrap.dedent("""
        from argrpc import _core
        _core._log_for_test(10, "debug nobody takes")
        _core._log_for_test(40, "an error nobody takes")
    """))
    assert proc.returncode == 0, proc.stderr
    assert "argrpc ERROR: an error nobody takes" in proc.stderr
    assert "debug nobody takes" not in proc.stderr


def test_a_stalled_handler_bounds_the_queue_and_says_what_was_dropped() -> None:
    result, _ = run("""
        gate = threading.Event()
        class Stall(logging.Handler):
            def emit(self, r):
                if r.getMessage() == "first":
                    gate.wait(30)
        logging.getLogger("argrpc.engine").addHandler(Stall())
        _core._log_for_test(30, "first")
        wait_for(lambda: any(m == "first" for _, _, m in records))
        for i in range(6000):
            _core._log_for_test(20, f"burst {i}")
        gate.set()
        wait_for(lambda: any("dropped" in m for _, _, m in records))
        time.sleep(0.5)
        burst = [m for _, _, m in records if m.startswith("burst ")]
        dropped = [m for _, lvl, m in records if "dropped" in m and lvl == 30]
        print("RESULT " + json.dumps({"burst": len(burst), "dropped": dropped,
                                      "last": burst[-1] if burst else None}))
    """)
    assert result["burst"] == 4096, result
    assert result["dropped"] == ["1904 engine messages were dropped (nobody took them in time)"]
    assert result["last"] == "burst 4095"


@needs_test_hooks
def test_a_failed_connection_with_calls_in_flight_is_a_warning() -> None:
    # A real engine message: a fabric write fails under calls in flight (the test fabric
    # injects it), and the connection's failure names the calls it ended.
    result, stderr = run("""
        srv = _core.Server(_engine.peek_engine(), {})
        client, served, link = _core._sim_pair(_engine.peek_engine(), srv,
                                               {"client": {"fail_write": 2}}, {})
        calls = [client.start_call("/x.Y/Z", [], 10.0) for _ in range(3)]
        for c in calls:
            c.send(b"abc")
        for c in calls:
            c.status(10.0)
        wait_for(lambda: any("calls affected" in m for _, _, m in records))
        client.close(); served.close(); srv.shutdown()
        print("RESULT " + json.dumps({"records": records}))
    """)
    warned = [m for name, lvl, m in result["records"]
              if name == "argrpc.engine" and lvl == 30 and "calls affected" in m]
    assert warned and "(3 calls affected)" in warned[0], result
    assert "calls affected" not in stderr, stderr


@needs_test_hooks
def test_a_call_whose_status_went_out_is_neither_lost_nor_cancelled() -> None:
    # The server's connection fails right after a call's status went out and before the
    # serving thread has ended the call, as when a client exits the moment it has its
    # answer (processes connecting, calling once and exiting hit it a few times in a
    # hundred). The call is complete: no warning about lost calls, no cancellation
    # reported to the server, and the server's record of it says OK.
    result, stderr = run("""
        _core.set_call_stats(True)
        srv = _core.Server(_engine.peek_engine(), {})
        client, served, link = _core._sim_pair(_engine.peek_engine(), srv, {}, {})
        served._probe_fail_at("finished")
        call = client.start_call("/x.Y/Z", [], 10.0)
        call.send(b"abc")
        call.half_close()
        sc = srv.accept(10.0)
        got = bytes(sc.recv())
        finished = sc.finish(0, "", [], got)
        wait_for(lambda: not served.alive)
        event = srv.next_event(0.5)[0]
        wait_for(lambda: any("test fail point" in m for _, _, m in records))
        calls, _ = _core._take_call_stats(1000)
        ended = [r[3] for r in calls if r[0] == 3]
        client.close(); served.close(); srv.shutdown()
        print("RESULT " + json.dumps({"finished": finished, "event": event,
                                      "server_ended": ended, "records": records}))
    """)
    assert result["finished"] is True, result
    assert result["event"] == "none", result  # not "cancelled"
    assert result["server_ended"] == [0], result
    failed = [(lvl, m) for name, lvl, m in result["records"] if "test fail point" in m]
    assert failed == [(10, "argrpc: connection failed at a test fail point (0 calls affected)")], result
    assert "affected" not in stderr, stderr


def test_a_forked_child_takes_its_own_messages() -> None:
    result, _ = run("""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            records.clear()
            _engine.get_engine(_config.load())  # the child's own engine and taker
            _core._log_for_test(30, "from the child")
            ok = wait_for(lambda: ("argrpc.engine", 30, "from the child") in records, 10)
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.waitpid(pid, 0)
        _core._log_for_test(30, "from the parent")
        ok = wait_for(lambda: ("argrpc.engine", 30, "from the parent") in records)
        print("RESULT " + json.dumps({"child": got == b"1", "parent": ok}))
    """)
    assert result == {"child": True, "parent": True}


@needs_test_hooks
def test_a_client_that_closes_with_a_call_open_loses_no_call() -> None:
    # A channel closed while one of its streams is still open (clients of many frameworks
    # do it every time): as with grpc the server sees that call CANCELLED, and the hang-up
    # that follows finds nothing to lose, so nothing is logged above DEBUG.
    result, stderr = run("""
        srv = _core.Server(_engine.peek_engine(), {})
        client, served, link = _core._sim_pair(_engine.peek_engine(), srv, {}, {})
        call = client.start_call("/x.Y/Z", [], 10.0)
        call.send(b"abc")
        sc = srv.accept(10.0)
        got = bytes(sc.recv())
        client.close()
        ended = call.status(10.0)
        wait_for(lambda: not served.alive)
        event = srv.next_event(5.0)[0]
        wait_for(lambda: any("affected" in m for _, _, m in records))
        served.close(); srv.shutdown()
        print("RESULT " + json.dumps({"got": got.decode(), "ended": list(ended[:2]),
                                      "event": event, "records": records}))
    """)
    assert result["got"] == "abc", result
    assert result["ended"] == [1, "Channel closed!"], result  # CANCELLED
    assert result["event"] == "cancelled", result
    loud = [(lvl, m) for name, lvl, m in result["records"] if lvl > 10]
    assert not loud, result
    assert "affected" not in stderr, stderr
