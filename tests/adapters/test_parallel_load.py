"""A pipeline directory's components loaded in parallel: the same pipeline a serial
`from_pretrained` gives, every component journaled as it loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.pipelinedirs import save_small_ltx, save_small_wan
from lifecycle.adapters.diffusers.directory import read_directory
from lifecycle.adapters.diffusers.loading import load_components
from tests.conftest import run_cli

diffusers = pytest.importorskip("diffusers")


def config_of(component: object) -> dict[str, object]:
    config = component.config  # type: ignore[attr-defined]
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def same_pipeline(a: object, b: object) -> None:
    """Every component of `a` is `b`'s: the same class, config and weights, bit for bit."""
    components_a, components_b = a.components, b.components  # type: ignore[attr-defined]
    assert components_a.keys() == components_b.keys()
    for name, first in components_a.items():
        second = components_b[name]
        assert type(first) is type(second), name
        if isinstance(first, torch.nn.Module):
            left, right = first.state_dict(), second.state_dict()
            assert left.keys() == right.keys(), name
            for key, tensor in left.items():
                assert not tensor.is_meta, f"{name}.{key} was left empty"
                assert tensor.dtype == right[key].dtype, f"{name}.{key}"
                assert torch.equal(tensor, right[key]), f"{name}.{key}"
            assert config_of(first) == config_of(second), name
        elif hasattr(first, "config"):
            assert config_of(first) == config_of(second), name
    tokenizer_a, tokenizer_b = components_a.get("tokenizer"), components_b.get("tokenizer")
    if tokenizer_a is not None:
        text = "a cat walks in the rain at night"
        assert tokenizer_a(text).input_ids == tokenizer_b(text).input_ids


@pytest.mark.parametrize("save", [save_small_wan, save_small_ltx], ids=["wan", "ltx"])
def test_components_loaded_in_parallel_are_the_serial_pipeline(
    tmp_path: Path, save: object
) -> None:
    """Loaded three times over in parallel (text encoder, transformer and VAE each in a thread
    of its own), the pipeline is `from_pretrained`'s, weight for weight, with no parameter
    left empty by another thread's skeleton."""
    path = save(tmp_path / "model")  # type: ignore[operator]
    directory = read_directory(str(path))
    cls = getattr(diffusers, directory.class_name)
    serial = cls.from_pretrained(str(path), local_files_only=True)
    for _ in range(3):
        same_pipeline(load_components(cls, directory, torch.device("cpu")), serial)


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_boot_shows_each_load_once_and_no_librarys_progress_bar(tmp_path: Path) -> None:
    """A boot of a Wan directory: the console's gate-check row names each component's load,
    and stderr holds none of diffusers' or transformers' own progress bars ("Loading pipeline
    components...", "Loading weights"), which the parallel loads would draw over each other."""
    model = save_small_wan(tmp_path / "small-wan")
    done = run_cli(
        "lifecycle",
        ["boot", "--model-path", str(model), "--db", "j.db", "--default-shape", "64x64x5",
         "--default-steps", "2", "--log-level", "warning"],
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (gate_check,) = [line for line in done.stdout.splitlines() if line.startswith("  gate-check")]
    for component in ("text_encoder", "transformer", "vae"):
        assert f"loaded {component} " in gate_check
    assert "Loading" not in done.stderr and "it/s]" not in done.stderr, done.stderr[-2000:]


def test_the_librarys_progress_bars_are_as_they_were_after_the_loads(tmp_path: Path) -> None:
    """The bars are off only while the components load: a program that loads a pipeline
    directory through the lifecycle still gets diffusers' and transformers' bars after, and
    one that turned them off keeps them off."""
    from transformers.utils import logging as transformers_logging

    diffusers_logging = diffusers.utils.logging
    path = save_small_wan(tmp_path / "model")
    directory = read_directory(str(path))
    cls = getattr(diffusers, directory.class_name)
    before = transformers_logging.is_progress_bar_enabled()  # off where HF_HUB_DISABLE_... is set
    load_components(cls, directory, torch.device("cpu"))
    assert diffusers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled() is before
    diffusers_logging.disable_progress_bar()
    try:
        load_components(cls, directory, torch.device("cpu"))
        assert not diffusers_logging.is_progress_bar_enabled()
    finally:
        diffusers_logging.enable_progress_bar()
