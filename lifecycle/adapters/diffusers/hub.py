"""A model named by its hub ID (`ORG/NAME[@REVISION]`): the snapshot folder that
huggingface_hub's cache holds for it, downloaded into that cache when it is not there, with
the cache's own layout and variables (`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`).

huggingface_hub comes with the diffusers extra (diffusers depends on it); it is imported only
for a hub ID, and before diffusers is, so that the operator's HF_HUB_OFFLINE is the one read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.adapters.diffusers.library import EXTRA
from lifecycle.adapters.diffusers.weights import WEIGHT_SUFFIXES
from lifecycle.pipelines import ConfigError

INDEX = "model_index.json"
# huggingface_hub's own rule for a repository's name (`validate_repo_id`), as ORG/NAME: word
# characters, `-` and `.`, neither `--` nor `..`, each part starting and ending with a word
# character, the name at most 96 long.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"(?P<org>{_PART})/(?P<name>{_PART})")
MAX_NAME = 96
# A branch, a tag or a commit; kept inside the cache's refs/ (no `..`, no leading `/`).
REVISION = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
# Weight files of another precision or kind than the component's own (`*.fp16.safetensors`),
# left out where the component has its own: diffusers loads those without a `variant`.
VARIANTS = frozenset({"fp16", "bf16", "fp32", "fp8", "ema", "non_ema"})
PREFERRED_WEIGHTS = ".safetensors"
DOWNLOAD_WORKERS = 8  # files downloaded at once: snapshot_download's default max_workers
# A page of the file list is waited for this many times huggingface_hub's timeout for a
# file's metadata (HF_HUB_ETAG_TIMEOUT, 10 s by default): a page is one request, as a file's
# metadata is, and may be retried.
LIST_PAGE_TIMEOUTS = 3
# What a component's folder may hold that the load never reads (other frameworks' weights).
NOT_READ = (".onnx", ".onnx_data", ".msgpack", ".h5", ".ckpt", ".tflite", ".mlmodel", ".pb")


@dataclass(frozen=True, slots=True, kw_only=True)
class HubModel:
    """A hub ID as given: the repository and the revision asked for (None: main)."""

    repo_id: str
    revision: str | None

    @property
    def shown(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def fetch_command(self) -> str:
        """The hub's own command that puts this model into the cache."""
        revision = "" if self.revision is None else f" --revision {self.revision}"
        return f"hf download {self.repo_id}{revision}"


def hub_model(given: str) -> HubModel | None:
    """The hub ID `given` names; None for a local path (one that exists is always a directory,
    and one written as a path, from `/`, `.` or `~`, or without a `/`, is left to be read as
    one); one line for what is neither a path that exists nor a well-formed hub ID."""
    if not given or Path(given).expanduser().exists() or given.startswith(("/", ".", "~")):
        return None
    repo_id, at, revision = given.partition("@")
    if "/" not in repo_id:
        return None
    match = HUB_ID.fullmatch(repo_id)
    why = None
    if match is None:
        why = "a hub ID is ORG/NAME of letters, digits, '_', '-' and '.'"
    elif "--" in repo_id or ".." in repo_id:
        why = "a hub ID holds neither '--' nor '..'"
    elif len(match["name"]) > MAX_NAME:
        why = f"a hub repository's name is at most {MAX_NAME} characters"
    elif at and (
        REVISION.fullmatch(revision) is None or ".." in revision.split("/") or revision == "."
    ):
        why = "the revision after '@' is a branch, a tag or a commit"
    if why is not None:
        raise ConfigError(
            f"--model-path {given}: no such directory, and not a hub ID ORG/NAME[@REVISION]"
            f" ({why})",
            field="model_path",
        )
    return HubModel(repo_id=repo_id, revision=revision if at else None)


def cache_folder() -> Path:
    """The cache huggingface_hub reads and writes (HF_HUB_CACHE, else HF_HOME's hub/)."""
    return Path(_hub().constants.HF_HUB_CACHE).expanduser().resolve()


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids reaching the hub, as huggingface_hub reads it."""
    return bool(_hub().constants.HF_HUB_OFFLINE)


def cached_snapshot(model: HubModel) -> Path | None:
    """The cache's whole snapshot of `model`, found without the network; None where there is
    none, or only part of one, and the hub may be reached; one line where it may not (with
    the cache searched and the command that fetches it)."""
    hub = _hub()
    folder: Path | None = None
    try:
        folder = Path(
            hub.snapshot_download(
                model.repo_id,
                revision=model.revision,
                local_files_only=True,
                allow_patterns=[INDEX],
            )
        )
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or only in part
        folder = None
    missing = "not in the cache" if folder is None else missing_from(folder)
    if missing is None:
        return folder
    if not hub_offline():
        return None
    raise ConfigError(
        f"--model-path {model.shown}: {missing} ({cache_folder()}, HF_HUB_OFFLINE set):"
        f" fetch it with `{model.fetch_command}`",
        field="model_path",
    )


def download_snapshot(model: HubModel) -> Path:
    """Download `model`'s model_index.json and its components' files into the cache (resumed
    where an earlier download stopped, with huggingface_hub's progress on a terminal) and
    return its snapshot folder; one line for a repository, revision or file the hub does not
    give, or a connection to it that failed (refused, dropped, timed out, or silent).

    Each file is huggingface_hub's `hf_hub_download` at the resolved commit, DOWNLOAD_WORKERS
    at a time (as its snapshot_download does), whose requests carry its timeouts
    (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT); the file list is bounded here (see
    _file_list), since its API call carries none."""
    hub = _hub()
    try:
        with _hub_quiet_unless_terminal(hub):
            index = Path(hub.hf_hub_download(model.repo_id, INDEX, revision=model.revision))
            commit = index.parent.name
            files = _file_list(hub, model, commit)
            chosen = snapshot_files(_read_index(index, model), files)
            with concurrent.futures.ThreadPoolExecutor(DOWNLOAD_WORKERS) as pool:
                fetched = [
                    pool.submit(hub.hf_hub_download, model.repo_id, name, revision=commit)
                    for name in chosen if name != INDEX
                ]  # fmt: skip
                for each in fetched:
                    each.result()
            folder = index.parent
    except (OSError, ValueError, hub.errors.EntryNotFoundError, *_transport_errors()) as exc:
        raise ConfigError(
            f"--model-path {model.shown}: cannot be downloaded from the hub into"
            f" {cache_folder()}: {_first_line(exc)}",
            field="model_path",
        ) from None
    missing = missing_from(folder)
    if missing is not None:
        raise ConfigError(
            f"--model-path {model.shown}: the downloaded snapshot {folder} is {missing}",
            field="model_path",
        )
    return folder


def _file_list(hub: Any, model: HubModel, commit: str) -> list[str]:
    """The repository's files at `commit`, read from the hub's paged tree API in a thread of
    its own, each page within LIST_PAGE_TIMEOUTS x HF_HUB_ETAG_TIMEOUT seconds: huggingface_hub
    2.4's `list_repo_tree` sets no timeout, so a hub that takes the connection and never
    answers would hold the startup for ever. A TimeoutError past that; the call's own error
    where it fails."""
    bound_s = LIST_PAGE_TIMEOUTS * float(hub.constants.HF_HUB_ETAG_TIMEOUT)
    repo_file = importlib.import_module("huggingface_hub.hf_api").RepoFile
    names: list[str] = []
    failed: list[BaseException] = []
    answered = [time.monotonic()]  # when the latest page came
    done = threading.Event()

    def walk() -> None:
        try:
            for entry in hub.list_repo_tree(model.repo_id, recursive=True, revision=commit):
                answered[0] = time.monotonic()
                if isinstance(entry, repo_file):
                    names.append(entry.path)
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=walk, name="hub-file-list", daemon=True).start()
    while not done.wait(0.1):
        if time.monotonic() - answered[0] > bound_s:
            raise TimeoutError(f"the hub did not answer for its file list in {bound_s:g} s")
    if failed:
        raise failed[0]
    return names


def snapshot_files(index: dict[str, Any], repo_files: Iterable[str]) -> tuple[str, ...]:
    """The files of the components model_index.json names that a load reads: each folder's
    configs and weights, its safetensors where it has them, never another precision's
    (`*.fp16.*`) beside its own, nor other frameworks' weights."""
    components = {
        key for key, value in index.items()
        if not key.startswith("_") and isinstance(value, list) and len(value) == 2
        and value[0] is not None
    }  # fmt: skip
    by_folder: dict[str, list[str]] = {}
    for name in repo_files:
        folder, slash, _ = name.partition("/")
        if slash and folder in components and not name.endswith(NOT_READ):
            by_folder.setdefault(folder, []).append(name)
    chosen: list[str] = []
    for names in by_folder.values():
        own = [n for n in names if not _variant(n)]
        weights = [n for n in own if n.endswith(WEIGHT_SUFFIXES)]
        safetensors = any(n.endswith(PREFERRED_WEIGHTS) for n in weights)
        for name in own:
            if name.endswith(WEIGHT_SUFFIXES) and safetensors:
                if not name.endswith(PREFERRED_WEIGHTS):
                    continue
            elif _is_bin_index(name) and safetensors:
                continue
            chosen.append(name)
        if not weights:
            chosen.extend(n for n in names if _variant(n))  # a component only in a variant
    return tuple(sorted(chosen))


def missing_from(folder: Path) -> str | None:
    """What keeps a snapshot folder from being a whole pipeline (None when nothing does): its
    model_index.json, a component's folder, a model component's weights, a shard its index
    names. huggingface_hub links a file into the snapshot only once it is whole."""
    if not (folder / INDEX).is_file():
        return f"a snapshot ({folder.name}) without {INDEX}: not a diffusers pipeline"
    try:
        index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # the directory's own check says what is wrong with it
    if not isinstance(index, dict):
        return None
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        if value[0] is None or "/" in key or key.startswith("."):
            continue
        component = folder / key
        if not component.is_dir():
            return f"a snapshot ({folder.name}) without {key}/, which {INDEX} names"
        shard_index = [p for p in component.iterdir() if p.name.endswith(".index.json")]
        for found in shard_index:
            for shard in _shards(found):
                if not (component / shard).is_file():
                    return f"a snapshot ({folder.name}) without {key}/{shard}"
        weights = [p for p in component.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]
        if (component / "config.json").is_file() and not weights:
            return f"a snapshot ({folder.name}) without {key}/'s weights"
    return None


def commit_of(folder: Path) -> str:
    """The commit a snapshot folder holds: its name."""
    return folder.name


def _shards(index_file: Path) -> set[str]:
    try:
        doc = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return set()
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return set()
    return {s for s in weight_map.values() if isinstance(s, str) and "/" not in s}


def _variant(name: str) -> bool:
    """Whether a file is a variant's (`diffusion_pytorch_model.fp16.safetensors`,
    `model.safetensors.index.bf16.json`, `model.fp16-00001-of-00002.safetensors`)."""
    parts = re.split(r"[.-]", name.rpartition("/")[2])
    return any(p in VARIANTS for p in parts[1:])


def _is_bin_index(name: str) -> bool:
    return name.endswith(".bin.index.json")


def _read_index(path: Path, model: HubModel) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(
            f"--model-path {model.shown}: its {INDEX} cannot be read: {_first_line(exc)}",
            field="model_path",
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f"--model-path {model.shown}: {INDEX} is not a JSON object", field="model_path"
        )
    return doc


def _hub() -> Any:
    """huggingface_hub; one line naming the extra that brings it when it is missing."""
    try:
        import huggingface_hub
        import huggingface_hub.errors
    except ImportError as exc:
        raise ConfigError(
            "a model by hub ID needs huggingface_hub, which comes with the diffusers extra"
            f" ({exc.name or 'huggingface_hub'} is not installed): pip install '{EXTRA}'",
            field="model_path",
        ) from None
    return huggingface_hub


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The errors of the HTTP client huggingface_hub speaks through (httpx2 in 2.x, httpx in
    1.x) that are no OSError: a connection refused, dropped part-way or timed out raises them
    through hf_hub_download and snapshot_download once the client's own retries are spent.
    Only those already imported (huggingface_hub imports its own)."""
    found: list[type[BaseException]] = []
    for module in ("httpx2", "httpx"):
        error = getattr(sys.modules.get(module), "HTTPError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


@contextlib.contextmanager
def _hub_quiet_unless_terminal(hub: Any) -> Iterator[None]:
    """huggingface_hub's progress bars and its warnings (each retry of a dropped connection)
    off while it is entered, where stderr is no terminal: what a failed download says is its
    one line. On a terminal, and where HF_HUB_DISABLE_PROGRESS_BARS decides the bars, left as
    they are."""
    if sys.stderr is not None and sys.stderr.isatty():
        yield
        return
    # The module (huggingface_hub.utils's attribute `tqdm` is the class, which shadows it).
    bars = importlib.import_module("huggingface_hub.utils.tqdm")
    bars_off = (
        hub.constants.HF_HUB_DISABLE_PROGRESS_BARS is None and not bars.are_progress_bars_disabled()
    )
    library_logger = logging.getLogger("huggingface_hub")
    level = library_logger.level
    library_logger.setLevel(logging.ERROR)
    if bars_off:
        bars.disable_progress_bars()
    try:
        yield
    finally:
        if bars_off:
            bars.enable_progress_bars()
        library_logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
