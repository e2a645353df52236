"""`--model-path ORG/NAME` downloaded for real: `lifecycle boot` against a fake hub on loopback
(tests.support.fakehub, reached through HF_ENDPOINT, huggingface_hub's own client speaking
HTTP to it) into an empty cache (HF_HOME). The download takes only the files the pipeline's
components load, is the startup's `download model` phase, and is not made again; a download
the network breaks is one line and exit 2, and the next start completes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lifecycle.adapters.diffusers.wan.tinywan import build_tiny_wan
from tests.conftest import Completed, assert_refused_before_start, run_cli
from tests.support.fakehub import COMMIT, FakeHub, fake_hub

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

REPO = "org/tiny-wan"
QUICK = ("--warmup-mode", "none", "--smoke-request", "off")
BOOT_WITHIN = 180.0  # a tiny model boots in ~15 s on CPU; a failed download ends in under 40 s
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
# Files the repository holds that a load of the pipeline never reads: a variant beside the
# component's own weights, a .bin beside its safetensors, another framework's weights, a folder
# no component is, the model card.
NOT_NEEDED = {
    "README.md": b"# tiny-wan\n",
    "assets/demo.mp4": b"\x00\x00\x00\x18ftypmp42" + bytes(64),
    "transformer/diffusion_pytorch_model.fp16.safetensors": bytes(range(256)) * 8,
    "vae/diffusion_pytorch_model.bin": b"PK\x03\x04" + bytes(512),
    "text_encoder/model.onnx": b"\x08\x07" + bytes(256),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hub's repository: tiny-wan saved by diffusers' save_pretrained, with NOT_NEEDED."""
    folder = tmp_path_factory.mktemp("repo") / "tiny-wan"
    build_tiny_wan().save_pretrained(str(folder))
    for name, data in NOT_NEEDED.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def needed(repo: Path) -> set[str]:
    """What save_pretrained wrote: every file a load of the pipeline reads."""
    files = {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()}
    return files - set(NOT_NEEDED)


def boot(cwd: Path, hub: FakeHub, db: str, **env: str) -> Completed:
    """`lifecycle boot --model-path org/tiny-wan`, its cache HF_HOME=cwd/hf, the hub `hub`."""
    return run_cli(
        "lifecycle", ["boot", "--model-path", REPO, *QUICK, "--db", db], cwd=cwd,
        env=hub.environ(cwd / "hf", **env), timeout=BOOT_WITHIN,
    )  # fmt: skip


def startup(cwd: Path, db: str) -> dict[str, Any]:
    shown = run_cli("replay", ["show", "latest", db, "--json"], cwd=cwd, timeout=60)
    assert shown.returncode == 0, shown.stderr[-2000:]
    (rank,) = json.loads(shown.stdout)["ranks"]
    return dict(rank["startup"])


def snapshot(cwd: Path) -> Path:
    return cwd / "hf" / "hub" / "models--org--tiny-wan" / "snapshots" / COMMIT


def linked(cwd: Path) -> set[str]:
    """The files the cache's snapshot holds whole (huggingface_hub links a file once whole)."""
    folder = snapshot(cwd)
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_boot_downloads_only_what_the_pipeline_loads_once(tmp_path: Path, repo: Path) -> None:
    """Into an empty cache, a boot by hub ID asks the hub for model_index.json, the tree and
    each component file the load reads, each downloaded once, and for nothing else (not the
    fp16 variant, the .bin beside the safetensors, the .onnx, the README or assets/); it
    reaches ready with the model named org/tiny-wan@COMMIT (main resolved) and journals the
    download as the startup's `download model` phase. A second boot, HF_HUB_OFFLINE=1, reads
    the cache without a single request to the hub and has no such phase."""
    with fake_hub(REPO, repo) as hub:
        first = boot(tmp_path, hub, "first.db")
        assert first.returncode == 0, first.stderr[-3000:]
        assert f"model {REPO}@{COMMIT}" in first.stdout.splitlines()[0]
        wanted = needed(repo)
        assert hub.requested() == wanted
        assert hub.downloads() == dict.fromkeys(wanted, 1)
        kinds = [r.kind for r in hub.log()]
        assert set(kinds) == {"resolve", "cdn", "tree"} and kinds.count("tree") > 2  # paged
        assert linked(tmp_path) == wanted
        assert (snapshot(tmp_path).parent.parent / "refs" / "main").read_text() == COMMIT
        phases = {p["name"]: p["seconds"] for p in startup(tmp_path, "first.db")["phases"]}
        assert phases["download model"] > 0, phases

        hub.forget()
        second = boot(tmp_path, hub, "second.db", HF_HUB_OFFLINE="1")
        assert second.returncode == 0, second.stderr[-3000:]
        assert hub.log() == []
        assert f"model {REPO}@{COMMIT}" in second.stdout.splitlines()[0]
        names = [p["name"] for p in startup(tmp_path, "second.db")["phases"]]
        assert "download model" not in names and "read settings" in names


@pytest.mark.parametrize("failure", ["dropped", "stopped", "silent"])
def test_a_broken_download_is_one_line_and_the_next_boot_completes_it(
    tmp_path: Path, repo: Path, failure: str
) -> None:
    """A download whose connection drops part-way through a weights file (every retry of it
    too), whose hub stops answering after model_index.json, or whose hub takes the file
    list's request and never answers it (huggingface_hub sets no timeout there; hub.py bounds
    each page at 3 x HF_HUB_ETAG_TIMEOUT, 1 s here): one line on stderr naming the model and
    the cache, exit 2, no traceback, no journal (httpx2's transport errors are no OSError:
    caught in hub.py). The cache keeps what came whole; a later boot with the hub answering
    downloads only the rest, each file once, and reaches ready (huggingface_hub 2.4.0
    resumes file by file: the cut file's partial bytes are not kept, it comes again
    whole)."""
    env = {"HF_HUB_ETAG_TIMEOUT": "1"} if failure == "silent" else {}
    with fake_hub(REPO, repo) as hub:
        if failure == "dropped":
            hub.drop(WEIGHTS)
        elif failure == "stopped":
            hub.stop_after("model_index.json")
        else:
            hub.silent("tree")
        broken = boot(tmp_path, hub, "j.db", **env)
        cache = (tmp_path / "hf" / "hub").resolve()
        assert_refused_before_start(
            broken, f"--model-path {REPO}: cannot be downloaded from the hub into {cache}: ",
            tmp_path / "j.db",
        )  # fmt: skip
        if failure == "dropped":
            assert hub.downloads()[WEIGHTS] > 1  # huggingface_hub's own retries, each cut
        kept = linked(tmp_path) if snapshot(tmp_path).exists() else set()
        assert "model_index.json" in kept and WEIGHTS not in kept
        if failure != "dropped":
            assert not all(r.answered for r in hub.log()) and kept == {"model_index.json"}
        if failure == "silent":
            assert "the hub did not answer for its file list in 3 s" in broken.stderr

        hub.heal()
        hub.forget()
        healed = boot(tmp_path, hub, "j.db")
        assert healed.returncode == 0, healed.stderr[-3000:]
        rest = needed(repo) - kept
        assert WEIGHTS in rest
        assert hub.downloads() == dict.fromkeys(rest, 1)
        assert linked(tmp_path) == needed(repo)
        assert "download model" in [p["name"] for p in startup(tmp_path, "j.db")["phases"]]
