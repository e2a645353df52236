"""The benchmark runner: `python -m bench --quick` runs every benchmark and reports them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bench.report import ReportError, Section, render, updated
from bench.table import Row
from tests.conftest import REPO, run_cli

# The benchmarks a test runs: the in-process ones, whose quick run takes seconds. The others
# start rank processes, servers and diffusers pipelines for minutes (`python -m bench --quick`
# runs them all; BENCHMARKS.md is their full run).
IN_PROCESS = ("journal", "replay")
ROW_NAMES = (
    "journal append latency, median",
    "journal append latency, p99",
    "journal append throughput, 1 process(es)",
    "journal append throughput, 8 process(es)",
    "replay show, 10,000 events (64 ranks)",
)


@pytest.mark.timeout(240)
def test_a_quick_run_prints_its_rows_and_writes_the_markdown(tmp_path: Path) -> None:
    """A quick run of the in-process benchmarks exits 0, prints a row for each figure and
    writes them to --output with the command that made them."""
    output = tmp_path / "bench.md"
    only = [arg for name in IN_PROCESS for arg in ("--only", name)]
    done = run_cli("bench", ["--quick", *only, "--output", str(output)], cwd=REPO, timeout=200.0)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = [name for name in ROW_NAMES if name not in done.stdout]
    assert missing == [], done.stdout
    markdown = output.read_text(encoding="utf-8")
    assert [name for name in ROW_NAMES if name not in markdown] == []
    assert "--quick --only journal --only replay --output" in markdown


def test_the_help_and_the_docs_give_one_time_for_a_quick_run() -> None:
    """`python -m bench --help` says how many minutes `--quick` takes on two cores, and the
    benchmarks page of the docs gives the same figure."""
    done = run_cli("bench", ["--help"], cwd=REPO, timeout=60.0)
    assert done.returncode == 0, done.stderr[-2000:]
    helped = " ".join(done.stdout.split())
    said = re.search(r"--quick small sizes, about (\d+) minutes on two cores", helped)
    assert said is not None, helped
    page = " ".join((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").split())
    assert f"`--quick` runs them small (about {said[1]} minutes on two cores" in page


def test_every_benchmark_module_names_one_benchmark_once() -> None:
    """Each module the runner lists holds a Benchmark under a name no other uses, so that
    `--only NAME` picks exactly one."""
    from bench.suite import MODULES, benchmarks

    names = [b.name for b in benchmarks()]
    assert len(names) == len(MODULES) == len(set(names))
    assert {"overhead", "history", "diffusers"} <= set(names)


def _machines(markdown: str) -> str:
    """The Machines section's list, as the file shows it."""
    return markdown.split("\n## Machines\n\n", 1)[1].split("\n\n## ", 1)[0]


def _section(markdown: str, name: str) -> str:
    """One benchmark's section, its heading included, as the file shows it."""
    after = markdown.split(f"\n### {name}\n", 1)[1]
    return f"### {name}\n" + after.split("\n### ", 1)[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_update_on_another_machine_keeps_the_others_and_lists_both(tmp_path: Path) -> None:
    """`--only NAME --update` on a machine the file does not list replaces that section with one
    naming this machine, keeps every other section byte for byte under the machine it names,
    and lists both machines; a file without sections is refused, as one line, before anything
    is measured, and is left as it was."""
    output = tmp_path / "bench.md"
    both = ["--quick", "--only", "journal", "--only", "replay", "--output", str(output)]
    assert run_cli("bench", both, cwd=REPO, timeout=200.0).returncode == 0
    written = output.read_text(encoding="utf-8")
    here = _machines(written).removeprefix("- machine 1\n")
    assert here.startswith("  - CPU: ") and "- machine" not in here
    assert " on machine 1; 1-minute load average" in _section(written, "journal")
    # The file as another machine would have left it: the same sections, another CPU.
    cpu = here.splitlines()[0]
    elsewhere = here.replace(cpu, "  - CPU: Another CPU, 2 of 2 logical cores available")
    before = written.replace(f"- machine 1\n{here}", f"- machine 1\n{elsewhere}")
    output.write_text(before, encoding="utf-8")

    again = ["--quick", "--only", "replay", "--update", "--output", str(output)]
    done = run_cli("bench", again, cwd=REPO, timeout=200.0)
    assert done.returncode == 0, done.stderr[-2000:]
    after = output.read_text(encoding="utf-8")
    assert _machines(after) == f"- machine 1\n{elsewhere}\n- machine 2\n{here}"
    assert _section(after, "journal") == _section(before, "journal")
    replay = _section(after, "replay")
    assert "--only replay --update --output" in replay
    assert " on machine 2; 1-minute load average" in replay
    assert [name for name in ROW_NAMES if name not in after] == []

    flat = tmp_path / "flat.md"
    flat.write_text("# Benchmarks\n\n| figure |\n", encoding="utf-8")
    refused = run_cli("bench", ["--only", "replay", "--update", "--output", str(flat)], cwd=REPO)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"bench: error: cannot update {flat}: it has no Machines or Results section"
    ]
    assert flat.read_text(encoding="utf-8") == "# Benchmarks\n\n| figure |\n"


EPYC = (
    "CPU: AMD EPYC, 2 of 2 logical cores available",
    "memory: 23.5 GiB",
    "Python 3.11.7, torch 2.13.0+cpu, SQLite 3.40.1, Linux 6.18.44-fc-v1045",
    "temporary files (journals): /tmp (ext4)",
)
XEON = (
    "CPU: Intel Xeon, 2 of 2 logical cores available",
    "memory: 7.8 GiB",
    "Python 3.11.7, torch 2.13.0+cpu, SQLite 3.40.1, Linux 6.1.0",
    "temporary files (journals): /tmp (tmpfs)",
)
ORDER = ("overhead", "journal", "replay")


def _listed(*machines: tuple[str, tuple[str, ...]]) -> str:
    """A Machines list as the file shows it."""
    return "\n".join(
        f"- machine {label}\n" + "\n".join(f"  - {fact}" for fact in facts)
        for label, facts in machines
    )


def _measured(name: str, commit: str) -> Section:
    row = Row(figure=f"{name} figure", value="1.00 ms", how=f"measured at {commit}")
    return Section.measured(
        name, [row], command=f"python -m bench --only {name} --update",
        started="2026-12-03 09:00 UTC", commit=commit, load=(0.5, 0.75),
    )  # fmt: skip


def test_a_full_run_lists_one_machine_and_names_it_in_every_section() -> None:
    """A full run's file lists its one machine as machine 1, and each section's provenance
    line names machine 1 after the commit."""
    markdown = render(EPYC, [_measured(name, "a1") for name in ORDER])
    assert _machines(markdown) == _listed(("1", EPYC))
    for name in ORDER:
        provenance = _section(markdown, name).splitlines()[2]
        assert " at commit a1 on machine 1; 1-minute load average 0.50" in provenance


def test_an_update_on_a_listed_machine_reuses_its_number() -> None:
    """An update measured on a machine the file lists (the same facts) names that machine's
    number and changes nothing but the section it replaces."""
    first = render(EPYC, [_measured(n, "a1") for n in ORDER])
    before = updated(first, XEON, {"journal": _measured("journal", "b2")}, ORDER)
    assert _machines(before) == _listed(("1", EPYC), ("2", XEON))
    after = updated(before, XEON, {"replay": _measured("replay", "c3")}, ORDER)
    assert _machines(after) == _listed(("1", EPYC), ("2", XEON))
    assert " at commit c3 on machine 2;" in _section(after, "replay")
    unchanged = before.replace(_section(before, "replay"), _section(after, "replay"))
    assert after == unchanged


def test_an_update_that_replaces_a_machines_last_section_drops_that_machine() -> None:
    """When an update replaces the last section measured on a machine, the file no longer
    lists it; the machines still named keep their numbers and their sections byte for byte."""
    first = render(EPYC, [_measured(n, "a1") for n in ORDER])
    both = updated(first, XEON, {"journal": _measured("journal", "b2")}, ORDER)
    assert _machines(both) == _listed(("1", EPYC), ("2", XEON))
    fresh = {n: _measured(n, "c3") for n in ("overhead", "replay")}
    after = updated(both, XEON, fresh, ORDER)
    assert _machines(after) == _listed(("2", XEON))
    assert _section(after, "journal") == _section(both, "journal")
    assert " at commit c3 on machine 2;" in _section(after, "overhead")
    # Numbers free again go to the next new machine.
    third = updated(after, EPYC, {"replay": _measured("replay", "d4")}, ORDER)
    assert _machines(third) == _listed(("1", EPYC), ("2", XEON))
    assert " at commit d4 on machine 1;" in _section(third, "replay")


FIRST_FORMAT_PROVENANCE = {
    "overhead": (
        "Measured by `.venv/bin/python -m bench --only overhead --update` on 2026-12-02"
        " 08:58 UTC at commit 98cd193e6b7e{}; 1-minute load average 0.79 at the start, 1.86"
        " at the end (other work on the machine shows here)."
    ),
    "journal": (
        "Measured by `.venv/bin/python -m bench` (every benchmark, 22:43 to 01:25) on"
        " 2026-12-01 22:43 UTC at commit 26c1a63aab29 (tracked files modified){}; 1-minute"
        " load average 1.41 at the start, 2.39 at the end of the whole run (other work on the"
        " machine shows here)."
    ),
}
TABLE = "| figure | value |\n|---|---|\n| a figure | 1.00 ms |\n"


def _first_format(label: str) -> dict[str, str]:
    """The first format's sections, their provenance naming machine `label` if one is given."""
    named = f" on machine {label}" if label else ""
    return {
        name: f"### {name}\n\n{line.format(named)}\n\n{TABLE}"
        for name, line in FIRST_FORMAT_PROVENANCE.items()
    }


def test_a_file_in_the_first_format_is_read_as_measured_on_its_one_machine() -> None:
    """A file with one Machine section and sections naming no machine is read: an update on
    another machine lists the file's machine as 1 and this one as 2, and the kept sections
    change only by naming machine 1 after their commit."""
    old = "\n".join(_first_format("").values())
    facts = "\n".join(f"- {fact}" for fact in EPYC)
    text = (
        f"# Benchmarks\n\nEach section under Results is one benchmark's latest run.\n\n"
        f"## Machine\n\n{facts}\n\n## Method\n\nMedians.\n\n## Results\n\n{old}"
    )
    after = updated(text, XEON, {"replay": _measured("replay", "b2")}, ORDER)
    assert _machines(after) == _listed(("1", EPYC), ("2", XEON))
    labelled = _first_format("1")
    assert _section(after, "overhead") == labelled["overhead"]
    assert f"{labelled['journal']}\n{_measured('replay', 'b2').render('2')}" in after
    assert " at commit b2 on machine 2;" in _section(after, "replay")
    same = updated(text, EPYC, {"replay": _measured("replay", "b2")}, ORDER)
    assert _machines(same) == _listed(("1", EPYC))
    assert " at commit b2 on machine 1;" in _section(same, "replay")


def test_a_section_naming_a_machine_the_file_does_not_list_is_refused() -> None:
    """An update refuses a file whose section names a machine its Machines section lacks,
    saying which section and machine."""
    text = render(EPYC, [_measured(n, "a1") for n in ORDER])
    broken = text.replace(" at commit a1 on machine 1; ", " at commit a1 on machine 3; ", 1)
    with pytest.raises(ReportError) as refused:
        updated(broken, EPYC, {}, ORDER)
    assert str(refused.value) == "section overhead names machine 3, which Machines lacks"


def test_the_median_interval_is_the_sign_tests_order_statistics() -> None:
    from bench.stats import median_interval

    # n = 11: P(at most 1 of 11 below the median) = 12/2048 <= 2.5 % < P(at most 2) = 67/2048,
    # so the 95 % interval runs from the 2nd to the 10th smallest, covering 1 - 24/2048.
    shuffled = [7.0, 3.0, 11.0, 1.0, 9.0, 5.0, 2.0, 10.0, 4.0, 8.0, 6.0]
    interval = median_interval(shuffled)
    assert (interval.low, interval.high) == (2.0, 10.0)
    assert interval.coverage == 1 - 24 / 2048
    # Too few samples for 95 %: the whole range, with the coverage it has (1 - 2/8).
    few = median_interval([3.0, 1.0, 2.0])
    assert (few.low, few.high, few.coverage) == (1.0, 3.0, 0.75)


def _marked(marker: str) -> list[tuple[int, str]]:
    """Live processes whose environment holds `marker`, with their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append((int(entry.name), command))
    return found


@pytest.mark.timeout(240)
def test_a_run_stopped_by_a_timeout_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGTERM to `python -m bench` (what `timeout` sends) while a benchmark's server and its
    rank processes run, each in a session of its own: the run ends, and so does every process
    it started."""
    marker = f"LIFECYCLE_BENCH_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--quick", "--only", "serving"],
        cwd=REPO, env={**os.environ, name: value, "PYTHONWARNINGS": "ignore"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            ranks = [c for _, c in _marked(marker) if "lifecycle.serve.ranks.worker" in c]
            if len(ranks) >= 2:
                break
            assert bench.poll() is None, (
                bench.stderr.read().decode()[-2000:] if bench.stderr else ""
            )
            time.sleep(0.2)
        else:
            pytest.fail("the serving benchmark started no rank process within 150 s")
        bench.send_signal(signal.SIGTERM)
        bench.communicate(timeout=60)
        time.sleep(0.5)
        assert _marked(marker) == []
        assert bench.returncode == 128 + signal.SIGTERM
    finally:
        for pid, _ in _marked(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=10)
