"""A plug-in is held to the pipeline protocol of `lifecycle.pipelines` when it is loaded: one
written against the protocol's first version is adapted, one that lacks a part is refused in one
line naming it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import Shape
from lifecycle.core.settings.modelspec import MODEL_PRESETS, MemoryModel
from lifecycle.pipelines import register_pipeline
from lifecycle.runtime.pipeline.conformance import EarlierProtocol, conform
from lifecycle.testing.plugins import MinimalPipeline
from tests.conftest import Completed, one_clear_line
from tests.support import EARLIER, plugin

# The same without `decode`, built by a class (known before any rank starts) or by a function
# (known once a rank has built it).
NO_DECODE = EARLIER.replace("    def decode(self, latents, shape):", "    def _decode(self, l, s):")
BY_FUNCTION = NO_DECODE + "\n\ndef build(spec, comm):\n    return EarlierPipeline(spec, comm)\n"


def test_a_plugin_of_the_first_protocol_boots_to_ready(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A plug-in whose denoise takes no guidance_scale (the first protocol) warms up and gets
    to ready, called with only what it takes."""
    env = plugin(tmp_path, EARLIER)
    result = lifecycle_cli("boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TypeError" not in result.stdout + result.stderr
    assert "startup to ready" in result.stdout


def test_a_plugin_class_without_decode_is_refused_before_any_rank_starts(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A plug-in whose class has no decode is one line naming it, exit 2, no run journaled."""
    env = plugin(tmp_path, NO_DECODE)
    result = lifecycle_cli("boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", env=env)
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "decode(latents, shape)" in line
    assert "earlier_plugin:PLUGIN" in line
    assert not (tmp_path / "j.db").exists()


def test_a_built_pipeline_without_decode_is_refused_in_one_line() -> None:
    """The check every rank makes of the pipeline it built names each part it lacks."""

    class Partial:
        spec = MODEL_PRESETS["micro-video"]
        components = ("text_encoder", "dit", "vae")
        parameter_bytes = 0

        def encode_prompt(self, prompt: str, negative_prompt: str) -> None: ...

        def denoise(self, embeds: object, shape: Shape, steps: int, *, seed: int) -> None: ...

    with pytest.raises(ConfigError) as refused:
        conform(Partial(), MODEL_PRESETS["micro-video"])
    message = str(refused.value)
    assert "decode(latents, shape)" in message
    assert "denoise taking the keyword on_step" in message
    assert "residency_options()" in message  # micro-video's spec declares residency


def test_an_earlier_pipeline_is_passed_only_what_it_takes() -> None:
    """The adapted pipeline calls a first-protocol denoise without guidance_scale and its
    encode_prompt with the prompt alone; a current one is returned as it is."""
    calls: list[tuple[object, ...]] = []

    class Earlier:
        spec = MODEL_PRESETS["micro-video"]
        components = ("text_encoder", "dit", "vae")
        parameter_bytes = 0

        def encode_prompt(self, prompt: str) -> str:
            calls.append(("encode", prompt))
            return prompt

        def denoise(
            self, embeds: object, shape: Shape, steps: int, *, seed: int, on_step: object
        ) -> int:
            calls.append(("denoise", embeds, steps, seed))
            return 7

        def decode(self, latents: object, shape: Shape) -> None: ...

        def residency_options(self, shape: Shape) -> tuple[()]:
            return ()

        def apply_residency(self, choices: object) -> None: ...

    adapted = conform(Earlier(), MODEL_PRESETS["micro-video"])
    assert isinstance(adapted, EarlierProtocol)
    shape = Shape(width=64, height=64, frames=1)
    assert adapted.encode_prompt("a cat", "blurry") == "a cat"
    assert adapted.denoise("e", shape, 2, seed=1, guidance_scale=3.0, on_step=print) == 7
    assert calls == [("encode", "a cat"), ("denoise", "e", 2, 1)]
    assert adapted.components == ("text_encoder", "dit", "vae")

    class Current(Earlier):
        def encode_prompt(self, prompt: str, negative_prompt: str) -> str:  # type: ignore[override]
            return prompt

        def denoise(  # type: ignore[override]
            self, embeds: object, shape: Shape, steps: int, *, seed: int, guidance_scale: float,
            on_step: object,
        ) -> int:  # fmt: skip
            return 8

    current = Current()
    assert conform(current, MODEL_PRESETS["micro-video"]) is current


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_a_built_pipeline_without_decode_is_refused_by_the_rank_with_exit_2(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], ranks: str
) -> None:
    """A plug-in whose factory is a plain function (what it builds is known only once built):
    the rank refuses the pipeline it built, journals why, and the boot exits 2 with a last line
    naming what it lacks."""
    env = plugin(tmp_path, BY_FUNCTION + "\nPLUGIN = (SPEC, build)\n")
    result = lifecycle_cli(
        "boot", "--pipeline", "earlier_plugin:PLUGIN", "--num-ranks", ranks, "--db", "j.db",
        "--log-level", "error", env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    refusals = [line for line in result.stderr.splitlines() if line.startswith("lifecycle: error:")]
    assert refusals and all("decode(latents, shape)" in line for line in refusals), result.stderr


def test_a_plugin_whose_import_raises_is_one_line_and_exit_2(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A plug-in module that raises while it is imported (a NameError here) is one line naming
    the target and the error, exit 2, no traceback."""
    env = plugin(tmp_path, EARLIER + "\nPLUGIN = (SPEC, undefined_factory)\n")
    result = lifecycle_cli("boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", env=env)
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "earlier_plugin:PLUGIN" in line and "NameError" in line


@pytest.mark.parametrize(
    ("memory", "named"),
    [
        ("fixed_bytes=float('nan'), bytes_per_token=1024, bytes_per_pixel=3", "fixed_bytes"),
        ("fixed_bytes=0, bytes_per_token=float('inf'), bytes_per_pixel=3", "bytes_per_token"),
        ("fixed_bytes=16 * 2**20, bytes_per_token=1024, bytes_per_pixel=-3", "bytes_per_pixel"),
        # finite, but infinite once multiplied by a request's tokens; too large for a float
        ("fixed_bytes=0, bytes_per_token=1e308, bytes_per_pixel=3", "bytes_per_token"),
        ("fixed_bytes=10**400, bytes_per_token=1024, bytes_per_pixel=3", "fixed_bytes"),
    ],
)
def test_a_plugin_whose_memory_model_is_not_bytes_is_refused_when_loaded(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], memory: str, named: str
) -> None:
    """A plug-in whose spec's MemoryModel holds NaN, infinity, a negative number or more than
    16 EiB is one line naming the plug-in and the field, exit 2, before any rank starts (no
    journal)."""
    source = EARLIER + (
        "\nfrom lifecycle.pipelines import MemoryModel\n"
        f"SPEC = dataclasses.replace(SPEC, memory=MemoryModel({memory}))\n"
        "PLUGIN = (SPEC, EarlierPipeline)\n"
    )
    env = plugin(tmp_path, source)
    result = lifecycle_cli("boot", "--pipeline", "earlier_plugin:PLUGIN", "--db", "j.db", env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_clear_line(result)
    assert "earlier_plugin:PLUGIN" in line and f"memory.{named}" in line
    assert not (tmp_path / "j.db").exists()


def test_registering_a_spec_whose_memory_model_is_nan_is_refused() -> None:
    """`register_pipeline` refuses a spec whose memory estimate would be NaN, naming the field,
    and registers nothing."""
    spec = dataclasses.replace(
        MODEL_PRESETS["micro-video"],
        name="nan-memory-video",
        memory=MemoryModel(fixed_bytes=0, bytes_per_token=math.nan, bytes_per_pixel=3),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError) as refused:
        register_pipeline(spec, MinimalPipeline)
    assert "memory.bytes_per_token" in str(refused.value)
    assert "nan-memory-video" not in MODEL_PRESETS
