"""diffusers models on the command line: `--model tiny-wan`, `--model-path DIR` of WanPipeline
or of another class, and one line for what cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pipelinedirs import save_small_ddpm
from lifecycle.store.journal import Journal
from tests.conftest import assert_refused_before_start, one_clear_line, run_cli

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def without_diffusers(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import diffusers, as where the extra is missing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['diffusers'] = None\n")
    return {"PYTHONPATH": str(site)}


@pytest.mark.parametrize("model", [["--model", "tiny-wan"], ["--model-path", "."]])
def test_a_diffusers_model_without_the_extra_is_one_line_naming_it(
    tmp_path: Path, model: list[str]
) -> None:
    """Without diffusers installed, tiny-wan or a pipeline directory is one line that names
    the extra to install, exit 2, and no journal is written."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    done = run_cli(
        "lifecycle", ["boot", *model, "--db", "j.db"], cwd=tmp_path,
        env=without_diffusers(tmp_path), timeout=120,
    )  # fmt: skip
    assert_refused_before_start(
        done, "pip install 'diffusion-lifecycle[diffusers]'", tmp_path / "j.db"
    )


@pytest.fixture(scope="module")
def ddpm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_ddpm(tmp_path_factory.mktemp("ddpm") / "tiny-ddpm")


@pytest.mark.slow
def test_another_pipeline_class_on_several_ranks_is_one_line(
    tmp_path: Path, ddpm_dir: Path
) -> None:
    """A pipeline class the lifecycle does not drive runs on one rank: asked for two, one line
    saying so, exit 2."""
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(ddpm_dir), "--num-ranks", "2", "--db", "j.db"],
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "another pipeline class runs on one rank" in one_clear_line(done)


@pytest.mark.parametrize("where", ["nowhere", "a file", "no index"])
def test_a_model_path_that_is_not_a_pipeline_directory_is_one_line(
    tmp_path: Path, where: str
) -> None:
    """A path that does not exist, a file, or a directory without model_index.json: one line
    naming it, exit 2."""
    target = tmp_path / "model"
    if where == "a file":
        target.write_text("x")
    elif where == "no index":
        target.mkdir()
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(target), "--db", "j.db"], cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--model-path {target}" in one_clear_line(done)


def test_another_pipeline_class_boots_on_one_rank_measured_by_its_components(
    tmp_path: Path, ddpm_dir: Path
) -> None:
    """An unconditional DDPM pipeline runs through its own call: the startup reaches ready on
    the bounded path (the diffusers-backend gate closes calibration), and its warmup record's
    stages are its own components, timed by forward hooks."""
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(ddpm_dir), "--db", "j.db", "--calibrate"],
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calibration skipped: diffusers backend" in done.stdout
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    events = list(journal.read())
    journal.close()
    (warmup,) = [e.event for e in events if e.kind == "warmup_record"]
    stages = {s.name: s for s in warmup.stages}  # type: ignore[attr-defined]
    assert set(stages) == {"unet"} and stages["unet"].ran and stages["unet"].seconds > 0
