"""What the engine hands out: request outputs (shaped like vLLM's ``RequestOutput``), its load, and
the chunks of a launched step. Plain values, no live engine objects: what could cross a process
boundary between the engine core and a node's I/O side as a message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    """`stop`, `length`, `abort`, `error` or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the output; None for EOS or length."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's queues and block pool (``LLMEngine.load``)."""

    num_running: int
    """Requests in the running batch."""
    num_waiting: int
    """Requests queued to be scheduled (new or preempted)."""
    num_waiting_for_kv: int
    """Requests whose blocks are reserved for KV another node computes."""
    num_held: int
    """Finished requests whose blocks are kept until their KV was sent elsewhere."""
    num_free_blocks: int
    """KV blocks free or holding evictable prefix cache."""
    num_blocks: int
    """KV blocks of the pool."""
    num_pending_prompt_tokens: int
    """Prompt tokens queued or running that are not computed yet (``num_pending_prompt_tokens``)."""
    num_prompt_tokens_computed: int
    """Prompt tokens run through the model since the engine started (cache hits excluded)."""
    num_prefix_hit_tokens: int
    """Prompt tokens found in the prefix cache when requests were admitted, since the start."""
    num_jit_compiles: int = 0
    """Triton kernels compiled in the engine's process since it started (0 on the CPU): flat once
    the start-up warm-up is over (``pdserve.kernels.triton_utils``)."""


@dataclass(frozen=True)
class LaunchedChunk:
    """One request's share of a step whose forward was just launched: tokens
    ``[start, start + num_tokens)`` of its sequence, written into ``block_ids`` (all its blocks)."""

    request_id: str
    start: int
    num_tokens: int
    num_prompt_tokens: int
    num_preemptions: int
    """Times the request was preempted so far: blocks of an earlier run may have been reused."""
    block_ids: tuple[int, ...]


LaunchListener = Callable[[list[LaunchedChunk], "list | None"], None]
"""Called by ``LLMEngine`` right after a step's forward was launched: ``(chunks, layer_events)``."""
