"""Tensor memory as bytes, and the CUDA ordering a worker thread needs before it touches a tensor."""

from __future__ import annotations

import threading

import numpy as np
import torch


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def require_contiguous(tensor: torch.Tensor, role: str) -> None:
    # The stores read and write the tensor's memory as one run of bytes, so a strided view would be wrong.
    if not tensor.is_contiguous():
        raise ValueError(f"slide-io: {role} must be contiguous (got strides {tensor.stride()})")


def byte_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy); this is how bf16 reaches numpy."""
    return tensor.reshape(-1).view(torch.uint8)


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy uint8 view of a contiguous host tensor's memory (no copy), for os.pwrite/os.pread."""
    if tensor.device.type != "cpu":
        raise ValueError(f"slide-io: this path moves host memory only, got a {tensor.device} tensor")
    return byte_tensor(tensor).numpy()


def ready_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """An event on the caller's current stream, so a worker thread waits for the kernels that make `tensor`.

    Recorded at submit time, on the caller's thread: the worker has no idea which stream produced the data.
    """
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


_local = threading.local()


def _worker_stream(device: torch.device) -> torch.cuda.Stream:
    # One side stream per worker thread and device: copies then never queue behind compute on the legacy
    # default stream, and one worker's copy never waits for another's.
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def copy_and_wait(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling worker thread, returning only when the bytes have landed."""
    cuda = dst.device if dst.device.type == "cuda" else src.device if src.device.type == "cuda" else None
    if cuda is None:
        dst.copy_(src)
        return
    stream = _worker_stream(cuda)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
