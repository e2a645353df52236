"""The runner: every registered benchmark, one table on stdout, the same table in Markdown."""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.table import Row

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "BENCHMARKS.md"
EXIT_OK = 0
EXIT_BENCHMARK_FAILED = 1
# A --quick run's wall time on two cores: 15 min at a load of 2 before its sizes were cut (the
# compile cache's three models alone 4 min); 22 min at a load of 5 to 8 after, of which 16 min
# of CPU.
QUICK_MINUTES = 12


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run every benchmark, print one table and write it to BENCHMARKS.md.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes, about {QUICK_MINUTES} minutes on two cores (20 or more under load);"
        " writes Markdown only with --output",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"where the Markdown goes (default: {DEFAULT_OUTPUT.name} for a full run)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this benchmark (repeatable); writes Markdown only with --output or --update",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help=f"replace the --only benchmarks' sections in {DEFAULT_OUTPUT.name} (or --output),"
        " keeping the others",
    )
    return parser


def cpu_s() -> float:
    """CPU seconds this process and its ended children have used: a benchmark's cost that
    another process's load on the machine changes less than it changes the wall clock."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def invocation(argv: Sequence[str]) -> str:
    """The command as it was typed, as near as it can be rebuilt."""
    python = sys.executable
    with_cwd = os.path.relpath(python, os.getcwd())
    if not with_cwd.startswith(".."):
        python = with_cwd
    entry = sys.argv[0] if Path(sys.argv[0]).name == "run.py" else "-m bench"
    return " ".join([shlex.quote(python), *(shlex.quote(a) for a in (*entry.split(" "), *argv))])


def main(argv: Sequence[str] | None = None) -> int:
    from bench.machine import as_installed, describe, git_commit, load_average
    from bench.reaper import reaping
    from bench.report import ReportError, Section, render, updated
    from bench.suite import Settings, benchmarks, progress
    from bench.table import Row, render_text

    as_installed(REPO)  # before any benchmark module copies the environment for its children
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args_list)
    chosen = [b for b in benchmarks() if not ns.only or b.name in ns.only]
    unknown = set(ns.only) - {b.name for b in benchmarks()}
    if unknown:
        names = ", ".join(b.name for b in benchmarks())
        print(f"bench: error: unknown benchmark {sorted(unknown)[0]!r} ({names})", file=sys.stderr)
        return 2
    output = ns.output
    if output is None and (ns.update or (not ns.quick and not ns.only)):
        output = DEFAULT_OUTPUT
    if ns.update and not ns.only:
        print(
            "bench: error: --update needs --only NAME (a full run rewrites the file)",
            file=sys.stderr,
        )
        return 2
    if ns.update and ns.quick and ns.output is None:
        print(f"bench: error: --quick sizes never go into {output.name}", file=sys.stderr)
        return 2
    machine = describe(temp_dir=tempfile.gettempdir()).lines()
    order = [b.name for b in benchmarks()]
    if ns.update:
        try:  # before an hour of measuring, not after
            updated(output.read_text(encoding="utf-8"), machine, {}, order)
        except (ReportError, OSError) as exc:
            print(f"bench: error: cannot update {output}: {exc}", file=sys.stderr)
            return 2
    command = invocation(args_list)
    commit = git_commit(REPO)
    started_run = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows: list[Row] = []
    sections: dict[str, Section] = {}
    broken: set[str] = set()  # failed: a full run shows why; --update keeps the last section
    with reaping(), tempfile.TemporaryDirectory(prefix="lifecycle-bench-") as workdir:
        settings = Settings(quick=ns.quick, workdir=Path(workdir))
        for benchmark in chosen:
            began, cpu_at_start, load_at_start = time.perf_counter(), cpu_s(), load_average()
            started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
            progress(f"{benchmark.name}: starting")
            try:
                measured = list(benchmark.measure(settings))
            except Exception as exc:  # one broken benchmark must not hide the others' rows
                traceback.print_exc(file=sys.stderr)
                measured = [Row(figure=f"{benchmark.name}: FAILED", value="-", how=str(exc)[:300])]
                broken.add(benchmark.name)
            rows.extend(measured)
            sections[benchmark.name] = Section.measured(
                benchmark.name, measured, command=command, started=started, commit=commit,
                load=(load_at_start, load_average()),
            )  # fmt: skip
            done = "FAILED" if benchmark.name in broken else "done"
            took_s, cpu_used_s = time.perf_counter() - began, cpu_s() - cpu_at_start
            progress(f"{benchmark.name}: {done} in {took_s:.1f} s ({cpu_used_s:.1f} s of CPU)")
    print(render_text(rows), flush=True)
    if output is None:
        progress("Markdown not written (pass --output PATH or --update)")
    elif ns.update:
        try:
            fresh = {name: s for name, s in sections.items() if name not in broken}
            text = updated(output.read_text(encoding="utf-8"), machine, fresh, order)
        except ReportError as exc:
            print(f"bench: error: cannot update {output}: {exc}", file=sys.stderr)
            return 2
        output.write_text(text, encoding="utf-8")
        progress(f"updated {', '.join(fresh) or 'no'} section(s) of {output}")
    else:
        output.write_text(render(machine, list(sections.values())), encoding="utf-8")
        progress(f"wrote {output} (started {started_run})")
    return EXIT_BENCHMARK_FAILED if broken else EXIT_OK


if __name__ == "__main__":
    if not __package__:
        # `python bench/run.py`: import `bench` from the repository root, not from bench/.
        here = str(Path(__file__).resolve().parent)
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
        sys.path.insert(0, str(REPO))
    sys.exit(main())
