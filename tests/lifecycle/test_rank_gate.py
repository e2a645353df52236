"""gate-check checks the ranks (docs/ranks.md, "The gate checks the ranks"): environments
compared, each rank's compute and each group's link probed against the median, a slow rank
warned of or failed on; the slow fault; each request's lag, and the straggler named from it.

The boots here are real `lifecycle boot` processes on gloo. A rank's environment is made to
differ through the test hook LIFECYCLE_TEST_RANK_ENVIRONMENT (one machine cannot run two
torch versions); a slow device through the `slow` fault, which idles the rank (FACTOR - 1)
times its own compute: no CUDA device exists here."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.decisions.rankcheck import (
    ProbeFigures,
    best_of,
    cross_host_partners,
    describe_slow,
    environment_differences,
    environment_failure,
    slow_findings,
    unusable_figure,
)
from lifecycle.core.decisions.stragglers import entry_lags, straggler
from lifecycle.core.errors import ConfigError, FaultSpecError
from lifecycle.core.format import events as ev
from lifecycle.core.format.kinds.rankevents import RankEnvironment
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.faults import FaultKind, parse_fault
from tests.conftest import Completed, run_cli
from tests.support.serving import journal_events

BOOT_S = 300.0
BASE = RankEnvironment(
    host="h", torch="2.13.0", cuda="12.8", nccl="2.27.3", driver="570.1", python="3.11.7",
    device="NVIDIA H100", capability="9.0", memory_bytes=80 << 30, dtype="bfloat16",
)  # fmt: skip


def env(**changed: object) -> RankEnvironment:
    from dataclasses import replace

    return replace(BASE, **changed)  # type: ignore[arg-type]


def test_a_difference_that_changes_numerics_fails_naming_rank_field_and_both_values() -> None:
    found = environment_differences([env(), env(nccl="2.31.0"), env(), env()])
    (difference,) = found
    assert (difference.field, difference.matters, difference.ranks) == ("nccl", True, (1,))
    line = environment_failure(found)
    assert line is not None
    assert "rank 1 runs nccl 2.31.0; ranks 0, 2, 3 run 2.27.3" in line
    assert "culprit: rank 1" in line


def test_a_difference_that_does_not_change_numerics_is_only_a_warning() -> None:
    found = environment_differences([env(), env(driver="570.2", memory_bytes=40 << 30)])
    assert {d.field for d in found} == {"driver", "memory_bytes"}
    assert not any(d.matters for d in found)
    assert environment_failure(found) is None


def test_on_a_tie_rank_0s_value_is_the_expected_one() -> None:
    (difference,) = environment_differences([env(torch="2.13.0"), env(torch="2.12.0")])
    assert (difference.expected, difference.ranks, difference.values) == (
        "2.13.0", (1,), ("2.12.0",),
    )  # fmt: skip


def test_a_slow_rank_is_found_against_the_median_at_two_and_four_ranks() -> None:
    pair = [ProbeFigures(rank=r, compute_s=s, links={}) for r, s in ((0, 0.002), (1, 0.008))]
    two = slow_findings(pair, threshold=0.7)
    assert [(f.rank, f.measure) for f in two] == [(1, "compute")]
    assert two[0].ratio == pytest.approx((2 / (1 / 0.002 + 1 / 0.008)) / 0.008)
    four = [ProbeFigures(rank=r, compute_s=0.002, links={}) for r in range(4)]
    four[2] = ProbeFigures(rank=2, compute_s=0.0025, links={})  # 0.8 of the median: not slow
    assert slow_findings(four, threshold=0.7) == ()
    four[3] = ProbeFigures(rank=3, compute_s=0.01, links={})
    assert [f.rank for f in slow_findings(four, threshold=0.7)] == [3]


def test_a_slow_link_names_the_members_of_the_group_slower_than_its_kind() -> None:
    def ranks(ulysses: float) -> list[ProbeFigures]:
        # 4 ranks, CFG 2 x Ulysses 2: ulysses0 = {0, 1}, ulysses1 = {2, 3}
        return [
            ProbeFigures(
                rank=r,
                compute_s=0.002,
                links={f"ulysses{r // 2}": ulysses if r < 2 else 0.001, f"cfg{r % 2}": 0.001},
            )
            for r in range(4)
        ]

    assert slow_findings(ranks(0.0012), threshold=0.7) == ()
    found = slow_findings(ranks(0.01), threshold=0.7)
    assert [(f.rank, f.measure, f.group) for f in found] == [
        (0, "link", "ulysses0"), (1, "link", "ulysses0"),
    ]  # fmt: skip


def test_a_slow_link_names_its_member_slow_in_compute_not_the_ones_that_waited_for_it() -> None:
    """Rank 1 slow in compute makes its group cfg1 = {1, 3} slow too: the link's finding names
    rank 1, not rank 3, which waited for it; a slow link with no member slow in compute still
    names every member."""
    figures = [
        ProbeFigures(rank=r, compute_s=0.008 if r == 1 else 0.002,
                     links={f"ulysses{r // 2}": 0.001, f"cfg{r % 2}": 0.01 if r % 2 else 0.002})
        for r in range(4)
    ]  # fmt: skip
    found = slow_findings(figures, threshold=0.7)
    assert [(f.rank, f.measure, f.group) for f in found] == [
        (1, "compute", "world"), (1, "link", "cfg1"),
    ]  # fmt: skip
    figures[1] = ProbeFigures(rank=1, compute_s=0.002, links=figures[1].links)
    found = slow_findings(figures, threshold=0.7)
    assert [(f.rank, f.group) for f in found] == [(1, "cfg1"), (3, "cfg1")]


def test_a_second_round_keeps_each_ranks_best_figure_measure_by_measure() -> None:
    """A rank measured slow in one round and not in the other is not slow; one slow in both
    is (best_of, the rounds gate-check runs when a round finds a rank slow)."""

    def rnd(slow: dict[int, float], crossing: float | None = None) -> list[ProbeFigures]:
        return [
            ProbeFigures(rank=r, compute_s=slow.get(r, 0.002), links={"ulysses0": 0.001 + r},
                         cross_host_s=crossing)
            for r in range(2)
        ]  # fmt: skip

    first, second = rnd({0: 0.009, 1: 0.008}, crossing=0.5), rnd({1: 0.008}, crossing=0.25)
    best = best_of(first, second)
    assert [(f.compute_s, f.links, f.cross_host_s) for f in best] == [
        (0.002, {"ulysses0": 0.001}, 0.25), (0.008, {"ulysses0": 1.001}, 0.25),
    ]  # fmt: skip
    assert [f.rank for f in slow_findings(best, threshold=0.7)] == [1]
    assert best_of(rnd({}), rnd({}, crossing=0.1))[0].cross_host_s is None


def test_across_hosts_each_rank_exchanges_with_its_place_on_the_next_host_and_the_one_before() -> (
    None
):
    """Hosts in the order of their lowest rank, a rank's place its index on its host: every
    rank sends to its place on the next host and receives from its place on the one before,
    and every send has its receive (a host with fewer ranks leaves places without a partner);
    on one host there is no exchange."""
    assert cross_host_partners([env(), env(), env()]) == {}
    two = cross_host_partners([env(host="a"), env(host="a"), env(host="b"), env(host="b")])
    assert {r: (p.to, p.from_) for r, p in two.items()} == {
        0: (2, 2), 1: (3, 3), 2: (0, 0), 3: (1, 1),
    }  # fmt: skip
    hosts = ["a", "a", "b", "c", "c"]
    three = cross_host_partners([env(host=h) for h in hosts])
    assert {r: (p.to, p.from_) for r, p in three.items()} == {
        0: (2, 3), 1: (None, 4), 2: (3, 0), 3: (0, 2), 4: (1, None),
    }  # fmt: skip
    sends = {(r, p.to) for r, p in three.items() if p.to is not None}
    receives = {(p.from_, r) for r, p in three.items() if p.from_ is not None}
    assert sends == receives


def test_a_rank_slow_across_hosts_is_found_against_every_others_exchange() -> None:
    """Each rank's exchange across hosts against the median of every rank's: the slow one
    named with the measure `link` in `cross-host`; within the threshold, none."""

    def ranks(slow: float) -> list[ProbeFigures]:
        times = [0.002, 0.002, 0.0021, slow]
        return [ProbeFigures(rank=r, compute_s=0.002, links={}, cross_host_s=t)
                for r, t in enumerate(times)]  # fmt: skip

    assert slow_findings(ranks(0.0025), threshold=0.7) == ()
    (found,) = slow_findings(ranks(0.01), threshold=0.7)
    assert (found.rank, found.measure, found.group) == (3, "link", "cross-host")
    assert describe_slow(found, threshold=0.7).startswith("rank 3's cross-host exchange took")
    unusable = unusable_figure(ranks(math.nan))
    assert unusable is not None and unusable.rank == 3
    assert "cross-host exchange probe measured" in unusable.line


@pytest.mark.parametrize("bad", [0.0, -0.001, math.nan, math.inf])
def test_a_figure_that_is_not_a_time_names_the_rank_not_a_division_by_zero(bad: float) -> None:
    figures = [ProbeFigures(rank=0, compute_s=0.002, links={"ulysses0": 0.001}),
               ProbeFigures(rank=1, compute_s=0.002, links={"ulysses0": bad})]  # fmt: skip
    found = unusable_figure(figures)
    assert found is not None and found.rank == 1
    assert found.line.startswith("rank 1's ulysses0's all-to-all probe measured")
    assert unusable_figure(figures[:1]) is None


@pytest.mark.parametrize("threshold", [0.0, -0.5, 1.5, math.nan])
def test_a_threshold_outside_0_1_is_refused(threshold: float) -> None:
    with pytest.raises(ConfigError, match=r"slow_rank_threshold|slow-rank-threshold"):
        ServerArgs(slow_rank_threshold=threshold)
    assert ServerArgs(slow_rank_threshold=1.0).slow_rank_threshold == 1.0


def test_the_threshold_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    done = run_cli("lifecycle", ["boot", "--slow-rank-threshold", "0"], cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--slow-rank-threshold must be in (0, 1]" in line
    assert not (tmp_path / "lifecycle.db").exists()


def test_the_slow_fault_takes_a_factor() -> None:
    assert parse_fault("1:gate-check:slow").factor == 3.0
    spec = parse_fault("2:re-warm:slow:4.5")
    assert (spec.kind, spec.factor, str(spec)) == (FaultKind.SLOW, 4.5, "2:re-warm:slow:4.5")
    served = parse_fault("1:request:slow:2:2.5")  # from the 2nd request, 2.5 times slower
    assert (served.request, served.factor, str(served)) == (2, 2.5, "1:request:slow:2:2.5")
    assert (parse_fault("1:request:slow:3").request, parse_fault("1:request:slow:3").factor) == (
        3,
        3.0,
    )
    for bad in ("1:gate-check:slow:1", "1:gate-check:slow:x", "1:gate-check:raise:4",
                "1:request:slow:2:1", "1:request:raise:2:3"):  # fmt: skip
        with pytest.raises(FaultSpecError):
            parse_fault(bad)


def test_entry_lags_are_each_members_median_lateness() -> None:
    entries = [[0.0, 1.0, 2.0, 3.0], [0.1, 1.2, 2.1, math.nan], [0.0, 1.0, 2.0, 3.0]]
    lags = entry_lags(entries)
    assert lags[0] == pytest.approx(0.0) and lags[2] == pytest.approx(0.0)
    assert lags[1] == pytest.approx(
        0.1
    )  # 0.1, 0.2, 0.1; the collective it has no entry for left out


def test_a_straggler_is_named_only_when_consistently_and_clearly_late() -> None:
    late = {0: [(0.0001, "ulysses0")] * 10, 1: [(0.05, "ulysses0")] * 10}
    found = straggler(late)
    assert found is not None and (found.rank, found.group) == (1, "ulysses0")
    assert found.describe() == (
        "rank 1 enters ulysses0's collectives 50 ms after its peers, median of the last 10 requests"
    )
    assert straggler({0: [(0.0001, "u")] * 10, 1: [(0.0015, "u")] * 10}) is None  # noise
    assert straggler({0: [(0.02, "u")] * 10, 1: [(0.03, "u")] * 10}) is None  # both late
    assert straggler({0: [(0.0, "u")] * 2, 1: [(0.5, "u")] * 2}) is None  # too few requests


# -- real ranks ----------------------------------------------------------------------------


def boot(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Completed:
    return run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--db", str(tmp_path / "j.db"), "--dist-timeout", "60",
         *args],
        cwd=tmp_path, timeout=BOOT_S, env=env,
    )  # fmt: skip


def diagnosis(tmp_path: Path) -> dict[str, Any]:
    done = run_cli(
        "replay", ["diagnose", "latest", str(tmp_path / "j.db"), "--json"], cwd=tmp_path, timeout=60
    )
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def checks(tmp_path: Path, kind: type[ev.Event]) -> dict[int, list[ev.Event]]:
    found: dict[int, list[ev.Event]] = {}
    for stored in journal_events(tmp_path / "j.db"):
        if isinstance(stored.event, kind):
            found.setdefault(stored.rank, []).append(stored.event)
    return found


def test_ranks_whose_torch_differs_are_refused_at_gate_check(tmp_path: Path) -> None:
    """Rank 1 reports another torch (and another driver: a warning beside it); the startup
    fails before any warmup, every rank with the same line, and the verdict names rank 1."""
    done = boot(
        tmp_path, "--num-ranks", "2",
        env={"LIFECYCLE_TEST_RANK_ENVIRONMENT": "1:torch=2.99.0,1:driver=999"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank 1 runs torch 2.99.0" in done.stdout
    environments = checks(tmp_path, ev.EnvironmentChecked)
    assert sorted(environments) == [0, 1]
    mine = environments[1][0]
    assert isinstance(mine, ev.EnvironmentChecked) and mine.environment.torch == "2.99.0"
    fields = {d.field: d for d in mine.differences}
    assert fields["torch"].matters and fields["torch"].ranks == (1,)
    assert not fields["driver"].matters
    assert checks(tmp_path, ev.RankProbed) == {}  # no probe, no warmup after the refusal
    states = {s.event.source for s in journal_events(tmp_path / "j.db")
              if isinstance(s.event, ev.Transition) and s.event.dest == "failed"}  # fmt: skip
    assert states == {"gate-check"}
    doc = diagnosis(tmp_path)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "failed", [1], "gate-check",
    )  # fmt: skip
    items = [e for e in doc["evidence"] if e["code"] == "environment"]
    assert {(e["rank"], e["field"], e["value"], e["matters"]) for e in items} == {
        (1, "torch", "2.99.0", True), (1, "driver", "999", False),
    }  # fmt: skip


def test_a_slow_rank_of_four_is_warned_of_with_its_figures_and_the_startup_goes_on(
    tmp_path: Path,
) -> None:
    done = boot(
        tmp_path, "--num-ranks", "4", "--cfg-parallel", "2", "--fault", "1:gate-check:slow:4"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    probed = checks(tmp_path, ev.RankProbed)
    assert sorted(probed) == [0, 1, 2, 3]
    for rank, (event,) in probed.items():
        assert isinstance(event, ev.RankProbed) and event.compute_s > 0
        assert {link.group for link in event.links} == {f"ulysses{rank // 2}", f"cfg{rank % 2}"}
    slow = checks(tmp_path, ev.SlowRank)
    assert 1 in slow, slow
    compute = [e for e in slow[1] if isinstance(e, ev.SlowRank) and e.measure == "compute"]
    (finding,) = compute
    assert finding.action == "warn" and finding.ratio < 0.7 and finding.figure_s > finding.median_s
    assert not any(e.measure == "compute" for r, es in slow.items() if r != 1 for e in es)  # type: ignore[attr-defined]
    doc = diagnosis(tmp_path)
    assert doc["outcome"] == "ready"
    assert any(e["code"] == "slow-rank" and e["rank"] == 1 for e in doc["evidence"])


def test_a_slow_rank_under_fail_stops_the_startup_and_the_verdict_names_it(
    tmp_path: Path,
) -> None:
    done = boot(
        tmp_path, "--num-ranks", "2", "--fault", "1:gate-check:slow:4", "--on-slow-rank", "fail"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "slow rank (--on-slow-rank fail): rank 1's compute took" in done.stdout
    doc = diagnosis(tmp_path)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "failed", [1], "gate-check",
    )  # fmt: skip
    assert checks(tmp_path, ev.WarmupRecord) == {}  # stopped before any warmup


def test_ranks_on_two_hosts_time_their_exchange_across_them(tmp_path: Path) -> None:
    """Rank 1 told by the test hook that it runs on another host: each rank times its
    exchange with the other across the hosts (one uneven all-to-all of the world), journals it
    among its links, and replay shows it."""
    done = boot(
        tmp_path, "--num-ranks", "2", env={"LIFECYCLE_TEST_RANK_ENVIRONMENT": "1:host=node-b"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    probed = checks(tmp_path, ev.RankProbed)
    for rank, other in ((0, 1), (1, 0)):
        (event,) = probed[rank]
        assert isinstance(event, ev.RankProbed)
        (crossing,) = [link for link in event.links if link.group.startswith("cross-host")]
        assert crossing.group == f"cross-host to rank {other}" and crossing.seconds > 0
    shown = run_cli("replay", ["show", "latest", str(tmp_path / "j.db")], cwd=tmp_path).stdout
    assert "cross-host to rank 1" in shown and "cross-host to rank 0" in shown


def test_the_gate_runs_on_one_rank_and_journals_its_figures(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """One rank has no peer to compare with: its environment and compute figure are still
    journaled (history per host), and nothing is slow."""
    done = boot(tmp_path, "--model", "micro-video")
    assert done.returncode == 0, done.stderr[-2000:]
    ((event,),) = checks(tmp_path, ev.RankProbed).values()
    assert isinstance(event, ev.RankProbed) and event.compute_s > 0 and event.links == ()
    ((environment,),) = checks(tmp_path, ev.EnvironmentChecked).values()
    assert isinstance(environment, ev.EnvironmentChecked)
    assert environment.environment.dtype == "float32"  # the built-in model's weights on CPU
    assert environment.differences == ()
    assert checks(tmp_path, ev.SlowRank) == {}
