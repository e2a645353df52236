"""Wan 2.2's two experts through the Wan adapter: the same video as WanPipeline, the expert not
in use swapped out and handed back ahead of its turn, the option the planner weighs, and one
line for a directory whose experts cannot run together."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.pipelinedirs import save_small_wan22
from lifecycle.adapters.diffusers import spec_for_directory
from lifecycle.adapters.diffusers.wan.experts import EXPERTS, SWAPPED, block_bytes
from lifecycle.core.errors import ConfigError
from lifecycle.pipelines import Shape
from tests.conftest import assert_refused_before_start, run_cli
from tests.support.adapters import adapter_of

SHAPE = Shape(width=32, height=32, frames=5)
STEPS = 4  # timesteps 999, 857 (high-noise expert), 667, 400 (low-noise) at boundary 0.75
PROMPT, NEGATIVE = "a cat walks in the rain", "blurry, static"
SEED = 3


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan22(tmp_path_factory.mktemp("wan22") / "small-wan22")


def generate(adapter: Any, *, guidance: float, guidance_2: float | None, **kw: Any) -> np.ndarray:
    embeds = adapter.encode_prompt(PROMPT, NEGATIVE)
    latents = adapter.denoise(
        embeds, SHAPE, STEPS, seed=SEED, guidance_scale=guidance, guidance_scale_2=guidance_2,
        **kw,
    )  # fmt: skip
    return adapter.decode(latents, SHAPE).numpy()  # type: ignore[no-any-return]


def diffusers_video(path: Path, *, guidance: float, guidance_2: float | None) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt=PROMPT, negative_prompt=NEGATIVE, height=SHAPE.height, width=SHAPE.width,
        num_frames=SHAPE.frames, num_inference_steps=STEPS, guidance_scale=guidance,
        guidance_scale_2=guidance_2, generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
    ).frames[0]  # fmt: skip
    return np.clip(np.round(frames * 255.0), 0, 255).astype(np.uint8)


def options_by_name(adapter: Any) -> dict[tuple[str, str], Any]:
    return {(o.component, o.name): o for o in adapter.residency_options(SHAPE)}


@pytest.mark.usefixtures("models_forgotten")
@pytest.mark.parametrize(("guidance", "guidance_2"), [(4.0, None), (4.0, 2.5), (1.0, 3.0)])
def test_both_experts_resident_or_swapped_make_wan_pipelines_video(
    wan22_dir: Path, guidance: float, guidance_2: float | None
) -> None:
    """With the same seed, the adapter's video is WanPipeline's (its guidance_scale_2 guiding
    the low-noise expert, and no guidance at all when the first scale is 1), within one uint8
    step, with both experts resident and with them swapped, which changes nothing."""
    expected = diffusers_video(wan22_dir, guidance=guidance, guidance_2=guidance_2)
    adapter = adapter_of(wan22_dir)
    resident = generate(adapter, guidance=guidance, guidance_2=guidance_2, on_step=lambda _: None)
    assert resident.shape == expected.shape == (5, 32, 32, 3)
    assert int(np.abs(resident.astype(int) - expected.astype(int)).max()) <= 1
    options = options_by_name(adapter)
    adapter.apply_residency([options[(EXPERTS, SWAPPED)]])
    swapped = generate(adapter, guidance=guidance, guidance_2=guidance_2, on_step=lambda _: None)
    assert np.array_equal(swapped, resident)


@pytest.mark.usefixtures("models_forgotten")
def test_swapped_experts_release_the_one_not_in_use_and_prefetch_the_next(
    wan22_dir: Path,
) -> None:
    """Swapped, the low-noise expert's weights are released through the high-noise steps and
    the high-noise expert's through the low-noise ones, no more than one expert's blocks ever
    holding weights; each comes back during the last pass of the step before its turn (the one
    before the boundary, then the last, for the next request), and a second request finds the
    high-noise expert resident again."""
    adapter = adapter_of(wan22_dir)
    high, low = adapter.pipe.transformer, adapter.pipe.transformer_2
    adapter.apply_residency([options_by_name(adapter)[(EXPERTS, SWAPPED)]])

    def released(expert: Any) -> bool:
        return all(p.is_meta for p in expert.blocks.parameters())

    assert released(low) and not released(high)
    # Whenever any block computes, the blocks holding weights are one expert's worth.
    held: list[int] = []

    def count(_module: Any, _args: Any) -> None:
        blocks = [*high.blocks, *low.blocks]
        held.append(sum(not next(b.parameters()).is_meta for b in blocks))

    for block in [*high.blocks, *low.blocks]:
        block.register_forward_pre_hook(count)
    seen: list[tuple[bool, bool]] = []
    for _ in range(2):
        seen.clear()
        generate(
            adapter, guidance=4.0, guidance_2=None,
            on_step=lambda _: seen.append((released(high), released(low))),
        )  # fmt: skip
        # Step 0 only computes; step 1's last pass hands over to the low-noise expert, which
        # steps 2 and 3 run on, and step 3's hands back.
        assert seen[0] == (False, True) and seen[2] == (True, False)
        swap = adapter.residency.experts
        assert [(h.to, h.during_step) for h in swap.handovers] == [(1, 1), (0, 3)]
        assert all(h.nbytes == block_bytes(high) for h in swap.handovers)
        assert released(low) and not released(high)
    assert held and max(held) <= len(high.blocks)


@pytest.mark.usefixtures("models_forgotten")
def test_the_experts_option_releases_one_expert_and_costs_two_handovers(
    wan22_dir: Path, tmp_path: Path
) -> None:
    """Wan 2.2 declares experts: resident (its reference) or swapped, which gives back one
    expert's blocks through every stage and adds a reload time per request; a Wan 2.1
    directory declares no such option."""
    from bench.pipelinedirs import save_small_wan

    adapter = adapter_of(wan22_dir)
    options = options_by_name(adapter)
    resident, swapped = options[(EXPERTS, "resident")], options[(EXPERTS, SWAPPED)]
    assert resident.reference and not swapped.reference
    assert swapped.released_bytes == block_bytes(adapter.pipe.transformer) > 0
    assert swapped.reload_s > 0
    plain = adapter_of(save_small_wan(tmp_path / "wan21"))
    assert not any(o.component == EXPERTS for o in plain.residency_options(SHAPE))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("wide", "transformer_2 is 32 wide (4 heads of 8), transformer 16 (2 heads of 8)"),
        ("ratio-high", "boundary_ratio 1.5 is not a ratio within 0..1"),
        ("ratio-negative", "boundary_ratio -0.2 is not a ratio within 0..1"),
        ("ratio-text", "boundary_ratio 'half' is not a ratio within 0..1"),
        ("no-expert", "boundary_ratio 0.75 gives the low-noise steps to transformer_2, which"),
        ("channels", "transformer_2's in_channels is 8, transformer's 16"),
    ],
)
def test_experts_that_cannot_run_together_are_one_line_naming_the_component(
    wan22_dir: Path, tmp_path: Path, damage: str, says: str
) -> None:
    """A transformer_2 of another width or other latent channels, a boundary_ratio that is not
    within 0..1, or one with no transformer_2: one ConfigError naming it."""
    target = tmp_path / "d"
    shutil.copytree(wan22_dir, target)
    index_path, config_path = target / "model_index.json", target / "transformer_2/config.json"
    index, config = json.loads(index_path.read_text()), json.loads(config_path.read_text())
    if damage == "wide":
        config["num_attention_heads"] = 4
    elif damage == "channels":
        config["in_channels"] = 8
    elif damage == "no-expert":
        del index["transformer_2"]
        shutil.rmtree(target / "transformer_2")
    else:
        index["boundary_ratio"] = {"ratio-high": 1.5, "ratio-negative": -0.2}.get(damage, "half")
    index_path.write_text(json.dumps(index))
    if config_path.exists():
        config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as raised:
        spec_for_directory(str(target))
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_mismatched_expert_stops_the_launch_before_any_rank_starts(
    wan22_dir: Path, tmp_path: Path
) -> None:
    """`lifecycle boot` on two ranks with a transformer_2 of another width: one line naming
    transformer_2, exit 2, and no journal written (no rank started)."""
    target = tmp_path / "d"
    shutil.copytree(wan22_dir, target)
    config_path = target / "transformer_2/config.json"
    config = json.loads(config_path.read_text())
    config["attention_head_dim"] = 16
    config_path.write_text(json.dumps(config))
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(target), "--num-ranks", "2", "--ulysses", "2",
                      "--db", "j.db"],
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert_refused_before_start(done, "transformer_2 is 32 wide (2 heads of 16)", tmp_path / "j.db")


@pytest.mark.usefixtures("models_forgotten")
@pytest.mark.parametrize(
    "fits",
    [
        "both",
        "one",
    ],
)
def test_the_planner_swaps_the_experts_only_when_both_do_not_fit(
    wan22_dir: Path, fits: str
) -> None:
    """Planned from one measurement with the adapter's own options: with a budget that holds
    both experts the plan keeps them resident (swapping costs time); with one that holds less
    than both even with the text encoder offloaded, it swaps them."""
    from lifecycle.core.decisions.residencyplanner import plan_residency
    from lifecycle.core.format.records import ComponentCost, PlannerInput

    adapter = adapter_of(wan22_dir)
    options = adapter.residency_options(SHAPE)
    expert = block_bytes(adapter.pipe.transformer)
    encoder = next(o.released_bytes for o in options if o.name == "offloaded")
    gib = 2**30
    baseline = 4 * gib
    costs = tuple(
        ComponentCost(component=name, seconds=seconds, peak_bytes=baseline + working)
        for name, seconds, working in (
            ("text_encoder", 0.5, 100 * 2**20), ("transformer", 20.0, gib), ("vae", 5.0, gib),
        )
    )  # fmt: skip
    total = 64 * gib
    headroom = max(gib, total // 50)
    both = baseline + gib + headroom
    budget = both if fits == "both" else both - encoder - expert // 2
    plan = plan_residency(
        PlannerInput(
            baseline_bytes=baseline, costs=costs, options=options, total_bytes=total,
            free_bytes=total, budget_bytes=budget,
        )
    )  # fmt: skip
    chosen = {o.component: o.name for o in plan.choices}
    assert plan.fits
    assert chosen[EXPERTS] == ("resident" if fits == "both" else SWAPPED)
