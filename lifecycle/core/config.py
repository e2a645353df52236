"""The server configuration (a frozen `ServerArgs`), model presets, and their validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lifecycle.core.command import DEFAULT_JOURNAL
from lifecycle.core.errors import ConfigError
from lifecycle.core.faults import FaultKind, FaultSpec
from lifecycle.core.records import Shape
from lifecycle.core.states import State


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


class SmokeRequest(StrEnum):
    AUTO = "auto"  # run it when drop-buffers freed the staging buffers
    ON = "on"
    OFF = "off"


VISUAL_TASKS = frozenset({"text-to-video", "image-to-video", "text-to-image", "image-to-image"})

# Hard limits on one request; a server refuses anything outside them with a clear reason.
MAX_SIDE = 4096
REQUEST_MARGIN_S = 120.0  # a request's silence allowed past --dist-timeout, by default
MAX_FRAMES = 257
MAX_STEPS = 200
MAX_RANKS = 64
MAX_PROMPT_CHARS = 4096
# A startup not ready after this long is failed: long enough for a large model's load and a
# probe at full shape behind a 600 s collective timeout, short enough that a rank hung outside
# any collective (which nothing else would end) does not hold its device for good.
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


MIN_MEMORY_BUDGET = 64 * 2**20
# After a fatal startup failure `lifecycle serve` stays up this long (a scrape of /metrics, a
# read of /lifecycle), then exits 1.
DEFAULT_LINGER_S = 60.0
DEFAULT_RING_CAPACITY = 65536
MAX_RING_CAPACITY = 1 << 22
# A seed is 64 bits, as torch's generators take it: a larger one would be refused only when
# the first request is run, well into the startup.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryModel:
    """Linear estimate of the memory one request needs beyond what is already in use: a fixed
    workspace, plus so much per latent token, plus so much per output pixel.

    The built-in models' coefficients come from two peaks that `lifecycle boot --calibrate`
    measured on CPU (linux-vmhwm, growth over the baseline before the request): 117 MiB for
    832x480x17 (520 tokens) and 330 MiB for 1280x720x81 (5040 tokens). The uint8 video is
    3 bytes a pixel; the DiT's activations about 4 KiB a token.
    """

    fixed_bytes: int
    bytes_per_token: int
    bytes_per_pixel: int

    def estimate(self, *, tokens: int, pixels: int) -> int:
        return self.fixed_bytes + self.bytes_per_token * tokens + self.bytes_per_pixel * pixels


# What runs a model (`ModelSpec.backend`): the lifecycle's own code or a plug-in's (NATIVE); a
# diffusers pipeline run as one opaque call (DIFFUSERS: the field's "diffusers backend" gate
# closes calibration for it); a diffusers pipeline whose components the adapter drives.
NATIVE_BACKEND = "native"
DIFFUSERS_BACKEND = "diffusers"
DIFFUSERS_COMPONENTS_BACKEND = "diffusers-components"
LIBRARY_BACKENDS = frozenset({DIFFUSERS_BACKEND, DIFFUSERS_COMPONENTS_BACKEND})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """What the gates and the planner need to know of a model; the pipeline brings the rest."""

    name: str
    task: str
    default_width: int
    default_height: int
    default_frames: int
    default_steps: int
    frame_multiple: int = 4  # valid frame counts are 1 + frame_multiple * k
    spatial_multiple: int = 16  # width and height are multiples of this
    pixels_per_token_side: int = 64  # VAE and patch compression, per spatial side
    frames_per_latent: int = 4
    attention_heads: int = 4
    supports_residency_calibration: bool = True
    backend: str = NATIVE_BACKEND
    realtime_adapter: bool = False
    # Whether its pipeline declares residency options for the planner (a plug-in opts in).
    declares_residency: bool = False
    default_guidance_scale: float = 5.0  # a request's classifier-free guidance unless given
    # Where a library's pipeline is loaded from (a diffusers directory), and a digest of its
    # configs and weight files: part of the spec, so that new weights are a new fingerprint.
    source: str | None = None
    source_digest: str = ""
    memory: MemoryModel = field(
        default_factory=lambda: MemoryModel(fixed_bytes=0, bytes_per_token=0, bytes_per_pixel=0)
    )

    @property
    def default_shape(self) -> Shape:
        return Shape(
            width=self.default_width, height=self.default_height, frames=self.default_frames
        )

    def tokens(self, shape: Shape) -> int:
        """Latent tokens the DiT attends over for one branch of a request of this shape."""
        side = self.pixels_per_token_side
        latent_frames = (shape.frames - 1) // self.frames_per_latent + 1
        return latent_frames * (-(-shape.height // side)) * (-(-shape.width // side))

    def estimated_peak_bytes(self, shape: Shape) -> int:
        return self.memory.estimate(tokens=self.tokens(shape), pixels=shape.pixels)


TINY_MEMORY = MemoryModel(fixed_bytes=96 * 2**20, bytes_per_token=4 * 2**10, bytes_per_pixel=3)

MODEL_PRESETS: dict[str, ModelSpec] = {
    # The field's video models default to 1280x720x81; tiny-video keeps that request shape and
    # compresses hard enough that a calibrated startup fits on two CPU cores.
    "tiny-video": ModelSpec(
        name="tiny-video",
        task="text-to-video",
        default_width=1280,
        default_height=720,
        default_frames=81,
        default_steps=50,
        declares_residency=True,
        memory=TINY_MEMORY,
    ),
    # The same architecture at a small default request, for quick multi-rank runs.
    "micro-video": ModelSpec(
        name="micro-video",
        task="text-to-video",
        default_width=512,
        default_height=288,
        default_frames=33,
        default_steps=20,
        declares_residency=True,
        memory=TINY_MEMORY,
    ),
}


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
    enable_torch_compile: bool = False
    enable_cache_dit: bool = False
    max_batch_size: int = 1
    num_ranks: int = 1
    cfg_parallel: int = 1
    ulysses: int = 1
    device: str = "auto"
    dist_timeout_s: float = 600.0
    on_peer_failure: PeerFailure = PeerFailure.ABORT
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
    """Raise ConfigError naming the first field that is out of range or inconsistent."""
    if args.cfg_parallel not in (1, 2):
        raise ConfigError(
            f"--cfg-parallel must be 1 or 2, not {args.cfg_parallel}", field="cfg_parallel"
        )
    if not 1 <= args.ulysses <= MAX_RANKS:
        raise ConfigError(f"--ulysses must be 1..{MAX_RANKS}, not {args.ulysses}", field="ulysses")
    if not 1 <= args.num_ranks <= MAX_RANKS:
        raise ConfigError(
            f"--num-ranks must be 1..{MAX_RANKS}, not {args.num_ranks}", field="num_ranks"
        )
    if not 0 <= args.flight_recorder_entries <= MAX_RING_CAPACITY:
        raise ConfigError(
            f"--flight-recorder must be 0..{MAX_RING_CAPACITY} entries,"
            f" not {args.flight_recorder_entries}",
            field="flight_recorder_entries",
        )
    if not 16 <= args.ring_capacity <= MAX_RING_CAPACITY:
        raise ConfigError(
            f"--ring-size must be 16..{MAX_RING_CAPACITY} records, not {args.ring_capacity}",
            field="ring_capacity",
        )
    if args.num_ranks != args.cfg_parallel * args.ulysses:
        raise ConfigError(
            f"--num-ranks {args.num_ranks} must equal --cfg-parallel {args.cfg_parallel}"
            f" x --ulysses {args.ulysses}",
            field="num_ranks",
        )
    if args.model.attention_heads % args.ulysses:
        raise ConfigError(
            f"--ulysses {args.ulysses} must divide the {args.model.attention_heads} attention"
            f" heads of {args.model.name}",
            field="ulysses",
        )
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"--device must be auto, cpu or cuda, not {args.device!r}", field="device"
        )
    if args.request_silence_s is not None and not 0 < args.request_silence_s <= 86400:
        raise ConfigError(
            f"--request-silence must be in (0, 86400] seconds, not {args.request_silence_s}",
            field="request_silence_s",
        )
    if not 0 < args.dist_timeout_s <= 86400:
        raise ConfigError(
            f"--dist-timeout must be in (0, 86400] seconds, not {args.dist_timeout_s}",
            field="dist_timeout_s",
        )
    if not 0.01 <= args.heartbeat_interval_s <= 3600:
        raise ConfigError(
            f"--heartbeat-interval must be in [0.01, 3600] seconds, not"
            f" {args.heartbeat_interval_s}",
            field="heartbeat_interval_s",
        )
    if not 0 < args.state_deadline_s <= 86400:
        raise ConfigError(
            f"--state-deadline must be in (0, 86400] seconds, not {args.state_deadline_s}",
            field="state_deadline_s",
        )
    if not 0 < args.startup_timeout_s <= 7 * 86400:
        raise ConfigError(
            f"--startup-timeout must be in (0, 604800] seconds, not {args.startup_timeout_s}",
            field="startup_timeout_s",
        )
    if args.max_batch_size < 1:
        raise ConfigError(
            f"--max-batch-size must be at least 1, not {args.max_batch_size}",
            field="max_batch_size",
        )
    if args.memory_budget_bytes is not None and args.memory_budget_bytes < MIN_MEMORY_BUDGET:
        raise ConfigError(
            f"--memory-budget must be at least 64MiB, not {args.memory_budget_bytes} bytes",
            field="memory_budget_bytes",
        )
    if not 0 <= args.seed <= MAX_SEED:
        shown = str(args.seed) if args.seed.bit_length() <= 128 else "a larger number"
        raise ConfigError(f"--seed must be an integer in 0..{MAX_SEED}, not {shown}", field="seed")
    placed: dict[tuple[int, str], FaultSpec] = {}
    for fault in args.faults:
        if fault.rank >= args.num_ranks:
            raise ConfigError(
                f"bad fault spec {fault}: rank {fault.rank} is outside 0..{args.num_ranks - 1}",
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
    validate_shape(args.model, args.model.default_shape, args.model.default_steps)


def validate_shape(model: ModelSpec, shape: Shape, steps: int) -> None:
    """Raise ConfigError unless a request of this shape and steps is one the model can run."""
    m = model.spatial_multiple
    for name, side in (("width", shape.width), ("height", shape.height)):
        if not m <= side <= MAX_SIDE or side % m:
            raise ConfigError(
                f"{name} must be a multiple of {m} in {m}..{MAX_SIDE}, not {side}", field=name
            )
    if not 1 <= shape.frames <= MAX_FRAMES or (shape.frames - 1) % model.frame_multiple:
        raise ConfigError(
            f"frames must be 1 + {model.frame_multiple}k in 1..{MAX_FRAMES}, not {shape.frames}",
            field="frames",
        )
    if not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"steps must be in 1..{MAX_STEPS}, not {steps}", field="steps")


def args_to_json(args: ServerArgs) -> dict[str, Any]:
    """The configuration as a JSON object, as recorded in the journal's `runs.config`."""
    out = dataclasses.asdict(args)
    out["faults"] = [str(f) for f in args.faults]
    return out


def args_from_json(doc: dict[str, Any]) -> ServerArgs:
    """Rebuild a ServerArgs from `args_to_json` output; unknown keys are ignored."""
    from lifecycle.core.faults import parse_fault

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
        }
        for key, enum in enums.items():
            if key in values:
                values[key] = enum(values[key])
        faults = tuple(parse_fault(s) for s in doc.get("faults", ()))
        return ServerArgs(model=model, faults=faults, **values)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"recorded config cannot be read: {exc}") from exc


def fault_for(args: ServerArgs, *, rank: int, state: State) -> FaultKind | None:
    """The fault to inject on `rank` when it enters `state`, if any."""
    for fault in args.faults:
        if fault.rank == rank and fault.state is state and fault.request is None:
            return fault.kind
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
