"""CUDA graphs of prefill and mixed steps, in pieces between the attention launches.

A step of a few hundred tokens is bound by the host when it runs eagerly: a Llama-3-8B forward
launches some fifteen kernels a layer (a linear alone costs ~25 us of host time to launch on an
H100 host), ~14.5 ms of host work for 128 tokens as for 512, while the GPU needs ~4 and ~12.5
(``docs/benchmarks/gpu_engine_piecewise_h100.json``). A short prompt's TTFT was that host floor, and
any other work on the host (the node's other threads, a second node) added to it. The attention
launch depends on the step's requests (how many, how long each); everything else depends on the
token count alone. So the forward is captured per token-count bucket in ``L + 1`` pieces that
run from one layer's attention output to the next layer's queries (as vLLM's piecewise graphs),
and the attention runs eagerly between them:

* piece 0: the embedding; layer 0's input norm, q/k/v projection (q/k norms), rotary, KV write;
* piece i: layer i-1's output projection, post-attention norm and MLP; layer i's input norm
  (the residual add fused in), projection, rotary, KV write;
* piece L: layer L-1's output projection, norm and MLP; the final norm.

A step of ``n`` tokens takes the smallest bucket ``T >= n``; rows ``n..T-1`` are padding (token 0
at position 0, slot -1: ``write_kv`` drops their KV). The attention reads and writes the first
``n`` rows only; every other op works row by row, so padding rows never touch real ones.

Tensors that cross pieces live in static buffers (the queries, the attention output, the
residual stream, the final hidden states); everything else lives in one memory pool shared by
every piece of every bucket: they run one at a time on one stream and leave nothing alive in it.
Pure-decode steps keep their whole-forward graphs (``cuda_graphs.py``); steps past the largest
bucket run eagerly, where the GPU's work hides the launches.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.copies import copy_to_device
from pdserve.engine.models.llama import CausalLM

logger = logging.getLogger(__name__)


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, 128, then every 128, and ``max_tokens`` itself (none for
    0). A step's matmuls read the weights whatever its row count up to a few hundred rows, so
    padding a step to its bucket costs the GPU little."""
    if max_tokens <= 0:
        return []
    sizes = [16, 32, 64, 128, *range(256, max_tokens + 1, 128)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class Replay(Protocol):
    """What ``PiecewiseGraphs`` needs of a captured piece: a ``torch.cuda.CUDAGraph``, or ``Eager``."""

    def replay(self) -> None: ...


class Eager:
    """A piece that runs its code when replayed: the decomposition without CUDA (the CPU tests)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class PiecewiseGraphs:
    """Captured pieces of the forward for every bucket, with the static buffers between them."""

    def __init__(
        self, model: CausalLM, backend: AttentionBackend, *, max_tokens: int, device: torch.device
    ) -> None:
        self.model = model
        self.backend = backend
        self.buckets = piecewise_buckets(max_tokens)
        assert self.buckets, "no bucket to capture"
        self.device = device
        self.graphs: dict[int, list[Replay]] = {}
        arch = model.arch
        dtype = model.lm_head.weight.dtype
        t = self.buckets[-1]
        with torch.inference_mode():
            self.tokens = torch.zeros(3, t, dtype=torch.long, device=device)  # ids, positions, slots
            self.q = torch.zeros(t, arch.num_heads, arch.head_dim, dtype=dtype, device=device)
            self.attn = torch.zeros(t, arch.num_heads, arch.head_dim, dtype=dtype, device=device)
            self.residual = torch.zeros(t, arch.hidden_size, dtype=dtype, device=device)
            self.out = torch.zeros(t, arch.hidden_size, dtype=dtype, device=device)

    def bucket_for(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def _piece(self, i: int, t: int) -> None:
        """Piece ``i`` of the forward at bucket ``t`` (the module docstring), from and to the static
        buffers."""
        layers = self.model.model.layers
        ids, positions, slots = self.tokens[0, :t], self.tokens[1, :t], self.tokens[2, :t]
        if i == 0:
            hidden, residual = self.model.model.embed_tokens(ids), None
        else:
            hidden, residual = layers[i - 1].post_attention(self.attn[:t], self.residual[:t])
        if i == len(layers):
            self.out[:t].copy_(self.model.model.norm.forward_add(hidden, residual)[0])
            return
        layer = layers[i]
        q, k, v, residual = layer.pre_attention(hidden, residual, positions)
        # The fused norm adds into the static buffer in place; the embedding and the CPU's norm do not.
        if residual.data_ptr() != self.residual.data_ptr():
            self.residual[:t].copy_(residual)
        self.backend.write(k, v, layer.self_attn.kv_cache, slots)
        self.q[:t].copy_(q)

    @torch.inference_mode()
    def capture(self, eager: bool = False, largest_only: bool = False) -> None:
        """Capture every bucket's pieces (``largest_only``: the largest bucket's, to measure the pool's
        size), largest first, into one pool (``eager``: record the pieces to run eagerly instead, on
        any device). Needs the KV cache bound."""
        start = time.monotonic()
        # Capture-time inputs are padding rows: no KV is written.
        self.tokens[:2].zero_()
        self.tokens[2].fill_(-1)
        pool = None if eager else torch.cuda.graph_pool_handle()
        for t in reversed(self.buckets[-1:] if largest_only else self.buckets):
            pieces = range(len(self.model.model.layers) + 1)
            if eager:
                self.graphs[t] = [Eager(lambda i=i, t=t: self._piece(i, t)) for i in pieces]
                continue
            # Warm-up outside the capture: Triton compiles each bucket's kernels, cuBLAS picks its
            # algorithms and workspaces.
            for i in pieces:
                self._piece(i, t)
            torch.cuda.synchronize(self.device)
            graphs: list[Replay] = []
            for i in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, t)
                graphs.append(graph)
            self.graphs[t] = graphs
        if eager:
            return
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d piecewise CUDA graphs for prefill and mixed steps of %s tokens in %.1f s",
            sum(len(g) for g in self.graphs.values()),
            ",".join(map(str, sorted(self.graphs))),
            time.monotonic() - start,
        )

    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows [M], ids [M]) on the device
    ) -> torch.Tensor:  # [n] the step's slot mapping on the device, for its ``AttentionMetadata``
        """Put a step of ``n = len(input_ids)`` tokens into the static inputs (padded to its bucket),
        ``fill`` overwriting ``input_ids[rows]`` with ``ids`` on the device."""
        n = len(input_ids)
        t = self.bucket_for(n)
        assert t is not None, (n, self.buckets)
        pad = t - n
        copy_to_device(self.tokens[:, :t], [input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad])
        if fill is not None:
            self.tokens[0].index_copy_(0, *fill)
        return self.tokens[2, :n]

    def run(
        self, meta: AttentionMetadata, after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:  # [n, hidden]: a view of the static output, valid until the next run
        """The forward of the step ``load`` put in (``meta``: its own): the bucket's pieces
        replayed, the attention of each layer launched between them; ``after_layer(i)`` runs once
        layer i's KV writes are queued (right after its piece)."""
        n = meta.num_tokens
        t = self.bucket_for(n)
        assert t is not None, (n, self.buckets)
        pieces = self.graphs[t]
        for i, layer in enumerate(self.model.model.layers):
            pieces[i].replay()
            if after_layer is not None:
                after_layer(i)
            attn = layer.self_attn
            self.backend.attend(self.q[:n], attn.kv_cache, meta, attn.scale, out=self.attn[:n])
        pieces[-1].replay()
        return self.out[:n]
