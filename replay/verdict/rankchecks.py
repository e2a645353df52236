"""The words a person reads about gate-check's check of the ranks (pure): an environment, a
field a rank differs in, the probes' figures, a slow finding and a straggler."""

from __future__ import annotations

from collections.abc import Mapping

from lifecycle.core.format import events as ev
from lifecycle.core.format.kinds.rankevents import (
    LinkFigure,
    RankEnvironment,
)
from lifecycle.core.format.text import format_bytes
from lifecycle.core.format.view import RankView
from lifecycle.verdict.evidence import EnvironmentDiffers, SlowAtGate, Straggling
from lifecycle.verdict.rankchecks import group_differences

# What --on-slow-rank made of a slow finding.
_ACTIONS = {"warn": "warned", "fail": "failed the startup"}


def duration_text(seconds: float) -> str:
    """A probe's or a lag's time: in ms below a second (one unit, so that a figure and its
    median compare at a glance), three decimals below a tenth of one."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e3:.3f} ms"


def size_text(n: float) -> str:
    """Bytes as a person reads them, KiB below a MiB (a link probe sends a few hundred)."""
    return f"{n / 2**10:.0f} KiB" if abs(n) < 2**20 else format_bytes(int(n))


def speed_text(flop: int, seconds: float) -> str:
    """The compute probe's speed: GFLOP/s, TFLOP/s from a thousand GFLOP/s on."""
    if seconds <= 0:
        return "no speed (the figure is not a time)"
    speed = flop / seconds / 1e9
    return f"{speed / 1e3:.1f} TFLOP/s" if speed >= 1e3 else f"{speed:.1f} GFLOP/s"


def gflops(flop: int, seconds: float) -> float | None:
    return flop / seconds / 1e9 if seconds > 0 else None


def compute_text(probed: ev.RankProbed) -> str:
    speed = speed_text(probed.compute_flop, probed.compute_s)
    return f"compute {duration_text(probed.compute_s)} ({speed})"


def link_text(link: LinkFigure) -> str:
    """'ulysses0 4.42 ms for 256 KiB (57 MiB/s)'."""
    if link.seconds <= 0:
        return f"{link.group} not a time"
    rate = size_text(link.bytes / link.seconds)
    return f"{link.group} {duration_text(link.seconds)} for {size_text(link.bytes)} ({rate}/s)"


def probe_text(probed: ev.RankProbed) -> str:
    """A rank's probe figures on one line: its compute, then each of its groups' links."""
    links = ", ".join(map(link_text, probed.links))
    return compute_text(probed) + (f"; links {links}" if links else "")


def environment_text(environment: RankEnvironment) -> str:
    """What a rank runs on, the fields it cannot tell left out: 'torch 2.13.0+cpu, python
    3.11.7, cpu AMD EPYC (AVX2), 23.54 GiB'; CUDA, NCCL and the driver on CUDA."""
    e = environment
    cuda = bool(e.cuda)
    device = e.device if cuda else f"cpu {e.device}"
    capability = f"capability {e.capability}" if cuda else e.capability
    parts = [
        f"torch {e.torch}" if e.torch else "",
        f"CUDA {e.cuda}" if e.cuda else "",
        f"NCCL {e.nccl}" if e.nccl else "",
        f"driver {e.driver}" if e.driver else "",
        f"python {e.python}" if e.python else "",
        device + (f" ({capability})" if e.capability else "") if e.device else "",
        format_bytes(e.memory_bytes) if e.memory_bytes > 0 else "",
        f"dtype {e.dtype}" if e.dtype else "",
    ]
    return ", ".join(p for p in parts if p) or "nothing it could tell"


def _value(field: str, value: str) -> str:
    if not value:
        return "none"
    if field == "memory_bytes" and value.isdigit():
        return format_bytes(int(value))
    return value


def _field(field: str) -> str:
    return "memory" if field == "memory_bytes" else field


def difference_text(
    field: str, value: str, expected: str, expected_ranks: tuple[int, ...], *, matters: bool
) -> str:
    """'torch 2.99.0 (rank 0: 2.13.0+cpu), fails the startup'; 'driver 999 (rank 0: none),
    warned'."""
    whose = ("rank " if len(expected_ranks) == 1 else "ranks ") + ", ".join(
        map(str, expected_ranks)
    )
    peers = f"{whose}: " if expected_ranks else "most ranks: "
    return (
        f"{_field(field)} {_value(field, value)} ({peers}{_value(field, expected)}),"
        f" {'fails the startup' if matters else 'warned'}"
    )


def slow_text(slow: SlowAtGate | ev.SlowRank) -> str:
    """'compute 1.66 ms against the median 0.65 ms: 0.39 of the median's speed (threshold
    0.7), warned'."""
    what = "compute" if slow.measure == "compute" else f"link {slow.group}"
    return (
        f"{what} {duration_text(slow.figure_s)} against the median"
        f" {duration_text(slow.median_s)}: {slow.ratio:.2f} of the median's speed (threshold"
        f" {slow.threshold:g}), {_ACTIONS.get(slow.action, slow.action)}"
    )


def straggler_text(group: str, median_lag_s: float, requests: int) -> str:
    """'enters ulysses0's collectives 5.61 ms after its peers, median of the last 5 requests'."""
    return (
        f"enters {group}'s collectives {duration_text(median_lag_s)} after its peers,"
        f" median of the last {requests} requests"
    )


def evidence_note(
    item: EnvironmentDiffers | SlowAtGate | Straggling, views: Mapping[int, RankView]
) -> str:
    """A rank-check evidence item as a part of its rank's note."""
    match item:
        case EnvironmentDiffers():
            expected = next(
                (d.expected_ranks for d in group_differences(views) if d.field == item.field),
                (),
            )
            text = difference_text(
                item.field, item.value, item.expected, expected, matters=item.matters
            )
            return f"environment differs: {text}"
        case SlowAtGate():
            return f"slow at gate-check: {slow_text(item)}"
        case Straggling():
            return "straggler: " + straggler_text(item.group, item.median_lag_s, item.requests)
