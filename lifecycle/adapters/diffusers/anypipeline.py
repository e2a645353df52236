"""Any other diffusers pipeline class: one rank, through the pipeline's own `__call__`, with
the lifecycle's states and journal around it. Forward hooks on each of its model components
measure the component's time and peak, which the request records as its stages; so do its
`encode` and `decode`, which a pipeline calls on its VAE instead of the module itself."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lifecycle.adapters.diffusers.regions import repeated_blocks_of
from lifecycle.pipelines import (
    Comm,
    ModelSpec,
    Shape,
    StageRecord,
    memory_meter,
    synchronize,
)

# A component's entry points besides its forward: a pipeline decodes through `vae.decode`
# (LTX, Flux, Stable Diffusion), which no forward hook sees.
ENTRY_METHODS = ("encode", "decode")


@dataclass(slots=True)
class _Measure:
    seconds: float = 0.0
    peak: int | None = None
    calls: int = 0
    started: float = 0.0
    depth: int = 0  # a decode that calls forward (or the reverse) is one call, timed once


class GenericAdapter:
    """A diffusers pipeline run as one call per request."""

    def __init__(self, spec: ModelSpec, comm: Comm, pipe: Any) -> None:
        """On one rank only (the table of families refuses more, naming the classes that run
        on several)."""
        self.spec = spec
        self.comm = comm
        self.pipe = pipe
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        self._meter = memory_meter(comm.device)
        modules = {
            name: module
            for name, module in pipe.components.items()
            if isinstance(module, torch.nn.Module)
        }
        self.components: tuple[str, ...] = tuple(modules)
        self._measures = {name: _Measure() for name in modules}
        for name, module in modules.items():
            module.register_forward_pre_hook(self._begin(name))
            module.register_forward_hook(self._end(name), always_call=True)
            for method in ENTRY_METHODS:
                found = getattr(module, method, None)
                if callable(found):
                    setattr(module, method, self._timed(name, found))
        self._parameters = set(inspect.signature(type(pipe).__call__).parameters)

    @property
    def parameter_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for module in self.pipe.components.values()
            if isinstance(module, torch.nn.Module)
            for p in module.parameters()
        )

    def repeated_blocks(self) -> tuple[Any, ...]:
        return repeated_blocks_of(*self.pipe.components.values())

    def _enter(self, name: str) -> None:
        measure = self._measures[name]
        measure.depth += 1
        if measure.depth == 1:
            self._meter.reset_peak()
            measure.started = time.perf_counter()

    def _leave(self, name: str) -> None:
        measure = self._measures[name]
        measure.depth -= 1
        if measure.depth > 0:
            return
        synchronize(self.comm.device)
        measure.seconds += time.perf_counter() - measure.started
        measure.calls += 1
        peak = self._meter.peak_bytes()
        if peak is not None:
            measure.peak = peak if measure.peak is None else max(measure.peak, peak)

    def _begin(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, _args: Any) -> None:
            self._enter(name)

        return hook

    def _end(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _out: Any) -> None:
            self._leave(name)

        return hook

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._enter(name)
            try:
                return method(*args, **kwargs)
            finally:
                self._leave(name)

        return timed

    def measured_stages(self) -> tuple[StageRecord, ...]:
        """Each component's time and peak over the last request, from its forward hooks."""
        return tuple(
            StageRecord(name=name, ran=m.calls > 0, seconds=m.seconds, peak_bytes=m.peak)
            for name, m in self._measures.items()
        )

    def encode_prompt(self, prompt: str, negative_prompt: str) -> tuple[str, str]:
        for measure in self._measures.values():
            measure.seconds, measure.peak, measure.calls, measure.depth = 0.0, None, 0, 0
        return prompt, negative_prompt

    @torch.no_grad()
    def denoise(
        self,
        embeds: tuple[str, str],
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor:
        """The whole call: its output frames (float, frames x height x width x 3)."""
        prompt, negative = embeds
        given: dict[str, Any] = {
            "prompt": prompt,
            "height": shape.height,
            "width": shape.width,
            "num_inference_steps": steps,
            "guidance_scale": guidance_scale,
            "generator": torch.Generator("cpu").manual_seed(seed),
            "output_type": "np",
            "negative_prompt": negative or None,
            "num_frames": shape.frames,
        }

        def after_step(_pipe: Any, step: int, _t: Any, _kwargs: dict[str, Any]) -> dict[str, Any]:
            on_step(step)
            return {}

        given["callback_on_step_end"] = after_step
        out = self.pipe(**{k: v for k, v in given.items() if k in self._parameters})
        frames = getattr(out, "frames", None)
        video = np.asarray(frames[0] if frames is not None else out.images)
        return torch.from_numpy(video.reshape(-1, *video.shape[-3:]).astype(np.float32))

    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        """The call's frames in [0, 1] as uint8 (frames, height, width, 3)."""
        return (latents * 255.0).round().clamp(0, 255).to(torch.uint8)
