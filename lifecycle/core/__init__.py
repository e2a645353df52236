"""The decision layer: states and the transition table, events, fold, gates, plan (pure:
no torch, no I/O)."""
