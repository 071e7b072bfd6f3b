"""What a run may use: the memory this process can still take, read from every limit that applies.

A run that does not fit should be refused before it starts, with its estimate and the limit, rather
than be killed by the kernel's OOM killer hours in. The binding limit is the smallest of the
machine's available memory (MemAvailable: free memory plus what the kernel can reclaim), a cgroup's
memory.max (containers, CI runners, Slurm) less what the cgroup already uses, and this process's
address-space limit (ulimit -v) less what it has mapped.
"""
from __future__ import annotations

import resource
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> tuple[int, str] | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return None


def _cgroup_available() -> tuple[int, str] | None:
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((CGROUP / "memory.current").read_text()), "the cgroup's memory.max"
    except (OSError, ValueError):
        return None


def address_space_available() -> tuple[int, str] | None:
    """(bytes of address space this process can still map, the limit's name), or None without ulimit -v."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        mapped = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        mapped = 0
    return soft - mapped, "the address-space limit (ulimit -v)"


def available_bytes() -> tuple[int, str] | None:
    """(bytes this process can still allocate, which limit binds), or None where no limit can be read."""
    limits = [limit for limit in (_meminfo_available(), _cgroup_available(), address_space_available()) if limit]
    return min(limits) if limits else None


def device_available_bytes(device) -> tuple[int, str] | None:
    """``available_bytes`` for the host, a CUDA device's free memory for a GPU."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {torch.cuda.get_device_name(device)}"
    return available_bytes()
