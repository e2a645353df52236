"""A diffusers pipeline directory: what it holds, checked before any rank loads it, and the
digest that makes new weights a new fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.pipelines import ConfigError

INDEX = "model_index.json"
# Files whose bytes describe the model: hashed whole. Weights are hashed by name and size, so
# that a digest costs milliseconds whatever the model's size, and new weights are a new digest.
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".yaml")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
MAX_CONFIG_BYTES = 64 * 2**20
# A hub snapshot lives in models--ORG--NAME/snapshots/REVISION: its name is the repository's.
HUB_PREFIX = "models--"


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineDirectory:
    """A directory as `save_pretrained` or a hub snapshot writes it."""

    path: Path
    class_name: str  # the pipeline class model_index.json names, e.g. WanPipeline
    components: dict[str, tuple[str | None, str | None]]  # name -> (library, class)
    name: str
    digest: str

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
    """The pipeline directory at `path`, checked: one line naming what is wrong otherwise."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"--model-path {path}: not a directory"
            + ("" if root.exists() else " (it does not exist)"),
            field="model_path",
        )
    index_path = root / INDEX
    if not index_path.is_file():
        raise ConfigError(
            f"--model-path {path}: no {INDEX}: not a diffusers pipeline directory",
            field="model_path",
        )
    index = _json_object(index_path)
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
        if not (root / key).is_dir():
            raise ConfigError(
                f"--model-path {path}: {INDEX} names component {key!r}, but {key}/ is missing",
                field="model_path",
            )
        for weights in sorted((root / key).glob("*.safetensors")):
            problem = safetensors_problem(weights)
            if problem is not None:
                raise ConfigError(
                    f"--model-path {path}: {key}/{weights.name} {problem}", field="model_path"
                )
    return PipelineDirectory(
        path=root.resolve(),
        class_name=class_name,
        components=components,
        name=_name_of(root.resolve()),
        digest=directory_digest(root),
    )


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be loaded (cut short, not one at all), read from its
    header alone; None when its header and sizes hold together."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or length > min(size - 8, MAX_CONFIG_BYTES):
                return "is not a safetensors file (its header length does not fit the file)"
            header = json.loads(file.read(length))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__"
        and isinstance(entry, dict)
        and len(entry.get("data_offsets", ())) == 2
    ]
    if ends and max(ends) > size - 8 - length:
        return f"is cut short ({size:,} bytes; its tensors need {8 + length + max(ends):,})"
    return None


def directory_digest(root: Path) -> str:
    """A digest of the directory's configs (their bytes) and weight files (names and sizes)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for file in sorted(filenames):
            path = Path(dirpath) / file
            relative = path.relative_to(root).as_posix()
            if file.endswith(WEIGHT_SUFFIXES):
                digest.update(f"w {relative} {path.stat().st_size}\n".encode())
            elif file.endswith(CONFIG_SUFFIXES) and path.stat().st_size <= MAX_CONFIG_BYTES:
                digest.update(f"c {relative}\n".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _name_of(root: Path) -> str:
    """The directory's name, or the hub repository's for a snapshot (ORG/NAME)."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(HUB_PREFIX):
        return root.parent.parent.name.removeprefix(HUB_PREFIX).replace("--", "/")
    return root.name


def _json_object(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than a config can be", field="model_path")
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(
            f"{path}: cannot be read as JSON: {_first_line(exc)}", field="model_path"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a JSON object", field="model_path")
    return doc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
