"""A pipeline held to the protocol of `lifecycle.pipelines`: what it lacks is refused in one
line, and what an earlier version of the protocol left out is adapted, so that a plug-in written
against that version keeps working (the CHANGELOG lists each version).

Version 1 of the protocol: `encode_prompt(prompt)` and `denoise(embeds, shape, steps, *, seed,
on_step)`. Version 2 added the negative prompt to `encode_prompt` and `guidance_scale` to
`denoise`: a version-1 pipeline is called with only what it takes (its own negative prompt and
guidance, whatever the request says).
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard, Unpack

import structlog
import torch

from lifecycle.core.errors import ConfigError, Setting
from lifecycle.core.format.records import Shape
from lifecycle.core.settings.modelspec import ModelSpec

PIPELINE = Setting("pipeline")  # the option that names a plug-in

log = structlog.get_logger("lifecycle.pipelines")


class DenoiseOptions(TypedDict):
    """What `Pipeline.denoise` takes by keyword, as one mapping: for a wrapper that passes a
    call on (a pipeline itself spells them, as the protocol does)."""

    seed: int
    guidance_scale: float
    on_step: Callable[[int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Takes:
    """What an earlier version of the protocol lets a pipeline leave out, found in its
    signatures: each False is an argument it is not passed."""

    negative_prompt: bool = True
    guidance_scale: bool = True

    @property
    def current(self) -> bool:
        return self.negative_prompt and self.guidance_scale

    def left_out(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, taken in (
                ("encode_prompt(negative_prompt)", self.negative_prompt),
                ("denoise(guidance_scale=)", self.guidance_scale),
            )
            if not taken
        )


def protocol_gaps(target: Any, *, spec: ModelSpec | None, bound: bool) -> tuple[list[str], Takes]:
    """What `target` (a pipeline, or its class when `bound` is False) lacks of the protocol,
    in words, and what of the current version it takes."""
    gaps: list[str] = []
    if bound:
        components = getattr(target, "components", None)
        if not (
            isinstance(components, Sequence)
            and not isinstance(components, str)
            and all(isinstance(c, str) for c in components)
        ):
            gaps.append("components (a tuple of component names)")
        if not isinstance(getattr(target, "spec", None), ModelSpec):
            gaps.append("spec (its ModelSpec)")
        if not hasattr(target, "parameter_bytes"):
            gaps.append("parameter_bytes")
    encode = _parameters(target, "encode_prompt", bound=bound)
    denoise = _parameters(target, "denoise", bound=bound)
    decode = _parameters(target, "decode", bound=bound)
    negative = guidance = True
    if encode is None:
        gaps.append("encode_prompt(prompt, negative_prompt)")
    elif not (_positional(encode, 1) or _positional(encode, 2)):
        gaps.append("encode_prompt taking the prompt and the negative prompt")
    else:
        negative = _positional(encode, 2)
    if denoise is None:
        gaps.append("denoise(embeds, shape, steps, *, seed, guidance_scale, on_step)")
    else:
        if not _positional(denoise, 3):
            gaps.append("denoise taking embeds, shape and steps")
        gaps.extend(
            f"denoise taking the keyword {name}"
            for name in ("seed", "on_step")
            if not _keyword(denoise, name)
        )
        guidance = _keyword(denoise, "guidance_scale")
        gaps.extend(
            f"denoise without its required keyword {p.name} (the lifecycle never passes it)"
            for p in denoise
            if p.kind is inspect.Parameter.KEYWORD_ONLY
            and p.default is inspect.Parameter.empty
            and p.name not in ("seed", "guidance_scale", "on_step")
        )
    if decode is None:
        gaps.append("decode(latents, shape)")
    elif not _positional(decode, 2):
        gaps.append("decode taking latents and shape")
    if spec is not None and spec.declares_residency:
        gaps.extend(
            f"{name}() (its spec declares residency)"
            for name in ("residency_options", "apply_residency")
            if _parameters(target, name, bound=bound) is None
        )
    return gaps, Takes(negative_prompt=negative, guidance_scale=guidance)


def refusal(what: str, gaps: Sequence[str]) -> ConfigError:
    return ConfigError(
        PIPELINE,
        f" {what} does not follow the lifecycle.pipelines protocol: it lacks {'; '.join(gaps)}",
    )


MEMORY_FIELDS = ("fixed_bytes", "bytes_per_token", "bytes_per_pixel")
MEMORY_FIELD_LIMIT = 2**64  # bytes: more than any device holds, and finite times any request


def memory_gaps(spec: ModelSpec) -> list[str]:
    """Each field of the spec's memory model that is not a number of bytes (finite, 0 to
    16 EiB), in words: an estimate made of it is NaN, infinite or negative, or becomes infinite
    once multiplied by a request's tokens, which admission can neither compare with a budget
    nor count in bytes."""
    gaps = []
    for name in MEMORY_FIELDS:
        value = getattr(spec.memory, name, None)
        said = f"memory.{name} is {str(value)[:40]}"
        if not _bytes_at_all(value):
            gaps.append(said)
        elif value > MEMORY_FIELD_LIMIT:
            gaps.append(f"{said}, more than 16 EiB")
    return gaps


def _bytes_at_all(value: object) -> TypeGuard[int | float]:
    """A number (not a bool), finite, 0 or more; an int is compared as it is (10**400 has no
    float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= 0


def check_memory(target: str, spec: ModelSpec) -> None:
    """Refuse a spec whose memory model is not bytes, in one line naming each field."""
    gaps = memory_gaps(spec)
    if gaps:
        raise ConfigError(
            PIPELINE,
            f" {target}: its ModelSpec's {'; '.join(gaps)}: a MemoryModel's fields are bytes,"
            " finite, 0 to 16 EiB (all 0 declares no estimate)",
        )


def check_factory(target: str, factory: Any, spec: ModelSpec) -> None:
    """Refuse a plug-in when it is loaded, before any rank starts: a memory model that is not
    bytes, and what its factory builds when that can be known without building it (a class,
    or a function whose return annotation is one); every rank checks the pipeline itself again
    once built (`conform`)."""
    check_memory(target, spec)
    if not callable(factory):
        raise ConfigError(PIPELINE, f" {target}: its factory is not callable")
    built = factory if isinstance(factory, type) else _returned_class(factory)
    if built is None or _is_protocol(built):
        return
    gaps, _ = protocol_gaps(built, spec=spec, bound=False)
    if gaps:
        raise refusal(f"{target} ({built.__module__}.{built.__qualname__})", gaps)


def conform(pipeline: Any, spec: ModelSpec) -> Any:
    """The pipeline a factory built, held to the protocol: itself when it follows the current
    version, adapted when it follows an earlier one, refused (ConfigError) otherwise."""
    what = f"of model {spec.name!r} ({type(pipeline).__qualname__})"
    gaps, takes = protocol_gaps(pipeline, spec=spec, bound=True)
    if gaps:
        raise refusal(what, gaps)
    if takes.current:
        return pipeline
    log.warning(
        "pipeline_protocol_adapted",
        model=spec.name,
        pipeline=type(pipeline).__qualname__,
        not_passed=list(takes.left_out()),
    )
    return EarlierProtocol(pipeline, takes)


class EarlierProtocol:
    """A pipeline written against an earlier version of the protocol, called with only the
    arguments it takes; everything else is the pipeline's own."""

    def __init__(self, pipeline: Any, takes: Takes) -> None:
        self._pipeline = pipeline
        self._takes = takes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> Any:
        if self._takes.negative_prompt:
            return self._pipeline.encode_prompt(prompt, negative_prompt)
        return self._pipeline.encode_prompt(prompt)

    def denoise(
        self, embeds: Any, shape: Shape, steps: int, **options: Unpack[DenoiseOptions]
    ) -> torch.Tensor:
        given: dict[str, Any] = dict(options)
        if not self._takes.guidance_scale:
            del given["guidance_scale"]
        denoised: torch.Tensor = self._pipeline.denoise(embeds, shape, steps, **given)
        return denoised


def _parameters(target: Any, name: str, *, bound: bool) -> list[inspect.Parameter] | None:
    """The parameters of `target.name` as a caller passes them (without `self`), or None
    when it has no such callable."""
    method = inspect.getattr_static(target, name, None) if not bound else None
    value = getattr(target, name, None)
    if value is None or not callable(value):
        return None
    try:
        parameters = list(inspect.signature(value).parameters.values())
    except (TypeError, ValueError):
        return None
    if not bound and not isinstance(method, staticmethod | classmethod) and parameters:
        parameters = parameters[1:]  # the function of a class: its first parameter is self
    return parameters


def _positional(parameters: list[inspect.Parameter], count: int) -> bool:
    """Whether a call with `count` positional arguments binds."""
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return True
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    return len(required) <= count <= len(positional)


def _keyword(parameters: list[inspect.Parameter], name: str) -> bool:
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (
            p.name == name
            and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
        for p in parameters
    )


def _returned_class(factory: Callable[..., Any]) -> type | None:
    try:
        returned = typing.get_type_hints(factory).get("return")
    except Exception:  # an annotation that does not resolve tells nothing: checked once built
        return None
    return returned if isinstance(returned, type) else None


def _is_protocol(cls: type) -> bool:
    """A factory annotated as returning the protocol itself says nothing of its class."""
    return bool(getattr(cls, "_is_protocol", False))
