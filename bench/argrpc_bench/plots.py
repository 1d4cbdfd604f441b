"""PNG plots: latency vs size, bandwidth vs size, PS throughput per transport.

Uses matplotlib's object API on the Agg canvas (no pyplot, no global state, no display),
so plotting works on a headless machine and in threads. matplotlib is optional: without
it ``write_plots`` raises ``PlotsUnavailable`` and the CLI says so and skips the PNGs.
"""
from __future__ import annotations

import os
from typing import Any, Sequence, cast

from argrpc_bench import APIS, MODES, TRANSPORTS
from argrpc_bench.report import BASELINE, env_label, fmt_ratio, fmt_size, speedup, \
    baseline_of
from argrpc_bench.results import Measurement

# One colour per transport, the same in every plot; line style per mode and API.
_COLOURS = {"grpc": "#7f7f7f", "shm": "#1f77b4", "verbs": "#d62728"}
_STYLES = {("threaded", "raw"): "-", ("threaded", "serialized"): "--",
           ("aio", "raw"): ":", ("aio", "serialized"): "-."}
_DPI = 110


class PlotsUnavailable(RuntimeError):
    pass


def _figure(width: float = 7.5, height: float = 4.6) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # optional dependency (the pyproject extra "bench")
        raise PlotsUnavailable("matplotlib is not installed: pip install matplotlib") from e
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _style(m: Measurement) -> str:
    return _STYLES.get((m.api, m.mode), "-")


def _series_label(m: Measurement, vary: set[str]) -> str:
    parts = [m.transport if m.api == "threaded" else f"{m.api} {m.transport}"]
    if "mode" in vary:
        parts.append(m.mode)
    if "scheme" in vary:
        parts.append(m.scheme)
    if "buffers" in vary:
        parts.append(f"{m.buffers} buf")
    if "env" in vary:
        parts.append(env_label(m.env))
    return ", ".join(parts)


def _varying(ms: Sequence[Measurement]) -> set[str]:
    vary = set()
    for attr in ("mode", "scheme", "buffers"):
        if len({getattr(m, attr) for m in ms}) > 1:
            vary.add(attr)
    if len({tuple(sorted(m.env.items())) for m in ms}) > 1:
        vary.add("env")
    return vary


def _series(ms: Sequence[Measurement]) -> dict[tuple[Any, ...], list[Measurement]]:
    """Measurements grouped into lines: everything but the size fixed."""
    out: dict[tuple[Any, ...], list[Measurement]] = {}
    for m in ms:
        key = (TRANSPORTS.index(m.transport) if m.transport in TRANSPORTS else 99,
               m.transport, MODES.index(m.mode) if m.mode in MODES else 99, m.mode,
               APIS.index(m.api) if m.api in APIS else 99, m.api, m.concurrency,
               m.scheme, m.buffers, tuple(sorted(m.env.items())))
        out.setdefault(key, []).append(m)
    return {k: sorted(v, key=lambda m: m.size) for k, v in sorted(out.items())}


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_size(s) for s in ticks], rotation=30 if len(ticks) > 5 else 0)
    ax.minorticks_off()
    ax.set_xlabel("message size")


def plot_latency(ms: Sequence[Measurement], path: str) -> str | None:
    # calls in flight at once have a latency under load, not a round trip: not plotted
    data = [m for m in ms if m.benchmark == "latency" and not m.skipped
            and m.p50_us is not None and m.concurrency == 1]
    if not data:
        return None
    fig = _figure(9.5, 4.8)
    ax = fig.add_subplot()
    vary = _varying(data)
    for (_, transport, *_), line in _series(data).items():
        xs = [m.size for m in line]
        colour = _COLOURS.get(transport, None)
        style = _style(line[0])
        ax.plot(xs, [m.p50_us for m in line], style, marker="o", color=colour,
                label=_series_label(line[0], vary) + " p50")
        p99 = [(m.size, m.p99_us) for m in line if m.p99_us is not None]
        if p99:
            ax.plot([p[0] for p in p99], [p[1] for p in p99], style, marker="v",
                    color=colour, alpha=0.45, linewidth=1,
                    label=_series_label(line[0], vary) + " p99")
    _size_axis(ax, [m.size for m in data])
    ax.set_yscale("log")
    ax.set_ylabel("round-trip latency, µs (log; lower is better)")
    ax.set_title("Latency vs message size (ping-pong echo)")
    ax.grid(True, which="major", alpha=0.3)
    # outside the axes: p50 and p99 lines of several series fill the plot area
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_bandwidth(ms: Sequence[Measurement], path: str) -> str | None:
    data = [m for m in ms if m.benchmark == "bandwidth" and not m.skipped
            and m.gbps is not None]
    if not data:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    vary = _varying(data)
    for (_, transport, *_), line in _series(data).items():
        ax.plot([m.size for m in line], [m.gbps for m in line], _style(line[0]),
                marker="o", color=_COLOURS.get(transport), label=_series_label(line[0], vary))
    _size_axis(ax, [m.size for m in data])
    ax.set_yscale("log")
    ax.set_ylabel("payload GB/s (log; higher is better)")
    ax.set_title("One-way bandwidth vs message size")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_ps(ms: Sequence[Measurement], path: str) -> str | None:
    """Grouped bars: one group per (mode, scheme, workers, env), one bar per transport,
    labelled with steps/s and the speedup over grpc."""
    data = [m for m in ms if m.benchmark == "ps" and not m.skipped
            and m.steps_per_s is not None]
    if not data:
        return None
    groups: dict[tuple[Any, ...], list[Measurement]] = {}
    for m in data:
        key = (MODES.index(m.mode) if m.mode in MODES else 99, m.mode, m.scheme,
               m.workers or 0, tuple(sorted(m.env.items())))
        groups.setdefault(key, []).append(m)
    transports = [t for t in TRANSPORTS if any(m.transport == t for m in data)]
    fig = _figure(max(5.0, 2.2 + 2.2 * len(groups)), 4.6)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(transports))
    labels = []
    top = max(m.steps_per_s or 0.0 for m in data)
    for gi, (key, members) in enumerate(sorted(groups.items())):
        _, mode, scheme, workers, env = key
        labels.append(f"{mode}, {scheme}\n{workers} workers"
                      + (f"\n{env_label(dict(env))}" if env else ""))
        for ti, t in enumerate(transports):
            bar = next((x for x in members if x.transport == t), None)
            if bar is None:
                continue
            steps = cast(float, bar.steps_per_s)  # `data` holds only measured runs
            x = gi + (ti - (len(transports) - 1) / 2) * width
            ax.bar(x, steps, width * 0.9, color=_COLOURS.get(t),
                   label=t if gi == 0 else None)
            r = speedup(bar, baseline_of(bar, data), "steps_per_s")
            text = f"{steps:.3g}/s" + \
                (f"\n{fmt_ratio(r)} grpc" if r is not None and t != BASELINE else "")
            ax.text(x, steps + top * 0.01, text, ha="center", va="bottom",
                    fontsize="small")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("steps/s (higher is better)")
    ax.set_title("Parameter-server throughput per transport")
    ax.grid(True, axis="y", alpha=0.3)
    handles, leg = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, leg, fontsize="small")
    return _save(fig, path)


def _save(fig: Any, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


def write_plots(ms: Sequence[Measurement], out_dir: str) -> list[str]:
    """Writes latency.png, bandwidth.png, ps.png (those with data); returns their paths."""
    written = []
    for name, fn in (("latency", plot_latency), ("bandwidth", plot_bandwidth),
                     ("ps", plot_ps)):
        p = fn(ms, os.path.join(out_dir, f"{name}.png"))
        if p:
            written.append(p)
    return written
