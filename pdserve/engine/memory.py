"""How much of a GPU the KV cache gets: ``gpu_memory_utilization`` as vLLM reads it.

The engine may keep alive ``total x gpu_memory_utilization`` of the device (the CUDA context
aside): its weights, the peak of a full-budget step (the forward, then the sampler's most
memory-hungry case on a full batch of rows), the CUDA graphs' memory pools and the KV cache. The
runner measures the first three before it allocates the cache (``ModelRunner.plan_kv_memory``: a
profiling step, and the graphs by capturing the largest bucket of each kind on a throwaway cache)
and gives the cache the rest. What torch's allocator caches beyond that (blocks of freed tensors
it keeps for reuse) it gives back when an allocation needs it. A device whose free memory (with
what this engine holds already) falls short of the share asked for is refused at start-up with
the figures, not left to run out of memory later.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class KVMemoryPlan:
    """The share of one device, what the engine needs besides its KV cache, and the cache's size."""

    device: str
    total: int
    utilization: float
    weights: int
    """The model's parameters and buffers (rotary tables)."""
    activations: int
    """The peak of a full-budget step (forward and sampler) beyond what was allocated before it."""
    graphs: int
    """The CUDA graphs' estimated memory: pools and static buffers (0 when eager)."""
    bytes_per_block: int

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.weights - self.activations - self.graphs

    @property
    def num_blocks(self) -> int:
        return max(self.kv_bytes, 0) // self.bytes_per_block

    def describe(self) -> str:
        return (
            f"{self.device}: gpu_memory_utilization {self.utilization} of {gib(self.total)} is "
            f"{gib(self.requested)}: {gib(self.weights)} weights, {gib(self.activations)} peak "
            f"activations, {gib(self.graphs)} CUDA graphs (estimated), {gib(self.kv_bytes)} KV cache "
            f"({self.num_blocks} blocks)"
        )


def check_free(device: str, total: int, free: int, held: int, utilization: float) -> None:
    """Refuse a share of the device larger than what is free of it (``free``) plus what this process
    holds already (``held``: its allocator's reserve, the weights among it)."""
    requested = int(total * utilization)
    available = free + held
    if available < requested:
        raise ValueError(
            f"{device} has {gib(available)} of {gib(total)} for this engine ({gib(total - available)} "
            f"used by other processes and CUDA contexts), less than gpu_memory_utilization "
            f"{utilization} asks for ({gib(requested)}): lower --gpu-memory-utilization or free the GPU"
        )


def size_kv_cache(plan: KVMemoryPlan) -> int:
    """The plan's number of blocks, or a clear error where nothing is left for the cache."""
    if plan.num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache ({plan.describe()}): raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, or use a smaller model"
        )
    return plan.num_blocks
