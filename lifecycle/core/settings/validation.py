"""The limits a server's settings and a request are held to, and the check a request's shape
passes before anything runs: each failure one ConfigError naming the setting, which the command
line or a config file then spells (the settings' own check is `ServerArgs`'s, in config.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lifecycle.core.errors import ConfigError, Setting
from lifecycle.core.format.records import Shape

if TYPE_CHECKING:
    from lifecycle.core.settings.modelspec import ModelSpec

# Hard limits on one request and on a server's settings; anything outside them is refused
# with a clear reason before it runs.
MAX_SIDE = 4096
MAX_FRAMES = 257
MAX_STEPS = 200
MAX_RANKS = 64
MAX_PROMPT_CHARS = 4096
MIN_MEMORY_BUDGET = 64 * 2**20
MAX_RING_CAPACITY = 1 << 22
# A seed is 64 bits, as torch's generators take it: a larger one would be refused only when
# the first request is run, well into the startup.
MAX_SEED = 2**64 - 1

CFG, ULYSSES, RANKS = Setting("cfg_parallel"), Setting("ulysses"), Setting("num_ranks")


def validate_shape(model: ModelSpec, shape: Shape, steps: int) -> None:
    """Raise ConfigError unless a request of this shape and steps is one the model can run
    (naming its first field that is not)."""
    for field, why in shape_problems(model, shape, steps):
        raise ConfigError(why, field=field)


def shape_problems(model: ModelSpec, shape: Shape, steps: int) -> list[tuple[str, str]]:
    """Every field of a request's shape and steps the model cannot run, with why (none: it
    can run it)."""
    problems = []
    m = model.spatial_multiple
    for name, side in (("width", shape.width), ("height", shape.height)):
        if not m <= side <= MAX_SIDE or side % m:
            problems.append(
                (name, f"{name} must be a multiple of {m} in {m}..{MAX_SIDE}, not {side}")
            )
    if not 1 <= shape.frames <= MAX_FRAMES or (shape.frames - 1) % model.frame_multiple:
        problems.append(
            (
                "frames",
                f"frames must be 1 + {model.frame_multiple}k in 1..{MAX_FRAMES}, not"
                f" {shape.frames}",
            )
        )
    if not 1 <= steps <= MAX_STEPS:
        problems.append(("steps", f"steps must be in 1..{MAX_STEPS}, not {steps}"))
    return problems
