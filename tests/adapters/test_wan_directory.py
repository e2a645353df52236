"""A diffusers pipeline directory read as a lifecycle model: its spec, its digest, and one
line for anything that is not a pipeline directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pipelinedirs import save_small_wan
from lifecycle.adapters.diffusers import spec_for_directory
from lifecycle.adapters.diffusers.specs import DIFFUSERS_COMPONENTS
from lifecycle.core.errors import ConfigError


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan(tmp_path_factory.mktemp("wan") / "Small-Wan-T2V")


def test_a_wan_directory_gives_its_name_grid_heads_and_wan_defaults(wan_dir: Path) -> None:
    """The spec comes from the directory: its name, the VAE's and patch's 16-pixel grid and
    4-frame rule, the transformer's heads, and WanPipeline's own call defaults."""
    spec = spec_for_directory(str(wan_dir))
    assert (spec.name, spec.backend, spec.attention_heads) == (
        "Small-Wan-T2V", DIFFUSERS_COMPONENTS, 2,
    )  # fmt: skip
    assert (spec.spatial_multiple, spec.frame_multiple, spec.frames_per_latent) == (16, 4, 4)
    assert (spec.default_width, spec.default_height, spec.default_frames) == (832, 480, 81)
    assert (spec.default_steps, spec.default_guidance_scale) == (50, 5.0)
    assert spec.source == str(wan_dir.resolve()) and spec.declares_residency


def test_new_weights_or_configs_are_a_new_digest(wan_dir: Path, tmp_path: Path) -> None:
    """The same files are the same digest; a weight file's new size is a new one."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(wan_dir, copy)
    first = spec_for_directory(str(copy)).source_digest
    assert spec_for_directory(str(copy)).source_digest == first
    weights = next((copy / "transformer").glob("*.safetensors"))
    with weights.open("ab") as out:
        out.write(b"\0" * 8)
    assert spec_for_directory(str(copy)).source_digest != first


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("missing", "does not exist"),
        ("no-index", "no model_index.json: not a diffusers pipeline directory"),
        ("bad-json", "cannot be read as JSON"),
        ("no-class", "names no pipeline class"),
        ("unknown-class", "diffusers has no pipeline class 'NoSuchPipeline'"),
        ("missing-component", "names component 'vae', but vae/ is missing"),
        ("cut-weights", "is cut short"),
    ],
)
def test_what_is_not_a_pipeline_directory_is_one_clear_error(
    wan_dir: Path, tmp_path: Path, damage: str, says: str
) -> None:
    """Each kind of broken directory raises one ConfigError naming what is wrong."""
    import shutil

    target = tmp_path / "d"
    if damage != "missing":
        shutil.copytree(wan_dir, target)
    index = target / "model_index.json"
    if damage == "no-index":
        index.unlink()
    elif damage == "bad-json":
        index.write_text("{not json")
    elif damage in ("no-class", "unknown-class"):
        doc = json.loads(index.read_text())
        doc["_class_name"] = "NoSuchPipeline" if damage == "unknown-class" else ""
        index.write_text(json.dumps(doc))
    elif damage == "missing-component":
        shutil.rmtree(target / "vae")
    elif damage == "cut-weights":
        weights = next((target / "transformer").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ConfigError) as raised:
        spec_for_directory(str(target))
    assert says in str(raised.value) and "\n" not in str(raised.value)
