"""The rules every rank must agree on, one pure function each: the live path calls them on
what the ranks exchanged, and `replay verify` on what the journal recorded."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lifecycle.core.decisions.gates import GATES, RESIDENCY_GATE_INDEX
from lifecycle.core.format.records import GateOutcome, Shape


def first_failed_gate(outcomes: Sequence[GateOutcome]) -> int:
    """The index of the first gate that failed; len(GATES) when every gate passed."""
    return next((i for i, o in enumerate(outcomes) if not o.passed), len(GATES))


def agreed_probe_shape(fitted: Iterable[Shape | None]) -> Shape | None:
    """The probe every rank runs: the smallest that any rank fitted (by pixels, then frames,
    width, height, so that ties break the same way everywhere); None when any rank fits none."""
    shapes = list(fitted)
    if not shapes or any(s is None or s.pixels == 0 for s in shapes):
        return None
    return min(
        (s for s in shapes if s is not None), key=lambda s: (s.pixels, s.frames, s.width, s.height)
    )


def reuse_token(reason: str | None) -> int:
    """A number naming the plan a rank would reuse, from the reason that names it (0: none),
    for the ranks to compare in a collective and `replay verify` from the journal."""
    if reason is None:
        return 0
    return int(hashlib.sha256(reason.encode()).hexdigest()[:15], 16)


def agreed_decision(
    first_failed: Sequence[int], tokens: Sequence[int], reuse: str | None
) -> tuple[str | None, bool]:
    """The skip reason every rank takes (None: calibrate) and whether it reuses a plan, from
    each rank's first failing gate and reuse token, and the reason naming this rank's plan
    (the same on every rank when they agree to reuse it)."""
    index, reused = agreed_gate(first_failed, tokens)
    if reused:
        return reuse, True
    return (GATES[index].reason if index < len(GATES) else None), False


def agreed_gate(first_failed: Sequence[int], tokens: Sequence[int]) -> tuple[int, bool]:
    """The gate decision every rank takes, from each rank's first failing gate and its reuse
    token: the earliest failing gate, and whether that is a reused residency plan.

    A plan is reused only when every rank found the same one, so that all run the same plan or
    none does; when the ranks found different plans (or some none), they calibrate.
    """
    earliest = min(first_failed, default=len(GATES))
    if earliest != RESIDENCY_GATE_INDEX:
        return earliest, False
    if any(t == 0 for i, t in zip(first_failed, tokens, strict=True) if i == earliest):
        return earliest, False  # the planner is not available on some rank
    if tokens and all(t == tokens[0] for t in tokens):
        return earliest, True
    return len(GATES), False


def agreed_rollback(failed: Iterable[bool]) -> tuple[int, ...]:
    """The ranks whose plan failed to apply or verify; any one rolls back every rank."""
    return tuple(rank for rank, bad in enumerate(failed) if bad)


# Settings a rank may hold on its own, paths on its own host: where it writes its journal and
# its Flight Recorder dumps, and where it reads its model's files (whose digest,
# model.source_digest, must still match). Every other setting must be the same on every rank:
# the run records one rank's settings, and replay judges every rank by them.
RANK_OWN_SETTINGS = frozenset({"db", "flight_recorder_dir", "model.source"})


def shared_settings(config: Mapping[str, object]) -> dict[str, object]:
    """The settings of `config` (as a run records it) every rank must share, by dotted name
    (`model.name`), as they compare: a whole number of seconds whether written 600 or 600.0,
    and the faults as a set, in whatever order they were given."""
    out: dict[str, object] = {}

    def walk(prefix: str, doc: Mapping[str, object]) -> None:
        for key, value in doc.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(f"{name}.", value)
            elif name not in RANK_OWN_SETTINGS:
                out[name] = _comparable(value)

    walk("", config)
    faults = out.get("faults")
    if isinstance(faults, list):
        out["faults"] = sorted(faults, key=str)
    return out


def _comparable(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    return value


def settings_digest(settings: Mapping[str, object]) -> int:
    """A number naming `settings` (56 bits, so an int64 tensor holds it), for the ranks to
    compare in one small collective before they exchange anything larger."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingDisagreement:
    """One setting the ranks differ on: each value it has (as JSON) and the ranks with it."""

    setting: str
    values: tuple[tuple[str, tuple[int, ...]], ...]


UNSET = "(unset)"  # a setting one rank has and another does not (another lifecycle version)


def disagreements(per_rank: Sequence[Mapping[str, object]]) -> tuple[SettingDisagreement, ...]:
    """The settings on which the ranks (their shared settings, in rank order) differ, in the
    order the settings come, each with its values in the order of the first rank holding one."""
    names = dict.fromkeys(name for settings in per_rank for name in settings)
    found = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            shown = json.dumps(settings[name], sort_keys=True) if name in settings else UNSET
            holders.setdefault(shown, []).append(rank)
        if len(holders) > 1:
            values = tuple((shown, tuple(ranks)) for shown, ranks in holders.items())
            found.append(SettingDisagreement(setting=name, values=values))
    return tuple(found)


# One line names this many settings, each value cut to this many characters: enough to act
# on, and short enough for an error line (a different model differs in every field).
SHOWN_SETTINGS = 4
SHOWN_VALUE_CHARS = 40


def describe_disagreements(found: Sequence[SettingDisagreement]) -> str:
    """What the ranks differ on, in one line: `seed (1 on ranks 0,2-3 vs 2 on rank 1)`."""
    parts = []
    for disagreement in found[:SHOWN_SETTINGS]:
        values = " vs ".join(
            f"{_cut(shown)} on {_ranks_text(ranks)}" for shown, ranks in disagreement.values
        )
        parts.append(f"{disagreement.setting} ({values})")
    more = len(found) - SHOWN_SETTINGS
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 3] + "..."


def _ranks_text(ranks: Sequence[int]) -> str:
    """`rank 3`, or `ranks 0-2,5`: runs of consecutive ranks as ranges."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
