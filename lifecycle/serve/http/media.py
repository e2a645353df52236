"""What a generated video or image is carried as in a reply, and which of them a model's reply
may be: uint8 frames as .npy (lossless), H.264 in an MP4 container encoded by PyAV (its wheel
carries FFmpeg and libx264), or an image model's one frame as an 8-bit RGB PNG (Pillow, which
diffusers itself needs)."""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable
from typing import Any

import numpy as np

from lifecycle.core.command import extra
from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.modelspec import ModelSpec

FORMATS = ("json", "npy", "mp4", "png")
MEDIA_TYPES = {"npy": "application/x-npy", "mp4": "video/mp4", "png": "image/png"}
FPS = 16  # Wan's frame rate
IMAGE_TASKS = frozenset({"text-to-image", "image-to-image"})
# The module an encoder imports, and the distribution a user installs for it (both come with
# the diffusers extra).
_ENCODER_LIBRARIES = {"mp4": ("av", "PyAV"), "png": ("PIL", "Pillow")}
_EXTRA = f"pip install '{extra('diffusers')}'"


def makes_images(model: ModelSpec) -> bool:
    """Whether the model's output is an image (one frame), not a video."""
    return model.task in IMAGE_TASKS


def format_refusal(model: ModelSpec, response_format: str) -> str | None:
    """Why a reply of this model cannot be `response_format`, in one line; None when it can.
    Decided before the request runs, so that a refused format costs no generation."""
    if response_format == "png" and not makes_images(model):
        return (
            f"response_format png is for image models; {model.name} makes video"
            f" ({model.task}): ask for npy or mp4"
        )
    library = _ENCODER_LIBRARIES.get(response_format)
    if library is not None:
        module, distribution = library
        try:
            importlib.import_module(module)
        except ImportError:
            return (
                f"response_format {response_format} needs {distribution}, in the diffusers"
                f" extra: {_EXTRA}"
            )
    return None


def npy_bytes(frames: np.ndarray[Any, Any]) -> bytes:
    """(frames, height, width, 3) uint8 as a .npy file."""
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(frames), allow_pickle=False)
    return out.getvalue()


def png_bytes(frames: np.ndarray[Any, Any]) -> bytes:
    """An image model's one frame, (1, height, width, 3) uint8, as an 8-bit RGB PNG."""
    from PIL import Image

    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != 1 or frames.shape[3] != 3:
        raise ValueError(f"a PNG holds one uint8 RGB frame, not {frames.dtype} {frames.shape}")
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frames[0])).save(out, format="PNG")
    return out.getvalue()


def mp4_bytes(frames: np.ndarray[Any, Any], *, fps: int = FPS) -> bytes:
    """(frames, height, width, 3) uint8 as H.264 (yuv420p) in MP4; an odd width or height is
    padded by one edge pixel, as the chroma subsampling needs even sides."""
    try:
        import av
    except ImportError:
        raise ConfigError(
            f"response_format mp4 needs PyAV, in the diffusers extra: {_EXTRA}",
            field="response_format",
        ) from None
    _, height, width, _ = frames.shape
    padded = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = padded.shape[2], padded.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in padded:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


ENCODERS: dict[str, Callable[[np.ndarray[Any, Any]], bytes]] = {
    "npy": npy_bytes,
    "mp4": mp4_bytes,
    "png": png_bytes,
}
