"""`--dtype`: a served diffusers pipeline loads its components in the precision asked (the whole
pipeline's, or one per component), equal to diffusers' own pipeline loaded in it, journals the
dtype it loaded, reports it at SGLang's GET /models, keys its residency fingerprint by it, and a
dtype a pipeline cannot take is refused in one line, exit 2."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.pipelinedirs import save_small_wan
from bench.wanplain import call as wan_pipeline_call
from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8
from lifecycle.core.decisions.agreement import settings_digest, shared_settings
from lifecycle.core.decisions.fingerprint import fingerprint, model_digest
from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.config import ServerArgs, args_from_json, args_to_json
from lifecycle.core.settings.dtypes import parse_dtype
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from tests.conftest import REPO, run_cli
from tests.support import families, serve
from tests.support.serving import journal_events

REQUEST = families.WAN_REQUEST


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("auto", "auto"),
        (" bfloat16 ", "bfloat16"),
        ("vae=float32, transformer=bfloat16", "transformer=bfloat16,vae=float32"),
        ("transformer=auto", "auto"),
    ],
)
def test_dtype_text_has_one_canonical_form(given: str, canonical: str) -> None:
    """--dtype is one torch name or COMPONENT=NAME pairs, written sorted without those at auto."""
    assert parse_dtype(given) == canonical


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("bf16", "'bf16' is not one of auto, bfloat16, float16, float32, as torch names them"),
        ("transformer=half", "'half' is not one of"),
        ("transformer", "'transformer' is not one of"),
        ("=bfloat16", "'=bfloat16' is not COMPONENT=DTYPE"),
        ("vae=float32,vae=bfloat16", "vae is named twice"),
    ],
)
def test_a_dtype_torch_does_not_name_is_refused_naming_it(given: str, said: str) -> None:
    """A name torch does not give a dtype, or a pair that is not one, is one line naming it."""
    with pytest.raises(ConfigError) as refused:
        parse_dtype(given)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_the_dtype_is_in_the_fingerprint_the_config_and_the_settings_the_ranks_compare() -> None:
    """Two dtypes are two fingerprints (so two plans and two sets of compile artifacts); auto
    keeps the fingerprint it had before --dtype; the recorded config carries the dtype back."""
    auto = ServerArgs(model=MODEL_PRESETS["micro-video"])
    bf16 = dataclasses.replace(auto, dtype="bfloat16")
    mixed = dataclasses.replace(auto, dtype="transformer=bfloat16,vae=float32")

    def key(args: ServerArgs) -> str:
        return fingerprint(args, device="cpu", total_bytes=1, torch_version="2", lifecycle="1").key

    assert len({key(auto), key(bf16), key(mixed)}) == 3
    on_cpu = fingerprint(auto, device="cpu", total_bytes=1, torch_version="2", lifecycle="1")
    assert on_cpu.model_config == model_digest(auto.model)
    assert args_from_json(args_to_json(mixed)).dtype == "transformer=bfloat16,vae=float32"
    digests = {settings_digest(shared_settings(args_to_json(a))) for a in (auto, bf16)}
    assert len(digests) == 2
    with pytest.raises(ConfigError):
        dataclasses.replace(auto, dtype="vae=float32,transformer=bfloat16")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--model", "tiny-wan", "--dtype", "bf16"], "--dtype bf16: 'bf16' is not one of"),
        (
            ["--model", "tiny-wan", "--dtype", "transformr=bfloat16"],
            "--dtype transformr=bfloat16: tiny-wan has no component 'transformr' that loads in a"
            " dtype; its components: text_encoder, transformer, vae",
        ),
        (
            ["--model", "tiny-qwen-image", "--dtype", "float16"],
            "--dtype float16: QwenImagePipeline's transformer cannot run in float16",
        ),
        (["--model", "tiny-video", "--dtype", "bfloat16"], "tiny-video is not a diffusers"),
    ],
    ids=["torch-name", "component", "family", "own-pipeline"],
)
def test_a_dtype_the_pipeline_cannot_take_is_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    """boot refuses a dtype torch does not name, a component the pipeline lacks (naming its
    components), a dtype the family cannot run, or any dtype for a pipeline that takes none:
    one line on stderr, exit 2, before any rank starts."""
    done = run_cli("lifecycle", ["boot", *argv, "--db", "j.db"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert not (tmp_path / "j.db").exists()


def _served(tmp_path: Path, *argv: str) -> tuple[np.ndarray, dict[str, Any], list[Any]]:
    """What a server started with `argv` answers REQUEST with (npy), its GET /models, and the
    events its run journaled; it answered 200 and stopped with exit 0."""
    with serve(tmp_path, *argv, *families.QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post(
            "/generate", json={**REQUEST, "response_format": "npy"}, timeout=240
        )
        assert reply.status_code == 200, reply.text
        output = np.load(io.BytesIO(reply.content), allow_pickle=False)
        described = server.client.get("/models").json()
        assert server.stop() == 0
    return output, described, journal_events(tmp_path / "j.db")


def _loaded_dtypes(events: list[Any]) -> dict[tuple[int, str], str]:
    return {
        (e.rank, e.event.component): e.event.dtype
        for e in events
        if e.kind == "load_finished" and e.event.dtype
    }


@pytest.fixture(scope="module")
def tiny_wan_bf16_video(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """What diffusers' own WanPipeline makes of REQUEST, loaded from tiny-wan's weights with
    dtype=torch.bfloat16, scaled to uint8."""
    import torch
    from diffusers import WanPipeline

    from lifecycle.adapters.diffusers.wan.tinywan import build_tiny_wan

    directory = tmp_path_factory.mktemp("tiny-wan") / "tiny-wan"
    build_tiny_wan().save_pretrained(str(directory))
    pipe = WanPipeline.from_pretrained(str(directory), local_files_only=True, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return to_uint8(wan_pipeline_call(pipe, REQUEST))


@pytest.mark.ranks
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("layout", families.LAYOUTS)
def test_tiny_wan_at_bfloat16_equals_wan_pipeline_loaded_in_bfloat16(
    tmp_path: Path, tiny_wan_bf16_video: np.ndarray, layout: tuple[str, ...]
) -> None:
    """`--model tiny-wan --dtype bfloat16` serves WanPipeline's video loaded with
    dtype=bfloat16 for the same seed, within one uint8 step everywhere, on one rank,
    CFG-parallel 2 and Ulysses 2, and every rank journals its components' loads in bfloat16."""
    output, described, events = _served(
        tmp_path, "--model", "tiny-wan", "--dtype", "bfloat16", *layout
    )
    assert output.shape == tiny_wan_bf16_video.shape == (9, 32, 48, 3)
    assert int(np.abs(output.astype(int) - tiny_wan_bf16_video.astype(int)).max()) <= 1
    loaded = _loaded_dtypes(events)
    ranks = 2 if layout else 1
    assert {(r, c) for r, c in loaded} == {
        (r, c) for r in range(ranks) for c in ("text_encoder", "transformer", "vae")
    }
    assert set(loaded.values()) == {"bfloat16"}
    assert (described["dit_precision"], described["vae_precision"]) == ("bf16", "bf16")


# How far a bfloat16 transformer between float32 components serves from the library's output,
# in uint8 steps (see the test below).
MIXED_STEPS = 4


@pytest.mark.usefixtures("no_leftover_processes")
def test_per_component_dtypes_load_as_asked_and_equal_the_library_loading_them(
    tmp_path: Path,
) -> None:
    """`--dtype transformer=bfloat16,vae=float32` on a Wan directory loads the transformer in
    bfloat16 and the rest in float32 (auto on CPU), as the journal's loads and GET /models say,
    and serves what WanPipeline loaded with the same per-component dtype makes, within 4 uint8
    steps: with a bfloat16 transformer between float32 components the two differ by up to 4
    (measured against the library in a process of its own, which gives the same bytes run to
    run), where every component at one dtype is within one step."""
    directory = save_small_wan(tmp_path / "small-wan", scheduler="unipc")
    # The library's output made in a process of its own, as the ranks make theirs: nothing an
    # earlier test set in this process (torch's global settings) can change its arithmetic.
    made = tmp_path / "reference.npy"
    script = (
        "import json, sys, numpy, torch\n"
        "from diffusers import WanPipeline\n"
        "from bench.wanplain import call\n"
        "from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8\n"
        "pipe = WanPipeline.from_pretrained(sys.argv[1], local_files_only=True,"
        " dtype={'transformer': torch.bfloat16, 'default': torch.float32})\n"
        "pipe.set_progress_bar_config(disable=True)\n"
        "numpy.save(sys.argv[2], to_uint8(call(pipe, json.loads(sys.argv[3]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(made), json.dumps(REQUEST)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    reference = np.load(made)
    output, described, events = _served(
        tmp_path, "--model-path", str(directory), "--dtype", "transformer=bfloat16,vae=float32"
    )
    assert _loaded_dtypes(events) == {
        (0, "text_encoder"): "float32",
        (0, "transformer"): "bfloat16",
        (0, "vae"): "float32",
    }
    assert (described["dit_precision"], described["vae_precision"]) == ("bf16", "fp32")
    assert described["text_encoder_precision"] == "fp32"
    assert int(np.abs(output.astype(int) - reference.astype(int)).max()) <= MIXED_STEPS
