"""OpenAI's own SDK pointed at a served `lifecycle serve`, and each call it makes timed."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import openai

from tests.conftest import processes_in
from tests.support import serve
from tests.support.families import QUICK
from tests.support.serving import Served

T = TypeVar("T")
# The Sora API's methods warn of its shutdown date; the shape they speak is what is tested.
SORA_WARNING = "ignore:The Sora API:DeprecationWarning"


def sdk_client(server: Served) -> openai.OpenAI:
    """A client of the server's /v1, retrying nothing (a 429 must reach the test)."""
    return openai.OpenAI(
        api_key="unused", base_url=f"{server.url}/v1", max_retries=0, timeout=240.0
    )


def timed(label: str, call: Callable[[], T]) -> T:
    """`call()`, its seconds printed (the closing note reads them from the test output)."""
    began = time.monotonic()
    try:
        return call()
    finally:
        print(f"openai-sdk {label}: {time.monotonic() - began:.3f} s")


def mp4_frames(data: bytes) -> np.ndarray:
    """An mp4's frames, decoded by PyAV: (frames, height, width, 3) uint8."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def wait_until(
    client: openai.OpenAI,
    video_id: str,
    done: Callable[[openai.types.Video], bool],
    *,
    within: float,
) -> openai.types.Video:
    """Retrieve the video until `done` holds of it, within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        video = client.videos.retrieve(video_id)
        if done(video):
            return video
        if time.monotonic() > deadline:
            raise AssertionError(f"{video_id} never got there: {video}")
        time.sleep(0.1)


@contextlib.contextmanager
def served_model(workdir: Path, model: str) -> Iterator[Served]:
    """`lifecycle serve --model MODEL` in `workdir`, ready; stopped at the end, and any process
    it left behind killed."""
    try:
        with serve(workdir, "--model", model, *QUICK) as served:
            served.wait_for_health(200, within=240)
            yield served
            assert served.stop() == 0
    finally:
        for pid in processes_in(workdir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
