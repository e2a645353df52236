"""`--dtype`, the precision components load in, as torch spells it: one name for the whole
pipeline (`bfloat16`) or one per component (`transformer=bfloat16,vae=float32`); `auto` is what
the model's family and files call for (pure: torch is not imported here)."""

from __future__ import annotations

import difflib
import re

from lifecycle.core.errors import ConfigError, Setting

AUTO = "auto"
# The dtypes a component may be loaded in, by the names torch gives them (`torch.bfloat16`).
DTYPES = (AUTO, "bfloat16", "float16", "float32")
DTYPE = Setting("dtype")
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _name(word: str, given: str) -> str:
    """One dtype name of `given`; ConfigError naming it, and torch's spelling where it is near."""
    if word in DTYPES:
        return word
    near = difflib.get_close_matches(word, DTYPES, n=1, cutoff=0.5)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise ConfigError(
        DTYPE, f" {given}: {word!r} is not one of {', '.join(DTYPES)}, as torch names them{hint}"
    )


def parse_dtype(given: str) -> str:
    """`given` in its canonical form: one name, or COMPONENT=NAME pairs sorted by component with
    those at auto left out (`auto` when none is left); ConfigError in one line naming what is
    wrong."""
    text = given.strip()
    if "=" not in text:
        return _name(text, given)
    chosen: dict[str, str] = {}
    for pair in text.split(","):
        component, sep, word = (part.strip() for part in pair.partition("="))
        if not sep or not _COMPONENT.fullmatch(component):
            raise ConfigError(
                DTYPE,
                f" {given}: {pair.strip()!r} is not COMPONENT=DTYPE (e.g."
                " transformer=bfloat16,vae=float32)",
            )
        if component in chosen:
            raise ConfigError(DTYPE, f" {given}: {component} is named twice")
        chosen[component] = _name(word, given)
    asked = sorted((c, d) for c, d in chosen.items() if d != AUTO)
    return ",".join(f"{c}={d}" for c, d in asked) or AUTO
