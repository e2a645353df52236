"""One side of bench.parallelload, in a worker process of its own (bench.procs' protocol): a Wan
pipeline directory written with random weights, then loaded by the lifecycle's parallel loader
or by diffusers' `WanPipeline.from_pretrained`, timed around the load alone (the imports come
before `go`), with a digest of every state dict tensor to show that both load the same.

Payloads: {"task": "build", ...sizes}, {"task": "load", "side": "lifecycle" | "diffusers" |
COMPONENT, "directory": DIR, "digest": bool}, {"task": "steps", "directory": DIR, "component":
NAME, "dtype": DTYPE} (bench.loadsteps).
"""

from __future__ import annotations

import hashlib
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.loadsteps import disk_bytes, steps

LIFECYCLE = "lifecycle"
DIFFUSERS = "diffusers"
COMPONENTS = ("transformer", "text_encoder", "vae")
SEED = 20260601
WEIGHT_STD = 0.02
# Shards of at most this size: save_pretrained serializes a shard whole before writing it, so
# this bounds what the writer holds beside the pipeline (the hub's Wan snapshots are sharded
# finer than diffusers' default of 10 GB too).
SHARD_SIZE = "2GB"

# Wan 2.1 T2V 1.3B's transformer (its diffusers config), and its text encoder's width: UMT5-XXL.
WAN_1_3B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
    "rope_max_seq_len": 1024,
}  # fmt: skip
UMT5_XXL = {
    "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "tie_word_embeddings": False,
}  # fmt: skip
UMT5_XXL_LAYERS = 24
BF16_BYTES, FP32_BYTES = 2, 4
PROCESS_BYTES = 3 * 2**29  # the interpreter, torch, diffusers and transformers: 1.5 GiB


def _filled(module: Any, generator: Any) -> Any:
    """A module built on the meta device given bf16 storage (never float32 first: the encoder
    would not fit) and normal random weights; buffers zeroed."""
    import torch

    module = module.to(torch.bfloat16).to_empty(device="cpu")
    if hasattr(module, "tie_weights"):
        module.tie_weights()  # to_empty gives tied parameters storage of their own
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, WEIGHT_STD, generator=generator)
        for buffer in module.buffers():
            buffer.zero_()
    return module.eval()


def build(payload: dict[str, Any]) -> dict[str, Any]:
    """Write a WanPipeline directory: Wan 2.1 1.3B's transformer at `transformer_layers`, a
    UMT5-XXL-wide encoder at `encoder_layers` over `vocab` tokens (None: as many layers as fit
    in `memory_bytes` and `disk_bytes`), Wan's VAE, all bf16."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    from lifecycle.adapters.diffusers.wan.tinywan import tiny_vocabulary

    def encoder_of(layers: int) -> Any:
        config = UMT5Config(vocab_size=payload["vocab"], num_layers=layers, **UMT5_XXL)
        return UMT5EncoderModel(config)

    generator = torch.Generator().manual_seed(SEED)
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**WAN_1_3B, num_layers=payload["transformer_layers"])
        vae = AutoencoderKLWan()
        layers, limited_by = payload["encoder_layers"], "given"
        if layers is None:
            layers, limited_by = layers_that_fit(
                memory_bytes=payload["memory_bytes"],
                disk_bytes=payload["disk_bytes"],
                upcast=_count(transformer) + _count(vae),
                encoder=(_count(encoder_of(1)), _count(encoder_of(2))),
            )
        encoder = encoder_of(layers)
    pipe = WanPipeline(
        tokenizer=T5Tokenizer(vocab=tiny_vocabulary(), extra_ids=0),
        text_encoder=_filled(encoder, generator),
        transformer=_filled(transformer, generator),
        vae=_filled(vae, generator),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    parameters = {component: _count(getattr(pipe, component)) for component in COMPONENTS}
    pipe.save_pretrained(payload["directory"], max_shard_size=SHARD_SIZE)
    return {"encoder_layers": layers, "limited_by": limited_by, "parameters": parameters}


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def layers_that_fit(
    *, memory_bytes: int, disk_bytes: int, upcast: int, encoder: tuple[int, int]
) -> tuple[int, str]:
    """The most encoder layers (at most UMT5-XXL's) whose directory, all bf16 in the page
    cache, fits in `memory_bytes` beside one load's own memory (the diffusers models, `upcast`
    parameters, as float32; the text encoder left in the page cache's pages, as transformers
    loads a tensor whose dtype it keeps; the process itself), and whose files fit in
    `disk_bytes`; with what limited it ("memory", "disk" or "UMT5-XXL", all its layers)."""
    one, two = encoder
    per_layer, rest = two - one, 2 * one - two
    files = BF16_BYTES * (upcast + rest)
    loaded = FP32_BYTES * upcast + PROCESS_BYTES
    by_memory = (memory_bytes - files - loaded) // (BF16_BYTES * per_layer)
    by_disk = (disk_bytes - files) // (BF16_BYTES * per_layer)
    layers = min(by_memory, by_disk, UMT5_XXL_LAYERS)
    if layers < 1:
        raise ValueError(
            f"{memory_bytes / 2**30:.1f} GiB of memory and {disk_bytes / 2**30:.1f} GiB of disk"
            " leave no room for an encoder layer"
        )
    if layers == UMT5_XXL_LAYERS:
        return layers, "UMT5-XXL"
    return int(layers), "memory" if by_memory <= by_disk else "disk"


def _lifecycle_load(directory: str) -> tuple[Any, list[dict[str, Any]], float]:
    """The lifecycle's load, as its adapter makes it, with each component's load_finished
    event; and how long reading the directory (its walk and fingerprint) took of it."""
    import torch
    from diffusers import WanPipeline

    from lifecycle.adapters.diffusers.directory import read_directory
    from lifecycle.adapters.diffusers.loading import load_components
    from lifecycle.core.format.events import Event, LoadFinished
    from lifecycle.runtime.phases import recording_loads

    finished: list[dict[str, Any]] = []

    class Loads:
        def record(self, event: Event) -> object:
            if isinstance(event, LoadFinished):
                finished.append(
                    {"component": event.component, "seconds": event.seconds,
                     "read_s": event.read_s, "device_s": event.device_s, "dtype": event.dtype,
                     "ok": event.ok}
                )  # fmt: skip
            return None

    started = time.perf_counter()
    found = read_directory(directory)
    walked_s = time.perf_counter() - started
    with recording_loads(Loads()):
        pipe = load_components(WanPipeline, found, torch.device("cpu"))
    return pipe, finished, walked_s


def _diffusers_load(directory: str, *, only: str | None = None) -> Any:
    """`WanPipeline.from_pretrained` with no dtype, as the lifecycle's loader calls it (each
    library then loads as it does by default); with `only`, that component alone, every other
    one left out, as the lifecycle's loader loads each."""
    from diffusers import WanPipeline

    others: dict[str, Any] = {}
    if only is not None:
        others = {name: None for name in (*COMPONENTS, "tokenizer", "scheduler") if name != only}
    return WanPipeline.from_pretrained(directory, local_files_only=True, **others)


def digests(pipe: Any) -> dict[str, str]:
    """Every state dict tensor of every component: sha256 of its dtype, shape and bytes."""
    import torch

    found = {}
    for component in COMPONENTS:
        for name, tensor in getattr(pipe, component).state_dict().items():
            digest = hashlib.sha256(f"{tensor.dtype} {list(tensor.shape)}".encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().data)
            found[f"{component}.{name}"] = digest.hexdigest()
    return found


def _anon_bytes() -> int:
    """This process's resident memory of its own (not pages of mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_s() -> float:
    """This process's CPU time, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def prepare() -> None:
    """Before `go`: the imports, torch on every core, no progress bars."""
    import diffusers
    import torch
    import transformers

    # diffusers and transformers import a class's modules on its first use.
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel  # noqa: F401
    from transformers import T5Tokenizer, UMT5EncoderModel  # noqa: F401

    import lifecycle.adapters.diffusers.directory
    import lifecycle.adapters.diffusers.loading  # noqa: F401

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def load(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    prepare()
    side, directory = payload["side"], payload["directory"]

    def work() -> dict[str, Any]:
        disk, cpu = disk_bytes(), _cpu_s()
        loads: list[dict[str, Any]] = []
        walked_s = 0.0
        started = time.perf_counter()
        if side == LIFECYCLE:
            pipe, loads, walked_s = _lifecycle_load(directory)
        elif side == DIFFUSERS:
            pipe = _diffusers_load(directory)
        else:
            pipe = _diffusers_load(directory, only=side)
        seconds = time.perf_counter() - started
        cpu_s = _cpu_s() - cpu
        return {
            "seconds": seconds,
            "cpu_s": cpu_s,
            "walked_s": walked_s,
            "loads": loads,
            "disk_bytes": disk_bytes() - disk,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "anon_bytes": _anon_bytes(),
            "dtypes": {c: str(getattr(getattr(pipe, c), "dtype", None)) for c in COMPONENTS
                       if getattr(pipe, c, None) is not None},
            "digests": digests(pipe) if payload.get("digest") else {},
        }  # fmt: skip

    return work


def task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    if payload["task"] == "build":
        return lambda: build(payload)
    if payload["task"] == "steps":
        prepare()
        return lambda: steps(payload["directory"], payload["component"], payload["dtype"])
    return load(payload)


if __name__ == "__main__":
    from bench.procs import serve

    serve(task)
