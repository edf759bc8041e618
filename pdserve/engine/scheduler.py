"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each ``schedule()`` call fills one engine step:

1. Running requests first, oldest first. Each gets what it still needs (one token when
   decoding, the rest of its prompt when a prefill was chunked), capped by the budget.
   When the pool cannot hold a request's new tokens, the newest running request is
   preempted — its blocks are freed and it goes back to the front of the queue to be
   recomputed later — until the request fits or was itself the one preempted.
2. Then waiting requests, in arrival order, while budget, ``max_num_seqs`` and blocks
   last. A request first takes back its longest cached prefix, then allocates for the
   rest; with chunked prefill a prompt longer than the remaining budget takes what is left.

``update_from_output`` advances ``num_computed_tokens``, appends sampled tokens of
requests whose computed tokens caught up, and finishes those that stop.

Parallel sampling (``n``/``best_of`` > 1): the first sequence computes the prompt; when its first
token is applied (here, or when remote KV lands) the other sequences fork from it (``_fork``):
each shares the blocks of the prompt's first ``P - 1`` tokens by reference count, gets a copy of
the partial block among them, and computes the last prompt token itself in its next step, whose
logits sample its own first token. So the prompt runs once, no sequence ever writes a shared
block, and the copies (``SchedulerOutput.block_copies``) run on the device before the step that
follows, after every step that wrote their sources.

Async scheduling: the engine may call ``schedule()`` for step N+1 before
``update_from_output`` of step N (never more than one step ahead). ``schedule()`` therefore
counts a step's tokens as in flight (``Request.num_inflight_tokens``) and each token it will
sample as an output placeholder; the next step starts after them and feeds the placeholder
from the device (``ScheduledRequest.num_device_inputs``). A request whose placeholders will
end it by length is not scheduled again; one that a stop token or stop string ends gets one
step too many, whose token ``update_from_output`` drops. With the engine's synchronous path
nothing is in flight when ``schedule()`` runs and all of this is zero.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SamplerOutput
from pdserve.logprobs import TokenLogprobs
from pdserve.utils import cdiv


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_tokens)`` of its sequence."""

    request: Request
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    needs_sample: bool
    """The step reaches the end of the request's tokens, so its last row samples the next token."""
    num_device_inputs: int = 0
    """Trailing tokens of the step that are output placeholders, sampled by the step in flight:
    the model runner takes their ids from that step's sampled tokens on the device."""

    @property
    def token_ids(self) -> list[int]:
        """The step's input ids that are on the host: all but the last ``num_device_inputs``."""
        # Slice prompt and output separately: all_token_ids would copy the whole sequence.
        r, end = self.request, self.start + self.num_tokens - self.num_device_inputs
        p = r.num_prompt_tokens
        if self.start >= p:
            return r.output_token_ids[self.start - p : end - p]
        return r.prompt_token_ids[self.start : end] + r.output_token_ids[: max(0, end - p)]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV blocks to copy before the step's forward: partial prompt blocks of forks."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        namespace: str = "",
        record_events: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, namespace, record_events
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Blocks reserved for KV that another node computes (WAITING_FOR_REMOTE_KV).
        self.remote: dict[str, Request] = {}
        # Blocks of finished requests kept until their KV has been sent elsewhere.
        self.held: dict[str, Request] = {}
        # Held requests whose blocks are being read from outside (a send in flight) -> whether a
        # release came meanwhile: their blocks are freed by ``unpin_held``, not before.
        self.pinned: dict[str, bool] = {}
        # Block copies of forked sequences, made before the next launched step.
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        # Prefix-cache statistics, counted when a request is admitted.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- admission -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.validate(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def validate(self, request: Request) -> None:
        """Raise ValueError for a request this scheduler can never take (duplicate id, too long)."""
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt is {request.num_prompt_tokens} tokens, "
                f"longer than max_model_len {self.max_model_len}"
            )
        # The prompt plus the first sampled token, but a request never holds KV past max_model_len.
        num_tokens = min(request.num_prompt_tokens + 1, self.max_model_len)
        if cdiv(num_tokens, self.block_size) > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs more KV blocks than the cache holds "
                f"({self.kv.pool.num_blocks} x {self.block_size} tokens)"
            )

    # -- KV computed elsewhere (decode side of disaggregation) ---------------------------------

    def reserve_remote(self, request: Request) -> list[int] | None:
        """Reserve blocks for the prompt, whose KV another node will write; None if short.

        The longest prefix this node has cached is shared, as a local prompt would share it:
        the first ``request.num_computed_tokens // block_size`` returned blocks hold valid KV
        already and must not be written (other requests may be reading them); only the rest
        wait for the remote KV. Those stay out of the prefix cache until ``remote_kv_landed``:
        until then their contents are not valid and no other request may share them.
        """
        self.validate(request)
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        # Room for the forked sequences' copies of the partial block too (parallel sampling).
        num_forks = len(request.pending_forks)
        num_prompt_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        if num_forks and self.kv.num_free_blocks < num_prompt_blocks + num_forks:
            return None
        if (
            self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit_tokens, hits, cache=False)
            is None
        ):
            return None
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return self.kv.get_block_ids(request.request_id)

    def remote_kv_landed(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None, num_cached_tokens: int
    ) -> Request | None:
        """The prompt's KV has fully arrived with its first token; the request joins the queue.

        Returns the request (finished already if the first token stops it), or None when it
        is no longer reserved (aborted or expired meanwhile).
        """
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.append_output_token(first_token, logprobs)
        self._fork(request)
        status = request.check_stop(self.max_model_len)
        if status is not None:
            request.status = status
            self._free(request)
        else:
            # It holds its blocks already: serve it before new prompts.
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        return request

    # -- KV sent elsewhere (prefill side of disaggregation) ------------------------------------

    def release_held(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_blocks`` request kept for sending its KV; a pinned
        request's are freed when it is unpinned. Unknown ids are ignored."""
        if request_id in self.pinned:
            self.pinned[request_id] = True
            return
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def pin_held(self, request_id: str) -> None:
        """Keep a held request's blocks through ``release_held`` (an abort) until ``unpin_held``."""
        if request_id not in self.held:
            raise KeyError(f"request {request_id!r} holds no blocks")
        self.pinned.setdefault(request_id, False)

    def unpin_held(self, request_id: str) -> None:
        """End a pin; blocks whose release came while pinned are freed now."""
        if self.pinned.pop(request_id, False):
            self.release_held(request_id)

    def get_request(self, request_id: str) -> Request | None:
        """A request queued, running, waiting for KV or holding blocks; None if unknown."""
        request = self.requests.get(request_id)
        return request if request is not None else self.held.get(request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string, error); frees their blocks. Unknown ids are ignored."""
        assert status.finished
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.remote[request_id]
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether ``schedule()`` could do anything (requests waiting for remote KV cannot run)."""
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.block_copies, self.pending_copies = self.pending_copies, []
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and (
                request.length_capped_ahead(self.max_model_len) or request.hold_blocks
            ):
                # Its token in flight ends it by length; or it keeps its blocks for a send once
                # finished, so no step may write them after the one that finishes it.
                i += 1
                continue
            num_new = min(request.num_tokens_with_placeholders - request.num_started_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work while running requests are being preempted would only thrash.
        compiling: list[Request] = []  # skipped while their grammars compile; they keep their place
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if not request.ready_to_schedule:
                compiling.append(self.waiting.popleft())
                continue
            # A request preempted with a token in flight is only queued again after that token
            # arrived: admission is skipped in any step that preempts.
            assert not request.num_inflight_tokens and not request.num_output_placeholders
            if request.num_computed_tokens:
                # Its prompt's KV was written by another node: it holds those blocks already.
                hits, num_hit_tokens = [], request.num_computed_tokens
            else:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += num_hit_tokens
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        if not out.scheduled:  # no step is launched: the copies wait for one (nothing writes meanwhile)
            self.pending_copies, out.block_copies = out.block_copies, []
        return out

    def _fork(self, parent: Request) -> None:
        """Start the sequences forked from ``parent`` once its first token is in (see the module
        docstring); they go to the front of the queue, holding their blocks, in order. One that
        cannot share (the parent was preempted, or no block is free for its copy) holds nothing
        and computes its prompt later, like a preempted request."""
        if not parent.pending_forks:
            return
        children, parent.pending_forks = parent.pending_forks, []
        num_shared = parent.num_prompt_tokens - 1
        for child in children:
            copies = self.kv.fork(parent, child, num_shared)
            if copies is not None:
                child.num_computed_tokens = num_shared
                child.num_cached_tokens = max(parent.num_cached_tokens, 0)
                self.pending_copies += copies
            child.status = RequestStatus.WAITING
            self.requests[child.request_id] = child
        self.waiting.extendleft(reversed(children))

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """The request's share of the step; its tokens count as in flight from now on."""
        block_ids = tuple(self.kv.get_block_ids(request.request_id))
        start = request.num_started_tokens
        end = start + num_new
        needs_sample = end == request.num_tokens_with_placeholders
        num_device_inputs = max(0, end - request.num_tokens)
        assert num_device_inputs <= 1, "at most one step is in flight"
        request.num_inflight_tokens += num_new
        request.num_output_placeholders += needs_sample
        return ScheduledRequest(request, start, num_new, block_ids, needs_sample, num_device_inputs)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0  # a token in flight still arrives: its placeholder stays
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[Request]:
        """Apply a step's results; returns requests that got a new token (finished ones included).

        ``sampled`` holds one token per scheduled request with ``needs_sample``, in order.
        """
        num_samples = sum(1 for s in out.scheduled if s.needs_sample)
        if len(sampled.token_ids) != num_samples or len(sampled.logprobs) != num_samples:
            raise ValueError(f"{len(sampled.token_ids)} sampled tokens for {num_samples} sampling requests")
        tokens = iter(zip(sampled.token_ids, sampled.logprobs))
        updated = []
        for s in out.scheduled:
            request = s.request
            token_id, logprobs = next(tokens) if s.needs_sample else (None, None)
            if request.is_finished:
                continue  # aborted or stopped while the step ran: its token is dropped
            if request.status == RequestStatus.RUNNING:
                assert request.num_inflight_tokens >= s.num_tokens
                request.num_computed_tokens += s.num_tokens
                request.num_inflight_tokens -= s.num_tokens
            # Otherwise it was preempted after this step was scheduled (async scheduling): its KV
            # is gone and will be recomputed, but the token it sampled is valid and kept.
            if token_id is None:
                continue
            request.num_output_placeholders -= 1
            request.append_output_token(token_id, logprobs)
            self._fork(request)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                request.status = status
                self._free(request)
            updated.append(request)
        return updated

    def _free(self, request: Request) -> None:
        del self.requests[request.request_id]
        if request.hold_blocks and request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            self.held[request.request_id] = request
        else:
            self.kv.free(request)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        queued = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert queued | set(self.remote) == set(self.requests), "a known request is in no queue"
        assert set(self.pinned) <= set(self.held), "a pinned request holds no blocks"
        owners = queued | set(self.remote) | set(self.held)
        assert set(self.kv.req_to_blocks) <= owners, "blocks held by a request the scheduler forgot"
        if not self.requests and not self.held:
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "idle pool is not all free"
