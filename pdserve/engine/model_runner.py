"""Runs the model for one scheduled step: builds the flat token batch, owns the KV cache memory.

On CUDA, unless ``enforce_eager``, pure-decode steps replay CUDA graphs captured right after the
KV cache is allocated (``cuda_graphs.py``), and prefill and mixed steps of at most
``piecewise_graph_max_tokens`` tokens replay graphs in pieces between eager attention launches
(``piecewise_graphs.py``); longer steps run eagerly. ``warm_up`` then launches every other Triton
specialization a step can meet, so that nothing compiles while the engine serves.

``execute`` never waits for the device: host lists go up through pinned memory (``copies.py``)
and input ids that the previous step sampled (output placeholders under async scheduling) are
copied from that step's sampled tensor on the device, so step N+1 is queued while step N runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.attention import AttentionMetadata, get_attention_backend
from pdserve.engine.copies import to_device
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.memory import GIB, KVMemoryPlan, check_free, gib, size_kv_cache
from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.piecewise_graphs import PiecewiseGraphs
from pdserve.engine.prompt_logprobs import prompt_logprobs as compute_prompt_logprobs
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kernels.block_copy import gather_blocks, scatter_blocks
from pdserve.kernels.paged_attention import eager_decode_warm_up_lens, prefill_config
from pdserve.kernels.triton_utils import num_jit_compiles
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInputs:
    """Input ids of a step that only the device holds: the previous step's sampled tokens.

    ``rows[j]`` is the row of ``token_ids`` that feeds the j-th scheduled request with
    ``num_device_inputs`` (its last input token), in scheduling order.
    """

    token_ids: torch.Tensor  # [M] int64 on the device
    rows: list[int]


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ArchConfig, model: CausalLM) -> None:
        self.config = config
        self.arch = arch
        self.model = model
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.cache.block_size
        self.backend = get_attention_backend(self.device)
        self.kv_cache: torch.Tensor | None = None  # [L, NB, 2, BS, Hkv, D], block-major in memory
        self.graphs: DecodeGraphs | None = None  # captured by allocate_kv_cache on CUDA
        self.piecewise: PiecewiseGraphs | None = None  # likewise
        self.memory_plan: KVMemoryPlan | None = None  # how the cache was sized (CUDA, by share)
        self.graph_bytes = 0  # what the captured graphs hold (pools, static buffers)

    @property
    def bytes_per_block(self) -> int:
        return self.arch.kv_bytes_per_token(self.dtype) * self.block_size

    def determine_num_blocks(self, sample: Callable[[torch.Tensor], object] | None = None) -> int:
        """The KV cache's size in blocks: ``num_kv_blocks``, else on CUDA this engine's share of the
        GPU less what it needs besides (``plan_kv_memory``; ``sample`` runs the sampler's worst case
        on a full batch's logits), else ``kv_cache_memory_gib``."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            self.memory_plan = plan = self.plan_kv_memory(sample)
            logger.info("%s", plan.describe())
            return size_kv_cache(plan)
        num_blocks = int(cache.kv_cache_memory_gib * GIB // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gib {cache.kv_cache_memory_gib} holds no KV block")
        return num_blocks

    def plan_kv_memory(self, sample: Callable[[torch.Tensor], object] | None = None) -> KVMemoryPlan:
        """This device's share (``gpu_memory_utilization``, refused if it is not free) less the
        model's weights, the peak of a full-budget step (the forward, then ``sample`` on the logits
        of ``max_num_seqs`` rows) and the CUDA graphs, measured on a throwaway KV cache
        (``pdserve.engine.memory``). Only what this engine allocates counts: memory that another
        engine of this process holds is neither its weights nor free."""
        dev, util = self.device, self.config.cache.gpu_memory_utilization
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        weights = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        check_free(str(dev), total, free, weights + cached, util)
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_blocks = cdiv(num_tokens, self.block_size)
        base = torch.cuda.memory_allocated(dev)
        self._bind_kv_cache(num_blocks)
        try:
            kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
            torch.cuda.reset_peak_memory_stats(dev)
            meta = AttentionMetadata.build(
                list(range(num_tokens)), [list(range(num_blocks))], [num_tokens], [num_tokens], dev
            )
            ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
            hidden = self.model(ids, torch.arange(num_tokens, device=dev), meta, self.backend)
            logits = self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
            del meta, ids, hidden
            if sample is not None:
                sample(logits)
            del logits
            torch.cuda.synchronize(dev)
            activations = torch.cuda.max_memory_allocated(dev) - base - kv_bytes
            graphs = self._graph_memory(largest_only=True)[0]
        finally:
            self.kv_cache = None
            torch.cuda.empty_cache()
        return KVMemoryPlan(str(dev), total, util, weights, activations, graphs, self.bytes_per_block)

    def _graph_memory(self, largest_only: bool) -> tuple[int, DecodeGraphs | None, PiecewiseGraphs | None]:
        """Capture the decode graphs and the piecewise ones on the bound cache (CUDA, not
        ``enforce_eager``; ``largest_only``: each kind's largest bucket, what sizing needs) and
        measure what they hold: their pools and static buffers, the allocator's cache emptied
        before and after (it then holds nothing the graphs do not)."""
        if self.device.type != "cuda" or self.config.model.enforce_eager:
            return 0, None, None
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(dev)
        decode = DecodeGraphs(
            self.model,
            self.backend,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_model_len=self.config.model.max_model_len,
            block_size=self.block_size,
            device=dev,
        )
        decode.capture(largest_only)
        piecewise = None
        max_tokens = min(
            self.config.model.piecewise_graph_max_tokens, self.config.scheduler.max_num_batched_tokens
        )
        if max_tokens > 0:
            piecewise = PiecewiseGraphs(self.model, self.backend, max_tokens=max_tokens, device=dev)
            piecewise.capture(largest_only=largest_only)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(dev) - base, decode, piecewise

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate and bind the KV cache, then capture the decode graphs and the piecewise ones
        (CUDA, not enforce_eager)."""
        self._bind_kv_cache(num_blocks)
        self.graph_bytes, self.graphs, self.piecewise = self._graph_memory(largest_only=False)
        if self.graphs is not None:
            estimate = f" (estimated {gib(self.memory_plan.graphs)})" if self.memory_plan else ""
            logger.info("CUDA graphs hold %s%s", gib(self.graph_bytes), estimate)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Launch every Triton kernel specialization a step of this engine can meet, once, before
        it serves (CUDA; after ``allocate_kv_cache``, whose graph capture ran the decode graphs').

        Beyond the model's fixed shapes and dtype, the kernels specialize on (see
        ``pdserve.kernels.triton_utils``):

        - prefill and mixed steps: ``prefill_config``, whose query tile is a power of two picked
          from the step's longest query: one forward per distinct config, queries of 2 up to
          ``max_num_batched_tokens`` tokens;
        - eager decode steps (``enforce_eager``): the grid's split count, a power of two
          (``eager_decode_warm_up_lens``); graphs fix theirs at capture;
        - the KV transports' block copies: one gather (the sender), one scatter (the receiver).

        The rest of what changes from step to step (token and request counts, the block table's
        width, contexts) is not specialized on. The forwards write KV into blocks that hold
        nothing yet.
        """
        if self.device.type != "cuda":
            return
        start, before = time.monotonic(), num_jit_compiles()
        a, dev = self.arch, self.device
        longest = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        configs = set()
        for n in sorted({1 << k for k in range(1, longest.bit_length())} | {longest}):
            config = prefill_config(a.num_heads, a.num_kv_heads, a.head_dim, self.block_size, self.dtype, n)
            key = tuple(sorted(config.items()))
            if n >= 2 and key not in configs:
                configs.add(key)
                self._warm_up_forward(n, n)
        if self.graphs is None:
            for seq_len in eager_decode_warm_up_lens(a.num_kv_heads, self.config.model.max_model_len, dev):
                self._warm_up_forward(1, seq_len)
        # As the transports call them: every layer (or a run of layers) of int64 block ids.
        ids = torch.arange(min(2, self.kv_cache.shape[1]), dtype=torch.long, device=dev)
        scatter_blocks(gather_blocks(self.kv_cache, ids), self.kv_cache, ids)
        torch.cuda.synchronize(dev)
        logger.info(
            "warm-up: %d Triton kernels compiled in %.1f s (%d prefill configs, %s)",
            num_jit_compiles() - before,
            time.monotonic() - start,
            len(configs),
            "decode in CUDA graphs" if self.graphs is not None else "eager decode",
        )

    def _warm_up_forward(self, query_len: int, seq_len: int) -> None:
        """One request's forward over blocks 0, 1, ...: its last ``query_len`` of ``seq_len`` tokens."""
        positions = list(range(seq_len - query_len, seq_len))  # also the slots: block i holds block i
        blocks = list(range(cdiv(seq_len, self.block_size)))
        meta = AttentionMetadata.build(positions, [blocks], [seq_len], [query_len], self.device)
        ids = torch.zeros(query_len, dtype=torch.long, device=self.device)
        hidden = self.model(ids, to_device(positions, torch.long, self.device), meta, self.backend)
        self.model.compute_logits(hidden[-1:])

    def _bind_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        # Indexed [L, NB, 2, BS, Hkv, D], block-major in memory: a block's slabs of every layer are
        # one region, so a run of blocks moves between nodes as one piece (``kv_transfer.base.
        # KVLayout``); each layer's view is strided by blocks, its [2, BS, Hkv, D] slabs contiguous.
        self.kv_cache = torch.zeros(
            num_blocks,
            a.num_layers,
            2,
            self.block_size,
            a.num_kv_heads,
            a.head_dim,
            dtype=self.dtype,
            device=self.device,
        ).transpose(0, 1)
        self.model.bind_kv_cache(list(self.kv_cache.unbind(0)))

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        device_inputs: DeviceInputs | None = None,
        layer_events: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> torch.Tensor:
        """Queue the step's forward; returns float32 logits [N, vocab] of the rows that sample, in order.

        Placeholder input ids (``ScheduledRequest.num_device_inputs``) come from
        ``device_inputs``; their slots in the host list hold 0 until the device fills them.
        With ``layer_events`` (a list, CUDA), an eager or piecewise-graph step appends one event per
        layer, recorded once that layer's kernels are queued: layer i's KV is written when event i
        completes. A decode-graph step appends none. The step's ``block_copies`` are made first. With
        ``prompt_logprobs`` (a list), each request that asks for them and computes prompt positions
        in this step appends ``(request_id, first_token_index, [TokenLogprobs, ...])``.
        """
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        device_rows: list[int] = []  # rows of input_ids that device_inputs fill
        max_blocks = 0
        first_rows: list[int] = []  # row of each scheduled request's first token
        for s in out.scheduled:
            end = s.start + s.num_tokens
            first_rows.append(len(input_ids))
            input_ids += s.token_ids
            for _ in range(s.num_device_inputs):
                device_rows.append(len(input_ids))
                input_ids.append(0)
            pos = range(s.start, end)
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            seq_lens.append(end)
            query_lens.append(s.num_tokens)
            if s.needs_sample:
                sample_rows.append(len(input_ids) - 1)
            max_blocks = max(max_blocks, cdiv(end, bs))
        table = [
            list(s.block_ids[:max_blocks]) + [0] * (max_blocks - len(s.block_ids)) for s in out.scheduled
        ]

        dev = self.device
        fill = None
        if device_rows:
            assert device_inputs is not None and len(device_inputs.rows) == len(device_rows)
            src = to_device(device_inputs.rows, torch.long, dev)
            fill = (to_device(device_rows, torch.long, dev), device_inputs.token_ids.index_select(0, src))
        graphs = self.graphs
        if (
            graphs is not None
            and all(s.num_tokens == 1 for s in out.scheduled)
            and graphs.bucket_for(len(table)) is not None
            and max_blocks <= graphs.max_blocks
        ):
            hidden = graphs.run(input_ids, positions, slots, seq_lens, table, fill)
        else:
            piecewise = self.piecewise
            if piecewise is not None and piecewise.bucket_for(len(input_ids)) is None:
                piecewise = None
            # A piecewise step's slots go up once, with its other static inputs.
            slot_mapping = slots if piecewise is None else piecewise.load(input_ids, positions, slots, fill)
            meta = AttentionMetadata.build(slot_mapping, table, seq_lens, query_lens, dev)
            after_layer = None
            if layer_events is not None and dev.type == "cuda":

                def after_layer(_: int) -> None:
                    event = torch.cuda.Event()
                    event.record()
                    layer_events.append(event)

            if piecewise is not None:
                hidden = piecewise.run(meta, after_layer)
            else:
                ids = to_device(input_ids, torch.long, dev)
                if fill is not None:
                    ids.index_copy_(0, *fill)
                positions_t = to_device(positions, torch.long, dev)
                hidden = self.model(ids, positions_t, meta, self.backend, after_layer)
        if prompt_logprobs is not None:
            self._prompt_logprobs(out, hidden, first_rows, prompt_logprobs)
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(sample_rows, torch.long, dev))
        return self.model.compute_logits(hidden)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, keys and values), queued before the step's forward."""
        src = to_device([c[0] for c in copies], torch.long, self.device)
        dst = to_device([c[1] for c in copies], torch.long, self.device)
        # kv_cache: [L, NB, 2, BS, Hkv, D]; each layer's view sees the copy
        # Blocks indexed outermost: index_select along dim 1 of the block-major cache is ~70x
        # slower on the CPU (``kv_transfer.base.select_blocks``).
        self.kv_cache.index_copy_(1, dst, self.kv_cache.transpose(0, 1).index_select(0, src).transpose(0, 1))

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor, first_rows: list[int], into: list
    ) -> None:
        for s, row in zip(out.scheduled, first_rows):
            r = s.request
            num_top = r.sampling_params.prompt_logprobs
            k = min(s.start + s.num_tokens, r.num_prompt_tokens - 1) - s.start
            if num_top is None or k <= 0:
                continue
            targets = r.prompt_token_ids[s.start + 1 : s.start + 1 + k]
            # In slices of max_num_seqs rows: the [rows, V] float tensors of one slice weigh less
            # than the sampler's worst case on a full batch, which the KV cache was sized with
            # (a 2,048-token chunk at once took ~2 GiB at a 128k vocabulary).
            step = self.config.scheduler.max_num_seqs
            logprobs = []
            for a in range(0, k, step):
                logits = self.model.compute_logits(hidden[row + a : row + min(k, a + step)])  # [<=step, V]
                logprobs += compute_prompt_logprobs(logits, targets[a : a + step], num_top)
            into.append((r.request_id, s.start + 1, logprobs))
