"""The /generate bodies several tests send, and the budget that tells the small from the big."""

from __future__ import annotations

BODY = {"prompt": "a lighthouse in a storm", "width": 256, "height": 192, "frames": 9, "steps": 3}

SMALL = {"prompt": "a lighthouse in a storm", "width": 256, "height": 192, "frames": 9, "steps": 4}
# Predicted at about 0.87 GiB on micro-video's decoding rank (its baseline of about 0.38 GiB,
# plus 96 MiB, 4 KiB a token and 3 bytes a pixel), where SMALL is about 0.47 GiB: a budget of
# 1700 MiB less its 1 GiB of headroom admits one and refuses the other, each by about 0.2 GiB.
OVER = {**SMALL, "width": 1280, "height": 1280, "frames": 81, "steps": 1}
BUDGET = "1700MiB"

SLOW_PROMPT = "slowly, a heron wades through reeds"
SLOW = {**SMALL, "prompt": SLOW_PROMPT, "steps": 8}  # slowed down by tests.plugins:SLOWING
