"""`--compile` and the shapes traffic used, paid once per fingerprint (README: "Compile and
shapes, paid once per fingerprint"): a second boot compiles from the artifact the first kept
in the journal, a stale or corrupt one is never loaded, a pipeline that declares no repeated
blocks runs eager and says so, compiled output equals eager, and a boot after serving warms
the shapes its traffic used. Real boots and a real server on 127.0.0.1; torch.compile on the
CPU (inductor, g++)."""

from __future__ import annotations

import json
import re
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Completed, run_cli
from tests.support import BODY, EARLIER, plugin, serve

pytestmark = pytest.mark.ranks

COMPILE_S = 900  # a cold compile on two loaded cores, with its boot


def events(db: Path, kind: str) -> list[tuple[str, dict[str, Any]]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        rows = conn.execute(
            "SELECT run_id, data FROM events WHERE kind = ? ORDER BY wall_time, seq", (kind,)
        ).fetchall()
    return [(run_id, json.loads(data)) for run_id, data in rows]


def boot(lifecycle_cli: Callable[..., Completed], *args: str) -> Completed:
    result = lifecycle_cli(
        "boot", "--model", "micro-video", "--db", "j.db", *args, timeout=COMPILE_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# Slow tier (two --compile boots, the suite's longest test): the default run keeps the
# artifact store's rules (tests/lifecycle/test_compile_artifacts.py), a plug-in without blocks
# under --compile, and the shapes a served run warms for the next boot.
@pytest.mark.slow
@pytest.mark.timeout(2 * COMPILE_S)
def test_a_second_boot_compiles_from_the_artifact_the_first_kept(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The first `--compile` boot finds no artifact (miss), compiles the DiT's blocks cold and
    keeps the compiler's cache in the journal; the second, in a compiler cache folder of its
    own, loads it before compiling (hit) and keeps nothing new. Each says so in its table."""
    first = boot(lifecycle_cli, "--compile")
    assert "compiled 4 blocks (default)" in first.stdout and "cold (no artifact" in first.stdout
    second = boot(lifecycle_cli, "--compile")
    assert "from the journal's artifact" in second.stdout
    db = tmp_path / "j.db"
    (run_a, cold), (run_b, warm) = events(db, "compiled")
    assert run_a != run_b and cold["key"] == warm["key"]
    assert (cold["cache"], cold["blocks"], cold["artifact_bytes"]) == ("miss", 4, 0)
    ((_, kept),) = events(db, "compile_kept")
    assert kept["kept"] is True and kept["bytes"] > 0
    assert (warm["cache"], warm["artifact_bytes"]) == ("hit", kept["bytes"])
    with sqlite3.connect(db) as conn:
        ((stored_run, used_run, size),) = conn.execute(
            "SELECT stored_run, used_run, size_bytes FROM compile_artifacts"
        ).fetchall()
    assert (stored_run, used_run, size) == (run_a, run_b, kept["bytes"])
    shown = run_cli("replay", ["show", run_b, "j.db"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "compile +" in shown.stdout and "from the journal's artifact" in shown.stdout
    as_json = run_cli("replay", ["show", run_a, "j.db", "--json"], cwd=tmp_path)
    (rank,) = json.loads(as_json.stdout)["ranks"]
    assert [(c["kind"], c["state"]) for c in rank["compile"]] == [
        ("compiled", "gate-check"),
        ("compile_kept", "ready"),
    ]
    assert rank["compile"][0]["cache"] == "miss" and rank["compile"][1]["kept"] is True


def test_a_plugin_that_declares_no_blocks_runs_eager_under_compile(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A plug-in written before `repeated_blocks` existed boots to ready under --compile,
    eager, and its gate-check says why nothing was compiled."""
    env = plugin(tmp_path, EARLIER)
    result = lifecycle_cli(
        "boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", "--compile", env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not compiled: the pipeline declares no repeated blocks" in result.stdout
    ((_, compiled),) = events(tmp_path / "j.db", "compiled")
    assert (compiled["cache"], compiled["key"], compiled["blocks"]) == ("off", None, 0)
    assert events(tmp_path / "j.db", "compile_kept") == []


def test_a_boot_after_serving_warms_the_shapes_its_traffic_used(tmp_path: Path) -> None:
    """A server answers requests at one shape; the next boot of the fingerprint warms that
    shape after the bounded warmup (role `learned`), after --warm-shape's own."""
    with serve(tmp_path) as served:
        served.wait_for_health(200, within=240)
        for _ in range(2):
            assert served.client.post("/generate", json=BODY).status_code == 200
        assert served.stop() == 0
    from tests.conftest import run_cli

    booted = run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--db", "j.db", "--warm-shape", "128x96x5"],
        cwd=tmp_path,
        timeout=600,
    )
    assert booted.returncode == 0, booted.stderr[-3000:]
    records = events(tmp_path / "j.db", "warmup_record")
    learned = [(r["shape"], r["steps"]) for run, r in records if r["role"] == "learned"]
    served_shape = {"width": BODY["width"], "height": BODY["height"], "frames": BODY["frames"]}
    assert learned == [
        ({"width": 128, "height": 96, "frames": 5}, 2),
        (served_shape, 2),
    ], learned
    assert "learned 256x192x9 at 2 steps" in booted.stdout


@pytest.mark.slow
@pytest.mark.timeout(2 * COMPILE_S)
def test_a_served_request_at_a_warmed_shape_compiles_nothing_more(tmp_path: Path) -> None:
    """Two ranks serve under `--compile` with the request's shape warmed: after ready, no
    request recompiles (torch's own `TORCH_LOGS=recompiles` lines in the ranks' output), and
    at no time is a recorded collective or a staging buffer recompiled: they run eagerly
    (traced, their bookkeeping became guards that failed again and again, 60 recompiles in
    the startup, until torch's limit on them)."""
    shape = f"{BODY['width']}x{BODY['height']}x{BODY['frames']}"
    env = {"TORCH_LOGS": "recompiles"}
    log = tmp_path / "serve.log"
    with serve(tmp_path, "--num-ranks", "2", "--compile", "--warm-shape", shape, env=env) as served:
        served.wait_for_health(200, within=COMPILE_S)
        at_ready = len(log.read_text(errors="replace"))
        for _ in range(2):
            assert served.client.post("/generate", json=BODY).status_code == 200
        assert served.stop() == 0
    said = log.read_text(errors="replace")
    assert "Recompiling" not in said[at_ready:], said[at_ready:][-3000:]
    eager = re.compile(r"Recompiling function (all_to_all|all_gather|all_reduce|get) in .*comm\.py")
    assert not [line for line in said.splitlines() if eager.search(line)]


@pytest.mark.slow
@pytest.mark.timeout(3 * COMPILE_S)
def test_a_stale_or_corrupt_artifact_is_never_loaded_and_the_boot_compiles_cold(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The key's artifact with its bytes damaged: rejected (its digest), compiled cold, and
    kept anew in its place; a row whose torch is another: rejected naming both versions."""
    boot(lifecycle_cli, "--compile")
    db = tmp_path / "j.db"
    ((digest,),) = sqlite3.connect(db).execute("SELECT digest FROM compile_artifacts").fetchall()
    artifact = tmp_path / "j.db.compile-cache" / digest
    artifact.write_bytes(b"\0" * artifact.stat().st_size)
    boot(lifecycle_cli, "--compile")
    rejected = events(db, "compiled")[-1][1]
    assert rejected["cache"] == "rejected" and "digest" in rejected["reason"], rejected
    assert events(db, "compile_kept")[-1][1]["kept"] is True
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE compile_artifacts SET torch = '2.0.0'")
    boot(lifecycle_cli, "--compile")
    stale = events(db, "compiled")[-1][1]
    assert stale["cache"] == "rejected", stale
    assert f"compiled by torch 2.0.0, this is torch {torch.__version__}" in stale["reason"]


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_S)
# torch's own inductor imports torch.utils.mkldnn, which warns of its own deprecated API.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_blocks_give_the_eager_output() -> None:
    """micro-video's DiT blocks compiled (inductor) denoise to latents within 1e-5 of eager
    (measured: 3e-7 of latents of scale 4), and decode to the same uint8 video within one
    level (measured: identical)."""
    import os

    from lifecycle.core.format.records import Shape
    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline import build_pipeline, repeated_blocks

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lifecycle-test-compile-")
    pipeline = build_pipeline(MODEL_PRESETS["micro-video"], Comm.alone(torch.device("cpu")))
    shape = Shape(width=256, height=192, frames=9)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        embeds = pipeline.encode_prompt("a fox in the snow", "")
        latents = pipeline.denoise(
            embeds, shape, 3, seed=1, guidance_scale=5.0, on_step=lambda _: None
        )
        return latents, pipeline.decode(latents, shape)

    eager_latents, eager_video = run()
    blocks = repeated_blocks(pipeline)
    assert blocks is not None and len(blocks) == 4
    for block in blocks:
        block.compile(backend="inductor")
    latents, video = run()
    assert (latents - eager_latents).abs().max().item() <= 1e-5
    assert (video.int() - eager_video.int()).abs().max().item() <= 1


def test_warm_shapes_and_budget_are_checked_before_any_rank_starts(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """A --warm-shape the model cannot run, or a negative --warm-budget, is one line, exit 2."""
    shape = lifecycle_cli("boot", "--model", "micro-video", "--warm-shape", "100x96x5")
    assert (
        shape.returncode == 2 and "--warm-shape 100x96x5: width must be a multiple" in shape.stderr
    )
    budget = lifecycle_cli("boot", "--model", "micro-video", "--warm-budget", "-1")
    assert budget.returncode == 2 and "--warm-budget" in budget.stderr
