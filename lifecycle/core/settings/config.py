"""The server configuration: a frozen `ServerArgs` (checked by `validate` on creation, within
core/validation.py's limits), its modes, its JSON form as the run row keeps it, and the fault it
injects where (models and their presets are core/modelspec.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lifecycle.core.command import DEFAULT_JOURNAL
from lifecycle.core.errors import ConfigError, Setting
from lifecycle.core.format.records import Shape
from lifecycle.core.format.states import State
from lifecycle.core.settings.dtypes import AUTO, parse_dtype
from lifecycle.core.settings.faults import FaultKind, FaultSpec
from lifecycle.core.settings.modelspec import MODEL_PRESETS, MemoryModel, ModelSpec
from lifecycle.core.settings.validation import (
    CFG,
    MAX_RANKS,
    MAX_RING_CAPACITY,
    MAX_SEED,
    MIN_MEMORY_BUDGET,
    RANKS,
    ULYSSES,
    validate_shape,
)


class PerformanceMode(StrEnum):
    AUTO = "auto"
    SPEED = "speed"
    MEMORY = "memory"


class WarmupMode(StrEnum):
    SERVER = "server"  # synthetic warmup requests at startup, before /health turns green
    NONE = "none"  # no warmup: the first user request pays for it


class DisaggRole(StrEnum):
    NONE = "none"
    ENCODER = "encoder"
    DENOISER = "denoiser"
    DECODER = "decoder"


class PeerFailure(StrEnum):
    """What the other ranks do when one fails for good."""

    ABORT = "abort"  # learn it within seconds, journal why, and stop (the agreed abort)
    WAIT = "wait"  # wait in their next collective until the process-group timeout ends it


class SlowRankPolicy(StrEnum):
    """What gate-check does with a rank its probes measured slow (docs/ranks.md)."""

    WARN = "warn"  # journal it (slow_rank), say it, and go on
    FAIL = "fail"  # stop the startup, naming the rank


class SmokeRequest(StrEnum):
    AUTO = "auto"  # run it when drop-buffers freed the staging buffers
    ON = "on"
    OFF = "off"


# torch.compile's modes, as --compile-mode takes them.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Shapes warmed at most, the most used first.
MAX_LEARNED_SHAPES = 8
REQUEST_MARGIN_S = 120.0  # a request's silence allowed past --dist-timeout, by default
# A startup not ready after this long is failed: long enough for a large model's load and a
# probe at full shape behind a 600 s collective timeout, short enough that a rank hung outside
# any collective (which nothing else would end) does not hold its device for good.
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


# After a fatal startup failure `lifecycle serve` stays up this long (a scrape of /metrics, a
# read of /lifecycle), then exits 1.
DEFAULT_LINGER_S = 60.0
DEFAULT_RING_CAPACITY = 65536


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerArgs:
    model: ModelSpec = field(default_factory=lambda: MODEL_PRESETS["tiny-video"])
    db: str = DEFAULT_JOURNAL
    performance_mode: PerformanceMode = PerformanceMode.AUTO
    warmup_mode: WarmupMode = WarmupMode.SERVER
    calibrate: bool = False
    disable_auto_residency: bool = False
    disagg_role: DisaggRole = DisaggRole.NONE
    enable_cuda_graph: bool = False
    enable_torch_compile: bool = False  # --compile: the denoiser's repeated block
    compile_mode: str = "default"  # torch.compile's mode (COMPILE_MODES)
    # How long warming the shapes traffic used may take at most; None: from history.
    warm_budget_s: float | None = None
    warm_shapes: tuple[Shape, ...] = ()  # --warm-shape: shapes warmed beside the learned ones
    enable_cache_dit: bool = False
    max_batch_size: int = 1
    num_ranks: int = 1
    cfg_parallel: int = 1
    ulysses: int = 1
    device: str = "auto"
    # --dtype in parse_dtype's canonical form: the precision each component loads in (part of
    # the residency fingerprint, and compared across ranks as every setting here is).
    dtype: str = AUTO
    # The host's keeper of finished weights: "auto" (the default socket, when one listens),
    # "off", or a socket's path.
    keeper: str = "auto"
    dist_timeout_s: float = 600.0
    on_peer_failure: PeerFailure = PeerFailure.ABORT
    # gate-check's check of the ranks: a rank whose probed speed is below this fraction of its
    # group's median is slow, and warned of or failed on; NCCL's own diagnostics for the gate's
    # communicators (NCCL 2.31+; nothing on gloo).
    slow_rank_threshold: float = 0.7
    on_slow_rank: SlowRankPolicy = SlowRankPolicy.WARN
    nccl_diagnostics: bool = False
    # How long a request may go without a denoising step on some rank before the server gives
    # it up; None: --dist-timeout plus REQUEST_MARGIN_S (a decode reports no step).
    request_silence_s: float | None = None
    heartbeat_interval_s: float = 1.0
    state_deadline_s: float = 300.0
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    # Collective records kept per rank after ready (a few requests of a 40-block DiT).
    ring_capacity: int = DEFAULT_RING_CAPACITY
    smoke_request: SmokeRequest = SmokeRequest.AUTO
    # The residency planner's per-rank budget; None: the device's free memory less headroom.
    memory_budget_bytes: int | None = None
    faults: tuple[FaultSpec, ...] = ()
    seed: int = 0
    # PyTorch's Flight Recorder: ring entries (0: as TORCH_FR_BUFFER_SIZE says) and where each
    # rank dumps it on trouble (None: beside the journal file).
    flight_recorder_entries: int = 0
    flight_recorder_dir: str | None = None

    def __post_init__(self) -> None:
        validate(self)

    @property
    def request_silence_limit_s(self) -> float:
        if self.request_silence_s is not None:
            return self.request_silence_s
        return self.dist_timeout_s + REQUEST_MARGIN_S

    @property
    def collective_stall_s(self) -> float:
        """After ready, a collective pending this long is a stall: the ring is written while
        the process-group timeout still has three quarters to run."""
        return max(0.5, self.dist_timeout_s / 4)


def validate(args: ServerArgs) -> None:
    """Raise ConfigError naming the first setting that is out of range or inconsistent."""
    _check_layout(args)
    _check_timeouts(args)
    _check_limits(args)
    _check_faults(args)
    validate_shape(args.model, args.model.default_shape, args.model.default_steps)
    _check_warmup(args)


def _check_layout(args: ServerArgs) -> None:
    """The rank grid, the rings each rank keeps, and the device they run on."""
    if args.cfg_parallel not in (1, 2):
        raise ConfigError(CFG, f" must be 1 or 2, not {args.cfg_parallel}")
    if not 1 <= args.ulysses <= MAX_RANKS:
        raise ConfigError(ULYSSES, f" must be 1..{MAX_RANKS}, not {args.ulysses}")
    if not 1 <= args.num_ranks <= MAX_RANKS:
        raise ConfigError(RANKS, f" must be 1..{MAX_RANKS}, not {args.num_ranks}")
    if not 0 <= args.flight_recorder_entries <= MAX_RING_CAPACITY:
        raise ConfigError(
            Setting("flight_recorder_entries"),
            f" must be 0..{MAX_RING_CAPACITY} entries, not {args.flight_recorder_entries}",
        )
    if not 16 <= args.ring_capacity <= MAX_RING_CAPACITY:
        raise ConfigError(
            Setting("ring_capacity"),
            f" must be 16..{MAX_RING_CAPACITY} records, not {args.ring_capacity}",
        )
    if args.num_ranks != args.cfg_parallel * args.ulysses:
        raise ConfigError(
            RANKS, f" {args.num_ranks} must equal ", CFG, f" {args.cfg_parallel} x ", ULYSSES,
            f" {args.ulysses}",
        )  # fmt: skip
    if args.model.attention_heads % args.ulysses:
        raise ConfigError(
            ULYSSES, f" {args.ulysses} must divide the {args.model.attention_heads} attention"
            f" heads of {args.model.name}",
        )  # fmt: skip
    if not (math.isfinite(args.slow_rank_threshold) and 0 < args.slow_rank_threshold <= 1):
        raise ConfigError(
            Setting("slow_rank_threshold"),
            f" must be in (0, 1] (a fraction of the group's median speed), not"
            f" {args.slow_rank_threshold}",
        )
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(Setting("device"), f" must be auto, cpu or cuda, not {args.device!r}")
    if parse_dtype(args.dtype) != args.dtype:
        raise ConfigError(
            Setting("dtype"), f" {args.dtype!r} is not written as {parse_dtype(args.dtype)!r}"
        )


def _check_timeouts(args: ServerArgs) -> None:
    """How long a request, a collective, a heartbeat, a state and the startup may take."""
    if args.request_silence_s is not None and not 0 < args.request_silence_s <= 86400:
        raise ConfigError(
            Setting("request_silence_s"),
            f" must be in (0, 86400] seconds, not {args.request_silence_s}",
        )
    if not 0 < args.dist_timeout_s <= 86400:
        raise ConfigError(
            Setting("dist_timeout_s"), f" must be in (0, 86400] seconds, not {args.dist_timeout_s}"
        )
    if not 0.01 <= args.heartbeat_interval_s <= 3600:
        raise ConfigError(
            Setting("heartbeat_interval_s"),
            f" must be in [0.01, 3600] seconds, not {args.heartbeat_interval_s}",
        )
    if not 0 < args.state_deadline_s <= 86400:
        raise ConfigError(
            Setting("state_deadline_s"),
            f" must be in (0, 86400] seconds, not {args.state_deadline_s}",
        )
    if not 0 < args.startup_timeout_s <= 7 * 86400:
        raise ConfigError(
            Setting("startup_timeout_s"),
            f" must be in (0, 604800] seconds, not {args.startup_timeout_s}",
        )


def _check_limits(args: ServerArgs) -> None:
    """The batch size, the memory budget and the seed."""
    if args.max_batch_size < 1:
        raise ConfigError(
            Setting("max_batch_size"), f" must be at least 1, not {args.max_batch_size}"
        )
    if args.memory_budget_bytes is not None and args.memory_budget_bytes < MIN_MEMORY_BUDGET:
        raise ConfigError(
            Setting("memory_budget_bytes"),
            f" must be at least 64MiB, not {args.memory_budget_bytes} bytes",
        )
    if not 0 <= args.seed <= MAX_SEED:
        shown = str(args.seed) if args.seed.bit_length() <= 128 else "a larger number"
        raise ConfigError(Setting("seed"), f" must be an integer in 0..{MAX_SEED}, not {shown}")


def _check_faults(args: ServerArgs) -> None:
    """Each injected fault on a rank that exists, able to fire, and alone where it fires."""
    placed: dict[tuple[int, str], FaultSpec] = {}
    for fault in args.faults:
        if fault.rank >= args.num_ranks:
            raise ConfigError(
                f"bad fault spec {fault}: rank {fault.rank} is outside 0..{args.num_ranks - 1}",
                field="faults",
            )
        if fault.kind is FaultKind.SKIP_COLLECTIVE and args.num_ranks == 1:
            raise ConfigError(
                f"bad fault spec {fault}: skip-collective never fires on one rank, which runs"
                " no collective",
                field="faults",
            )
        first = placed.setdefault((fault.rank, fault.where), fault)
        if first is not fault:
            # Only one fault fires on entering a state; a second would be dropped unseen.
            where = f"state {fault.state.value!r}" if fault.request is None else fault.where
            raise ConfigError(
                f"bad fault spec {fault}: rank {fault.rank} already has fault {first} in"
                f" {where} (one fault per rank and state, or request)",
                field="faults",
            )


def _check_warmup(args: ServerArgs) -> None:
    """The compile mode, the warmup budget and the shapes warmed at startup."""
    if args.compile_mode not in COMPILE_MODES:
        raise ConfigError(
            Setting("compile_mode"),
            f" must be one of {', '.join(COMPILE_MODES)}, not {args.compile_mode!r}",
        )
    if args.warm_budget_s is not None and not 0 <= args.warm_budget_s <= 86400:
        raise ConfigError(
            Setting("warm_budget_s"), f" must be in [0, 86400] seconds, not {args.warm_budget_s}"
        )
    if len(args.warm_shapes) > MAX_LEARNED_SHAPES:
        raise ConfigError(
            Setting("warm_shapes"),
            f" takes at most {MAX_LEARNED_SHAPES} shapes, not {len(args.warm_shapes)}",
        )
    for shape in args.warm_shapes:
        try:
            validate_shape(args.model, shape, 1)
        except ConfigError as exc:
            raise ConfigError(Setting("warm_shapes"), f" {shape}: {exc}") from None


def args_to_json(args: ServerArgs) -> dict[str, Any]:
    """The configuration as a JSON object, as recorded in the journal's `runs.config`."""
    out = dataclasses.asdict(args)
    out["faults"] = [str(f) for f in args.faults]
    return out


def args_from_json(doc: dict[str, Any]) -> ServerArgs:
    """Rebuild a ServerArgs from `args_to_json` output; unknown keys are ignored."""
    from lifecycle.core.settings.faults import parse_fault

    try:
        model_doc = dict(doc["model"])
        memory = MemoryModel(**model_doc.pop("memory"))
        model_fields = {f.name for f in dataclasses.fields(ModelSpec)}
        model = ModelSpec(
            memory=memory, **{k: v for k, v in model_doc.items() if k in model_fields}
        )
        known = {f.name for f in dataclasses.fields(ServerArgs)} - {"model", "faults"}
        values = {k: v for k, v in doc.items() if k in known}
        enums: dict[str, type[StrEnum]] = {
            "performance_mode": PerformanceMode,
            "warmup_mode": WarmupMode,
            "disagg_role": DisaggRole,
            "smoke_request": SmokeRequest,
            "on_peer_failure": PeerFailure,
            "on_slow_rank": SlowRankPolicy,
        }
        for key, enum in enums.items():
            if key in values:
                values[key] = enum(values[key])
        faults = tuple(parse_fault(s) for s in doc.get("faults", ()))
        values["warm_shapes"] = tuple(Shape(**shape) for shape in values.get("warm_shapes", ()))
        return ServerArgs(model=model, faults=faults, **values)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"recorded config cannot be read: {exc}") from exc


def fault_for(args: ServerArgs, *, rank: int, state: State) -> FaultSpec | None:
    """The fault to inject on `rank` when it enters `state`, if any."""
    for fault in args.faults:
        if fault.rank == rank and fault.state is state and fault.request is None:
            return fault
    return None


def request_fault_for(args: ServerArgs, *, rank: int, request: int) -> FaultSpec | None:
    """The fault to inject on `rank` half-way through its `request`th request after ready."""
    return next(
        (f for f in args.faults if f.rank == rank and f.request == request),
        None,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    """Where a rank sits in the CFG-parallel x Ulysses grid (rank = cfg_rank * ulysses + u)."""

    rank: int
    cfg_parallel: int
    ulysses: int

    @property
    def world_size(self) -> int:
        return self.cfg_parallel * self.ulysses

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses

    def ulysses_groups(self) -> tuple[tuple[int, ...], ...]:
        k = self.ulysses
        return tuple(tuple(range(c * k, (c + 1) * k)) for c in range(self.cfg_parallel))

    def cfg_groups(self) -> tuple[tuple[int, ...], ...]:
        k = self.ulysses
        return tuple(tuple(c * k + u for c in range(self.cfg_parallel)) for u in range(k))
