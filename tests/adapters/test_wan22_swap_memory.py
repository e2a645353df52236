"""Wan 2.2's experts swapped give back the memory of the expert not in use, when diffusers
loaded them from the directory as the lifecycle does (each weight file one memory map that
its tensors view): no page of a released expert's weight file stays mapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.pipelinedirs import save_small_wan22
from lifecycle.adapters.diffusers.wan.experts import EXPERTS, RESIDENT, SWAPPED
from lifecycle.pipelines import Shape
from tests.support.adapters import adapter_of

pytest.importorskip("diffusers")

SHAPE = Shape(width=32, height=32, frames=5)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture
def wan22_dir(tmp_path: Path) -> Path:
    return save_small_wan22(tmp_path / "small-wan22").resolve()


def mapped_experts(directory: Path) -> set[str]:
    """The experts whose weight file this process has mapped."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if WEIGHTS in line}
    return {e for e in ("transformer", "transformer_2") if str(directory / e / WEIGHTS) in paths}


def denoise(adapter: Any) -> None:
    embeds = adapter.encode_prompt("a cat walks in the rain", "blurry")
    adapter.denoise(embeds, SHAPE, 4, seed=3, guidance_scale=4.0, on_step=lambda _: None)


@pytest.mark.usefixtures("models_forgotten")
def test_swapped_experts_leave_no_page_of_the_released_experts_file_mapped(
    wan22_dir: Path,
) -> None:
    """Loaded, both experts' weight files are mapped; swapped, the low-noise expert's file is
    unmapped at once and, after a request has handed over to it and back, the high-noise
    one's too (its weights live in the blocks brought back); resident again, both experts
    hold their weights."""
    adapter = adapter_of(wan22_dir)
    assert mapped_experts(wan22_dir) == {"transformer", "transformer_2"}
    options = {o.name: o for o in adapter.residency_options(SHAPE) if o.component == EXPERTS}
    adapter.apply_residency([options[SWAPPED]])
    assert mapped_experts(wan22_dir) == {"transformer"}
    denoise(adapter)
    assert mapped_experts(wan22_dir) == set()
    assert not any(p.is_meta for p in adapter.pipe.transformer.parameters())
    assert all(p.is_meta for p in adapter.pipe.transformer_2.blocks.parameters())
    adapter.apply_residency([options[RESIDENT]])
    assert not any(p.is_meta for p in adapter.pipe.transformer_2.parameters())
