"""The Wan adapter's residency options: each option's measured peak and time against its
reference, beside what `wan_options` declares.

`python -m bench.wanresidency vae VAE OPTION WIDTH HEIGHT FRAMES DECODES` and
`python -m bench.wanresidency encoder ENCODER` are the workers: one process per measurement,
so that each peak RSS is its own.
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
TINY, WAN = "tiny-wan", "wan-2.1"
# What each VAE is: tiny-wan's own, and the Wan 2.1 VAE's architecture (diffusers'
# AutoencoderKLWan defaults: base_dim 96, dim_mult 1,2,4,4, 2 residual blocks) with seeded random
# weights, whose channel widths are what its working memory scales with.
VAE_WHAT = {
    TINY: "tiny-wan's VAE (base_dim 4)",
    WAN: "the Wan 2.1 VAE architecture (base_dim 96, dim_mult 1,2,4,4; seeded random weights)",
}
# The text encoders measured: tiny-wan's own, and one layer of UMT5-XXL's widths (Wan's text
# encoder: d_model 4096, d_ff 10240, 64 heads) over tiny-wan's vocabulary, large enough that
# freeing its weights shows in the resident set.
ENCODER_WHAT = {
    TINY: "tiny-wan's UMT5 text encoder",
    WAN: "one UMT5 layer of UMT5-XXL's widths (d_model 4096, d_ff 10240) over tiny-wan's"
    " vocabulary",
}


# glibc adjusts its mmap threshold upwards as large blocks are freed, and then keeps freed
# feature maps in its heap: the resident set of a second decode would say more of where the heap
# was left than of what the decode holds (a tiled decode measured 0 MiB, a whole one twice its
# first). Fixed at its initial 128 KiB, every block above it goes back to the system when freed,
# and VmHWM follows the tensors alive, as the CUDA allocator's peak does.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """Which VAEs are measured at which shape (width, height, frames), and the encoders."""

    vaes: tuple[tuple[str, tuple[int, int, int]], ...]
    encoders: tuple[str, ...]
    decodes: int  # measured per option, after one untimed


def sizes(settings: Settings) -> Sizes:
    if settings.quick:
        return Sizes(vaes=((TINY, (128, 128, 9)),), encoders=(TINY,), decodes=1)
    return Sizes(
        vaes=((TINY, (256, 256, 17)), (TINY, (832, 480, 17)), (WAN, (256, 256, 5))),
        encoders=(TINY, WAN),
        decodes=2,
    )


def _pipe(vae: str, encoder: str) -> Any:
    """tiny-wan, with the VAE or the text encoder swapped for a larger one of the same class."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from lifecycle.adapters.diffusers.tiny import build_tiny_wan

    pipe = build_tiny_wan()
    torch.manual_seed(0)
    if vae == WAN:
        pipe.vae = AutoencoderKLWan().eval()
    if encoder == WAN:
        pipe.text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=pipe.text_encoder.config.vocab_size, d_model=4096, d_kv=64, d_ff=10240,
                num_layers=1, num_heads=64, relative_attention_num_buckets=32,
            )
        ).eval()  # fmt: skip
    return pipe


def _adapter(pipe: Any, shape: tuple[int, int, int]) -> Any:
    """The Wan adapter on `pipe`, whose default request (the shape a probe measures, and the
    one its tiles are cut for) is `shape`."""
    import torch

    from lifecycle.adapters.diffusers.specs import wan_spec
    from lifecycle.adapters.diffusers.wan import WanAdapter
    from lifecycle.runtime.comm import Comm

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


def _chosen(adapter: Any, shape: Any, names: tuple[str, ...]) -> tuple[Any, Any]:
    options = adapter.residency_options(shape)
    chosen = [o for o in options if o.name in names]
    adapter.apply_residency(chosen)
    return options, chosen


def decode_once(
    vae: str, option: str, width: int, height: int, frames: int, *, decodes: int
) -> dict[str, Any]:
    """Decode seeded random latents of one shape through the adapter (its VAE, then frames as
    uint8: the stage the planner measures) with one VAE option, once untimed and then
    `decodes` times: the peak above the resident set before each (VmHWM, the worse) and the
    seconds (the better)."""
    import torch

    from lifecycle.pipelines import Shape
    from lifecycle.runtime.device import LinuxRssMeter

    adapter = _adapter(_pipe(vae, TINY), (width, height, frames))
    shape = Shape(width=width, height=height, frames=frames)
    options, _ = _chosen(adapter, shape, (option, "resident"))
    config = adapter.pipe.vae.config
    latent = (
        1,
        config.z_dim,
        (frames - 1) // config.scale_factor_temporal + 1,
        height // config.scale_factor_spatial,
        width // config.scale_factor_spatial,
    )
    latents = torch.randn(latent, generator=torch.Generator("cpu").manual_seed(0))
    # The first decode allocates what every later one reuses (the convolutions' primitives
    # and scratch): a startup's probe follows its bounded warmup, so it is left out.
    adapter.decode(latents, shape)
    meter = LinuxRssMeter()
    best_s, peak = float("inf"), 0
    for _ in range(decodes):
        gc.collect()
        base = meter.current_bytes() or 0
        meter.reset_peak()
        started = time.perf_counter()
        video = adapter.decode(latents, shape)
        best_s = min(best_s, time.perf_counter() - started)
        peak = max(peak, (meter.peak_bytes() or 0) - base)
        del video
    declared = next(o for o in options if o.name == option)
    return {
        "seconds": best_s,
        "peak_bytes": peak,
        "peak_scale": declared.peak_scale,
        "time_scale": declared.time_scale,
        "tiling": list(adapter.residency.tiling),
    }


def encoder_once(encoder: str) -> dict[str, Any]:
    """Offload the text encoder through the adapter's option: the resident set it gives back
    (VmRSS before and after) and what encoding a prompt costs with it offloaded, against what
    the option declares."""
    from lifecycle.pipelines import Shape
    from lifecycle.runtime.actions import WARMUP_PROMPT
    from lifecycle.runtime.device import LinuxRssMeter

    adapter = _adapter(_pipe(TINY, encoder), (128, 128, 33))
    shape = Shape(width=128, height=128, frames=33)

    def encode_s() -> float:
        started = time.perf_counter()
        adapter.encode_prompt(WARMUP_PROMPT, "")
        return time.perf_counter() - started

    meter = LinuxRssMeter()
    resident_s = min(encode_s() for _ in range(3))
    gc.collect()
    before = meter.current_bytes() or 0
    options, _ = _chosen(adapter, shape, (WHOLE, "offloaded"))
    gc.collect()
    after = meter.current_bytes() or 0
    offloaded_s = min(encode_s() for _ in range(3))
    declared = next(o for o in options if o.name == "offloaded")
    return {
        "released_bytes": before - after,
        "declared_bytes": declared.released_bytes,
        "resident_s": resident_s,
        "offloaded_s": offloaded_s,
        "reload_s": declared.reload_s,
        "parameter_bytes": sum(
            p.numel() * p.element_size() for p in adapter.pipe.text_encoder.parameters()
        ),
    }


def _worker(*args: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.wanresidency", *args]
    env = {**os.environ, **WORKER_ENV}
    done = subprocess.run(
        command, check=False, cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
        env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"`{' '.join(args)}` failed: {done.stderr.strip()[-300:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _within(measured: float, declared: float) -> bool:
    return abs(declared - measured) <= TOLERANCE * measured


def _vae_rows(vae: str, shape: tuple[int, int, int], decodes: int) -> list[Row]:
    measured = {}
    for option in (WHOLE, TILED):
        progress(f"diffusers: residency, {vae} VAE {option} at {shape}")
        measured[option] = _worker("vae", vae, option, *map(str, shape), str(decodes))
    whole, tiled = measured[WHOLE], measured[TILED]
    at = "x".join(map(str, shape))
    tile_h, tile_w, stride_h, stride_w = tiled["tiling"]
    how = (
        f"{VAE_WHAT[vae]}, WanAdapter.decode (AutoencoderKLWan.decode, then frames as uint8) of"
        f" seeded random latents, one process per option; tiles {tile_w}x{tile_h}, stride"
        f" {stride_w}x{stride_h} (tile_size of a model whose default request is {at})"
    )
    peak_ratio = tiled["peak_bytes"] / whole["peak_bytes"]
    time_ratio = tiled["seconds"] / whole["seconds"]
    return [
        Row(
            figure=f"residency (Wan): VAE tiled peak above baseline, {vae}, {at}",
            value=f"{tiled['peak_bytes'] / MIB:.0f} MiB",
            baseline=f"{whole['peak_bytes'] / MIB:.0f} MiB whole",
            ratio=format_ratio(peak_ratio),
            target=verdict(
                f"declared {tiled['peak_scale']:.2f} within {TOLERANCE:.0%}",
                met=_within(peak_ratio, tiled["peak_scale"]),
            ),
            how=f"VmHWM growth over the decode (reset through clear_refs), the worse of"
            f" {decodes} after one untimed decode, glibc's mmap threshold fixed at 128 KiB"
            f" (MALLOC_MMAP_THRESHOLD_, so that the resident set follows the tensors alive);"
            f" {how}",
        ),
        compared_seconds(
            figure=f"residency (Wan): VAE tiled time, {vae}, {at}",
            value_s=tiled["seconds"],
            baseline_s=whole["seconds"],
            baseline_note=" whole",
            target=verdict(
                f"declared {tiled['time_scale']:.2f} within {TOLERANCE:.0%}",
                met=_within(time_ratio, tiled["time_scale"]),
            ),
            how=f"the better of {decodes} decode(s), in the same processes as the peaks; {how}",
        ),
    ]


def _encoder_rows(encoder: str) -> list[Row]:
    progress(f"diffusers: residency, {encoder} text encoder offloaded")
    m = _worker("encoder", encoder)
    released, declared = m["released_bytes"], m["declared_bytes"]
    extra_s = m["offloaded_s"] - m["resident_s"]
    return [
        Row(
            figure=f"residency (Wan): text encoder offloaded, released bytes, {encoder}",
            value=f"{released / MIB:.1f} MiB released",
            baseline=f"{declared / MIB:.1f} MiB declared",
            ratio=format_ratio(released / declared),
            target=verdict(f"declared within {TOLERANCE:.0%}", met=_within(released, declared)),
            how=f"{ENCODER_WHAT[encoder]}: VmRSS before and after WanResidency offloads it"
            f" (weights written to a file, freed); its parameters are"
            f" {m['parameter_bytes'] / MIB:.1f} MiB",
        ),
        compared_seconds(
            figure=f"residency (Wan): text encoder offloaded, encode time, {encoder}",
            value_s=m["offloaded_s"],
            baseline_s=m["resident_s"],
            value_note=" offloaded",
            baseline_note=" resident",
            target=f"declared reload {m['reload_s'] * 1e3:.1f} ms, measured {extra_s * 1e3:.1f} ms",
            how="encode_prompt of the warmup prompt, the better of 3 each; offloaded: the"
            " weights read back from the file, the prompt encoded, written out again",
        ),
    ]


def measure_rows(settings: Settings) -> list[Row]:
    chosen = sizes(settings)
    rows = [row for vae, shape in chosen.vaes for row in _vae_rows(vae, shape, chosen.decodes)]
    rows.extend(row for encoder in chosen.encoders for row in _encoder_rows(encoder))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "vae":
        width, height, frames, decodes = (int(v) for v in sys.argv[4:8])
        print(
            json.dumps(
                decode_once(sys.argv[2], sys.argv[3], width, height, frames, decodes=decodes)
            )
        )
    elif len(sys.argv) == 3 and sys.argv[1] == "encoder":
        print(json.dumps(encoder_once(sys.argv[2])))
    else:
        sys.exit(
            "usage: python -m bench.wanresidency vae VAE OPTION WIDTH HEIGHT FRAMES DECODES"
            " | encoder ENCODER"
        )
