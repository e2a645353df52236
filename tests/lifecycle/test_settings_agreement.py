"""The settings every rank must share: what counts as the same, and how a difference is said."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.decisions.agreement import (
    describe_disagreements,
    disagreements,
    settings_digest,
    shared_settings,
)
from lifecycle.core.settings.config import ServerArgs, WarmupMode, args_to_json
from lifecycle.core.settings.faults import parse_fault
from lifecycle.core.settings.modelspec import MODEL_PRESETS


def settings_of(**changes: object) -> dict[str, object]:
    return shared_settings(args_to_json(ServerArgs(**changes)))  # type: ignore[arg-type]


def test_settings_written_differently_but_meaning_the_same_agree() -> None:
    """600 and 600.0 seconds, and the same faults given in another order, are one setting."""
    first, second = parse_fault("0:probe:raise"), parse_fault("0:gate-check:hang")
    one = {**args_to_json(ServerArgs(faults=(first, second))), "dist_timeout_s": 600.0}
    other = {**args_to_json(ServerArgs(faults=(second, first))), "dist_timeout_s": 600}
    one, other = shared_settings(one), shared_settings(other)
    assert settings_digest(one) == settings_digest(other)
    assert disagreements([one, other]) == ()


def test_where_a_rank_writes_and_reads_may_differ_from_rank_to_rank() -> None:
    """The journal, the dump folder and the model's files are paths on each rank's own host:
    no disagreement."""
    model = MODEL_PRESETS["micro-video"]
    one = settings_of(db="/a/j.db", flight_recorder_dir="/a/fr", model=model)
    other = settings_of(
        db="postgresql://h/j",
        flight_recorder_dir=None,
        model=dataclasses.replace(model, source="/elsewhere/micro"),
    )
    assert settings_digest(one) == settings_digest(other)
    assert disagreements([one, other]) == ()


def test_a_differing_setting_is_named_with_the_ranks_holding_each_value() -> None:
    """Four ranks, rank 2 with another seed and rank 3 another warmup mode: each setting is
    named once, with each value and the ranks that hold it."""
    per_rank = [
        settings_of(seed=1),
        settings_of(seed=1),
        settings_of(seed=2),
        settings_of(seed=1, warmup_mode=WarmupMode.NONE),
    ]
    assert len({settings_digest(s) for s in per_rank}) == 3
    assert describe_disagreements(disagreements(per_rank)) == (
        'warmup_mode ("server" on ranks 0-2 vs "none" on rank 3);'
        " seed (1 on ranks 0-1,3 vs 2 on rank 2)"
    )


def test_a_different_model_is_said_in_one_line_of_bounded_length() -> None:
    """Another model differs in most of its fields: the line names the first few, then how
    many more, and stays short enough to read."""
    tiny, micro = (settings_of(model=MODEL_PRESETS[name]) for name in ("tiny-video", "micro-video"))
    found = disagreements([tiny, micro])
    said = describe_disagreements(found)
    assert said.startswith('model.name ("tiny-video" on rank 0 vs "micro-video" on rank 1)')
    assert said.endswith(f"; and {len(found) - 4} more")
    assert len(said) < 600


@given(st.lists(st.integers(0, 3), min_size=1, max_size=16))
def test_ranks_disagree_exactly_when_some_setting_differs(seeds: list[int]) -> None:
    """Whatever seeds the ranks hold, there is a disagreement (on the seed alone) exactly when
    two of them differ, and the digests then differ too."""
    per_rank = [settings_of(seed=seed) for seed in seeds]
    found = disagreements(per_rank)
    assert bool(found) == (len(set(seeds)) > 1)
    assert [d.setting for d in found] == (["seed"] if found else [])
    assert (len({settings_digest(s) for s in per_rank}) > 1) == bool(found)
