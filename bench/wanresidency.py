"""The Wan adapter's residency options: each option's measured peak and time against its
reference, beside what `wan_options` declares.

The workers, one process per peak so that each peak RSS is its own:
`python -m bench.wanresidency peak VAE OPTION WIDTH HEIGHT FRAMES DECODES`,
`python -m bench.wanresidency time VAE WIDTH HEIGHT FRAMES PAIRS` (whole and tiled decodes
alternated in one process) and `python -m bench.wanresidency encoder ENCODER`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.compare import compared_seconds
from bench.suite import BenchError, Settings, progress
from bench.table import Row, format_ratio, verdict

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
# Declared against measured: the tolerance for a declared effect.
TOLERANCE = 0.25
WORKER_TIMEOUT_S = 1800.0
WHOLE, TILED = "whole", "tiled"
RESIDENT, OFFLOADED = "resident", "offloaded"
TINY, WAN = "tiny-wan", "wan-2.1"
# tiny-wan's VAE, and the Wan 2.1 VAE's architecture (diffusers' AutoencoderKLWan defaults) with
# seeded random weights: its channel widths are what its working memory scales with.
VAE_WHAT = {
    TINY: "tiny-wan's VAE (base_dim 4)",
    WAN: "the Wan 2.1 VAE architecture (base_dim 96, dim_mult 1,2,4,4; seeded random weights)",
}
# Text encoders of one UMT5 layer over tiny-wan's vocabulary, at umt5-base's and at UMT5-XXL's
# widths (Wan's text encoder): (d_model, d_ff, heads). tiny-wan's own encoder is left out: its
# weights are blocks small enough that the heap keeps them when freed, and nothing shows.
ENCODERS = {"umt5-base layer": (768, 2048, 12), "umt5-xxl layer": (4096, 10240, 64)}
# glibc raises its mmap threshold as large blocks are freed and then keeps freed feature maps in
# its heap: a second decode's resident set says more of where the heap was left than of what the
# decode holds (a tiled decode measured 0 MiB, a whole one twice its first). Fixed at its
# initial 128 KiB, every block above it goes back to the system when freed, and VmHWM follows
# the tensors alive, as the CUDA allocator's peak does.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """Which VAEs are measured at which shape (width, height, frames), and which encoders."""

    vaes: tuple[tuple[str, tuple[int, int, int]], ...]
    encoders: tuple[str, ...]
    decodes: int  # peaks measured per option, after one untimed decode
    pairs: int  # whole and tiled decodes alternated, for the time


def sizes(settings: Settings) -> Sizes:
    if settings.quick:
        return Sizes(
            vaes=((TINY, (128, 128, 9)),), encoders=("umt5-base layer",), decodes=1, pairs=2
        )
    return Sizes(
        vaes=((TINY, (256, 256, 17)), (TINY, (832, 480, 17)), (WAN, (256, 256, 5))),
        encoders=tuple(ENCODERS),
        decodes=2,
        pairs=3,
    )


def _pipe(*, vae: str = TINY, encoder: str | None = None) -> Any:
    """tiny-wan, its VAE or its text encoder swapped for a larger one of the same class."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from lifecycle.adapters.diffusers.wan.tinywan import build_tiny_wan

    pipe = build_tiny_wan()
    torch.manual_seed(0)
    if vae == WAN:
        pipe.vae = AutoencoderKLWan().eval()
    if encoder is not None:
        d_model, d_ff, heads = ENCODERS[encoder]
        pipe.text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=pipe.text_encoder.config.vocab_size, d_model=d_model, d_kv=64,
                d_ff=d_ff, num_layers=1, num_heads=heads, relative_attention_num_buckets=32,
            )
        ).eval()  # fmt: skip
    return pipe


def _adapter(pipe: Any, shape: tuple[int, int, int]) -> Any:
    """The Wan adapter on `pipe`, whose default request (the shape a probe measures, and the
    one its tiles are cut for) is `shape`."""
    import torch

    from lifecycle.adapters.diffusers.specs import wan_spec
    from lifecycle.adapters.diffusers.wan.wanadapter import WanAdapter
    from lifecycle.runtime.group.comm import Comm

    width, height, frames = shape
    spec = wan_spec(
        name="bench-wan",
        source=None,
        digest="",
        pipe_configs={"vae": dict(pipe.vae.config), "transformer": dict(pipe.transformer.config)},
        defaults={"width": width, "height": height, "num_frames": frames},
    )
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return WanAdapter(spec, Comm.alone(torch.device("cpu")), pipe)


class Decoding:
    """Seeded random latents of one shape, decoded through the adapter (its VAE, then frames
    as uint8: the stage the planner measures) with the option applied last."""

    def __init__(self, vae: str, width: int, height: int, frames: int) -> None:
        import torch

        from lifecycle.pipelines import Shape

        self.adapter = _adapter(_pipe(vae=vae), (width, height, frames))
        self.shape = Shape(width=width, height=height, frames=frames)
        self.options = self.adapter.residency_options(self.shape)
        config = self.adapter.pipe.vae.config
        latent = (
            1,
            config.z_dim,
            (frames - 1) // config.scale_factor_temporal + 1,
            height // config.scale_factor_spatial,
            width // config.scale_factor_spatial,
        )
        self.latents = torch.randn(latent, generator=torch.Generator("cpu").manual_seed(0))

    def declared(self, option: str) -> Any:
        return next(o for o in self.options if o.name == option)

    def use(self, option: str) -> None:
        self.adapter.apply_residency([self.declared(option), self.declared(RESIDENT)])

    def seconds(self, option: str) -> float:
        self.use(option)
        started = time.perf_counter()
        self.adapter.decode(self.latents, self.shape)
        return time.perf_counter() - started


def peak_once(vae: str, option: str, shape: tuple[int, int, int], decodes: int) -> dict[str, Any]:
    """The peak above the resident set before each decode (VmHWM), the worse of `decodes`
    after one: the first allocates what every later one reuses (the convolutions' primitives
    and scratch), and a startup's probe follows its bounded warmup."""
    from lifecycle.runtime.device import LinuxRssMeter

    decoding = Decoding(vae, *shape)
    decoding.seconds(option)
    meter = LinuxRssMeter()
    peak = 0
    for _ in range(decodes):
        gc.collect()
        base = meter.current_bytes() or 0
        meter.reset_peak()
        decoding.seconds(option)
        peak = max(peak, (meter.peak_bytes() or 0) - base)
    declared = decoding.declared(option)
    tiling = decoding.adapter.residency.tiling
    return {"peak_bytes": peak, "peak_scale": declared.peak_scale, "tiling": list(tiling)}


def time_pairs(vae: str, shape: tuple[int, int, int], pairs: int) -> dict[str, Any]:
    """Whole and tiled decodes alternated in one process (whole first, then tiled first, ...),
    after one of each: their medians and the median of the paired ratios."""
    from bench.stats import interleave, median

    decoding = Decoding(vae, *shape)
    paired = interleave(
        lambda: decoding.seconds(TILED), lambda: decoding.seconds(WHOLE), pairs=pairs, discard=1
    )
    return {
        "tiled_s": median(paired.a),
        "whole_s": median(paired.b),
        "ratio": paired.paired_ratio,
        "time_scale": decoding.declared(TILED).time_scale,
    }


def encoder_once(encoder: str) -> dict[str, Any]:
    """Offload the text encoder through the adapter's option: the resident set it gives back
    (VmRSS before and after) and what encoding a prompt costs with it offloaded, against what
    the option declares."""
    from lifecycle.pipelines import Shape
    from lifecycle.runtime.actions import WARMUP_PROMPT
    from lifecycle.runtime.device import LinuxRssMeter

    adapter = _adapter(_pipe(encoder=encoder), (128, 128, 33))
    options = adapter.residency_options(Shape(width=128, height=128, frames=33))
    chosen = [o for o in options if o.name in (WHOLE, OFFLOADED)]

    def encode_s() -> float:
        started = time.perf_counter()
        adapter.encode_prompt(WARMUP_PROMPT, "")
        return time.perf_counter() - started

    meter = LinuxRssMeter()
    resident_s = min(encode_s() for _ in range(3))
    gc.collect()
    before = meter.current_bytes() or 0
    adapter.apply_residency(chosen)
    gc.collect()
    after = meter.current_bytes() or 0
    offloaded_s = min(encode_s() for _ in range(3))

    def reload_s() -> float:
        started = time.perf_counter()
        with adapter.residency.text_encoder_in_use():
            pass
        return time.perf_counter() - started

    reloads = [reload_s() for _ in range(5)]
    declared = next(o for o in chosen if o.name == OFFLOADED)
    encoder_module = adapter.pipe.text_encoder
    return {
        "released_bytes": before - after,
        "declared_bytes": declared.released_bytes,
        "resident_s": resident_s,
        "offloaded_s": offloaded_s,
        "reload_s": declared.reload_s,
        "measured_reload_s": sorted(reloads)[len(reloads) // 2],
        "parameter_bytes": sum(p.numel() * p.element_size() for p in encoder_module.parameters()),
    }


def _worker(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.wanresidency", *args], check=False, cwd=REPO,
        capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env={**os.environ, **WORKER_ENV},
    )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"`{' '.join(args)}` failed: {done.stderr.strip()[-300:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _within(measured: float, declared: float) -> bool:
    return abs(declared - measured) <= TOLERANCE * abs(measured)


def _declared(value: float) -> str:
    return f"declared {value:.2f} within {TOLERANCE:.0%}"


def _vae_rows(vae: str, shape: tuple[int, int, int], chosen: Sizes) -> list[Row]:
    at = "x".join(map(str, shape))
    peaks = {}
    for option in (WHOLE, TILED):
        progress(f"diffusers: residency, {vae} VAE {option} peak at {at}")
        peaks[option] = _worker("peak", vae, option, *map(str, shape), str(chosen.decodes))
    progress(f"diffusers: residency, {vae} VAE whole and tiled time at {at}")
    timed = _worker("time", vae, *map(str, shape), str(chosen.pairs))
    whole, tiled = peaks[WHOLE], peaks[TILED]
    tile_h, tile_w, stride_h, stride_w = tiled["tiling"]
    how = (
        f"{VAE_WHAT[vae]}: WanAdapter.decode (AutoencoderKLWan.decode, then frames as uint8) of"
        f" seeded random latents; tiles {tile_w}x{tile_h}, stride {stride_w}x{stride_h}"
        f" (tile_size of a model whose default request is {at})"
    )
    peak_ratio = tiled["peak_bytes"] / whole["peak_bytes"]
    return [
        Row(
            figure=f"residency (Wan): VAE tiled peak above baseline, {vae}, {at}",
            value=f"{tiled['peak_bytes'] / MIB:.0f} MiB",
            baseline=f"{whole['peak_bytes'] / MIB:.0f} MiB whole",
            ratio=format_ratio(peak_ratio),
            target=verdict(
                _declared(tiled["peak_scale"]), met=_within(peak_ratio, tiled["peak_scale"])
            ),
            how=f"VmHWM growth over the decode (reset through clear_refs), one process per"
            f" option, the worse of {chosen.decodes} after one untimed decode, glibc's mmap"
            " threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_, so that the resident set"
            f" follows the tensors alive); {how}",
        ),
        Row(
            figure=f"residency (Wan): VAE tiled time, {vae}, {at}",
            value=f"{timed['tiled_s']:.2f} s",
            baseline=f"{timed['whole_s']:.2f} s whole",
            ratio=format_ratio(timed["ratio"]),
            target=verdict(
                _declared(timed["time_scale"]), met=_within(timed["ratio"], timed["time_scale"])
            ),
            how=f"whole and tiled decodes alternated in one process, {chosen.pairs} pairs after"
            " one of each; medians, the ratio is the median of the paired ratios; " + how,
        ),
    ]


def _encoder_rows(encoder: str) -> list[Row]:
    progress(f"diffusers: residency, text encoder ({encoder}) offloaded")
    m = _worker("encoder", encoder)
    released, declared = m["released_bytes"], m["declared_bytes"]
    extra_s, reload_s = m["offloaded_s"] - m["resident_s"], m["reload_s"]
    d_model, d_ff, _ = ENCODERS[encoder]
    what = (
        f"a text encoder of one UMT5 layer at {encoder.removesuffix(' layer')}'s widths (d_model"
        f" {d_model},"
        f" d_ff {d_ff}; {m['parameter_bytes'] / MIB:.0f} MiB of parameters)"
    )
    return [
        Row(
            figure=f"residency (Wan): text encoder offloaded, released, {encoder}",
            value=f"{released / MIB:.1f} MiB",
            baseline=f"{declared / MIB:.1f} MiB declared",
            ratio=format_ratio(released / declared),
            target=verdict(f"within {TOLERANCE:.0%}", met=_within(released, declared)),
            how=f"VmRSS before and after WanResidency offloads {what} (its weights written to"
            " a file and freed)",
        ),
        compared_seconds(
            figure=f"residency (Wan): text encoder offloaded, reload, {encoder}",
            value_s=m["measured_reload_s"],
            baseline_s=reload_s,
            baseline_note=" declared",
            target=verdict(
                f"within {TOLERANCE:.0%}", met=_within(m["measured_reload_s"], reload_s)
            ),
            how=f"the weights of {what} read back from their file and written out again"
            " (WanResidency.text_encoder_in_use around nothing), the median of 5; declared"
            " from a round trip of the same calls measured at the adapter's start",
        ),
        compared_seconds(
            figure=f"residency (Wan): text encoder offloaded, encode time, {encoder}",
            value_s=m["offloaded_s"],
            baseline_s=m["resident_s"],
            value_note=" offloaded",
            baseline_note=" resident",
            target=f"reported ({extra_s:+.3f} s)",
            how=f"encode_prompt of the warmup prompt with {what}, the better of 3 each;"
            " offloaded: the weights read back from the file, the prompt encoded, the weights"
            " written out again",
        ),
    ]


def measure_rows(settings: Settings) -> list[Row]:
    chosen = sizes(settings)
    rows = [row for vae, shape in chosen.vaes for row in _vae_rows(vae, shape, chosen)]
    rows.extend(row for encoder in chosen.encoders for row in _encoder_rows(encoder))
    return rows


def main(argv: list[str]) -> dict[str, Any]:
    numbers = [int(v) for v in argv if v.isdigit()]
    if len(argv) == 7 and argv[0] == "peak":
        return peak_once(argv[1], argv[2], (numbers[0], numbers[1], numbers[2]), numbers[3])
    if len(argv) == 6 and argv[0] == "time":
        return time_pairs(argv[1], (numbers[0], numbers[1], numbers[2]), numbers[3])
    if len(argv) == 2 and argv[0] == "encoder":
        return encoder_once(argv[1])
    sys.exit(
        "usage: python -m bench.wanresidency peak VAE OPTION WIDTH HEIGHT FRAMES DECODES"
        " | time VAE WIDTH HEIGHT FRAMES PAIRS | encoder ENCODER"
    )


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
