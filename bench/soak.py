"""`python -m bench.soak`: SIGKILL ranks of real startups at random moments, many times over,
and report how every journal held up."""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

from bench.crash import KillResult, kill_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--kills", type=int, default=500, help="kills that must land")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--parallel", type=int, default=4, help="startups at a time")
    ns = parser.parse_args(argv)
    started = time.monotonic()
    results: list[KillResult] = []
    with tempfile.TemporaryDirectory(prefix="lifecycle-soak-") as root:
        for result in kill_loop(Path(root), kills=ns.kills, seed=ns.seed, parallel=ns.parallel):
            results.append(result)
            if not result.ok:
                print(f"kill {result.index} ({result.ranks} rank(s)): {result.problem}", flush=True)
            count = sum(r.killed for r in results)
            if count and count % 50 == 0 and result.killed:
                print(f"{count} kills landed, {time.monotonic() - started:.0f} s", flush=True)
    landed = [r for r in results if r.killed]
    print(f"startups: {len(results)}; kills landed: {len(landed)}"
          f" ({sum(r.ranks == 2 for r in landed)} of a rank of 2); finished before the kill:"
          f" {len(results) - len(landed)}")  # fmt: skip
    intact = sum(r.integrity == "ok" and r.gapless for r in results)
    print(f"journals intact (integrity_check ok, gapless): {intact} of {len(results)}")
    print(f"diagnoses right (crashed, the killed rank, its last state): "
          f"{sum(r.ok for r in landed)} of {len(landed)}")  # fmt: skip
    states = collections.Counter(r.last_state for r in landed)
    print("killed in: " + ", ".join(f"{s} {n}" for s, n in states.most_common()))
    print(f"events per journal: median {sorted(r.events for r in landed)[len(landed) // 2]};"
          f" {time.monotonic() - started:.0f} s in all, seed {ns.seed}")  # fmt: skip
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
