"""examples/prometheus_metrics: argrpc's metrics published for Prometheus, scraped here
over HTTP as a Prometheus server would."""
from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import pytest

from tests.support.procs import REPO_ROOT, child_env

pytest.importorskip("prometheus_client", reason="needs prometheus-client (argrpc[test])")
pytest.importorskip("opentelemetry.exporter.prometheus",
                    reason="needs opentelemetry-exporter-prometheus (argrpc[test])")

CALLS = 25


def _value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels...}` (labels a subset of the sample's) in an exposition."""
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_prometheus_scrapes_argrpcs_metrics() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.prometheus_metrics.serve", "--port", "0", "--calls",
         str(CALLS), "--large-mib", "4", "--linger", "60"],
        cwd=REPO_ROOT, env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert proc.stdout is not None
        transport = proc.stdout.readline().split()
        url = proc.stdout.readline().split()
        assert transport == ["transport", "shm"], (transport, proc.stderr)
        assert url[0] == "SCRAPE", url
        with urllib.request.urlopen(url[1], timeout=30) as response:
            text = response.read().decode()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    method = {"grpc_method": "demo.Echo/Echo"}
    # grpc's per-call metrics under the names Prometheus gives grpc's own plugin's
    assert _value(text, "grpc_client_attempt_started_total", **method) == CALLS + 1
    assert _value(text, "grpc_client_attempt_duration_seconds_count", grpc_status="OK",
                  **method) == CALLS + 1
    assert _value(text, "grpc_server_call_duration_seconds_count", grpc_status="OK",
                  **method) == CALLS + 1
    assert _value(text, "grpc_client_call_duration_seconds_count", grpc_status="OK",
                  **method) == CALLS + 1
    sent = _value(text, "grpc_client_attempt_sent_total_compressed_message_size_bytes_sum",
                  grpc_status="OK", **method)
    assert sent == CALLS * 64 + (4 << 20)
    # argrpc's own, by transport and path
    assert _value(text, "argrpc_transport_bytes_total", argrpc_transport="shm",
                  argrpc_path="rendezvous", argrpc_direction="sent") >= 2 * (4 << 20)
    assert _value(text, "argrpc_transport_bytes_total", argrpc_transport="shm",
                  argrpc_path="eager", argrpc_direction="received") >= 2 * CALLS * 64
    assert _value(text, "argrpc_connections_open", argrpc_transport="shm") == 2
    assert _value(text, "argrpc_pool_capacity_bytes") > 0
