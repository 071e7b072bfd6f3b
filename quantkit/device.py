"""Which devices quantkit runs on (quantization, training, evaluation and the runtime alike): the CPU,
or a CUDA GPU of compute capability 8.0 or newer (the Triton kernels use bf16 and Ampere-class tensor
cores; sm_89 RTX 4090 and sm_87 Jetson Orin are the tuned targets)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

DEVICES = ("cpu", "cuda")
# What a --device option accepts: a device, or "auto" (a supported CUDA GPU when one is visible, else the CPU)
DEVICE_CHOICES = ("auto", *DEVICES)
MIN_CUDA_CAPABILITY = (8, 0)


def require_capability(capability: tuple[int, int], name: str = "this GPU") -> None:
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        major, minor = capability
        raise RuntimeError(f"{name} has compute capability {major}.{minor}; quantkit's CUDA kernels need "
                           f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} or newer (Ampere, Ada, Orin). "
                           "Use --device cpu.")


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is visible to PyTorch (this build: "
                               f"torch {torch.__version__}); use --device cpu")
        require_capability(torch.cuda.get_device_capability(), torch.cuda.get_device_name())


def resolve_device(device: str) -> str:
    """The device a --device value names, checked: "auto" is the CUDA GPU when PyTorch sees one of compute
    capability 8.0 or newer, and the CPU otherwise."""
    if device == "auto":
        usable = torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) >= MIN_CUDA_CAPABILITY
        device = "cuda" if usable else "cpu"
    check_device(device)
    return device


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with torch on ``count`` threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
