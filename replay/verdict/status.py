"""Each rank's verdict, as `lifecycle.verdict.status` decides it."""

from __future__ import annotations

from lifecycle.verdict.status import PendingInfo, RankVerdict, Status

__all__ = ["PendingInfo", "RankVerdict", "Status"]
