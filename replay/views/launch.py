"""What replay says of a rank's launch phase (lifecycle.core.format.launchphase) (pure)."""

from __future__ import annotations

from lifecycle.core.format.launchphase import LaunchPhase

# Two process starts closer than this (/proc counts in 10 ms ticks) are one process's.
SAME_INSTANT_S = 0.001


def launch_text(launch: LaunchPhase, *, phased: bool = False) -> str:
    """What the launch phase held: the rank's process start after its launcher's (none for a
    rank that was its own launcher) and its imports up to its first event (`phased`: its
    phases are shown apart, in the startup accounted)."""
    parts = []
    if launch.spawn_s is not None and launch.spawn_s > SAME_INSTANT_S:
        parts.append(f"process started +{launch.spawn_s:.2f} s")
    if launch.imports_s is not None and phased:
        parts.append(f"{launch.imports_s:.2f} s in its process before its first event")
    elif launch.imports_s is not None:
        parts.append(f"imports {launch.imports_s:.2f} s (torch, the lifecycle)")
    return ", ".join(parts) or "process started, torch imported"
