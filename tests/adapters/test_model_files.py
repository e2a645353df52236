"""A pipeline directory is read as a load would read it, and no further: a FIFO, a device, a
dangling or looping link anywhere in it, or a model_index.json naming something that is not a
pipeline class, is one line and exit 2 within seconds, before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.pipelinedirs import save_small_ddpm, save_small_wan
from lifecycle.adapters.diffusers import spec_for_directory
from lifecycle.adapters.diffusers.modelfiles import MAX_DEPTH, MAX_ENTRIES
from lifecycle.core.errors import ConfigError
from tests.conftest import one_clear_line, run_cli

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# The refused boot (interpreter start, the directory's walk) takes a second or two; a FIFO
# would otherwise be waited on forever, and the subprocess is killed past KILLED_AFTER_S.
REFUSED_WITHIN_S = 30
KILLED_AFTER_S = 90


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan(tmp_path_factory.mktemp("wan") / "small-wan")


def _weights(model: Path) -> Path:
    return next((model / "transformer").glob("*.safetensors"))


def _linked_folder_with_fifo(model: Path) -> str:
    """vae/ moved elsewhere and linked back, a FIFO inside the folder it leads to."""
    elsewhere = model.parent / "vae-elsewhere"
    shutil.move(model / "vae", elsewhere)
    (model / "vae").symlink_to(elsewhere, target_is_directory=True)
    os.mkfifo(elsewhere / "notes.json")
    return "vae/notes.json is a FIFO, not a regular file"


def _fifo(relative: str) -> Callable[[Path], str]:
    def make(model: Path) -> str:
        target = model / relative
        target.unlink(missing_ok=True)
        os.mkfifo(target)
        return f"{relative} is a FIFO, not a regular file"

    return make


def _zero_json(model: Path) -> str:
    (model / "vae" / "zero.json").symlink_to("/dev/zero")
    return "vae/zero.json is a character device, not a regular file"


def _fifo_weights(model: Path) -> str:
    relative = _weights(model).relative_to(model).as_posix()
    return _fifo(relative)(model)


def _dangling(model: Path) -> str:
    (model / "text_encoder" / "extra.json").symlink_to(model / "gone.json")
    return "text_encoder/extra.json is a link that leads nowhere"


def _link_loop(model: Path) -> str:
    (model / "loop.json").symlink_to(model / "loop.json")
    return "loop.json is a loop of links"


def _cycle(model: Path) -> str:
    (model / "vae" / "up").symlink_to(model, target_is_directory=True)
    return "vae/up leads back to the directory itself (a directory cycle)"


def _huge_config(model: Path) -> str:
    with (model / "vae" / "huge.json").open("wb") as sparse:
        sparse.truncate(65 * 2**20)
    return "vae/huge.json is larger than a config can be (68,157,440 bytes, more than 67,108,864)"


BAD_FILES: dict[str, Callable[[Path], str]] = {
    "json-linked-to-dev-zero": _zero_json,
    "fifo-in-a-component": _fifo("vae/notes.json"),
    "fifo-as-weights": _fifo_weights,
    "fifo-as-model-index": _fifo("model_index.json"),
    "fifo-at-the-root": _fifo("notes.txt"),
    "fifo-in-a-linked-folder": _linked_folder_with_fifo,
    "dangling-link": _dangling,
    "link-loop": _link_loop,
    "directory-cycle": _cycle,
    "config-over-its-bound": _huge_config,
}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_a_file_no_load_can_read_is_one_line_within_seconds(
    tmp_path: Path, wan_dir: Path, bad: str
) -> None:
    """A .json linked to /dev/zero, a FIFO (in a component, as the weights, as
    model_index.json, at the root, behind a linked folder), a dangling link, a loop of links,
    a folder linking back up or a config past its bound: `lifecycle boot` says which file and
    why in one line, exit 2, within seconds, and writes no journal."""
    model = tmp_path / "model"
    shutil.copytree(wan_dir, model)
    says = BAD_FILES[bad](model)
    started = time.monotonic()
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(model), "--db", "j.db"], cwd=tmp_path,
        timeout=KILLED_AFTER_S,
    )  # fmt: skip
    assert time.monotonic() - started < REFUSED_WITHIN_S
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_clear_line(done) == f"lifecycle: error: --model-path {model}: {says}"
    assert not (tmp_path / "j.db").exists()


@pytest.mark.parametrize(
    "named",
    [
        "utils",
        *(
            pytest.param(n, marks=pytest.mark.slow)
            for n in ("UNet2DModel", "DiffusionPipeline", "__version__")
        ),
    ],
)
def test_a_class_name_that_is_not_a_pipeline_class_is_one_line(tmp_path: Path, named: str) -> None:
    """model_index.json naming a module of diffusers (`utils`), a model class, the pipelines'
    base class or any other name diffusers holds that is not a pipeline class: one line
    naming it, exit 2."""
    model = save_small_ddpm(tmp_path / "ddpm")
    index = model / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": named}))
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(model), "--db", "j.db"], cwd=tmp_path,
        timeout=KILLED_AFTER_S,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_clear_line(done) == (
        f"lifecycle: error: --model-path {model}: {named!r}, which model_index.json names as"
        " the pipeline class, is not a diffusers pipeline class"
    )


def _many_files(model: Path) -> str:
    crowd = model / "crowd"
    crowd.mkdir()
    for n in range(MAX_ENTRIES):
        (crowd / f"{n}.txt").touch()
    return f"--model-path {model}: holds more than {MAX_ENTRIES:,} files and folders"


def _deep_folders(model: Path) -> str:
    deep = model.joinpath(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    return f"--model-path {model}: {'/'.join(['d'] * (MAX_DEPTH + 1))} is more than"


@pytest.mark.parametrize("past", [_many_files, _deep_folders], ids=["entries", "depth"])
def test_a_tree_past_the_walks_bounds_is_one_error(
    tmp_path: Path, wan_dir: Path, past: Callable[[Path], str]
) -> None:
    """A directory holding more files and folders than a pipeline does, or folders nested
    deeper, is one ConfigError saying so rather than a walk without end."""
    model = tmp_path / "model"
    shutil.copytree(wan_dir, model)
    says = past(model)
    with pytest.raises(ConfigError) as raised:
        spec_for_directory(str(model))
    assert str(raised.value).startswith(says) and "\n" not in str(raised.value)
