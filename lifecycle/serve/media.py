"""A generated video as a reply carries it: uint8 frames as .npy (lossless), or H.264 in an
MP4 container encoded by PyAV (its wheel carries FFmpeg and libx264)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from lifecycle.core.errors import ConfigError

FORMATS = ("json", "npy", "mp4")
MEDIA_TYPES = {"npy": "application/x-npy", "mp4": "video/mp4"}
FPS = 16  # Wan's frame rate


def npy_bytes(frames: np.ndarray[Any, Any]) -> bytes:
    """(frames, height, width, 3) uint8 as a .npy file."""
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(frames), allow_pickle=False)
    return out.getvalue()


def mp4_bytes(frames: np.ndarray[Any, Any], *, fps: int = FPS) -> bytes:
    """(frames, height, width, 3) uint8 as H.264 (yuv420p) in MP4; an odd width or height is
    padded by one edge pixel, as the chroma subsampling needs even sides."""
    try:
        import av
    except ImportError:
        raise ConfigError(
            "response_format mp4 needs PyAV, in the diffusers extra: pip install"
            " 'lifecycle[diffusers]'",
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
