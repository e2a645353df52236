"""A diffusers pipeline directory: what it holds, checked before any rank loads it, and the
digest that is its model's fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.adapters.diffusers.modelfiles import ModelFile, model_files, read_bounded
from lifecycle.adapters.diffusers.weights import WEIGHT_SUFFIXES, NotWeights, digest_weights
from lifecycle.pipelines import ConfigError

INDEX = "model_index.json"
# Files whose bytes describe the model: hashed whole, each within a bound and all of them
# within another, so that a directory holding something else is refused in a second.
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".yaml")
MAX_CONFIG_BYTES = 64 * 2**20
MAX_CONFIGS_BYTES = 256 * 2**20
# A hub snapshot lives in models--ORG--NAME/snapshots/COMMIT: its name is ORG/NAME@COMMIT.
HUB_PREFIX = "models--"


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineDirectory:
    """A directory as `save_pretrained` or a hub snapshot writes it."""

    path: Path
    class_name: str  # the pipeline class model_index.json names, e.g. WanPipeline
    components: dict[str, tuple[str | None, str | None]]  # name -> (library, class)
    name: str
    digest: str
    files: tuple[ModelFile, ...] = ()  # every regular file, walked through links

    def files_of(self, component: str) -> list[tuple[str, int]]:
        """A component's files, by name inside the directory, with their sizes."""
        prefix = f"{component}/"
        return [(f.relative, f.size) for f in self.files if f.relative.startswith(prefix)]

    def index(self) -> dict[str, Any]:
        """model_index.json itself: the pipeline's own config beside its components."""
        return _json_object(self.path / INDEX)

    def has(self, component: str) -> bool:
        """Whether model_index.json names `component` with a library (not `[null, null]`)."""
        library, _ = self.components.get(component, (None, None))
        return library is not None

    def config(self, component: str) -> dict[str, Any]:
        """A component's own config (config.json, or scheduler_config.json)."""
        for file in ("config.json", "scheduler_config.json"):
            found = self.path / component / file
            if found.is_file():
                return _json_object(found)
        raise ConfigError(
            f"--model-path {self.path}: {component}/ has no config.json", field="model_path"
        )


def read_directory(path: str) -> PipelineDirectory:
    """The pipeline directory at `path`, checked: one line naming what is wrong otherwise.
    Every file in it is walked (through links) and refused unless regular before any is read,
    so that nothing here or in the load waits on a FIFO or reads a device."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"--model-path {path}: not a directory"
            + ("" if root.exists() else " (it does not exist)"),
            field="model_path",
        )
    if not (root / INDEX).exists():
        raise ConfigError(
            f"--model-path {path}: no {INDEX}: not a diffusers pipeline directory",
            field="model_path",
        )
    files = model_files(root, shown=path)
    index = _json_object(root / INDEX)
    class_name = index.get("_class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ConfigError(
            f"--model-path {path}: {INDEX} names no pipeline class (_class_name)",
            field="model_path",
        )
    components: dict[str, tuple[str | None, str | None]] = {}
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, cls = value
        components[key] = (library, cls)
        if library is None:
            continue
        if key.startswith(".") or "/" in key or os.sep in key:
            raise ConfigError(
                f"--model-path {path}: {INDEX} names component {key!r}, not a folder's name",
                field="model_path",
            )
        if not (root / key).is_dir():
            raise ConfigError(
                f"--model-path {path}: {INDEX} names component {key!r}, but {key}/ is missing",
                field="model_path",
            )
    return PipelineDirectory(
        path=root.resolve(),
        class_name=class_name,
        components=components,
        name=_name_of(root.resolve()),
        digest=directory_digest(files, shown=path),
        files=files,
    )


def directory_digest(files: tuple[ModelFile, ...], *, shown: str) -> str:
    """The model's fingerprint: every config file's name and bytes, and every weight file's
    name and share (`digest_weights`), by name; one line for a file that cannot be read."""
    digest = hashlib.sha256()
    configs = 0
    for file in sorted(files, key=lambda f: f.relative):
        try:
            if file.relative.endswith(WEIGHT_SUFFIXES):
                digest_weights(digest, file.path, file.relative)
            elif file.relative.endswith(CONFIG_SUFFIXES):
                if file.size > MAX_CONFIG_BYTES:
                    raise ConfigError(
                        f"--model-path {shown}: {file.relative} is larger than a config can be"
                        f" ({file.size:,} bytes, more than {MAX_CONFIG_BYTES:,})",
                        field="model_path",
                    )
                configs += file.size
                if configs > MAX_CONFIGS_BYTES:
                    raise ConfigError(
                        f"--model-path {shown}: its config files come to more than"
                        f" {MAX_CONFIGS_BYTES:,} bytes: not a pipeline directory",
                        field="model_path",
                    )
                data = read_bounded(file.path, limit=MAX_CONFIG_BYTES)
                digest.update(f"c {file.relative} {len(data)}\n".encode())
                digest.update(data)
        except NotWeights as exc:
            raise ConfigError(
                f"--model-path {shown}: {file.relative} {exc}", field="model_path"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"--model-path {shown}: {file.relative} cannot be read ({_reason(exc)})",
                field="model_path",
            ) from None
    return digest.hexdigest()[:16]


def _name_of(root: Path) -> str:
    """The directory's name, or for a hub snapshot the repository's and its commit (the
    snapshot folder's name): ORG/NAME@COMMIT, so that two commits are two models."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(HUB_PREFIX):
        repo = root.parent.parent.name.removeprefix(HUB_PREFIX).replace("--", "/")
        return f"{repo}@{root.name}"
    return root.name


def _json_object(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_bounded(path, limit=MAX_CONFIG_BYTES).decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({_reason(exc)})", field="model_path") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(
            f"{path}: cannot be read as JSON: {_first_line(exc)}", field="model_path"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a JSON object", field="model_path")
    return doc


def _reason(exc: OSError) -> str:
    """An OSError in a few words: its own (a FIFO, not a regular file) or the system's."""
    if exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
