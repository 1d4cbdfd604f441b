"""argrpc._config: defaults, parsing, validation messages, options vs environment."""

from __future__ import annotations

import pytest

from argrpc import _config
from argrpc._config import Config, ConfigError, load

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for key in list(os.environ):
        if key.startswith("TF_RDMA_"):
            monkeypatch.delenv(key)


def test_defaults_are_the_tables() -> None:
    cfg = load()
    assert cfg == Config()
    for k in _config.TABLE:
        assert getattr(cfg, k.field) == k.default, k.name
    # run-time choices are None ("auto"), never a guess written down here
    assert cfg.dev_name is None and cfg.port_num is None and cfg.gid_index is None


@pytest.mark.parametrize("text,expected", [
    ("4194304", 4 * MiB), ("8K", 8 * KiB), ("8k", 8 * KiB), ("4M", 4 * MiB), ("4m", 4 * MiB),
    ("1G", GiB), ("1g", GiB), (" 2M ", 2 * MiB), ("64KiB", 64 * KiB), ("3MB", 3 * MiB),
])
def test_parse_size(text: str, expected: int) -> None:
    assert _config.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "4T", "-1K", "1.5M", "4 M B", "0x10", "abc"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        _config.parse_size(text)


def test_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "TF_RDMA_ENABLED": "off", "TF_RDMA_TRANSPORT": "SHM", "TF_RDMA_DEV_NAME": "rxe0",
        "TF_RDMA_CHUNK_SIZE": "1M", "TF_RDMA_ACC_SIZE": "16k", "TF_RDMA_BUF_SIZE": "2G",
        "TF_RDMA_RING_SIZE": "4M", "TF_RDMA_SPIN_US": "0", "TF_RDMA_READS_IN_FLIGHT": "8",
        "TF_RDMA_STREAM_WINDOW": "256K", "TF_RDMA_OVER_TLS": "yes",
    }.items():
        monkeypatch.setenv(key, value)
    assert load() == Config(enabled=False, transport="shm", dev_name="rxe0", chunk_size=MiB,
                            acc_size=16 * KiB, buf_size=2 * GiB, ring_size=4 * MiB, spin_us=0,
                            reads_in_flight=8, stream_window=256 * KiB, over_tls=True)


@pytest.mark.parametrize("text,value", [
    ("true", True), ("1", True), ("yes", True), ("on", True), ("TRUE", True),
    ("false", False), ("0", False), ("no", False), ("off", False), ("False", False),
])
def test_bools(monkeypatch: pytest.MonkeyPatch, text: str, value: bool) -> None:
    monkeypatch.setenv("TF_RDMA_ENABLED", text)
    assert load().enabled is value


def test_environment_read_at_load_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load().chunk_size == 4 * MiB
    monkeypatch.setenv("TF_RDMA_CHUNK_SIZE", "128K")
    assert load().chunk_size == 128 * KiB


def test_empty_env_value_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_RDMA_CHUNK_SIZE", "")
    assert load().chunk_size == 4 * MiB


# (variable, bad value, text the error must contain to say what is accepted)
BAD_VALUES = [
    ("TF_RDMA_ENABLED", "maybe", "true/false/1/0/yes/no/on/off"),
    ("TF_RDMA_ENABLED", "2", "true/false/1/0/yes/no/on/off"),
    ("TF_RDMA_TRANSPORT", "tcp", "auto, verbs, shm, grpc"),
    ("TF_RDMA_PORT_NUM", "0", "auto or a port number from 1 to 255"),
    ("TF_RDMA_PORT_NUM", "first", "auto or a port number from 1 to 255"),
    ("TF_RDMA_GID_INDEX", "-1", "auto or a GID table index from 0 to 65535"),
    ("TF_RDMA_GID_INDEX", "65536", "auto or a GID table index from 0 to 65535"),
    ("TF_RDMA_QPS", "0", "an integer from 1 to 16"),
    ("TF_RDMA_QPS", "17", "an integer from 1 to 16"),
    ("TF_RDMA_QP_TIMEOUT", "0", "an integer from 1 to 31"),
    ("TF_RDMA_QP_TIMEOUT", "32", "an integer from 1 to 31"),
    ("TF_RDMA_QP_RETRY", "8", "an integer from 0 to 7"),
    ("TF_RDMA_QP_RETRY", "-1", "an integer from 0 to 7"),
    ("TF_RDMA_CQ_DEPTH", "255", "an integer from 256 to 4194304"),
    ("TF_RDMA_CQ_DEPTH", "8K", "an integer from 256 to 4194304"),
    ("TF_RDMA_DEV_NAME", "   ", "non-empty"),
    ("TF_RDMA_CHUNK_SIZE", "abc", "from 64K to 1G"),
    ("TF_RDMA_CHUNK_SIZE", "32K", "from 64K to 1G"),
    ("TF_RDMA_CHUNK_SIZE", "2G", "from 64K to 1G"),
    ("TF_RDMA_CHUNK_SIZE", "-4M", "from 64K to 1G"),
    ("TF_RDMA_ACC_SIZE", "512", "from 1K to 1M"),
    ("TF_RDMA_ACC_SIZE", "2M", "from 1K to 1M"),
    ("TF_RDMA_ACC_SIZE", "8KB2", "from 1K to 1M"),
    ("TF_RDMA_BUF_SIZE", "32M", "from 64M to 64G"),
    ("TF_RDMA_BUF_SIZE", "65G", "from 64M to 64G"),
    ("TF_RDMA_BUF_SIZE", "1.5G", "from 64M to 64G"),
    ("TF_RDMA_RING_SIZE", "32K", "from 64K to 256M"),
    ("TF_RDMA_RING_SIZE", "512M", "from 64K to 256M"),
    ("TF_RDMA_RING_SIZE", "96K", "power of two"),
    ("TF_RDMA_SPIN_US", "-1", "from 0 to 100000"),
    ("TF_RDMA_SPIN_US", "100001", "from 0 to 100000"),
    ("TF_RDMA_SPIN_US", "5ms", "from 0 to 100000"),
    ("TF_RDMA_READS_IN_FLIGHT", "0", "from 1 to 64"),
    ("TF_RDMA_READS_IN_FLIGHT", "65", "from 1 to 64"),
    ("TF_RDMA_READS_IN_FLIGHT", "four", "from 1 to 64"),
    ("TF_RDMA_STREAM_WINDOW", "1K", "from 64K to 1G"),
    ("TF_RDMA_STREAM_WINDOW", "4G", "from 64K to 1G"),
    ("TF_RDMA_OVER_TLS", "sure", "true/false/1/0/yes/no/on/off"),
]


@pytest.mark.parametrize("name,value,accepted", BAD_VALUES)
def test_bad_env_values(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                        accepted: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load()
    msg = str(info.value)
    assert name in msg
    assert repr(value) in msg  # names the value too
    assert accepted in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name,value,accepted", [b for b in BAD_VALUES
                                                 if b[0] not in ("TF_RDMA_BUF_SIZE", "TF_RDMA_SPIN_US")])
def test_bad_option_values(name: str, value: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as info:
        load([(name, value)])
    assert name in str(info.value) and accepted in str(info.value)


def test_acc_size_limited_by_ring_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_RDMA_RING_SIZE", "64K")
    assert load().ring_size == 64 * KiB
    monkeypatch.setenv("TF_RDMA_ACC_SIZE", "32K")
    with pytest.raises(ConfigError) as info:
        load()
    msg = str(info.value)
    assert "TF_RDMA_ACC_SIZE" in msg and "TF_RDMA_RING_SIZE/4" in msg and "16K" in msg
    monkeypatch.setenv("TF_RDMA_ACC_SIZE", "16K")
    assert load().acc_size == 16 * KiB


def test_options_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_RDMA_CHUNK_SIZE", "1M")
    monkeypatch.setenv("TF_RDMA_ENABLED", "true")
    monkeypatch.setenv("TF_RDMA_TRANSPORT", "shm")
    cfg = load([("grpc.max_receive_message_length", 10), ("TF_RDMA_CHUNK_SIZE", "8M"),
                ("TF_RDMA_ENABLED", False), ("TF_RDMA_TRANSPORT", "grpc"),
                ("TF_RDMA_READS_IN_FLIGHT", 16), ("TF_RDMA_OVER_TLS", 1)])
    assert cfg.chunk_size == 8 * MiB
    assert cfg.enabled is False
    assert cfg.transport == "grpc"
    assert cfg.reads_in_flight == 16
    assert cfg.over_tls is True
    # a dict works as well; the last occurrence of a repeated key wins
    assert load({"TF_RDMA_ACC_SIZE": 4096}).acc_size == 4096
    assert load([("TF_RDMA_ACC_SIZE", "2K"), ("TF_RDMA_ACC_SIZE", "4K")]).acc_size == 4 * KiB


def test_bad_env_is_reported_even_if_an_option_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_RDMA_CHUNK_SIZE", "lots")
    with pytest.raises(ConfigError, match="TF_RDMA_CHUNK_SIZE"):
        load([("TF_RDMA_CHUNK_SIZE", "8M")])


@pytest.mark.parametrize("name", ["TF_RDMA_BUF_SIZE", "TF_RDMA_SPIN_US"])
def test_process_wide_knobs_rejected_as_options(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load([(name, "128M" if name.endswith("SIZE") else "10")])
    assert name in str(info.value) and "process-wide" in str(info.value)


def test_unknown_tf_rdma_option_rejected() -> None:
    with pytest.raises(ConfigError, match="TF_RDMA_CHUNKSIZE"):
        load([("TF_RDMA_CHUNKSIZE", "8M")])


def test_bad_option_types() -> None:
    for name, value in [("TF_RDMA_CHUNK_SIZE", 1.5), ("TF_RDMA_CHUNK_SIZE", True),
                        ("TF_RDMA_ENABLED", 2), ("TF_RDMA_TRANSPORT", 1), ("TF_RDMA_DEV_NAME", None)]:
        with pytest.raises(ConfigError, match=name):
            load([(name, value)])


def test_verbs_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_RDMA_TRANSPORT", "Verbs")
    monkeypatch.setenv("TF_RDMA_PORT_NUM", "2")
    monkeypatch.setenv("TF_RDMA_GID_INDEX", "3")
    monkeypatch.setenv("TF_RDMA_QPS", "8")
    monkeypatch.setenv("TF_RDMA_QP_TIMEOUT", "18")
    monkeypatch.setenv("TF_RDMA_QP_RETRY", "7")
    monkeypatch.setenv("TF_RDMA_CQ_DEPTH", "65536")
    cfg = load()
    assert (cfg.transport, cfg.port_num, cfg.gid_index, cfg.qps) == ("verbs", 2, 3, 8)
    assert (cfg.qp_timeout, cfg.qp_retry, cfg.cq_depth) == (18, 7, 65536)
    # `auto` (and an option) gives the choice back to argrpc
    cfg = load([("TF_RDMA_PORT_NUM", "auto"), ("TF_RDMA_GID_INDEX", "AUTO"), ("TF_RDMA_QPS", 1)])
    assert (cfg.port_num, cfg.gid_index, cfg.qps) == (None, None, 1)
    assert load([("TF_RDMA_GID_INDEX", 0)]).gid_index == 0


def test_split_options() -> None:
    opts = [("grpc.max_receive_message_length", 100), ("TF_RDMA_CHUNK_SIZE", "8M"),
            ("grpc.primary_user_agent", "x"), ("tf_rdma_enabled", "0")]
    grpc_opts, ours = _config.split_options(opts)
    assert grpc_opts == [("grpc.max_receive_message_length", 100), ("grpc.primary_user_agent", "x")]
    assert ours == [("TF_RDMA_CHUNK_SIZE", "8M"), ("tf_rdma_enabled", "0")]
    assert _config.split_options(None) == ([], [])
    assert _config.split_options(()) == ([], [])
    # option keys are case-insensitive like the split
    assert load(ours) == Config(chunk_size=8 * MiB, enabled=False)


def test_message_lengths() -> None:
    assert _config.max_receive_length(None) == 4 * MiB
    assert _config.max_send_length(None) == -1
    opts = [("grpc.max_receive_message_length", 100), ("grpc.max_send_message_length", 200)]
    assert _config.max_receive_length(opts) == 100
    assert _config.max_send_length(opts) == 200
    assert _config.max_receive_length([("grpc.max_receive_message_length", -1)]) == -1
    assert _config.max_receive_length([("grpc.max_receive_message_length", 1),
                                       ("grpc.max_receive_message_length", 2)]) == 2
    with pytest.raises(ConfigError, match="grpc.max_send_message_length"):
        _config.max_send_length([("grpc.max_send_message_length", "lots")])


def test_engine_and_conn_config() -> None:
    cfg = load([("TF_RDMA_QP_RETRY", "3"), ("TF_RDMA_CHUNK_SIZE", "1M")])
    assert _config.engine_config(cfg) == {
        "buf_size": cfg.buf_size, "spin_us": cfg.spin_us, "malloc_tuning": 1}
    conn = _config.conn_config(cfg, 4 * MiB)
    assert conn["chunk_size"] == MiB and conn["qp_retry"] == 3 and conn["max_recv"] == 4 * MiB
    assert set(conn) == {k.field for k in _config.TABLE
                         if k.engine in ("ConnConfig", "VerbsConfig")} | {"max_recv"}
    assert _config.conn_config(cfg, -1)["max_recv"] == -1


def test_knob_table() -> None:
    names = [k[0] for k in _config.KNOBS]
    assert names == ["TF_RDMA_ENABLED", "TF_RDMA_TRANSPORT", "TF_RDMA_DEV_NAME",
                     "TF_RDMA_PORT_NUM", "TF_RDMA_GID_INDEX", "TF_RDMA_QPS",
                     "TF_RDMA_QP_TIMEOUT", "TF_RDMA_QP_RETRY", "TF_RDMA_CQ_DEPTH",
                     "TF_RDMA_CHUNK_SIZE", "TF_RDMA_ACC_SIZE", "TF_RDMA_BUF_SIZE",
                     "TF_RDMA_RING_SIZE", "TF_RDMA_SPIN_US", "TF_RDMA_READS_IN_FLIGHT",
                     "TF_RDMA_STREAM_WINDOW", "TF_RDMA_KEEPALIVE_TIMEOUT_MS", "TF_RDMA_ZERO_COPY_MIN",
                     "TF_RDMA_OVER_TLS", "TF_RDMA_MALLOC_TUNING"]
    assert all(len(k) == 3 and all(isinstance(x, str) and x for x in k) for k in _config.KNOBS)
    table = _config.knob_table_markdown()
    lines = table.strip().splitlines()
    assert lines[0].startswith("| variable | default |")
    assert len(lines) == 2 + len(names)
    for name, default, _ in _config.KNOBS:
        assert any(f"`{name}`" in line and default in line for line in lines)
