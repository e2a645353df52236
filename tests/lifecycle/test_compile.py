"""`--compile` and the shapes traffic used, paid once per fingerprint (docs/compile.md): a second
boot compiles from the artifact the first kept in the journal, one the operator's key did not sign
or a stale or corrupt one is never loaded, nothing another user left in the shared temporary folder
is compiled in, a pipeline that declares no repeated blocks runs eager and says so, compiled output
equals eager, and a boot after serving warms the shapes its traffic used. Real boots and a real
server on 127.0.0.1; torch.compile on the CPU (inductor, g++)."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.runtime.artifacts.archive import pack, unpack
from tests.conftest import Completed, run_cli
from tests.support import BODY, EARLIER, plugin, serve

pytestmark = pytest.mark.ranks

COMPILE_S = 900  # a cold compile on two loaded cores, with its boot
OPERATOR_KEY = "operator-" + "4" * 40
ANOTHER_KEY = "another-" + "6" * 40


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The boots' own config folder (where the artifact key file is made), not the user's."""
    folder = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(folder))
    for name in ("LIFECYCLE_ARTIFACT_KEY", "LIFECYCLE_ARTIFACT_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    return folder


def events(db: Path, kind: str) -> list[tuple[str, dict[str, Any]]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        rows = conn.execute(
            "SELECT run_id, data FROM events WHERE kind = ? ORDER BY wall_time, seq", (kind,)
        ).fetchall()
    return [(run_id, json.loads(data)) for run_id, data in rows]


def boot(
    lifecycle_cli: Callable[..., Completed], *args: str, env: dict[str, str] | None = None
) -> Completed:
    result = lifecycle_cli(
        "boot", "--model", "micro-video", "--db", "j.db", *args, timeout=COMPILE_S, env=env
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
    compiling = [c for c in rank["compile"] if c["kind"].startswith("compile")]  # not weights'
    assert [(c["kind"], c["state"]) for c in compiling] == [
        ("compiled", "gate-check"),
        ("compile_kept", "ready"),
    ]
    assert compiling[0]["cache"] == "miss" and compiling[1]["kept"] is True


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


NOT_MODULES = (
    EARLIER
    + """

class NamedBlocksPipeline(EarlierPipeline):
    def repeated_blocks(self):
        return ["block_0", "block_1"]


PLUGIN = (SPEC, NamedBlocksPipeline)
"""
)


def test_a_plugin_whose_blocks_are_not_modules_is_told_what_it_returned(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A plug-in whose `repeated_blocks()` returns names instead of modules boots eager under
    --compile, and its gate-check says what it returned, not that it declares none."""
    env = plugin(tmp_path, NOT_MODULES)
    result = lifecycle_cli(
        "boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", "--compile", env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ((_, compiled),) = events(tmp_path / "j.db", "compiled")
    assert compiled["cache"] == "off"
    assert compiled["reason"] == (
        "repeated_blocks() returned 2 of 2 that are not torch modules (the first a str):"
        " it runs eager"
    )
    assert "declares no repeated blocks" not in result.stdout


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


PLANTED = 'open({marker!r}, "w").write("ran")\n'


@pytest.mark.slow
@pytest.mark.timeout(5 * COMPILE_S)
def test_only_an_artifact_the_operators_key_signed_is_loaded(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A database writer appends code to the kept artifact's modules and sets its digest and
    size to match: the next boot rejects it (its signature), none of that code runs, and the
    boot's own signed artifact replaces it; a boot with the same key loads that one (hit), a
    boot with another key rejects it. The key is in no output and no row."""
    operator = {"LIFECYCLE_ARTIFACT_KEY": OPERATOR_KEY}
    first = boot(lifecycle_cli, "--compile", env=operator)
    db, folder = tmp_path / "j.db", tmp_path / "j.db.compile-cache"
    ((digest, signature),) = (
        sqlite3.connect(db).execute("SELECT digest, signature FROM compile_artifacts").fetchall()
    )
    assert signature is not None and len(signature) == 64
    marker = tmp_path / "their-code-ran"
    theirs_folder = unpack((folder / digest).read_bytes(), parent=tmp_path)
    modules = list(theirs_folder.rglob("*.py"))
    assert modules
    for module in modules:
        module.write_text(module.read_text() + PLANTED.format(marker=str(marker)))
    theirs = pack(theirs_folder)
    theirs_digest = hashlib.sha256(theirs).hexdigest()
    (folder / theirs_digest).write_bytes(theirs)
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE compile_artifacts SET digest = ?, size_bytes = ?", (theirs_digest, len(theirs))
        )
    second = boot(lifecycle_cli, "--compile", env=operator)
    assert not marker.exists()
    rejected = events(db, "compiled")[-1][1]
    assert rejected["cache"] == "rejected", rejected
    assert "signature does not verify" in rejected["reason"], rejected
    assert events(db, "compile_kept")[-1][1]["kept"] is True
    third = boot(lifecycle_cli, "--compile", env=operator)
    assert events(db, "compiled")[-1][1]["cache"] == "hit"
    assert "from the journal's artifact" in third.stdout
    fourth = boot(lifecycle_cli, "--compile", env={"LIFECYCLE_ARTIFACT_KEY": ANOTHER_KEY})
    other = events(db, "compiled")[-1][1]
    assert other["cache"] == "rejected" and "signature does not verify" in other["reason"]
    assert not marker.exists()
    said = "".join(r.stdout + r.stderr for r in (first, second, third, fourth))
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("j.db*") if p.is_file())
    for key in (OPERATOR_KEY, ANOTHER_KEY):
        assert key not in said and key.encode() not in stored


@pytest.mark.slow
@pytest.mark.timeout(3 * COMPILE_S)
def test_a_header_planted_in_the_shared_temporary_folder_is_not_compiled_in(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Inductor precompiles its headers into $TMPDIR/torchinductor_$USER/precompiled_headers,
    shared by every process of the user: a header there given a constructor (and its compiled
    form removed, so that it is compiled again) ran in every rank that compiled kernels. A
    `--compile` boot compiles its headers in its own private folder: it neither builds nor
    uses the planted header, and the constructor never runs."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    plain = subprocess.run(
        [sys.executable, "-c", "import torch\n"
         "f = torch.compile(lambda x: (x * 2).sin().sum(-1))\nf(torch.randn(8, 8))\n"],
        env={**os.environ, "TMPDIR": str(shared),
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "plain-cache")},
        capture_output=True, text=True, timeout=COMPILE_S, check=False,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    headers = shared / f"torchinductor_{getpass.getuser()}" / "precompiled_headers"
    planted = list(headers.glob("*.h"))
    assert planted, "torch precompiled no header into the shared folder"
    marker = tmp_path / "constructor-ran"
    for header in planted:
        header.write_text(
            header.read_text() + "#include <cstdio>\n"
            "__attribute__((constructor)) static void planted() {"
            f' FILE* f = std::fopen("{marker}", "w"); if (f) std::fclose(f); }}\n'
        )
        Path(f"{header}.gch").unlink()
    boot(lifecycle_cli, "--compile", env={"TMPDIR": str(shared)})
    assert events(tmp_path / "j.db", "compiled")[-1][1]["cache"] == "miss"
    assert not marker.exists()
    assert [p for p in headers.iterdir() if p.suffix == ".gch"] == []


def test_every_collective_and_buffer_lookup_runs_eagerly_under_compile() -> None:
    """Under --compile a recorded collective and a staging buffer's lookup break the compiled
    graph instead of being traced (their journal records and the buffers' dict would become
    guards that recompile a block when they change): each is marked for
    run_eagerly_under_compile, the one that may be called inside a block."""
    from lifecycle.runtime.group import comm

    marked = {
        f"{owner.__name__}.{name}"
        for owner in (comm.RecordedGroup, comm.StagingBuffers)
        for name, member in vars(owner).items()
        if getattr(member, comm._EAGER, False)
    }
    assert marked == {
        "RecordedGroup.all_to_all", "RecordedGroup.exchange", "RecordedGroup.all_gather",
        "RecordedGroup.all_reduce", "StagingBuffers.get",
    }  # fmt: skip
