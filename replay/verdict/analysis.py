"""The analysis of a run read from its journals: `lifecycle.verdict.analysis` over a RunInfo."""

from __future__ import annotations

from typing import TypeAlias

from lifecycle.verdict import analysis
from lifecycle.verdict.analysis import analyze, combine
from replay.load import RunInfo

RunAnalysis: TypeAlias = analysis.RunAnalysis[RunInfo]

__all__ = ["RunAnalysis", "analyze", "combine"]
