"""A pipeline directory's components loaded in parallel: the same pipeline a serial
`from_pretrained` gives, every component journaled as it loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.pipelinedirs import save_small_ltx, save_small_wan
from lifecycle.adapters.diffusers.directory import read_directory
from lifecycle.adapters.diffusers.loading import load_components

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
