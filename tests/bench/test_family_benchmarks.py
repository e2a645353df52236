"""The parts of the families benchmark that decide what it reports: Wan 2.2's experts measured
in each residency and set against each other and against the option's declaration, the
library's Qwen-Image call timed and digested as /generate digests, and the /generate row's
paired ratio. The smallest sizes, in process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.expertswap import RESIDENT, SWAPPED, experts_rows, latents_agree, measure_experts
from bench.families import QWEN, WAN22, Served, generate_row
from bench.stats import median
from bench.suite import Settings
from bench.table import format_ratio
from bench.wanserving import generate_body

pytest.importorskip("diffusers")

MIB = 2**20


def number(cell: str) -> float:
    """The first number of a cell, in the unit the cell gives it ("1.5 KiB", "20.00 ms")."""
    found = re.match(r"(-?[\d.]+) (s|ms|us|MiB|KiB)\b", cell)
    assert found, cell
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "MiB": MIB, "KiB": 1024}[found.group(2)]
    return float(found.group(1)) * scale


# Slow tier: the swap's memory and the handover are held by tests/adapters/test_wan22_swap_memory.py
# in the default run, and the rows' arithmetic by the tests above.
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_experts_rows_set_swapped_against_resident_and_the_declaration(tmp_path: Path) -> None:
    """A round of each residency's worker process (the smallest Wan 2.2 directory, one request
    each after an untimed one) gives four rows, each with positive figures, a ratio computed
    from them and a target met or missed; the two residencies make the same latents, to float32
    rounding."""
    from bench.pipelinedirs import save_small_wan22

    directory = save_small_wan22(tmp_path / "wan22")
    request = generate_body((32, 32, 5, 4))
    settings = Settings(quick=True, workdir=tmp_path)
    runs = measure_experts(settings, directory, request, rounds=1)
    resident, swapped = runs[RESIDENT][0], runs[SWAPPED][0]
    # The same latents, or within float32 rounding (a CPU may round reloaded blocks otherwise).
    assert latents_agree(resident, swapped).startswith(("identical", "within float32 rounding"))
    assert len(swapped.step_s) == 4 and swapped.switch_step == 2
    assert len(swapped.waits_s) == 2 and resident.waits_s == ()
    assert swapped.released_bytes > 0 and swapped.reload_s > 0
    assert resident.transformers_peak_bytes > 0 and swapped.transformers_peak_bytes > 0

    rows = experts_rows(runs, what="the smallest Wan 2.2", request=request)
    assert [r.figure.split(": ", 1)[1] for r in rows] == [
        "Wan 2.2 transformers' peak, experts swapped / both resident",
        "Wan 2.2 step at the switch, swapped / median step",
        "experts swapped, transformers' peak, measured / declared",
        "experts swapped, denoising time, measured / declared",
    ]
    for row in rows:
        assert number(row.value) > 0 and number(row.baseline) > 0, row
        assert re.fullmatch(r"(<= [\d.]+|within 25%): (met|MISSED)", row.target), row.target
        assert re.search(
            r"latents (identical|within float32 rounding).* across residencies", row.how
        )
    peak, switch, declared_peak, declared_time = rows
    peaks = swapped.transformers_peak_bytes, resident.transformers_peak_bytes
    assert peak.ratio == format_ratio(peaks[0] / peaks[1])
    assert switch.ratio == format_ratio(swapped.step_s[2] / median(swapped.step_s))
    assert declared_peak.ratio == format_ratio(peaks[0] / (peaks[1] - swapped.released_bytes))
    expected = swapped.denoise_s / (resident.denoise_s + swapped.reload_s)
    assert declared_time.ratio == format_ratio(expected)


def test_the_qwen_image_worker_digests_the_image_as_generate_does(tmp_path: Path) -> None:
    """The library's side for Qwen-Image times QwenImagePipeline's call and digests its image
    as the lifecycle digests the one /generate returns (uint8, one frame)."""
    import torch
    from diffusers import QwenImagePipeline

    from bench import families
    from lifecycle.adapters.diffusers.qwen.tinyqwen import build_tiny_qwen_image
    from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8
    from lifecycle.runtime.request import video_checksum

    directory = tmp_path / "qwen"
    build_tiny_qwen_image().save_pretrained(str(directory))
    request = generate_body((32, 32, 1, 2))
    doc = families.warm_task({"directory": str(directory), "request": request})()
    pipe = QwenImagePipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = to_uint8(families.qwen_image_call(pipe, request))
    assert image.shape == (1, 32, 32, 3)
    assert doc["checksum"] == video_checksum(torch.from_numpy(image))
    assert doc["seconds"] > 0


def test_a_generate_row_is_the_median_of_the_paired_ratios() -> None:
    """The /generate row shows each side's median and the median of the rounds' ratios,
    against the 1.05 target, says whether the outputs were identical, and splits the served
    time into the rank's own request and the rest."""
    measured = Served(
        served_s=(2.0, 3.3, 2.2), plain_s=(2.0, 3.0, 1.0), same_output=True,
        rank_s=(1.9, 3.0, 2.15), steps_s=(1.5, 2.5, 1.7),
    )  # fmt: skip
    row = generate_row(WAN22, measured, (96, 96, 9, 6), "a Wan 2.2 directory")
    assert (row.value, row.baseline) == ("2.20 s", "2.00 s WanPipeline")
    assert row.ratio == format_ratio(1.1)  # of 1.0, 1.1 and 2.2
    assert row.target == "<= 1.05: MISSED"
    assert "POST /generate 96x96x9 at 6 steps" in row.how and "outputs identical" in row.how
    # The rank's share: its median total_s, and the rest the median of 0.1, 0.3 and 0.05.
    assert "total_s) took 2.15 s, its steps 1.70 s" in row.how
    assert "the reply) 100.00 ms (median" in row.how
    quick = Served(
        served_s=(1.0, 1.0), plain_s=(1.0, 1.0), same_output=False, rank_s=(0.9, 0.9),
        steps_s=(0.5, 0.5),
    )  # fmt: skip
    qwen = generate_row(QWEN, quick, (128, 128, 1, 8), "tiny-qwen-image")
    assert qwen.target == "<= 1.05: met" and "128x128 at 8 steps" in qwen.how
    assert "not bit for bit" in qwen.how and qwen.baseline.endswith("QwenImagePipeline")
