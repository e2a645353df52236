"""`lifecycle.testing`: the minimal plug-in boots on real ranks, `check_plugin` passes it and
names what a broken pipeline gets wrong, and every module imports without pytest."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import CollectiveStarted
from lifecycle.pipelines import Comm, ModelSpec, Shape
from lifecycle.testing.plugins import PLUGIN, SPEC, MinimalPipeline, check_plugin
from tests.conftest import Completed
from tests.support import journal_events
from tests.support.interpreter import run_python


@pytest.mark.ranks
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_minimal_plugin_boots_to_ready(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path, ranks: int
) -> None:
    """`--pipeline lifecycle.testing.plugins:PLUGIN` gets every rank to ready, exit 0; at
    two ranks each denoising step's average over the world is a journaled collective."""
    result = lifecycle_cli(
        "boot", "--pipeline", "lifecycle.testing.plugins:PLUGIN", "--num-ranks", str(ranks),
        "--db", "j.db",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "startup to ready" in result.stdout
    collectives = [
        e.event.purpose
        for e in journal_events(tmp_path / "j.db")
        if isinstance(e.event, CollectiveStarted)
    ]
    assert ("minimal-latents" in collectives) is (ranks == 2)


def test_check_plugin_runs_one_request_through_the_minimal_pipeline() -> None:
    """The minimal plug-in passes: a uint8 video of the smallest shape, its three stages
    timed under the pipeline's component names, the same checksum for the same seed."""
    first = check_plugin(PLUGIN)
    again = check_plugin(PLUGIN)
    assert first.video is not None and first.video.dtype == torch.uint8
    assert tuple(first.video.shape) == (5, 64, 64, 3)
    assert [s.name for s in first.result.stages] == ["text_encoder", "denoiser", "decoder"]
    assert len(first.result.step_s) == 2
    assert first.result.checksum == again.result.checksum


class FloatFrames(MinimalPipeline):
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        return super().decode(latents, shape).float()


class Transposed(MinimalPipeline):
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        return super().decode(latents, shape).permute(0, 3, 1, 2)


class Silent(MinimalPipeline):
    def denoise(
        self, embeds: torch.Tensor, shape: Shape, steps: int, *, seed: int,
        guidance_scale: float, on_step: Callable[[int], None],
    ) -> torch.Tensor:  # fmt: skip
        return super().denoise(
            embeds, shape, steps, seed=seed, guidance_scale=guidance_scale, on_step=lambda _: None
        )


class StepsAtTheEnd(MinimalPipeline):
    """Does all its steps, then calls on_step once per step."""

    def denoise(
        self, embeds: torch.Tensor, shape: Shape, steps: int, *, seed: int,
        guidance_scale: float, on_step: Callable[[int], None],
    ) -> torch.Tensor:  # fmt: skip
        latents = super().denoise(
            embeds, shape, steps, seed=seed, guidance_scale=guidance_scale, on_step=lambda _: None
        )
        for step in range(steps):
            on_step(step)
        return latents


class NoDecode:
    components = ("text_encoder", "denoiser", "decoder")
    parameter_bytes = 0

    def __init__(self, spec: ModelSpec, comm: Comm) -> None:
        self.spec = spec

    def encode_prompt(self, prompt: str, negative_prompt: str) -> None: ...


@pytest.mark.parametrize(
    ("pipeline", "named"),
    [
        (FloatFrames, "decode returned torch.float32, not torch.uint8"),
        (Transposed, "decode returned shape (5, 3, 64, 64), not (5, 64, 64, 3)"),
        (Silent, "denoise called on_step 0 times for 2 steps"),
        (StepsAtTheEnd, "denoise called on_step only before or after its work"),
        (NoDecode, "decode(latents, shape)"),
    ],
)
def test_check_plugin_names_what_a_pipeline_gets_wrong(pipeline: type, named: str) -> None:
    """A pipeline that breaks the protocol, in its signatures or in what it returns, is a
    ConfigError naming the part, as `--pipeline` would refuse it."""
    with pytest.raises(ConfigError) as refused:
        check_plugin((SPEC, pipeline))
    assert named in str(refused.value)


class SlowFirstStep(MinimalPipeline):
    """Spends most of its denoise in the first step (a one-time warm-up), then steps quickly."""

    def denoise(
        self, embeds: torch.Tensor, shape: Shape, steps: int, *, seed: int,
        guidance_scale: float, on_step: Callable[[int], None],
    ) -> torch.Tensor:  # fmt: skip
        def after(step: int) -> None:
            if step == 0:
                time.sleep(0.5)
            on_step(step)

        return super().denoise(
            embeds, shape, steps, seed=seed, guidance_scale=guidance_scale, on_step=after
        )


def test_check_plugin_passes_a_pipeline_whose_first_step_takes_most_of_the_time() -> None:
    """Steps of very uneven length are still steps: a pipeline whose first step holds a long
    warm-up, with real work between its on_step calls, passes."""
    generated = check_plugin((SPEC, SlowFirstStep), steps=3)
    assert len(generated.result.step_s) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [("fixed_bytes", math.nan), ("bytes_per_token", math.inf), ("bytes_per_pixel", -1)],
)
def test_check_plugin_names_a_memory_model_that_is_not_bytes(field: str, value: float) -> None:
    """A spec whose MemoryModel holds NaN, infinity or a negative number is a ConfigError
    naming the field, as `--pipeline` refuses it."""
    memory = dataclasses.replace(SPEC.memory, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        check_plugin((dataclasses.replace(SPEC, memory=memory), MinimalPipeline))
    assert f"memory.{field}" in str(refused.value)


def test_every_testing_module_imports_without_pytest() -> None:
    """With pytest unimportable, each module of lifecycle.testing imports (what a wheel
    installed without the test extras needs)."""
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import lifecycle.testing, lifecycle.testing.journals, lifecycle.testing.plugins,"
        " lifecycle.testing.storecontract\n"
        "print('imported')"
    )
    done = run_python(code, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"
