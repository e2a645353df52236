"""Benchmarks of the lifecycle that print figures; `python -m bench` runs them all."""

from __future__ import annotations
