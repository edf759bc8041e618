"""CUDA graphs of the model forward for pure-decode steps, one per batch-size bucket.

An eager decode step launches some fifteen kernels per layer; at small batches the GPU spends
most of the step waiting for the CPU to launch them. A pure-decode step (every scheduled
request has exactly one new token) runs the same kernels on same-shaped tensors for every step
of the same batch size, once the attention launch no longer depends on the contexts
(``StaticDecodePlan``): so the forward is captured once per bucket at start-up and replayed.

A graph step:

1. takes the smallest bucket >= the step's ``n`` requests; rows ``n..bucket-1`` are padding;
2. copies token ids, positions, slots, context lengths and block tables into the static input
   buffers (queued from pinned memory: the host does not wait for the step before), then writes
   the ids that only the device holds (the previous step's sampled tokens, under async
   scheduling) into the token-id buffer on the device. Padding rows are token 0 at position 0
   with slot -1, so ``write_kv`` drops their KV, and a context of 1 over block 0: a real block
   that is read, never written, so their attention is finite and touches nothing of the real
   rows;
3. replays; the first ``n`` rows of the bucket's static output are the step's hidden states.

The lm head and the sampler stay outside the graphs. All graphs share one memory pool,
captured largest first: they only ever run one at a time on one stream, and each output is
consumed before the next replay, so their intermediates may share memory.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.copies import copy_to_device
from pdserve.engine.models.llama import CausalLM
from pdserve.kernels.paged_attention import StaticDecodePlan
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, then every 16, and ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards for every bucket, with the static buffers they read and write."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        assert device.type == "cuda", device
        self.model = model
        self.backend = backend
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> [bucket, hidden], written by replay
        max_bs = self.buckets[-1]
        with torch.inference_mode():
            i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
            self.tokens = torch.zeros(3, max_bs, **i64)  # rows: input ids, positions, slots
            self.seq_lens = torch.ones(max_bs, **i32)
            self.block_tables = torch.zeros(max_bs, self.max_blocks, **i32)
            # One query per request in every decode step: the row offsets never change.
            self.query_start_loc = torch.arange(max_bs + 1, **i32)
            arch = model.arch
            splits = {
                bs: StaticDecodePlan.num_splits_for(bs, arch.num_kv_heads, max_model_len, device)
                for bs in self.buckets
            }
            numel = max(
                StaticDecodePlan.workspace_numel(bs, arch.num_heads, arch.head_dim, splits[bs])
                for bs in self.buckets
            )
            # Split-K partials, shared by all graphs (they never run at once).
            workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
            self.plans = {bs: StaticDecodePlan(splits[bs], workspace) for bs in self.buckets}

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :bs],
            block_tables=self.block_tables[:bs],
            seq_lens=[self.max_model_len] * bs,
            query_lens=[1] * bs,
            seq_lens_t=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            static_decode=self.plans[bs],
        )

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.tokens[0, :bs], self.tokens[1, :bs], meta, self.backend)

    @torch.inference_mode()
    def capture(self, largest_only: bool = False) -> None:
        """Capture every bucket (``largest_only``: the largest, to measure the pool's size), largest
        first, into one pool. Needs the KV cache bound."""
        start = time.monotonic()
        # Capture-time inputs are padding rows: no KV is written, every context is one position.
        self.tokens[0].zero_()
        self.tokens[1].zero_()
        self.tokens[2].fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets[-1:] if largest_only else self.buckets):
            meta = self._metadata(bs)
            # Warm-up outside the capture: Triton compiles each bucket's kernels, cuBLAS picks its
            # algorithms and workspaces.
            self._forward(bs, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs, meta)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %s in %.1f s",
            len(self.graphs),
            ",".join(map(str, sorted(self.graphs))),
            time.monotonic() - start,
        )

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],  # one row per request, all of one width <= max_blocks
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows [M], ids [M]) on the device
    ) -> torch.Tensor:  # [n, hidden]: a view of the bucket's static output, valid until the next replay
        """Replay the bucket that fits ``n = len(input_ids)`` one-token requests.

        ``fill`` overwrites ``input_ids[rows]`` with ``ids`` on the device before the replay.
        """
        n = len(input_ids)
        bs = self.bucket_for(n)
        assert bs is not None and len(seq_lens) == n == len(block_tables), (n, self.buckets)
        width = len(block_tables[0])
        assert width <= self.max_blocks, (width, self.max_blocks)
        pad = bs - n
        rows = [input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad]
        copy_to_device(self.tokens[:, :bs], rows)
        if fill is not None:
            self.tokens[0].index_copy_(0, *fill)
        copy_to_device(self.seq_lens[:bs], seq_lens + [1] * pad)
        # Columns past `width` keep older steps' block ids: no context reaches them.
        copy_to_device(self.block_tables[:bs, :width], block_tables + [[0] * width] * pad)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
