"""The decisions (pure): the startup machine, the gates, the warmup plan, the
residency planner, the fingerprint, deadlines, agreement, admission and the compile key."""
