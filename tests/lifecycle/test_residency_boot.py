"""The residency planner live: real ranks, real forward passes, real peak RSS, a real journal.

Memory is the process's peak RSS (VmHWM); offloading on CPU writes the text encoder's weights
to a file. Moving modules to host memory on CUDA cannot run here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lifecycle.core.format import events as ev
from lifecycle.core.format.phrases import reuse_text
from lifecycle.core.format.records import ReuseCode, Shape
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.device import LinuxRssMeter
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline
from lifecycle.store.journal import Journal
from tests.conftest import Completed
from tests.support.interpreter import run_python

MIB = 2**20


def runs_of(db: Path) -> list[list[ev.StoredEvent]]:
    """Every run's events, oldest run first."""
    journal = Journal.open_for_read(str(db))
    ordered = sorted(journal.runs(), key=lambda r: r.created_at)
    return [list(journal.read(run_id=r.run_id)) for r in ordered]


def of(events: list[ev.StoredEvent], kind: type) -> list[ev.StoredEvent]:
    return [e for e in events if isinstance(e.event, kind)]


def path(events: list[ev.StoredEvent], rank: int = 0) -> list[str]:
    return [e.event.dest for e in events if isinstance(e.event, ev.Transition) and e.rank == rank]


CALIBRATED = ["gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready", "stopped"]


def test_a_failed_verification_rolls_every_rank_back_and_the_plan_is_never_reused(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`--fault 1:re-warm:over-budget` makes rank 1 measure over the budget: both ranks agree
    through a recorded collective, roll back to the reference residency, and still reach
    ready; the next startup does not reuse that plan and says why, and the one after that
    reuses the plan it verified, on both ranks, agreed through `reuse-agree`."""
    common = ("boot", "--db", "j.db", "--model", "micro-video", "--num-ranks", "2")
    result = lifecycle_cli(*common, "--fault", "1:re-warm:over-budget")
    assert result.returncode == 0, result.stderr
    assert "rolled back vae=" in result.stdout
    (events,) = runs_of(tmp_path / "j.db")
    for rank in (0, 1):
        assert path(events, rank) == CALIBRATED
        (rolled,) = [e for e in of(events, ev.ResidencyRolledBack) if e.rank == rank]
        assert rolled.state == "re-warm" and rolled.event.ranks == (1,)
    reasons = {e.rank: e.event.reason for e in of(events, ev.ResidencyRolledBack)}
    assert reasons[1].startswith("measured peak") and "exceeds the budget" in reasons[1]
    assert reasons[0] == "rank 1 could not apply or verify the plan"
    assert not of(events, ev.ResidencyVerified)
    agree = [
        e
        for e in events
        if e.kind == "collective_started" and e.event.purpose == "residency-agree"  # type: ignore[attr-defined]
    ]
    assert sorted(e.rank for e in agree) == [0, 1]
    from tests.conftest import run_cli

    shown = run_cli("replay", ["show", "latest", "j.db"], cwd=tmp_path, timeout=120)
    assert shown.returncode == 0, shown.stderr
    rolled_lines = [line for line in shown.stdout.splitlines() if "residency" in line]
    assert sum("rolled back vae=" in line and "(failed on 1)" in line for line in rolled_lines) == 2
    assert sum("planned vae=" in line for line in rolled_lines) == 2

    again = lifecycle_cli(*common)
    assert again.returncode == 0, again.stderr
    second = runs_of(tmp_path / "j.db")[1]
    assert path(second) == CALIBRATED
    (planned,) = [e for e in of(second, ev.ResidencyPlanned) if e.rank == 0]
    assert planned.event.reuse.code == ReuseCode.ROLLED_BACK
    assert planned.event.reuse.run_id == runs_of(tmp_path / "j.db")[0][0].run_id
    said = reuse_text(planned.event.reuse)
    assert "rolled back in run" in said and "it is not reused" in said

    reused = lifecycle_cli(*common)
    assert reused.returncode == 0, reused.stderr
    third = runs_of(tmp_path / "j.db")[2]
    reason = f"verified residency plan {planned.event.plan.plan_id} from run {second[0].run_id}"
    for rank in (0, 1):
        assert path(third, rank) == ["gate-check", "bounded-warm", "ready", "stopped"]
        (applied,) = [e for e in of(third, ev.ResidencyApplied) if e.rank == rank]
        assert applied.event.reused_from == second[0].run_id
    purposes = [e.event.purpose for e in third if e.kind == "collective_started" and e.rank == 0]  # type: ignore[attr-defined]
    # After the check of the ranks (environments, probes: docs/ranks.md), the gate's agreement.
    decided = purposes.index("gate-agree")
    assert purposes[:decided] == [
        "environment-agree", "link-probe", "link-probe", "link-probe", "probe-figures",
    ]  # fmt: skip
    assert purposes[decided : decided + 2] == ["gate-agree", "reuse-agree"]
    assert f"calibration skipped: {reason}" in reused.stdout


@pytest.mark.slow
def test_a_budget_nothing_fits_keeps_the_reference_residency_and_is_not_reused(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """With a budget below any plan's peak plus the headroom, the planner says none fits;
    nothing is applied or verified, the startup is ready on the reference residency, and a
    later startup calibrates again because that plan never verified."""
    args = ("boot", "--db", "j.db", "--model", "micro-video", "--memory-budget", "1GiB")
    result = lifecycle_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "no plan applied" in result.stdout
    (events,) = runs_of(tmp_path / "j.db")
    (planned,) = of(events, ev.ResidencyPlanned)
    assert not planned.event.plan.fits
    assert planned.event.plan.reason.startswith("none of 8 plans fits")
    assert planned.event.given.budget_bytes == 2**30
    assert not of(events, ev.ResidencyApplied) and not of(events, ev.ResidencyVerified)
    assert path(events) == CALIBRATED

    again = lifecycle_cli(*args)
    assert again.returncode == 0, again.stderr
    (replanned,) = of(runs_of(tmp_path / "j.db")[1], ev.ResidencyPlanned)
    assert replanned.event.reuse.code == ReuseCode.NEVER_VERIFIED
    assert reuse_text(replanned.event.reuse).endswith("never verified")


@pytest.mark.slow
def test_calibrate_and_a_new_budget_calibrate_again_and_say_why(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """After a verified plan, --calibrate calibrates all the same, and a different budget is a
    different fingerprint; each journals why the plan was not reused. `replay verify` decides
    every plan again from its journaled inputs and agrees."""
    args = ("boot", "--db", "j.db", "--model", "micro-video")
    assert lifecycle_cli(*args).returncode == 0
    forced = lifecycle_cli(*args, "--calibrate")
    assert forced.returncode == 0, forced.stderr
    budget = lifecycle_cli(*args, "--memory-budget", "8GiB")
    assert budget.returncode == 0, budget.stderr
    _, second, third = runs_of(tmp_path / "j.db")
    assert path(second) == CALIBRATED and path(third) == CALIBRATED
    (planned,) = of(second, ev.ResidencyPlanned)
    assert planned.event.reuse.code == ReuseCode.CALIBRATE_ASKED
    assert reuse_text(planned.event.reuse).startswith("--calibrate asked for a calibration; ")
    (other,) = of(third, ev.ResidencyPlanned)
    assert (other.event.reuse.code, other.event.reuse.differs) == (
        ReuseCode.FINGERPRINT_DIFFERS,
        ("budget",),
    )
    assert reuse_text(other.event.reuse).endswith(f"(run {second[0].run_id}) differs in budget")
    verified = lifecycle_cli("boot", "--db", "j.db", "--model", "micro-video")
    assert "calibration skipped: verified residency plan" in verified.stdout
    from tests.conftest import run_cli

    check = run_cli("replay", ["verify", "--all", "j.db"], cwd=tmp_path, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("consistent") == 4


def _pipeline() -> TinyVideoPipeline:
    return TinyVideoPipeline(MODEL_PRESETS["tiny-video"], comm=Comm.alone(torch.device("cpu")))


DECODE = """
import sys, torch
from lifecycle.core.settings.config import Shape
from lifecycle.runtime.device import LinuxRssMeter
from lifecycle.runtime.pipeline.placement import DecoderResidency
from tests.lifecycle.test_residency_boot import _pipeline
frames_at_once, tiles, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pipeline = _pipeline()
pipeline.decoder_residency = DecoderResidency(frames_at_once=frames_at_once, tiles=tiles)
shape = Shape(width=832, height=480, frames=33)
generator = torch.Generator().manual_seed(1)
latents = torch.randn((1, *pipeline.latent_shape(shape)), generator=generator)
meter = LinuxRssMeter()
base = meter.current_bytes()
meter.reset_peak()
video = pipeline.decode(latents, shape)
print(meter.peak_bytes() - base)
torch.save(video, out)
"""


@pytest.mark.slow
def test_decoder_options_change_peak_memory_and_not_the_picture(tmp_path: Path) -> None:
    """Decoding every latent frame at once peaks far above tiles (peak RSS of a process of
    its own each); the video differs at most by one uint8 step where convolutions round
    otherwise."""
    repo = Path(__file__).resolve().parents[2]
    videos, peaks = {}, {}
    for name, (frames_at_once, tiles) in {"all": (0, 1), "one": (1, 1), "tiles": (1, 2)}.items():
        out = tmp_path / f"{name}.pt"
        done = run_python(
            DECODE, str(frames_at_once), str(tiles), str(out), cwd=repo, timeout=120, check=True
        )
        peaks[name] = int(done.stdout.split()[-1])
        videos[name] = torch.load(out, weights_only=True)
    assert peaks["all"] > peaks["one"] + 100 * MIB
    assert peaks["tiles"] < peaks["one"]
    for name in ("all", "tiles"):
        diff = (videos[name].int() - videos["one"].int()).abs()
        assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.01


def test_an_offloaded_text_encoder_gives_its_weights_back_and_encodes_the_same() -> None:
    pipeline = _pipeline()
    before = pipeline.encode_prompt("a fox", "").text.clone()
    options = pipeline.residency_options(Shape(width=832, height=480, frames=17))
    offload = [o for o in options if o.name in ("frames-1", "offloaded")]
    meter = LinuxRssMeter()
    resident = meter.current_bytes() or 0
    pipeline.apply_residency(offload)
    assert all(p.is_meta for p in pipeline.text_encoder.parameters())
    assert (meter.current_bytes() or 0) < resident - 32 * MIB
    assert torch.equal(pipeline.encode_prompt("a fox", "").text, before)
    assert all(p.is_meta for p in pipeline.text_encoder.parameters())
    pipeline.apply_residency([o for o in options if o.reference])
    assert not any(p.is_meta for p in pipeline.text_encoder.parameters())


@pytest.mark.slow
def test_a_plan_edited_in_the_journal_is_not_reused_and_verify_flags_it(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A verified plan whose choices were edited in the journal (its VAE option swapped for
    another declared one) is not the plan its journaled inputs decide: the next startup
    calibrates and says so, as `replay verify` flags the same run (and a verification whose
    journaled re-warm time is far above the prediction)."""
    import json
    import sqlite3

    from tests.conftest import run_cli

    args = ("boot", "--db", "j.db", "--model", "micro-video")
    assert lifecycle_cli(*args).returncode == 0
    (first,) = runs_of(tmp_path / "j.db")
    (planned,) = of(first, ev.ResidencyPlanned)
    chosen = {o.component: o.name for o in planned.event.plan.choices}
    forged = next(
        o
        for o in planned.event.given.options
        if o.component == "vae" and o.name != chosen["vae"] and not o.reference
    )
    with sqlite3.connect(tmp_path / "j.db") as conn:
        rows = conn.execute(
            "SELECT rowid, data FROM events WHERE kind LIKE 'residency_%'"
        ).fetchall()
        for rowid, data in rows:
            doc = json.loads(data)
            doc["plan"]["choices"] = [
                {**c, "name": forged.name, "peak_scale": forged.peak_scale,
                 "time_scale": forged.time_scale, "reference": forged.reference}
                if c["component"] == "vae" else c
                for c in doc["plan"]["choices"]
            ]  # fmt: skip
            if "measured_s" in doc:  # the verification's times too: a re-warm far too slow
                doc["measured_s"] = 10 * doc["predicted_s"] + 5
            conn.execute("UPDATE events SET data = ? WHERE rowid = ?", (json.dumps(doc), rowid))

    check = run_cli("replay", ["verify", first[0].run_id, "j.db"], cwd=tmp_path, timeout=120)
    assert check.returncode == 1
    assert f"recorded residency plan vae={forged.name} (fits)" in check.stdout
    assert "was verified, but measured request time" in check.stdout

    again = lifecycle_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "calibration skipped" not in again.stdout
    second = runs_of(tmp_path / "j.db")[1]
    assert path(second) == CALIBRATED
    (replanned,) = of(second, ev.ResidencyPlanned)
    assert replanned.event.reuse.code == ReuseCode.NOT_REPLANNED
    assert reuse_text(replanned.event.reuse) == (
        f"plan vae={forged.name} from run"
        f" {first[0].run_id} is not the plan its journaled inputs decide; it is not reused"
    )


@pytest.mark.slow
def test_a_verified_plan_that_keeps_the_reference_residency_is_reused(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """tiny-wan's fastest plan keeps every component's reference option: the re-warm verifies
    it, and the next startup of the same fingerprint reuses it instead of calibrating again."""
    boot = ("boot", "--model", "tiny-wan", "--default-shape", "64x64x21", "--db", "j.db")
    first = lifecycle_cli(*boot)
    assert first.returncode == 0, first.stderr[-2000:]
    second = lifecycle_cli(*boot)
    assert second.returncode == 0, second.stderr[-2000:]
    calibrated, reused = runs_of(tmp_path / "j.db")
    (planned,) = of(calibrated, ev.ResidencyPlanned)
    assert not planned.event.plan.changes_residency
    (verified,) = of(calibrated, ev.ResidencyVerified)
    assert verified.event.plan.plan_id == planned.event.plan.plan_id
    assert path(reused) == ["gate-check", "bounded-warm", "ready", "stopped"]
    (decided,) = of(reused, ev.GateDecided)
    assert decided.event.skip_reason == (
        f"verified residency plan {planned.event.plan.plan_id} from run {planned.run_id}"
    )
    assert "calibration skipped: verified residency plan" in second.stdout
