"""Host <-> device copies that never make the host wait for the device.

A plain ``torch.tensor(values, device="cuda")`` or ``t.to("cuda")`` copies from pageable memory
and then synchronizes the stream, so the host stops until every kernel queued before it has run.
With async scheduling the host prepares step N+1 while the GPU runs step N: every copy on that
path must go through pinned memory with ``non_blocking=True`` instead. The pinned buffers come
from torch's caching host allocator, which keeps a buffer out of reuse until the copies that read
it have run, so they may be dropped right after the call.

Device -> host: ``HostCopy`` starts the copy into pinned memory and records an event behind it;
``wait()`` blocks on that event only, when the values are actually needed.

On the CPU there is nothing to overlap: values are plain tensors and ``wait()`` returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a CPU tensor that can be copied to ``device`` without a sync (pinned on CUDA)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``; the copy is queued on the current stream, the host goes on."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return host_tensor(values, dtype, device).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, values: Sequence) -> None:
    """``dst.copy_(values)`` queued on the current stream (static buffers of CUDA graphs)."""
    dst.copy_(host_tensor(values, dst.dtype, dst.device).view(dst.shape), non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host: started now, read by ``wait()``."""

    def __init__(self, src: torch.Tensor) -> None:
        if src.device.type == "cpu":
            self._host = src
            self._event = None
            return
        self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._host.copy_(src, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """Whether ``wait()`` would return without blocking."""
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        """Block until the copy, and so all device work queued before it, has run."""
        if self._event is not None:
            self._event.synchronize()

    def wait(self) -> torch.Tensor:
        """The values on the host (blocks until the copy has run)."""
        self.synchronize()
        return self._host
