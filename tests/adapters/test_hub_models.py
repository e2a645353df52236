"""`--model-path ORG/NAME[@REVISION]`: a model by hub ID, read from huggingface_hub's cache as
its own tools lay it out (HF_HUB_CACHE, HF_HUB_OFFLINE), its commit part of the model's name
and fingerprint; one line, exit 2 and no journal for an ID the cache cannot give."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from bench.pipelinedirs import save_tiny_qwen_image
from lifecycle.adapters.diffusers.hub import snapshot_files
from lifecycle.adapters.diffusers.wan.tinywan import build_tiny_wan
from tests.conftest import assert_refused_before_start, one_clear_line, run_cli
from tests.support import serve

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

MAIN = "a" * 40  # the commit refs/main names
OTHER = "b" * 40  # another commit, tagged v2
QUICK = ("--warmup-mode", "none", "--smoke-request", "off")


def lay_out_snapshot(
    cache: Path, repo_id: str, commit: str, source: Path, *, refs: tuple[str, ...]
) -> Path:
    """`source`'s files in the cache as huggingface_hub lays them out: each in blobs/ under
    its hash, linked from snapshots/COMMIT/, and refs/REF holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        linked = snapshot / file.relative_to(source)
        linked.parent.mkdir(parents=True, exist_ok=True)
        linked.symlink_to(os.path.relpath(blob, linked.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # as the hub writes it: no newline
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding tiny-wan (main, and a commit tagged v2 with another scheduler shift)
    and tiny Qwen-Image, each saved by diffusers' own save_pretrained."""
    root = tmp_path_factory.mktemp("hub")
    wan = root / "saved" / "tiny-wan"
    build_tiny_wan().save_pretrained(str(wan))
    cache = root / "hub"
    lay_out_snapshot(cache, "org/tiny-wan", MAIN, wan, refs=("main",))
    config = wan / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift": 7.0}))
    lay_out_snapshot(cache, "org/tiny-wan", OTHER, wan, refs=("v2",))
    qwen = save_tiny_qwen_image(root / "saved" / "tiny-qwen-image")
    lay_out_snapshot(cache, "org/tiny-qwen-image", MAIN, qwen, refs=("main",))
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_hub_id_in_the_cache_serves_offline_and_names_its_commit(
    tmp_path: Path, hub_cache: Path
) -> None:
    """`--model-path org/tiny-wan` with HF_HUB_OFFLINE=1 gets to ready from the cache's
    snapshot of main; /lifecycle and `replay show` name the model with its commit, the
    OpenAI API takes the hub ID alone for it, and SGLang's /models names the hub ID and its
    commit."""
    with serve(tmp_path, "--model-path", "org/tiny-wan", *QUICK, env=offline(hub_cache)) as up:
        up.wait_for_health(200, within=240)
        model = up.client.get("/lifecycle").json()["model"]
        snapshot = hub_cache.resolve() / "models--org--tiny-wan" / "snapshots" / MAIN
        assert model == {"name": f"org/tiny-wan@{MAIN}", "source": str(snapshot)}
        assert up.client.get("/v1/models/org/tiny-wan").status_code == 200
        described = up.client.get("/models").json()  # as SGLang says it: the hub ID served
        assert (described["model_path"], described["revision"]) == ("org/tiny-wan", MAIN)
        assert up.stop() == 0
    shown = run_cli("replay", ["show", "latest", "j.db"], cwd=tmp_path).stdout
    assert f"model org/tiny-wan@{MAIN}" in shown


SPECS = """\
import sys
from lifecycle.adapters.diffusers import spec_for_directory
from lifecycle.core.decisions.fingerprint import model_digest
from lifecycle.serve.ranks.models import model_directory
for given in sys.argv[1:]:
    spec = spec_for_directory(model_directory(given))
    print(spec.name, spec.source, model_digest(spec))
"""


def test_a_revision_picks_its_own_snapshot_and_fingerprint(tmp_path: Path, hub_cache: Path) -> None:
    """`@v2` and `@COMMIT` read those snapshots, main the one refs/main names: each model is
    named ORG/NAME@COMMIT, loads from its snapshot folder, and two commits are two
    fingerprints; Qwen-Image by hub ID is read the same way."""
    script = tmp_path / "specs.py"
    script.write_text(SPECS)
    given = ["org/tiny-wan", "org/tiny-wan@v2", f"org/tiny-wan@{OTHER}", "org/tiny-qwen-image"]
    done = run_cli(
        str(script.with_suffix("").name), given, cwd=tmp_path, env=offline(hub_cache), timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    names = [name for name, _, _ in rows]
    assert names == [
        f"org/tiny-wan@{MAIN}", f"org/tiny-wan@{OTHER}", f"org/tiny-wan@{OTHER}",
        f"org/tiny-qwen-image@{MAIN}",
    ]  # fmt: skip
    repo = hub_cache.resolve() / "models--org--tiny-wan" / "snapshots"
    assert [source for _, source, _ in rows[:2]] == [str(repo / MAIN), str(repo / OTHER)]
    digests = [digest for _, _, digest in rows]
    assert digests[0] != digests[1] and digests[1] == digests[2]


def test_a_hub_id_the_cache_lacks_offline_is_one_line_naming_the_cache_and_the_fetch(
    tmp_path: Path, hub_cache: Path
) -> None:
    """An ID absent from the cache, or a revision it has no snapshot of, with HF_HUB_OFFLINE=1:
    one line naming the cache searched and `hf download`, exit 2, no journal."""
    for given, fetch in (
        ("org/absent", "hf download org/absent"),
        ("org/tiny-wan@v3", "hf download org/tiny-wan --revision v3"),
    ):
        done = run_cli(
            "lifecycle", ["boot", "--model-path", given, "--db", "j.db"], cwd=tmp_path,
            env=offline(hub_cache), timeout=120,
        )  # fmt: skip
        assert_refused_before_start(done, fetch, tmp_path / "j.db")
        line = one_clear_line(done)
        assert f"--model-path {given}: not in the cache ({hub_cache.resolve()}" in line


def test_a_snapshot_without_its_index_offline_is_one_line(tmp_path: Path) -> None:
    """A cached snapshot that lacks model_index.json (or a component's weights) is not
    taken as whole: one line saying what it lacks, exit 2, no journal."""
    source = tmp_path / "partial"
    (source / "transformer").mkdir(parents=True)
    (source / "transformer" / "config.json").write_text("{}")
    cache = tmp_path / "hub"
    lay_out_snapshot(cache, "org/partial", MAIN, source, refs=("main",))
    done = run_cli(
        "lifecycle", ["boot", "--model-path", "org/partial", "--db", "j.db"], cwd=tmp_path,
        env=offline(cache), timeout=120,
    )  # fmt: skip
    assert_refused_before_start(done, "without model_index.json", tmp_path / "j.db")
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    (source / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(cache)
    lay_out_snapshot(cache, "org/partial", MAIN, source, refs=("main",))
    done = run_cli(
        "lifecycle", ["boot", "--model-path", "org/partial", "--db", "j.db"], cwd=tmp_path,
        env=offline(cache), timeout=120,
    )  # fmt: skip
    assert_refused_before_start(done, "without transformer/'s weights", tmp_path / "j.db")


@pytest.mark.parametrize("given", ["org/bad name", "org/na..me", "a/b/c", "o/n@"])
def test_a_malformed_hub_id_is_one_line(tmp_path: Path, given: str) -> None:
    """What is neither a directory nor ORG/NAME[@REVISION] as the hub spells them: one line
    saying so, exit 2, no journal."""
    done = run_cli(
        "lifecycle", ["boot", "--model-path", given, "--db", "j.db"], cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}, timeout=120,
    )  # fmt: skip
    assert_refused_before_start(done, f"--model-path {given}: no such directory", tmp_path / "j.db")
    assert "not a hub ID ORG/NAME[@REVISION]" in one_clear_line(done)


def test_a_download_takes_the_components_files_safetensors_over_others() -> None:
    """From a repository's files, a download takes the files of the components
    model_index.json names, their safetensors over .bin, never a variant's beside them,
    another framework's weights or a folder no component is."""
    index = {
        "_class_name": "WanPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "unused": [None, None],
    }
    files = [
        "model_index.json", "README.md", "assets/demo.mp4", "unused/config.json",
        "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.fp16.safetensors",
        "transformer/diffusion_pytorch_model.bin",
        "tokenizer/spiece.model", "tokenizer/tokenizer_config.json",
        "vae/config.json", "vae/diffusion_pytorch_model.bin", "vae/model.onnx",
    ]  # fmt: skip
    assert snapshot_files(index, files) == (
        "tokenizer/spiece.model", "tokenizer/tokenizer_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/config.json", "vae/diffusion_pytorch_model.bin",
    )  # fmt: skip
