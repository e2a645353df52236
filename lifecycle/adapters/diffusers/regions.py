"""A diffusers model's repeated blocks, as it declares them (`_repeated_blocks`, the class
names `compile_repeated_blocks` compiles): what `--compile` compiles of a library pipeline."""

from __future__ import annotations

from typing import Any


def repeated_blocks_of(*models: Any) -> tuple[Any, ...]:
    """Every module of `models` (None skipped) whose class its model names as repeated."""
    blocks: list[Any] = []
    for model in models:
        names = set(getattr(model, "_repeated_blocks", None) or ())
        if model is None or not names:
            continue
        blocks += [m for m in model.modules() if type(m).__name__ in names]
    return tuple(blocks)
