"""Plug-in modules the tests write into a tmp_path and boot with `--pipeline MODULE:PLUGIN`."""

from __future__ import annotations

import textwrap
from pathlib import Path

# A plug-in of the protocol's first version: `encode_prompt(prompt)` and a `denoise` without
# `guidance_scale`, around `lifecycle.testing`'s minimal pipeline.
EARLIER = """
import dataclasses

from lifecycle.testing.plugins import SPEC as MINIMAL, MinimalPipeline

SPEC = dataclasses.replace(MINIMAL, name="earlier-video")


class EarlierPipeline:
    def __init__(self, spec, comm):
        self._inner = MinimalPipeline(spec, comm)
        self.spec = spec
        self.components = self._inner.components

    @property
    def parameter_bytes(self):
        return self._inner.parameter_bytes

    def encode_prompt(self, prompt):
        return self._inner.encode_prompt(prompt, "")

    def denoise(self, embeds, shape, steps, *, seed, on_step):
        return self._inner.denoise(
            embeds, shape, steps, seed=seed, guidance_scale=5.0, on_step=on_step
        )

    def decode(self, latents, shape):
        return self._inner.decode(latents, shape)


PLUGIN = (SPEC, EarlierPipeline)
"""


def plugin(tmp_path: Path, source: str) -> dict[str, str]:
    """Write `source` as the module earlier_plugin in `tmp_path`; the environment that finds it."""
    (tmp_path / "earlier_plugin.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": str(tmp_path)}
