"""The engine: scheduler + model runner + sampler + output processing, one ``step()`` at a time.

A step is scheduled, launched (the forward and the sampling are queued on the device) and then
applied: its sampled tokens are read on the host, given to the scheduler, detokenized and
checked for stop strings. Synchronously, a step is applied right after its launch. With async
scheduling (vLLM's ``--async-scheduling``) it is applied one step later, after the next step
was scheduled and launched: the host's work for step N (reading its tokens, stop checks,
detokenizing, streaming) and for step N+1 (scheduling, building its inputs) overlaps step N+1
on the device, and step N+1 reads step N's tokens on the device (``DeviceInputs``). A step
whose sampling has penalties is applied before the next one is scheduled, because penalties
count the output tokens on the host.

Node services use the engine through its public methods only (``load``, ``request_ids``,
``pin_held``, ``add_launch_listener``, ...): their arguments and results are plain values and
ids, never the scheduler's objects, so that the engine core can move into a process of its own
with these calls as its messages. The scheduler and the model runner are the engine's insides;
only the engine's own tests reach into them. Every method runs on the thread that steps the
engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass

import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.model_runner import DeviceInputs, ModelRunner
from pdserve.engine.models import load_model
from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.outputs import (
    CompletionOutput,
    EngineLoad,
    LaunchedChunk,
    LaunchListener,
    RequestOutput,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import PendingSample, Sampler, SamplingRow, make_generator
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sim import Simulation, load_calibration, simulated_config
from pdserve.engine.sim.runner import SimModelRunner, SimPendingSample, SimSampler
from pdserve.engine.structured_output import StructuredOutputManager
from pdserve.hashing import BlockEvent
from pdserve.kernels.triton_utils import count_jit_compiles, num_jit_compiles
from pdserve.logprobs import TokenLogprobs
from pdserve.model_source import resolve_model
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, load_tokenizer
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """Engine-side companions of a request: its sampler generator and detokenizer."""

    request: Request
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None


@dataclass(eq=False)
class _Group:
    """A parallel-sampling request (``n``/``best_of`` > 1): its sequences, forked from the first
    once the prompt is computed (``Scheduler._fork``), answer as one ``RequestOutput`` whose
    ``outputs`` hold every sequence by index; it is finished when all of them are."""

    request_id: str
    sequences: list[Request]
    texts: list[str]

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.sequences)


@dataclass(frozen=True)
class _Forward:
    """A step whose forward is launched and whose sampling is not: its logits [N, V] on the device."""

    out: SchedulerOutput
    logits: torch.Tensor
    sampling: list[Request]  # the requests of the logits' rows, in order

    @property
    def waits_for_previous(self) -> bool:
        """A row's grammar needs the token of the step in flight before its mask can be filled."""
        return any(r.structured_output is not None and r.num_output_placeholders > 1 for r in self.sampling)


@dataclass(frozen=True)
class _LaunchedStep:
    """A step queued on the device whose sampled tokens the scheduler has not seen yet."""

    out: SchedulerOutput
    sample: PendingSample | SimPendingSample
    rows: dict[str, int]  # request id -> its row of sample.token_ids
    needs_host_tokens: bool  # a row has penalties: the next sampling counts this step's tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, record_block_events: bool = False) -> None:
        """``record_block_events`` queues the prefix cache's changes for ``take_block_events``."""
        start = time.monotonic()
        self.source = resolve_model(config.model)
        self.arch = ArchConfig.from_hf_config(self.source.hf_config, config.model.max_model_len)
        if self.source.simulated_gpu:
            config = simulated_config(config, self.arch)
        config = config.resolved(self.arch.dtype, self.arch.max_position_embeddings)
        self.config = config
        self.max_model_len = config.model.max_model_len
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )
        if config.device.num_threads > 0:
            torch.set_num_threads(config.device.num_threads)
        count_jit_compiles()  # before the first kernel: pdserve_jit_compiles_total counts them all

        self.tokenizer = load_tokenizer(self.source.tokenizer_dir) if self.source.tokenizer_dir else None
        self.eos_token_ids = self._eos_token_ids()
        self.simulation: Simulation | None = None
        """What a simulated engine models (``--model sim:...``); None for a real model."""
        # The one place a simulated engine differs: its runner and sampler model the forward's time
        # instead of running it (pdserve.engine.sim); everything else below is the same engine.
        if self.source.simulated_gpu:
            calibration = load_calibration(self.source.simulated_gpu, config.model.sim_calibration)
            self.runner = SimModelRunner(config, self.arch, calibration)
            self.sampler = SimSampler()
            self.model = None
            self.simulation = Simulation(calibration.gpu, calibration, self.runner.bytes_per_block)
        else:
            if config.model.sim_calibration:
                raise ValueError("--sim-calibration applies to simulated models (--model sim:...) only")
            self.model = load_model(
                self.source,
                self.arch,
                self.max_model_len,
                config.torch_device,
                config.torch_dtype,
                config.model.seed,
            )
            self.runner = ModelRunner(config, self.arch, self.model)
            self.sampler = Sampler(self.eos_token_ids, seed=config.model.seed, device=config.torch_device)
        num_blocks = self.runner.determine_num_blocks(self._sample_worst_case)
        if num_blocks * config.cache.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.cache.block_size} tokens, fewer than "
                f"max_model_len {self.max_model_len}: lower max_model_len or give the cache more memory"
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.warm_up()  # every Triton compile happens here, none while serving
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.max_model_len,
            namespace=self.source.model_id,
            record_events=record_block_events,
        )
        """The engine's insides, with ``runner``: nothing outside ``pdserve.engine`` (and the engine's
        own tests) reads them; node services use the methods below."""
        self.structured = StructuredOutputManager(
            self.tokenizer, self.arch.vocab_size, self.eos_token_ids, config.torch_device
        )
        self.async_scheduling = bool(config.scheduler.async_scheduling)
        """Apply each step after launching the next (see the module docstring). Benchmarks flip it
        to compare; either way a step in flight is applied in order."""
        self._in_flight: _LaunchedStep | None = None
        self._states: dict[str, _RequestState] = {}
        self._groups: dict[str, _Group] = {}  # parallel-sampling request id -> its group
        self._group_of: dict[str, _Group] = {}  # each of a group's sequence ids -> the group
        self._next_id = 0
        self._launch_listeners: list[LaunchListener] = []
        self.num_prompt_tokens_computed = 0
        """Prompt tokens this engine ran through the model (prefix-cache hits and remote KV excluded)."""
        logger.info(
            "engine ready in %.1f s: %s (%s) on %s, %d KV blocks x %d tokens (%.2f GiB), %s scheduling",
            time.monotonic() - start,
            self.source.model_id,
            config.model.dtype,
            f"a simulated {self.simulation.gpu}" if self.simulation else config.torch_device,
            num_blocks,
            config.cache.block_size,
            num_blocks * self.runner.bytes_per_block / (1 << 30),
            "async" if self.async_scheduling else "synchronous",
        )

    def _sample_worst_case(self, logits: torch.Tensor) -> None:
        """Sample a full batch's logits as the most memory-hungry requests would (temperature,
        min_p, top_k, top_p, penalties, 20 logprobs each; the vocabulary sorted per row), so that
        the KV cache is sized with the sampler's peak counted (``ModelRunner.plan_kv_memory``).

        One row is greedy and asks for no logprobs: in a batch that mixes them the sampler copies
        the random rows and the logprob rows out (``[rows, vocab]`` each), which a batch of one
        kind does not. On one H100 at 128 rows of a 128k vocabulary, 874 MiB above the logits
        against 660 for 128 rows alike (a serving batch of 4 greedy and 124 top_p rows with
        logprobs: 856)."""
        params = SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            min_p=0.01,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            min_tokens=1,
            logprobs=20,
            logit_bias={0: 1.0},
        )
        rows = [SamplingRow(params, [1, 2], [3]) for _ in range(logits.shape[0])]
        if len(rows) > 1:
            rows[0] = SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3])
        self.sampler(logits, rows)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.arch.eos_token_ids)
        folder = self.source.weights_dir
        gen_cfg = folder / "generation_config.json" if folder else None
        if gen_cfg is not None and gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return tuple(dict.fromkeys(ids))

    # -- requests ------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.source.model_id} has no tokenizer: pass prompt_token_ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        hold_blocks: bool = False,
    ) -> Request:
        """Queue a request. ``hold_blocks`` keeps its KV blocks after it finishes (see ``release_held``).

        Raises ValueError for a request the engine can never serve (duplicate id, too long).
        """
        request = self._new_request(request_id, prompt, params, prompt_token_ids)
        request.hold_blocks = hold_blocks
        self._validate_forks(request)
        self.scheduler.add_request(request)
        self._track(request)
        return request

    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError where ``add_request`` would; queues nothing."""
        self.scheduler.validate(self._new_request(request_id, None, params, prompt_token_ids))

    def _new_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None
    ) -> Request:
        """The request, and with ``params.num_sequences`` > 1 the group of its sequences: the
        request is sequence 0, the others wait in ``pending_forks`` (ids ``<request_id>#<j>``)."""
        request = self._single_request(request_id, prompt, params.for_sequence(0), prompt_token_ids)
        if params.num_sequences == 1:
            return request
        ids = request.prompt_token_ids
        request.pending_forks = [
            self._single_request(f"{request_id}#{j}", prompt, params.for_sequence(j), ids)
            for j in range(1, params.num_sequences)
        ]
        return request

    def _validate_forks(self, request: Request) -> None:
        if not request.pending_forks:
            return
        num_seqs, num_prompt = len(request.pending_forks) + 1, request.num_prompt_tokens
        num_blocks = self.blocks_for_tokens(num_prompt + 1) + num_seqs - 1
        total = self.scheduler.kv.pool.num_blocks
        if num_blocks > total:
            raise ValueError(
                f"{num_seqs} sequences of a {num_prompt}-token prompt need {num_blocks} KV blocks to start, "
                f"more than the cache holds ({total})"
            )
        for child in request.pending_forks:
            if self.scheduler.get_request(child.request_id) is not None or child.request_id in self._group_of:
                raise ValueError(f"duplicate request id {child.request_id!r}")

    def _single_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None
    ) -> Request:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})")
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        return Request(
            request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, prompt=prompt
        )

    def _track(self, request: Request) -> None:
        """Give a new request (and the sequences it forks, as a group) a generator and a detokenizer."""
        if request.pending_forks:
            sequences = [request, *request.pending_forks]
            group = _Group(request.request_id, sequences, [""] * len(sequences))
            self._groups[request.request_id] = group
            for r in sequences:
                self._group_of[r.request_id] = group
            for child in request.pending_forks:
                self._track(child)
        params = request.sampling_params
        if params.structured_outputs is not None:
            request.structured_output = self.structured.request(params.structured_outputs)
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, self.config.torch_device)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
        self._states[request.request_id] = _RequestState(request, generator, detokenizer)

    # -- disaggregation ------------------------------------------------------------------------

    def reserve_remote(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[int] | None:
        """Reserve blocks for a prompt whose KV another node computes; None when blocks are short now.

        Raises ValueError for a request this engine can never serve. Prompt logprobs are the
        computing node's to report: none are computed here.
        """
        if params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)
        request = self._new_request(request_id, None, params, prompt_token_ids)
        self._validate_forks(request)
        # Another node writes these blocks, unordered with this engine's stream: a block freed
        # while the step in flight still writes it (an abort, a late stop) must not be handed out
        # before that step has run.
        self.wait_for_device()
        block_ids = self.scheduler.reserve_remote(request)
        if block_ids is not None:
            self._track(request)
        return block_ids

    def remote_kv_landed(
        self,
        request_id: str,
        first_token: int,
        logprobs: TokenLogprobs | None,
        generator_state: bytes,
        num_cached_tokens: int,
    ) -> RequestOutput | None:
        """Continue a reserved request whose prompt KV and first token arrived; None if it is gone."""
        state = self._states.get(request_id)
        if state is None:
            return None
        if state.generator is not None and generator_state:
            state.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        request = self.scheduler.remote_kv_landed(request_id, first_token, logprobs, num_cached_tokens)
        if request is None:
            self._forget(request_id)
            return None
        return self._outputs([request])[0]

    def generator_state(self, request_id: str) -> bytes:
        """The seeded sampler state of a request (empty when unseeded), to continue sampling elsewhere."""
        state = self._states.get(request_id)
        if state is None or state.generator is None:
            return b""
        return state.generator.get_state().cpu().numpy().tobytes()

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """The blocks a finished ``hold_blocks`` request keeps; None when it holds none."""
        if request_id not in self.scheduler.held:
            return None
        return self.scheduler.kv.get_block_ids(request_id)

    def release_held(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_blocks`` request kept (unknown ids are ignored).

        A pinned request's blocks are freed only when it is unpinned (``unpin_held``).
        """
        self.scheduler.release_held(request_id)
        self._forget(request_id)

    def pin_held(self, request_id: str) -> None:
        """Keep a held request's blocks until ``unpin_held``, through ``release_held`` and
        ``abort_request``: someone outside the engine reads them (a KV send in flight).

        The request stays known (``has_request``) while pinned. Raises KeyError when it holds no
        blocks.
        """
        self.scheduler.pin_held(request_id)

    def unpin_held(self, request_id: str) -> None:
        """End ``pin_held``: the blocks stay held, or are freed now if a release or abort came
        while they were pinned. Unknown ids are ignored."""
        self.scheduler.unpin_held(request_id)

    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request whose KV this engine has; for a request reserved by
        ``reserve_remote``, the prefix shared from the prefix cache. Raises KeyError if unknown."""
        return self._request(request_id).num_computed_tokens

    def num_preemptions(self, request_id: str) -> int:
        """Times the request was preempted (blocks of an earlier run may have been reused since).
        Raises KeyError if unknown."""
        return self._request(request_id).num_preemptions

    def _request(self, request_id: str) -> Request:
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        return request

    def abort_request(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End requests wherever they are (queued, running, waiting for KV, or holding blocks);
        blocks pinned by ``pin_held`` stay until ``unpin_held``. Unknown ids are ignored. A
        parallel-sampling request ends with every one of its sequences, forked or not."""
        ids = []
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                ids.append(request_id)
                continue
            group.sequences[0].pending_forks = []
            for r in group.sequences:
                ids.append(r.request_id)
                self._group_of.pop(r.request_id, None)
        self.scheduler.finish_requests(ids, status)
        for request_id in ids:
            self.release_held(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Drop a request's engine-side state (its generator, detokenizer and grammar matcher)."""
        state = self._states.pop(request_id, None)
        if state is not None and state.request.structured_output is not None:
            state.request.structured_output.close()

    # -- what the node asks of the engine ------------------------------------------------------

    def load(self) -> EngineLoad:
        """Counts of the engine's queues and blocks now, and its prompt-token counters."""
        s = self.scheduler
        return EngineLoad(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.remote),
            num_held=len(s.held),
            num_free_blocks=s.kv.num_free_blocks,
            num_blocks=s.kv.pool.num_blocks,
            num_pending_prompt_tokens=self.num_pending_prompt_tokens(),
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_prefix_hit_tokens=s.num_prefix_hit_tokens,
            num_jit_compiles=num_jit_compiles(),
        )

    def request_ids(self) -> list[str]:
        """Every request the engine holds: queued, running, waiting for KV, or holding blocks (a
        parallel-sampling request once, under its own id)."""
        ids = list(self.scheduler.requests) + list(self.scheduler.held)
        return list(dict.fromkeys(self._group_id(i) for i in ids))

    def _group_id(self, request_id: str) -> str:
        group = self._group_of.get(request_id)
        return request_id if group is None else group.request_id

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_ids`` has it; a finished request that keeps its blocks counts."""
        return request_id in self._groups or self.scheduler.get_request(request_id) is not None

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free now (evictable prefix cache included)."""
        return self.scheduler.kv.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (as vLLM's ``reset_prefix_cache``), so the next prompts
        compute everything; refused (False) while any block is in use."""
        return self.scheduler.kv.pool.reset_prefix_cache()

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """KV blocks that ``num_tokens`` tokens take."""
        return cdiv(num_tokens, self.config.cache.block_size)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV cache, ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``: for a
        KV transport to register (it reads and writes blocks named by id)."""
        return self.runner.kv_cache

    def add_launch_listener(self, listener: LaunchListener) -> None:
        """Call ``listener(chunks, layer_events)`` right after each step's forward was launched,
        before its tokens are sampled, with one ``LaunchedChunk`` per request in the step. On an
        eager CUDA step ``layer_events`` holds one event per layer after which that layer's KV is
        written; else it is None (everything queued so far is). A prefill node ships KV from here,
        layer by layer while the rest of the forward runs. The events are device handles: this
        call stays beside the device if the engine core gets a process of its own."""
        self._launch_listeners.append(listener)

    def remove_launch_listener(self, listener: LaunchListener) -> None:
        """Stop calling a listener added by ``add_launch_listener``."""
        self._launch_listeners.remove(listener)

    def take_block_events(self) -> list[BlockEvent]:
        """Block hashes stored in or evicted from the prefix cache since the last call."""
        return self.scheduler.kv.pool.take_events()

    def num_pending_prompt_tokens(self) -> int:
        """Prompt tokens queued or running that are not computed yet (the node's prefill backlog).

        A queued prompt counts without the prefix its admission will find cached (looked up
        once per request: the estimate for routing, not a promise).
        """
        s = self.scheduler
        pending = 0
        for r in s.running:
            pending += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        for r in s.waiting:
            if r.num_computed_tokens == 0 and r.expected_cached_tokens < 0:
                r.expected_cached_tokens = s.kv.get_computed_blocks(r)[1]
            cached = max(r.num_computed_tokens, r.expected_cached_tokens)
            pending += max(0, r.num_prompt_tokens - cached)
        return pending

    def has_unfinished_requests(self) -> bool:
        """Requests queued, running or waiting for KV (finished ones that hold blocks do not count)."""
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether ``step()`` has anything to do: requests to schedule or a step to apply."""
        return self.scheduler.has_work() or self._in_flight is not None

    def wait_for_device(self) -> None:
        """Block until the step in flight, if any, has run on the device (it stays unapplied)."""
        if self._in_flight is not None:
            self._in_flight.sample.synchronize()

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; returns outputs of the requests that got a token.

        Synchronously those are this step's; with async scheduling, the previous step's, applied
        after this one was launched (the last call, with nothing left to schedule, applies the
        step still in flight).
        """
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._in_flight.needs_host_tokens:
            outputs += self._apply(self._take_in_flight())
        out = self.scheduler.schedule()
        previous = self._take_in_flight()
        if not out.is_empty:
            forward = self._forward(out, previous)
            if previous is not None and forward.waits_for_previous:
                # A grammar's mask needs the token still in flight: apply that step now, while this
                # step's forward runs, and sample after (vLLM defers such a step's sampling alike).
                outputs += self._apply(previous)
                previous = None
            self._in_flight = self._sample(forward)
        elif previous is None:
            self._wait_for_grammars()
        if previous is not None:
            outputs += self._apply(previous)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._apply(self._take_in_flight())
        if envs.PDSERVE_CHECK_INTEGRITY:
            self.scheduler.check_integrity()
        return outputs

    def _take_in_flight(self) -> _LaunchedStep | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _wait_for_grammars(self, timeout: float = 0.005) -> None:
        """Nothing could be scheduled: if a queued request waits for its grammar, give the compile
        thread a moment instead of spinning (``has_work`` stays true while such a request waits)."""
        for request in self.scheduler.waiting:
            if not request.ready_to_schedule:
                request.structured_output.wait(timeout)
                return

    def _forward(self, out: SchedulerOutput, previous: _LaunchedStep | None) -> _Forward:
        """Queue the step's forward; reads nothing back from the device."""
        device_inputs = None
        sources = [previous.rows[s.request.request_id] for s in out.scheduled if s.num_device_inputs]
        if sources:
            device_inputs = DeviceInputs(previous.sample.token_ids, sources)
        listeners = list(self._launch_listeners)
        layer_events: list | None = [] if listeners else None
        prompt_logprobs: list | None = None
        if any(s.request.needs_prompt_logprobs for s in out.scheduled):
            prompt_logprobs = []
        logits = self.runner.execute(out, device_inputs, layer_events, prompt_logprobs)
        for request_id, first, entries in prompt_logprobs or ():
            request = self.scheduler.get_request(request_id)
            if request is not None and len(request.prompt_logprobs) == first:  # not after a preemption
                request.prompt_logprobs += entries
        if listeners:
            chunks = [
                LaunchedChunk(
                    s.request.request_id,
                    s.start,
                    s.num_tokens,
                    s.request.num_prompt_tokens,
                    s.request.num_preemptions,
                    s.block_ids,
                )
                for s in out.scheduled
            ]
            for listener in listeners:
                listener(chunks, layer_events or None)
        for s in out.scheduled:
            prompt_end = min(s.start + s.num_tokens, s.request.num_prompt_tokens)
            self.num_prompt_tokens_computed += max(0, prompt_end - s.start)
        return _Forward(out, logits, [s.request for s in out.scheduled if s.needs_sample])

    def _sample(self, forward: _Forward) -> _LaunchedStep:
        """Mask the logits of rows with a grammar and queue the sampling; reads nothing back.

        Every grammar row's matcher must have seen all of its request's tokens but this step's
        (``_Forward.waits_for_previous`` is false).
        """
        logits = forward.logits
        grammars = [r.structured_output for r in forward.sampling]
        for r, g in zip(forward.sampling, grammars):
            if g is not None and not g.closed:
                # A request that entered the batch without waiting for its grammar (a decode node's
                # landed prompt, whose first token came from the prefill node) waits here: no grammar
                # row is ever sampled unmasked, and a late matcher first catches up with its tokens.
                if not g.ready:
                    g.wait()
                g.advance(r.generated_token_ids)
        if any(g is not None for g in grammars):
            filled = self.structured.fill_bitmask(grammars)
            if filled is not None:
                self.structured.apply_bitmask(logits, *filled)
        rows: list[SamplingRow] = []
        row_of: dict[str, int] = {}
        for r in forward.sampling:
            row_of[r.request_id] = len(rows)
            rows.append(
                SamplingRow(
                    r.sampling_params,
                    r.prompt_token_ids,
                    r.generated_token_ids,
                    self._generator(r),
                    # Placeholders of earlier steps; this step's own one is the token sampled now.
                    num_pending_outputs=max(0, r.num_output_placeholders - 1),
                )
            )
        sample = self.sampler.sample(logits, rows)
        needs_host_tokens = any(row.params.has_penalties for row in rows)
        return _LaunchedStep(forward.out, sample, row_of, needs_host_tokens)

    def _apply(self, step: _LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens on the host (waits for it) and process them."""
        updated = self.scheduler.update_from_output(step.out, step.sample.get())
        return self._outputs(updated)

    def _generator(self, request: Request) -> torch.Generator | None:
        state = self._states.get(request.request_id)
        return state.generator if state else None

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs of requests that got a token: one per request, one per group of sequences."""
        outputs = []
        groups: dict[str, _Group] = {}
        for request in requests:
            text = self._advance(request)
            group = self._group_of.get(request.request_id)
            if group is None:
                outputs.append(self._output(request, text))
            else:
                group.texts[group.sequences.index(request)] = text
                groups[group.request_id] = group
        for group in groups.values():
            outputs.append(self._group_output(group))
        return outputs

    def _advance(self, request: Request) -> str:
        """Detokenize a request's new token and apply its stop strings; its text so far."""
        state = self._states[request.request_id]
        if request.hold_blocks and request.is_finished:
            # A prefill-only request: its output is the first token, the text is the decode node's
            # job; its state (the seeded generator) lives until ``release_held``.
            return ""
        params = request.sampling_params
        grammar = request.structured_output
        if grammar is not None:
            grammar.advance(request.generated_token_ids)
            if grammar.is_terminated and not request.is_finished:
                # The grammar is complete and took its end token (ignore_eos kept it going).
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        detok = state.detokenizer
        if detok is not None:
            before = len(detok.text)
            detok.add(request.output_token_ids[-1:])
            if params.stop and not request.is_finished:
                hit = find_stop_string(detok.text, before, params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    stop, end = hit
                    detok.text = detok.text[:end]
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                    request.stop_reason = stop
        if request.is_finished:
            self._forget(request.request_id)
        return detok.text if detok else ""

    @staticmethod
    def _completion(request: Request, text: str, index: int = 0) -> CompletionOutput:
        logprobs = None
        cumulative = None
        if request.sampling_params.logprobs is not None:
            logprobs = list(request.output_logprobs)
            cumulative = sum(lp.logprob for lp in logprobs if lp is not None)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    @classmethod
    def _output(cls, request: Request, text: str) -> RequestOutput:
        return cls._request_output(request, [cls._completion(request, text)], request.is_finished)

    @staticmethod
    def _request_output(first: Request, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None and not first.needs_prompt_logprobs:
            prompt_logprobs = first.prompt_logprobs  # complete: never changes again, so not copied
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
        )

    def _group_output(self, group: _Group) -> RequestOutput:
        """Every sequence of the group, by index; a finished group leaves the engine's books. The
        sequences are all there even when ``best_of`` asks for fewer: the caller ranks them."""
        outputs = [self._completion(r, t, j) for j, (r, t) in enumerate(zip(group.sequences, group.texts))]
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for r in group.sequences:
                self._group_of.pop(r.request_id, None)
        return self._request_output(group.sequences[0], outputs, finished)


def find_stop_string(
    text: str, new_from: int, stops: tuple[str, ...], include: bool
) -> tuple[str, int] | None:
    """The first stop string that text[new_from:] completes, and where to cut the text.

    Only matches that end in the new part count; earlier text was already checked.
    """
    best: tuple[str, int] | None = None
    best_pos = len(text) + 1
    for stop in stops:
        pos = text.find(stop, max(0, new_from - len(stop) + 1))
        if pos != -1 and pos < best_pos:
            best_pos = pos
            best = (stop, pos + len(stop) if include else pos)
    return best
