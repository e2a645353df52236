"""The model families the lifecycle drives component by component, against diffusers alone:
/generate on Qwen-Image and on Wan 2.2 (two experts) through a real `lifecycle serve
--model-path DIR` against the library's own pipeline call in a warm process, and Wan 2.2's
experts swapped against both resident (bench.expertswap).

The directories are built offline and saved by diffusers' `save_pretrained`: tiny-qwen-image
(lifecycle.adapters.diffusers.qwen.tinyqwen) and a Wan 2.2 directory of the tests'
(bench.pipelinedirs.save_small_wan22) at a size where weights outweigh the working
memory, as they do in the real experts.

`python -m bench.families` is the warm worker of the library's side for Qwen-Image
(bench.procs' protocol): `QwenImagePipeline.from_pretrained` once, then one call per round.
Wan 2.2's side is bench.wanplain's `WanPipeline`, which loads `transformer_2` and
`boundary_ratio` from the directory as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.diffusers import ENV
from bench.expertswap import experts_rows, measure_experts
from bench.procs import Pool
from bench.stats import interleave, median
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most
from bench.wanplain import call_arguments, loaded, warm_round
from bench.wanserving import READY_TIMEOUT_S, WanServer, generate_body

GENERATE_TARGET = 1.05
QWEN, WAN22 = "Qwen-Image", "Wan 2.2"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    """The Wan 2.2 directory's transformers (heads of 8, blocks, FFN width), each family's
    request (width, height, frames, steps) and the rounds of each comparison."""

    wan22: tuple[int, int, int]
    requests: Mapping[str, tuple[int, int, int, int]]
    rounds: int


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(
            wan22=(2, 2, 32), requests={QWEN: (32, 32, 1, 2), WAN22: (32, 32, 5, 4)}, rounds=1
        )
    # Each expert 66 MiB of blocks (16 heads of 8, 4 blocks, FFN 16384 wide) against about 17
    # MiB of working memory at 96x96x9. A request takes 1 to 3 s on two quiet cores (tiny-qwen-
    # image at 128x128 and 8 steps took 0.17 s, which another process's load made 2 to 30 times
    # longer on either side).
    return Sized(
        wan22=(16, 4, 16384),
        requests={QWEN: (320, 320, 1, 20), WAN22: (96, 96, 9, 6)},
        rounds=9,
    )


def save_directories(workdir: Path, sized: Sized) -> dict[str, Path]:
    from bench.pipelinedirs import save_small_wan22
    from lifecycle.adapters.diffusers.qwen.tinyqwen import build_tiny_qwen_image

    heads, layers, ffn_dim = sized.wan22
    progress("families: saving tiny-qwen-image and a Wan 2.2 directory with save_pretrained")
    qwen = workdir / "tiny-qwen-image"
    build_tiny_qwen_image().save_pretrained(str(qwen))
    wan22 = save_small_wan22(workdir / "wan22", heads=heads, layers=layers, ffn_dim=ffn_dim)
    return {QWEN: qwen, WAN22: wan22}


# -- the library's side ----------------------------------------------------------------------


def qwen_image_call(pipe: Any, request: Mapping[str, Any], **call: Any) -> Any:
    """`QwenImagePipeline.__call__` with /generate's fields (its guidance as true_cfg_scale,
    as the lifecycle takes it; left out, the pipeline's own) and `call`'s arguments: the
    image in [0, 1], (1, height, width, 3)."""
    if "guidance_scale" in request:
        call = {"true_cfg_scale": request["guidance_scale"], **call}
    return pipe(**call_arguments(request), **call).images


def warm_task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """A round of the Qwen-Image worker (bench.wanplain.warm_round's): QwenImagePipeline
    loaded from the directory the first time (untimed), then called, timed around the call
    alone."""
    from diffusers import QwenImagePipeline

    return warm_round(
        payload, load=functools.partial(loaded, QwenImagePipeline), call=qwen_image_call
    )


# -- /generate against the library's call ----------------------------------------------------

PLAIN = {QWEN: ("bench.families", "QwenImagePipeline"), WAN22: ("bench.wanplain", "WanPipeline")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    """Both sides' seconds, paired by round, whether their outputs' checksums agreed, and of
    each served request the seconds its rank took (`total_s`) and its steps took."""

    served_s: tuple[float, ...]
    plain_s: tuple[float, ...]
    same_output: bool
    rank_s: tuple[float, ...]
    steps_s: tuple[float, ...]


def model_args(request: tuple[int, int, int, int]) -> tuple[str, ...]:
    """The server's default request: the one measured (its bounded warmup a smaller one)."""
    width, height, frames, steps = request
    return ("--default-shape", f"{width}x{height}x{frames}", "--default-steps", str(steps))


def measure_generate(
    settings: Settings, family: str, directory: Path, request: tuple[int, int, int, int],
    rounds: int,
) -> Served:  # fmt: skip
    """One server of one rank and one warm library process, the two alternated round by
    round after one untimed request each; nothing else running."""
    sent = generate_body(request)
    module, _ = PLAIN[family]
    served: list[dict[str, Any]] = []
    plain: list[str] = []
    server = WanServer(
        workdir=settings.workdir, label=f"families-{family.replace(' ', '-').lower()}",
        directory=directory, args=model_args(request), env=ENV,
    )  # fmt: skip
    pool: Pool | None = None
    try:
        server.wait_ready()
        pool = Pool(module, size=1, workdir=settings.workdir, timeout_s=READY_TIMEOUT_S)
        payload = {"directory": str(directory), "request": sent}

        def serve_side() -> float:
            seconds, reply = server.generate(sent)
            served.append(reply)
            return seconds

        def plain_side(pool: Pool = pool) -> float:
            (doc,) = pool.round([payload])
            plain.append(doc["checksum"])
            return float(doc["seconds"])

        progress(f"families: {family} /generate against {PLAIN[family][1]}, {rounds} rounds")
        paired = interleave(serve_side, plain_side, pairs=rounds, discard=1)
    finally:
        if pool is not None:
            pool.close()
        server.stop()
    kept = served[1:]  # the untimed request left out, as interleave leaves it out
    return Served(
        served_s=paired.a,
        plain_s=paired.b,
        same_output={r["checksum"] for r in served} == set(plain),
        rank_s=tuple(float(r["total_s"]) for r in kept),
        steps_s=tuple(float(sum(r["step_s"])) for r in kept),
    )


def generate_row(
    family: str, measured: Served, request: tuple[int, int, int, int], directory_note: str
) -> Row:
    ratio = median([a / b for a, b in zip(measured.served_s, measured.plain_s, strict=True)])
    served, plain = median(measured.served_s), median(measured.plain_s)
    width, height, frames, steps = request
    shape = f"{width}x{height}" + (f"x{frames}" if frames > 1 else "")
    sent = generate_body(request)
    pipeline = PLAIN[family][1]
    call, experts = (
        ("true_cfg_scale the request's guidance, as the lifecycle takes it", "")
        if family == QWEN
        else (
            "transformer_2 and boundary_ratio from the directory, guidance_scale_2 unset as"
            " the request leaves it",
            ", both experts resident",
        )
    )
    outside = median([a - r for a, r in zip(measured.served_s, measured.rank_s, strict=True)])
    rank_s, steps_s = median(measured.rank_s), median(measured.steps_s)
    return Row(
        figure=f"families: {family} /generate, lifecycle serve 1 rank",
        value=format_seconds(served),
        baseline=format_seconds(plain) + f" {pipeline}",
        **ratio_at_most(ratio, GENERATE_TARGET, spec=".2f"),
        how=(
            f"POST /generate {shape} at {steps} steps (prompt, negative prompt, guidance"
            f" {sent['guidance_scale']:g}, seed {sent['seed']}), JSON reply, the seconds the"
            f" client waited, to `lifecycle serve --model-path DIR {' '.join(model_args(request))}`"
            " with LIFECYCLE_DISABLE_AUTO_RESIDENCY=1 (the reference residency: the VAE whole,"
            f" the text encoder resident{experts}); against"
            f" {pipeline}.__call__ ({call}) with the same fields in a warm process"
            " (from_pretrained of the same directory), timed around the call; one untimed"
            f" request each, then {len(measured.served_s)} rounds alternated (A B, B A, ...),"
            " no other server running; medians, the ratio is the median of the paired ratios"
            f" (ratio of the medians: {format_ratio(served / plain)}); outputs"
            f" {'identical' if measured.same_output else 'not bit for bit'} (checksums); served,"
            f" the rank's own request (the reply's total_s) took {format_seconds(rank_s)}, its"
            f" steps {format_seconds(steps_s)}, and the rest (HTTP, the control channel, the"
            f" reply) {format_seconds(outside)} (median of each request's difference). DIR:"
            f" {directory_note}"
        ),
    )


def directory_notes(sized: Sized) -> dict[str, str]:
    heads, layers, ffn_dim = sized.wan22
    return {
        QWEN: "tiny-qwen-image (2 transformer blocks, 4 heads of 16) saved by save_pretrained",
        WAN22: (
            f"a Wan 2.2 directory (two experts of {layers} blocks, {heads} heads of 8, FFN"
            f" {ffn_dim} wide; boundary_ratio 0.75; UniPC) saved by save_pretrained"
        ),
    }


def measure(settings: Settings) -> list[Row]:
    """/generate against the library's call for both families, then Wan 2.2's experts."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return [missing_extra("families: not run", extra="diffusers")]
    sized = _sized(settings)
    directories = save_directories(settings.workdir, sized)
    notes = directory_notes(sized)
    rows = []
    for family in (QWEN, WAN22):
        request = sized.requests[family]
        measured = measure_generate(settings, family, directories[family], request, sized.rounds)
        rows.append(generate_row(family, measured, request, notes[family]))
    rows.extend(experts_rows_for(settings, sized, directories[WAN22], notes[WAN22]))
    return rows


def experts_rows_for(settings: Settings, sized: Sized, directory: Path, note: str) -> Sequence[Row]:
    sent = generate_body(sized.requests[WAN22])
    runs = measure_experts(settings, directory, sent, sized.rounds)
    return experts_rows(runs, what=note, request=sent)


BENCHMARK = Benchmark(name="families", measure=measure)


if __name__ == "__main__":
    from bench.procs import serve

    serve(warm_task)
