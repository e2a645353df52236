"""A diffusers directory served through the lifecycle and held to the library's own output,
and the field's failure on 4 ranks diagnosed: what the serving tests of each model family
share."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.families import qwen_image_call
from bench.wanplain import call as wan_pipeline_call
from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8
from lifecycle.core.format.events import StoredEvent
from tests.conftest import run_cli
from tests.support.serving import journal_events, serve

QUICK = ("--warmup-mode", "none", "--smoke-request", "off", "--dist-timeout", "60")
# One rank, CFG-parallel 2 and Ulysses 2; the default run keeps Ulysses, which trades tokens
# in every attention (the others run with `-m slow`).
LAYOUTS = [
    pytest.param((), marks=pytest.mark.slow, id="1-rank"),
    pytest.param(("--num-ranks", "2", "--cfg-parallel", "2"), marks=pytest.mark.slow, id="cfg-2"),
    pytest.param(("--num-ranks", "2", "--ulysses", "2"), id="ulysses-2"),
]


def family_request(
    shape: str, *, prompt: str, negative_prompt: str, steps: int, guidance_scale: float, seed: int
) -> dict[str, Any]:
    """The /generate body a family's test sends its server and hands the library's pipeline,
    with every field that decides the output: `shape` is WIDTHxHEIGHTxFRAMES, as
    --default-shape takes it."""
    width, height, frames = map(int, shape.split("x"))
    return {
        "prompt": prompt,
        "negative_prompt": negative_prompt,
        "width": width,
        "height": height,
        "frames": frames,
        "steps": steps,
        "guidance_scale": guidance_scale,
        "seed": seed,
    }


def wan_pipeline_video(directory: Path, request: dict[str, Any]) -> np.ndarray:
    """What diffusers' own WanPipeline, loaded from `directory`, makes of `request` (/generate's
    fields), scaled to uint8."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return to_uint8(wan_pipeline_call(pipe, request))


def qwen_image_pipeline_image(directory: Path, request: dict[str, Any]) -> np.ndarray:
    """What diffusers' own QwenImagePipeline, loaded from `directory`, makes of `request`
    (/generate's fields, its guidance as true_cfg_scale), scaled to uint8."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return to_uint8(qwen_image_call(pipe, request))


def served_npy(
    tmp_path: Path,
    directory: Path,
    layout: tuple[str, ...],
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
) -> tuple[np.ndarray, list[StoredEvent]]:
    """What a server of `directory` in `layout` answers `body` with, as npy, and the events its
    run journaled; it answered 200 and stopped with exit 0."""
    with serve(tmp_path, "--model-path", str(directory), *layout, *QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post(
            "/generate", json={**body, "response_format": "npy"}, headers=headers, timeout=240
        )
        assert reply.status_code == 200, reply.text
        for name, value in (headers or {}).items():
            assert reply.headers[name] == value
        output = np.load(io.BytesIO(reply.content), allow_pickle=False)
        assert server.stop() == 0
    return output, journal_events(tmp_path / "j.db")


def assert_served_within_one_step(
    tmp_path: Path,
    directory: Path,
    layout: tuple[str, ...],
    request: dict[str, Any],
    reference: np.ndarray,
    *,
    headers: dict[str, str] | None = None,
) -> list[StoredEvent]:
    """A server of `directory` in `layout` answers `request` (npy) with the library's
    output (`reference`), of the request's frames, height and width, within one uint8 step
    everywhere, and every rank ran the request to the end, trading with its peers (gathers or
    all-to-alls) when it has any; the events its run journaled."""
    output, events = served_npy(tmp_path, directory, layout, request, headers=headers)
    assert output.shape == (request["frames"], request["height"], request["width"], 3)
    assert output.shape == reference.shape
    assert int(np.abs(output.astype(int) - reference.astype(int)).max()) <= 1
    finished = [e for e in events if e.kind == "request_finished"]
    assert len(finished) == (2 if layout else 1)
    assert all(e.event.ok for e in finished)  # type: ignore[attr-defined]
    # After ready the records stay in each rank's ring; the request counts what it ran.
    assert all(e.event.collectives >= (1 if layout else 0) for e in finished)  # type: ignore[attr-defined]
    return events


def assert_the_fields_failure_is_diagnosed(tmp_path: Path, *model: str) -> None:
    """`model` (its options) on 4 ranks (CFG 2 x Ulysses 2), calibrating, rank 1 raising in
    drop-buffers, its peers waiting as the field's did (`--on-peer-failure wait`): the boot
    exits 1, and `replay diagnose` names rank 1 in drop-buffers as the culprit, and the
    all-to-all of the Ulysses group its peer waits in."""
    booted = run_cli(
        "lifecycle",
        ["boot", *model, "--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2",
         "--calibrate", "--fault", "1:drop-buffers:raise", "--dist-timeout", "5",
         "--on-peer-failure", "wait", "--db", "j.db", "--log-level", "warning"],
        cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert booted.returncode == 1, booted.stderr[-2000:]
    done = run_cli("replay", ["diagnose", "latest", "j.db", "--json"], cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "hung", [1], "drop-buffers",
    )  # fmt: skip
    blocked = {r["rank"]: r["pending_collective"] for r in doc["ranks"] if r["rank"] != 1}
    assert blocked[0]["group"] == "ulysses0" and blocked[0]["op"] == "all_to_all"


# The request the tiny Wan tests serve and give diffusers' own WanPipeline alike.
WAN_REQUEST = family_request(
    "48x32x9",
    prompt="a cat walks in the rain",
    negative_prompt="blurry, static",
    steps=3,
    guidance_scale=4.5,
    seed=11,
)
