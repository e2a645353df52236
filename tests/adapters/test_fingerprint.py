"""A pipeline directory's fingerprint follows its model wherever the directory's links lead:
every config's bytes, every weight file's tensors (names, dtypes, shapes) and a sample of its
bytes; ranks started on different models stop at the rendezvous saying so."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.pipelinedirs import rewrite_weights, save_small_wan
from lifecycle.adapters.diffusers import spec_for_directory
from lifecycle.core.errors import ConfigError
from tests.conftest import reaped
from tests.lifecycle.test_torchrun_env import rank_env

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

BOOT_RANK = (
    "boot", "--model-path", "model", "--num-ranks", "2", "--db", "j.db", "--log-level", "error",
    "--warmup-mode", "none", "--smoke-request", "off",
)  # fmt: skip


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan(tmp_path_factory.mktemp("wan") / "small-wan")


def _copy(wan_dir: Path, to: Path) -> Path:
    shutil.copytree(wan_dir, to)
    return to


def _digest(model: Path) -> str:
    return spec_for_directory(str(model)).source_digest


def _weights(model: Path, component: str = "transformer") -> Path:
    return next((model / component).glob("*.safetensors"))


def test_a_linked_component_folder_is_followed_into_its_config(
    wan_dir: Path, tmp_path: Path
) -> None:
    """transformer/ as a link to a folder elsewhere: its config going from 1 to 12 layers is
    a new digest, and the digest is the one the same files give unlinked."""
    model = _copy(wan_dir, tmp_path / "model")
    unlinked = _digest(model)
    elsewhere = tmp_path / "transformer-elsewhere"
    shutil.move(model / "transformer", elsewhere)
    (model / "transformer").symlink_to(elsewhere, target_is_directory=True)
    assert _digest(model) == unlinked
    config = elsewhere / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 12}))
    assert _digest(model) != unlinked


@pytest.mark.parametrize(
    "rewrite",
    [{"seed": 99}, {"dtype": torch.int32}],
    ids=["new-values", "same-bytes-another-dtype"],
)
def test_new_weights_of_the_same_size_are_a_new_digest(
    wan_dir: Path, tmp_path: Path, rewrite: dict[str, object]
) -> None:
    """Weights rewritten at the same size, with new values or with the same bytes as another
    dtype, are a new digest; rewritten unchanged, the same one."""
    model = _copy(wan_dir, tmp_path / "model")
    first = _digest(model)
    rewrite_weights(_weights(model, "vae"))
    assert _digest(model) == first
    rewrite_weights(_weights(model, "vae"), **rewrite)  # type: ignore[arg-type]
    assert _digest(model) != first


def test_sharded_and_pickled_weights_are_digested_too(wan_dir: Path, tmp_path: Path) -> None:
    """A transformer saved in shards with their index, and a VAE saved as a pickled .bin: a
    shard's new values and the .bin's new bytes at the same size are each a new digest."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    model = _copy(wan_dir, tmp_path / "model")
    transformer = WanTransformer3DModel.from_pretrained(str(model / "transformer"))
    shutil.rmtree(model / "transformer")
    transformer.save_pretrained(str(model / "transformer"), max_shard_size="16KB")
    vae = AutoencoderKLWan.from_pretrained(str(model / "vae"))
    shutil.rmtree(model / "vae")
    vae.save_pretrained(str(model / "vae"), safe_serialization=False)
    shards = sorted((model / "transformer").glob("*.safetensors"))
    (pickled,) = (model / "vae").glob("*.bin")
    assert len(shards) > 1 and list((model / "transformer").glob("*.safetensors.index.json"))
    first = _digest(model)
    rewrite_weights(shards[-1], seed=5)
    second = _digest(model)
    assert second != first
    data = bytearray(pickled.read_bytes())
    data[-100] ^= 0xFF  # inside the archive's last stored tensor or its directory
    pickled.write_bytes(bytes(data))
    assert _digest(model) != second


def _header(doc: object) -> bytes:
    text = json.dumps(doc).encode()
    return len(text).to_bytes(8, "little") + text + b"\0" * 16


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ((200_000_000).to_bytes(8, "little") + b"{}", "header would be 200,000,000 bytes"),
        (_header({"w": {"dtype": "F32"}}), "(tensor 'w' has no dtype, shape and offsets)"),
        (_header([1, 2]), "(its header is not a JSON object)"),
        (b"\x05", "(its header length does not fit the file)"),
    ],
    ids=["header-over-100-MB", "tensor-without-shape", "not-an-object", "too-short"],
)
def test_a_weight_file_with_a_header_that_cannot_be_is_one_error(
    wan_dir: Path, tmp_path: Path, content: bytes, says: str
) -> None:
    """A .safetensors file whose header is past safetensors' bound, malformed, or missing is
    one ConfigError naming the file, read without reading the rest."""
    model = _copy(wan_dir, tmp_path / "model")
    weights = _weights(model, "vae")
    weights.write_bytes(content)
    with pytest.raises(ConfigError) as raised:
        _digest(model)
    message = str(raised.value)
    assert message.startswith(f"--model-path {model}: {weights.relative_to(model).as_posix()} ")
    assert says in message and "\n" not in message


# Slow tier: the default run holds the settings agreement's refusal in-process
# (tests/lifecycle/test_settings_agreement.py) and ranks stopping at the rendezvous on what they
# disagree on (tests/lifecycle/test_store_trust.py, different store keys).
@pytest.mark.slow
@pytest.mark.ranks
def test_nodes_holding_different_models_at_the_same_path_stop_at_the_rendezvous(
    wan_dir: Path, tmp_path: Path
) -> None:
    """Two ranks under torchrun, each on its own node (working directory) given the same
    relative --model-path, whose transformers differ only in their weights' values: both stop
    at the rendezvous naming model.source_digest and each rank's value, exit 2."""
    from lifecycle.serve.ranks.supervisor import free_port

    port = free_port()
    models = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        models.append(_copy(wan_dir, tmp_path / f"node{node}" / "model"))
    rewrite_weights(_weights(models[1]), seed=42)
    digests = [_digest(model) for model in models]
    assert digests[0] != digests[1]
    with contextlib.ExitStack() as stack:
        ranks = []
        for node in (0, 1):
            with (tmp_path / f"node{node}" / "stderr.txt").open("w") as err:
                rank = subprocess.Popen(
                    [sys.executable, "-m", "lifecycle", *BOOT_RANK], cwd=tmp_path / f"node{node}",
                    stdout=subprocess.DEVNULL, stderr=err, text=True,
                    env=rank_env(node, 2, port, TORCHELASTIC_RUN_ID="job-models"),
                )  # fmt: skip
            ranks.append(stack.enter_context(reaped(rank)))
        statuses = [rank.wait(timeout=180) for rank in ranks]
    said = (
        "the ranks were started with different settings: model.source_digest"
        f' ("{digests[0]}" on rank 0 vs "{digests[1]}" on rank 1)'
    )
    for node, status in enumerate(statuses):
        err_text = (tmp_path / f"node{node}" / "stderr.txt").read_text()
        assert status == 2, err_text[-2000:]
        assert err_text.strip().splitlines()[-1] == f"lifecycle: error: rank {node}: {said}"
