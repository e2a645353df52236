"""`lifecycle first-run`: the check a person with CUDA GPUs runs first.

It boots one rank on the calibrating path and again on the bounded path (reusing the plan the
first verified), two ranks when there are two GPUs, then reproduces the field's failure: a
rank that never enters a collective while its peer waits there until the process-group
timeout (NCCL's watchdog) ends the wait, with PyTorch's Flight Recorder on. `replay` diagnoses
each run, the Flight Recorder dumps included, and one table says what held. Every step is a
real `lifecycle boot` / `replay` process; the journal, the dumps and each step's log stay in
the output folder. `--device cpu` runs the same steps on gloo as a dry run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.core.command import extra
from lifecycle.core.format.events import (
    FlightRecorderDumped,
    ReferenceOutput,
    ResidencyApplied,
    ResidencyPlanned,
    ResidencyVerified,
    RunStarted,
    WeightsReleased,
)

HELD, NOT_HELD, NOT_RUN = "held", "did not hold", "not run"
LIMIT_S = 600.0  # the whole check, on one GPU
HANG_STATE = "bounded-warm"
ENTRIES = 2000  # the Flight Recorder's ring, per rank
# Every check's name, for the table's first column.
CHECK_NAMES = (
    "devices",
    "boot 1 rank, calibrating",
    "boot 1 rank, bounded (plan reused)",
    "sleep and wake",
    "tiny-wan (diffusers)",
    "boot 2 ranks",
    "the field's hang, 2 ranks",
    "flight recorder dumps",
    "time",
)
NAME_WIDTH = max(map(len, CHECK_NAMES))
RESULT_WIDTH = max(map(len, (HELD, NOT_HELD, NOT_RUN)))
DETAIL_RULE = 50  # the detail column is as wide as its text; its rule is this long


def add_first_run(sub: Any) -> None:
    p = sub.add_parser(
        "first-run",
        help="check this machine's CUDA and NCCL paths end to end, and print what held",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda, or cpu for a dry run on gloo (default: %(default)s)",
    )
    p.add_argument("--model", default="tiny-video", help="the model booted (default: %(default)s)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where the journal, the dumps and the logs go (default: ./first-run-TIMESTAMP)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        metavar="SECONDS",
        help="the process-group timeout that ends the reproduced hang (default: 20 on cuda,"
        " 5 on cpu)",
    )


@dataclass(frozen=True)
class Check:
    name: str
    result: str
    detail: str


class FirstRun:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.device = ns.device
        self.model = ns.model
        self.out = Path(ns.out or f"first-run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        self.db = self.out / "first-run.db"
        self.timeout_s = ns.dist_timeout or (20.0 if self.device == "cuda" else 5.0)
        self.started = time.monotonic()

    def _run(self, name: str, module: str, args: list[str], *, timeout: float) -> tuple[int, str]:
        """`python -m module args`, its output in OUT/name.log; (exit status, stdout)."""
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        with (self.out / f"{name}.log").open("w") as log:
            try:
                done = subprocess.run(
                    [sys.executable, "-P", "-m", module, *args],  # never OUT's own modules
                    cwd=self.out, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                    timeout=timeout, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                return -1, ""
            log.write(done.stdout)
        return done.returncode, done.stdout

    def boot(self, name: str, *extra: str, timeout: float = 300.0) -> int:
        # On CUDA, NCCL's own diagnostics of the gate's communicators too (docs/ranks.md).
        nccl = ("--nccl-diagnostics",) if self.device == "cuda" else ()
        args = ["boot", "--device", self.device, "--model", self.model, "--db", str(self.db),
                "--flight-recorder", str(ENTRIES), "--log-level", "warning", *nccl,
                *extra]  # fmt: skip
        return self._run(name, "lifecycle", args, timeout=timeout)[0]

    def diagnose(self, name: str) -> dict[str, Any]:
        status, out = self._run(
            f"{name}-diagnose", "replay", ["diagnose", "latest", str(self.db), "--json"],
            timeout=120,
        )  # fmt: skip
        try:
            doc: dict[str, Any] = json.loads(out)
        except ValueError:
            return {"outcome": f"replay exited {status} without a verdict"}
        return doc

    def events(self, kind: type | tuple[type, ...]) -> list[Any]:
        """Events of `kind` of the latest run, every rank's, as (rank, event), in the journal's
        order."""
        from lifecycle.store.journal import Journal

        journal = Journal.open_for_read(str(self.db))
        try:
            run_id = max(journal.runs(), key=lambda r: r.created_at).run_id
            return [
                (s.rank, s.event) for s in journal.read(run_id=run_id) if isinstance(s.event, kind)
            ]
        finally:
            journal.close()


def _devices(device: str) -> tuple[Check, int]:
    import torch

    if device == "cpu":
        return Check("devices", HELD, "cpu: a dry run on gloo; the CUDA and NCCL paths are not"
                     " exercised"), 2  # fmt: skip
    if not torch.cuda.is_available():
        return Check("devices", NOT_HELD, "no CUDA device is visible to torch"), 0
    count = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    return Check("devices", HELD, f"{count} x {names}; torch {torch.__version__}"), count


def _ready(doc: dict[str, Any]) -> str:
    return (
        f"ready in {doc.get('startup_to_ready_s') or 0:.1f} s"
        if doc.get("outcome") == "ready"
        else str(doc.get("outcome"))
    )


def _verdict(doc: dict[str, Any]) -> str:
    """The verdict in a few words: outcome, culprit, and the wait that ended the run."""
    text = str(doc.get("outcome"))
    culprits = doc.get("culprit_ranks") or []
    if culprits:
        text += f", culprit rank {', '.join(map(str, culprits))} in {doc.get('culprit_state')}"
    for item in doc.get("evidence", []):
        if item.get("code") == "blocked":
            text += (
                f"; rank {item['rank']} in {item['op']} #{item['group_seq']} of {item['group']},"
                f" {item['ended']} after {item['waited_s']:.1f} s"
            )
            break
    return text


def _http(method: str, url: str, *, timeout: float) -> tuple[int, dict[str, Any]]:
    """One request: the status and the JSON answer ({} for none); status 0 when none came."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except OSError:
        return 0, {}
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {}
    return status, doc if isinstance(doc, dict) else {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _sleep_check(fr: FirstRun) -> Check:
    """A serving rank with a keeper of its own put to sleep and woken (docs/keeper.md): the
    device memory the sleep gave back, measured on CUDA, the wake's time, and the weights held
    to the reference again."""
    name = "sleep and wake"
    sock, port = fr.out / "keeper" / "k.sock", _free_port()
    python = [sys.executable, "-P", "-m", "lifecycle"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        log = stack.enter_context((fr.out / "sleep-wake.log").open("w"))
        procs = []
        for args in (
            ["keeper", "--socket", str(sock), "--db", str(fr.db)],
            ["serve", "--device", fr.device, "--model", fr.model, "--db", str(fr.db), "--port",
             str(port), "--keeper", str(sock), "--log-level", "warning"],
        ):  # fmt: skip
            procs.append(subprocess.Popen([*python, *args], cwd=fr.out, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
        stack.callback(_stop, procs)
        deadline = time.monotonic() + 300
        while _http("GET", f"{url}/health", timeout=5)[0] != 200:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return Check(name, NOT_HELD, "the server was not ready within 300 s")
            time.sleep(0.5)
        slept = _http("POST", f"{url}/sleep", timeout=300)
        health = _http("GET", f"{url}/health", timeout=5)
        woke = _http("POST", f"{url}/wake", timeout=300)
        ready = _http("GET", f"{url}/health", timeout=5)[0] == 200
    released = [e for _, e in fr.events(WeightsReleased)]
    after = [e for _, e in fr.events((WeightsReleased, ReferenceOutput))]
    woken = after[after.index(released[0]) :] if released else []
    matched = [e for e in woken if isinstance(e, ReferenceOutput) and e.outcome == "matched"]
    if slept[0] != 200 or health[1].get("status") != "asleep" or woke[0] != 200 or not ready:
        return Check(name, NOT_HELD, f"/sleep {slept[0]}, /health asleep {health[1]}, /wake"
                     f" {woke[0]}, ready again: {ready}")  # fmt: skip
    freed = released[0].device_bytes if released else None
    memory = "not measured on cpu" if freed is None else f"{freed / 2**20:.0f} MiB freed"
    detail = (f"asleep in {slept[1].get('seconds', 0):.2f} s (device memory {memory}), awake"
              f" in {woke[1].get('seconds', 0):.2f} s, reference output"
              f" {'matched' if matched else 'not matched'}")  # fmt: skip
    kept = bool(released) and released[0].reason is None
    return Check(name, HELD if kept and matched else NOT_HELD, detail)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each (the server first, then its keeper), a minute each, then SIGKILL."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _diffusers_check(fr: FirstRun, devices: int) -> Check:
    """tiny-wan, diffusers' Wan pipeline driven by the adapter: calibrating on every device
    there is, sequence-parallel (Ulysses) over two when there are two."""
    name = "tiny-wan (diffusers)"
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return Check(
            name, NOT_RUN, f"needs the diffusers extra: pip install '{extra('diffusers')}'"
        )
    count = 2 if devices >= 2 else 1
    ranks = ("--num-ranks", "2", "--ulysses", "2") if count == 2 else ()
    # The dry run probes a smaller default request: two CPU cores, not a GPU.
    smaller = ("--default-shape", "64x64x33") if fr.device == "cpu" else ()
    status = fr.boot(
        "tiny-wan", "--model", "tiny-wan", "--calibrate", *ranks, *smaller, timeout=600.0
    )
    doc = fr.diagnose("tiny-wan")
    verified = fr.events(ResidencyVerified)
    planned = fr.events(ResidencyPlanned)
    detail = f"{_ready(doc)}; {count} rank{'s' if count > 1 else ''}"
    if verified:
        detail += f"; plan {verified[0][1].plan.plan_id} verified"
    elif planned:  # everything fits as it is: no plan to apply, nothing to verify
        detail += f"; plan {planned[0][1].plan.plan_id}"
    return Check(name, HELD if status == 0 and doc.get("outcome") == "ready" else NOT_HELD, detail)


def run_checks(fr: FirstRun, say: Callable[[Check], None]) -> None:
    """Run every check in turn, and `say` each as soon as it is done."""
    fr.out.mkdir(parents=True, exist_ok=True)
    device, devices = _devices(fr.device)
    say(device)
    if device.result != HELD:
        return
    status = fr.boot("calibrating", "--calibrate")
    doc = fr.diagnose("calibrating")
    verified = fr.events(ResidencyVerified)
    detail = _ready(doc)
    if verified:
        v = verified[0][1]
        detail += (f"; plan {v.plan.plan_id} verified,"
                   f" peak {v.measured_bytes / 2**20:.0f} MiB measured (predicted"
                   f" {v.predicted_bytes / 2**20:.0f} MiB)")  # fmt: skip
    say(Check("boot 1 rank, calibrating", HELD if status == 0 and verified else NOT_HELD, detail))
    status = fr.boot("bounded")
    doc = fr.diagnose("bounded")
    reused = any(e.reused_from for _, e in fr.events(ResidencyApplied))
    say(
        Check(
            "boot 1 rank, bounded (plan reused)",
            HELD if status == 0 and reused else NOT_HELD,
            _ready(doc),
        )
    )
    say(_sleep_check(fr))
    say(_diffusers_check(fr, devices))
    if devices < 2:
        say(Check("boot 2 ranks", NOT_RUN, "needs 2 GPUs"))
        say(Check("the field's hang", NOT_RUN, "needs 2 GPUs"))
        return
    two = ("--num-ranks", "2", "--cfg-parallel", "2")
    status = fr.boot("two-ranks", *two)
    doc = fr.diagnose("two-ranks")
    started = sorted(fr.events(RunStarted), key=lambda re: re[0])
    placed = [e.device for _, e in started]
    backend = {str(e.dist_backend) for _, e in started}
    # Each rank on a device of its own (set_device); on cpu they share the host.
    apart = len(set(placed)) == 2 or fr.device == "cpu"
    say(Check(
        "boot 2 ranks",
        HELD if status == 0 and len(placed) == 2 and apart else NOT_HELD,
        f"{_ready(doc)}; {', '.join(sorted(backend))}; "
        + ", ".join(f"rank {rank} on {e.device}" for rank, e in started),
    ))  # fmt: skip
    t = fr.timeout_s
    status = fr.boot(
        "hang", *two, "--fault", f"1:{HANG_STATE}:hang", "--dist-timeout", f"{t:g}",
        "--state-deadline", f"{max(1.0, t / 2):g}", "--startup-timeout", f"{4 * t + 60:g}",
        timeout=8 * t + 240,
    )  # fmt: skip
    doc = fr.diagnose("hang")
    named = doc.get("culprit_ranks") == [1] and doc.get("culprit_state") == HANG_STATE
    say(Check(
        "the field's hang, 2 ranks",
        HELD if status != 0 and doc.get("outcome") == "hung" and named else NOT_HELD,
        f"boot exited {status}; replay: {_verdict(doc)}",
    ))  # fmt: skip
    dumped = fr.events(FlightRecorderDumped)
    ranks = sorted({rank for rank, e in dumped if e.path})
    read = (doc.get("flight_recorder") or {}).get("ranks", [])
    watchdog = sorted(p.name for p in fr.out.rglob("nccl_trace_rank_*"))
    say(Check(
        "flight recorder dumps",
        HELD if ranks == [0, 1] and read == [0, 1] else NOT_HELD,
        f"written by rank {', '.join(map(str, ranks)) or 'none'}; read by replay:"
        f" {', '.join(map(str, read)) or 'none'}"
        + (f"; NCCL's watchdog wrote {', '.join(watchdog)}" if watchdog else ""),
    ))  # fmt: skip


def table_row(name: str, result: str, detail: str) -> str:
    """A row of the table, its columns as wide as the longest check name and result: fixed
    before the first check runs, so that each row is printed when its check is done."""
    from lifecycle.core.format.text import clean, pad

    cells = (pad(clean(name), NAME_WIDTH), pad(result, RESULT_WIDTH), clean(detail))
    return "  ".join(cells).rstrip()


def first_run(ns: argparse.Namespace) -> int:
    started = time.monotonic()
    fr = FirstRun(ns)
    checks: list[Check] = []

    def say(check: Check) -> None:
        checks.append(check)
        print(table_row(check.name, check.result, check.detail), flush=True)

    print(table_row("check", "result", "detail"))
    print(table_row("-" * NAME_WIDTH, "-" * RESULT_WIDTH, "-" * DETAIL_RULE), flush=True)
    run_checks(fr, say)
    took = time.monotonic() - started
    say(Check("time", HELD if took <= LIMIT_S else NOT_HELD,
              f"{took / 60:.1f} min (limit {LIMIT_S / 60:.0f} min)"))  # fmt: skip
    print(f"\njournal, dumps and logs: {fr.out}")
    return 0 if all(c.result != NOT_HELD for c in checks) else 1
