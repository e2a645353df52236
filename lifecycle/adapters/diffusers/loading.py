"""A pipeline directory's components loaded in parallel, each by diffusers' own loader and each
journaled as it loads, moved to the device apart from the read: the pipeline a serial
`from_pretrained` gives, in about the time of its slowest component instead of their sum.

Each component is loaded by `from_pretrained` itself, told to leave the others out (`name=None`
for each other component), and the pipeline is then assembled by `from_pretrained` given every
loaded component, so that what is loaded and how is diffusers' and transformers' own.

While a library builds a model's empty skeleton it swaps process-wide functions for its own and
puts them back after: diffusers swaps torch's initializers and, through accelerate,
`nn.Module.register_parameter` (which then makes every new parameter, in any thread, an empty
one); transformers sets torch's default dtype and `torch.linspace`. So: skeletons are built one
at a time, under one lock; and the transformers components (the text encoders, which set their
loaded weights through `register_parameter`) start loading only once every diffusers model has
built its skeleton. Reading and copying the weights, where the time goes, runs in parallel. A
component that still comes out with an empty parameter is loaded again on its own, and where a
library's version lacks the hooks this relies on, the components load one after another.

The libraries' own progress bars ("Loading pipeline components...", "Loading weights") are off
while the components load: one per thread, they would draw over each other on the rank's
stderr, and the console names each component's load already.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.pipelines import ConfigError, component_load

# One skeleton at a time, in any thread (reentrant: a model may build another inside it).
_SKELETONS = threading.RLock()
# How long a text encoder waits for the diffusers models' skeletons: each takes well under a
# second; past this something went wrong in another thread, which reports it.
SKELETONS_WITHIN_S = 600.0


class _Skeletons:
    """Counts the diffusers models still to build their skeleton; opens once none is left."""

    def __init__(self, builders: int) -> None:
        self._left = builders
        self._lock = threading.Lock()
        self.built = threading.Event()
        self._local = threading.local()
        if builders == 0:
            self.built.set()

    def begin(self) -> None:
        """This thread starts a component's load (a pool's thread loads one after another)."""
        self._local.counted = False

    def one_built(self) -> None:
        """This thread's model has its skeleton (or its load ended without one): once."""
        if getattr(self._local, "counted", False):
            return
        self._local.counted = True
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.built.set()


def load_components(
    cls: Any, directory: PipelineDirectory, device: Any, dtypes: Mapping[str, Any] | None = None
) -> Any:
    """The pipeline of `directory`, its components loaded concurrently (one thread each, at
    most one per core), each in its torch dtype of `dtypes` (one not there: as the library
    loads it) and moved to `device` once read."""
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    names = [name for name, (library, _) in directory.components.items() if library is not None]
    builders = {
        name
        for name, (library, class_name) in directory.components.items()
        if library == "diffusers"
        and isinstance(found := getattr(diffusers, class_name or "", None), type)
        and issubclass(found, ModelMixin)
    }
    skeletons = _Skeletons(len(builders))
    path = str(directory.path)

    def load_alone(name: str) -> Any:
        others: dict[str, Any] = {other: None for other in names if other != name}
        if (dtype := (dtypes or {}).get(name)) is not None:
            others["dtype"] = dtype  # diffusers' own (and transformers') name for it
        try:
            return getattr(cls.from_pretrained(path, local_files_only=True, **others), name)
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"--model-path {directory.path}: component {name} could not be loaded"
                f" ({_first_line(exc)})",
                field="model_path",
            ) from None

    def load(name: str) -> Any:
        files = directory.files_of(name)
        names_of_files, nbytes = [f for f, _ in files], sum(size for _, size in files)
        skeletons.begin()
        with component_load(name, files=names_of_files, nbytes=nbytes) as step:
            try:
                if name not in builders and not skeletons.built.wait(SKELETONS_WITHIN_S):
                    raise ConfigError(
                        f"--model-path {directory.path}: {name} waited {SKELETONS_WITHIN_S:.0f} s"
                        " for the other components' models to be built",
                        field="model_path",
                    )
                component = load_alone(name)
            finally:
                if name in builders:
                    skeletons.one_built()
            if _has_empty_parameters(component):
                with _SKELETONS:  # nothing else builds a skeleton meanwhile
                    component = load_alone(name)
            step.read_done(dtype=getattr(component, "dtype", None))
            if hasattr(component, "to") and hasattr(component, "parameters"):
                component.to(device)
        return component

    workers = max(1, min(len(names), os.cpu_count() or 1))
    with library_bars_off(), _skeletons_one_at_a_time(skeletons) as parallel:
        if parallel and workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="lifecycle-load") as pool:
                # The diffusers models first: their skeletons are what the others wait for.
                order = sorted(names, key=lambda n: n not in builders)
                loaded = dict(zip(order, pool.map(load, order), strict=True))
        else:
            skeletons.built.set()
            loaded = {name: load(name) for name in names}
        return cls.from_pretrained(path, local_files_only=True, **loaded)


# The libraries whose loaders draw progress bars (tqdm) unless their logging turns them off.
_BARS_OF = ("diffusers.utils.logging", "transformers.utils.logging")


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """diffusers' and transformers' progress bars off while it is entered; those that were on
    are on again after (the switch is each library's, process-wide)."""
    switched = []
    for name in _BARS_OF:
        try:
            logging = importlib.import_module(name)
        except ImportError:
            continue
        if logging.is_progress_bar_enabled():
            logging.disable_progress_bar()
            switched.append(logging)
    try:
        yield
    finally:
        for logging in switched:
            logging.enable_progress_bar()


def _has_empty_parameters(component: Any) -> bool:
    parameters = getattr(component, "parameters", None)
    if not callable(parameters):
        return False
    return any(p.is_meta for p in parameters())


@contextlib.contextmanager
def _skeletons_one_at_a_time(skeletons: _Skeletons) -> Iterator[bool]:
    """While it is entered, diffusers and transformers build a model's skeleton under
    `_SKELETONS` (diffusers' count toward `skeletons`); yields whether both could be made to
    (else the components load one at a time)."""
    try:
        from diffusers.models import modeling_utils as diffusers_models
        from transformers import modeling_utils as transformers_models
    except ImportError:
        yield False
        return
    no_init = getattr(diffusers_models, "no_init_weights", None)
    model_class = getattr(transformers_models, "PreTrainedModel", None)
    contexts = getattr(model_class, "get_init_context", None)
    if no_init is None or model_class is None or contexts is None:
        yield False
        return

    @contextlib.contextmanager
    def locked_no_init() -> Iterator[None]:
        # diffusers enters this first and leaves it last around a model's construction.
        with _SKELETONS, no_init():
            yield
        skeletons.one_built()

    original = model_class.__dict__["get_init_context"]

    def locked_contexts(klass: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return [_SKELETONS, *contexts.__func__(klass, *args, **kwargs)]

    diffusers_models.no_init_weights = locked_no_init
    model_class.get_init_context = classmethod(locked_contexts)
    try:
        yield True
    finally:
        diffusers_models.no_init_weights = no_init
        model_class.get_init_context = original


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
