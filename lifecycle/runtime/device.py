"""The platform: which device, how much memory, and how peak memory is measured."""

from __future__ import annotations

import os
import re
from typing import Protocol

import torch

from lifecycle.core.format.records import Platform

CUDA_ALLOCATOR = "cuda-allocator"
LINUX_VMHWM = "linux-vmhwm"


class MemoryMeter(Protocol):
    """Measures one phase: reset the peak, run the phase, read the peak."""

    source: str | None

    def current_bytes(self) -> int | None: ...

    def reset_peak(self) -> None: ...

    def peak_bytes(self) -> int | None: ...


class CudaMeter:
    """Allocator statistics of one CUDA device."""

    source: str | None = CUDA_ALLOCATOR

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def current_bytes(self) -> int | None:
        return int(torch.cuda.memory_allocated(self._device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)

    def peak_bytes(self) -> int | None:
        torch.cuda.synchronize(self._device)
        return int(torch.cuda.max_memory_allocated(self._device))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class LinuxRssMeter:
    """This process's resident set: VmRSS now, VmHWM as the peak, reset through clear_refs.

    Writing 5 to /proc/self/clear_refs resets the high-water mark to the current RSS (Linux 4.0+).
    """

    source: str | None = LINUX_VMHWM

    def current_bytes(self) -> int | None:
        return _status_kib("VmRSS")

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")

    def peak_bytes(self) -> int | None:
        return _status_kib("VmHWM")

    @staticmethod
    def available() -> bool:
        if _status_kib("VmHWM") is None:
            return False
        try:
            LinuxRssMeter().reset_peak()
        except OSError:
            return False
        return True


class NoMeter:
    """A platform that cannot measure peak memory: every figure is None."""

    source: str | None = None

    def current_bytes(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        return None

    def peak_bytes(self) -> int | None:
        return None


def cuda_refusal() -> str | None:
    """Why `--device cuda` cannot run here (a torch built without CUDA, or no device seen),
    or None when it can."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"--device cuda: this torch ({torch.__version__}) was built without CUDA"
    if not torch.cuda.is_available():
        return f"--device cuda: torch {torch.__version__} sees no CUDA device"
    return None


def select_device(requested: str, *, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def memory_meter(device: torch.device) -> MemoryMeter:
    if device.type == "cuda":
        return CudaMeter(device)
    if LinuxRssMeter.available():
        return LinuxRssMeter()
    return NoMeter()


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    pages = os.sysconf("SC_PHYS_PAGES") if field == "MemTotal" else os.sysconf("SC_AVPHYS_PAGES")
    return int(pages) * os.sysconf("SC_PAGE_SIZE")


def probe_platform(device: torch.device, meter: MemoryMeter, *, local_ranks: int) -> Platform:
    """The device's name and memory as this rank may use it.

    On CPU every rank on the host shares the same memory, so each is given its share.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Platform(
            device="cuda",
            name=torch.cuda.get_device_name(device),
            total_bytes=int(total),
            free_bytes=int(free),
            peak_source=meter.source,
        )
    share = max(1, local_ranks)
    return Platform(
        device="cpu",
        name=f"cpu ({os.cpu_count()} cores)",
        total_bytes=_meminfo_bytes("MemTotal") // share,
        free_bytes=_meminfo_bytes("MemAvailable") // share,
        peak_source=meter.source,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cache(device: torch.device) -> int | None:
    """Return cached allocator blocks to the device; the bytes released, where measurable."""
    if device.type != "cuda":
        return None
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return int(before - torch.cuda.memory_reserved(device))
