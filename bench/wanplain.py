"""diffusers alone, the side bench.diffusers sets the lifecycle beside: a `WanPipeline` loaded
from a directory and called with a request, and nothing else.

`python -m bench.wanplain startup SPEC_JSON` is a fresh process (its imports count): it loads
the directory, runs the requests one after another, and prints when it had loaded and when the
last request finished (wall clock, as the journal's times are). With no arguments it is a warm
worker on bench.procs' protocol: it loads a directory once and runs one request per round.

A request is /generate's body: prompt, negative_prompt, width, height, frames, steps,
guidance_scale, seed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any


def loaded(pipeline_class: Any, directory: str) -> Any:
    """`pipeline_class.from_pretrained` of the directory, offline, its progress bar off (as the
    lifecycle's adapter turns it off), on as many threads as the lifecycle's one rank uses."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    pipe = pipeline_class.from_pretrained(directory, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load(directory: str) -> Any:
    """`WanPipeline` loaded from the directory (see `loaded`)."""
    from diffusers import WanPipeline

    return loaded(WanPipeline, directory)


def call_arguments(request: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a diffusers pipeline's call that every family takes from the request
    alike: the prompts, the size, the steps, a CPU generator seeded with its seed, and numpy
    output."""
    import torch

    return {
        "prompt": request["prompt"],
        "negative_prompt": request["negative_prompt"],
        "height": request["height"],
        "width": request["width"],
        "num_inference_steps": request["steps"],
        "generator": torch.Generator("cpu").manual_seed(request["seed"]),
        "output_type": "np",
    }


def call(pipe: Any, request: dict[str, Any]) -> Any:
    """`WanPipeline.__call__` with the request's fields: frames in [0, 1], (frames, h, w, 3)."""
    return pipe(
        **call_arguments(request),
        num_frames=request["frames"],
        guidance_scale=request["guidance_scale"],
    ).frames[0]


def checksum(frames: Any) -> str:
    """The checksum the lifecycle journals for a video: frames as uint8, digested."""
    import torch

    from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8
    from lifecycle.runtime.request import video_checksum

    return video_checksum(torch.from_numpy(to_uint8(frames)))


def startup(spec: dict[str, Any]) -> dict[str, Any]:
    pipe = load(spec["directory"])
    loaded_at = time.time()
    videos = [call(pipe, request) for request in spec["requests"]]
    finished_at = time.time()
    # Digested after the last request: a plain script would not do this.
    return {
        "loaded_at": loaded_at,
        "finished_at": finished_at,
        "checksums": [checksum(video) for video in videos],
    }


_PIPES: dict[str, Any] = {}


def warm_round(
    payload: dict[str, Any],
    *,
    load: Callable[[str], Any],
    call: Callable[[Any, dict[str, Any]], Any],
) -> Callable[[], dict[str, Any]]:
    """A round of a warm worker: `load` the directory the first time (before `go`, untimed),
    then `call` the pipeline with the request, timed around the call alone."""
    directory = payload["directory"]
    if directory not in _PIPES:
        _PIPES[directory] = load(directory)
    pipe = _PIPES[directory]

    def work() -> dict[str, Any]:
        started = time.perf_counter()
        output = call(pipe, payload["request"])
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "checksum": checksum(output)}

    return work


def warm_task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """A round of the WanPipeline worker (see `warm_round`)."""
    return warm_round(payload, load=load, call=call)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "startup":
        print(json.dumps(startup(json.loads(sys.argv[2]))), flush=True)
    elif len(sys.argv) == 1:
        from bench.procs import serve

        serve(warm_task)
    else:
        sys.exit("usage: python -m bench.wanplain [startup SPEC_JSON]")
