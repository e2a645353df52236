"""The checks a server's settings and a request pass before anything runs: each failure one
ConfigError naming the setting, which the command line or a config file then spells."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lifecycle.core.compiling import COMPILE_MODES, MAX_LEARNED_SHAPES
from lifecycle.core.errors import ConfigError, Setting
from lifecycle.core.faults import FaultKind, FaultSpec
from lifecycle.core.records import Shape

if TYPE_CHECKING:
    from lifecycle.core.config import ServerArgs
    from lifecycle.core.modelspec import ModelSpec

# Hard limits on one request and on a server's settings; anything outside them is refused
# with a clear reason before it runs.
MAX_SIDE = 4096
MAX_FRAMES = 257
MAX_STEPS = 200
MAX_RANKS = 64
MAX_PROMPT_CHARS = 4096
MIN_MEMORY_BUDGET = 64 * 2**20
MAX_RING_CAPACITY = 1 << 22
# A seed is 64 bits, as torch's generators take it: a larger one would be refused only when
# the first request is run, well into the startup.
MAX_SEED = 2**64 - 1

CFG, ULYSSES, RANKS = Setting("cfg_parallel"), Setting("ulysses"), Setting("num_ranks")


def validate(args: ServerArgs) -> None:
    """Raise ConfigError naming the first setting that is out of range or inconsistent."""
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
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(Setting("device"), f" must be auto, cpu or cuda, not {args.device!r}")
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
    validate_shape(args.model, args.model.default_shape, args.model.default_steps)
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
