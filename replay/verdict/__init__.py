"""The verdict: what a run's events say happened, as facts (pure)."""
