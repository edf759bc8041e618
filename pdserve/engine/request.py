"""A request inside an engine and its status machine.

Token accounting follows vLLM v1: there are no separate prefill and decode phases.
A request holds ``num_tokens`` tokens (prompt + output so far) of which
``num_computed_tokens`` already have KV in the cache; each step the scheduler
gives it some of the rest. When ``num_computed_tokens`` catches up with
``num_tokens`` the step's logits sample the next token. A fresh request needs its
whole prompt; a running one needs one token per step; a preempted one starts
again from zero (prefix caching usually hands most of it back).

With async scheduling the scheduler plans step N+1 before step N's sampled tokens reach the
host. Tokens of steps scheduled but not yet applied are ``num_inflight_tokens`` (their KV is
being written; the next step starts at ``num_started_tokens``), and each of those steps that
samples adds an output placeholder: a token that exists on the device only. The next step
computes the placeholder's KV with the id taken from the device, so a running request needs
one token per step whether or not its last token has reached the host.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.logprobs import TokenLogprobs
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PREEMPTED`` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Finished states: keep them after PREEMPTED.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling; -1 until then."""
    expected_cached_tokens: int = -1
    """While queued: the cached prefix its admission is expected to find (a routing estimate)."""
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's full blocks, extended as tokens arrive (see hashing.py)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the request, if any."""
    hold_blocks: bool = False
    """Keep the blocks after a normal finish until ``Scheduler.release_held`` (KV still to be sent)."""
    num_inflight_tokens: int = 0
    """Tokens of scheduled steps whose output is not applied yet (async scheduling; else 0 between steps)."""
    num_output_placeholders: int = 0
    """Tokens those steps sample: on the device, not yet in ``output_token_ids``."""
    structured_output: StructuredOutputRequest | None = None
    """The grammar its output must follow (``SamplingParams.structured_outputs``), if any."""
    pending_forks: list[Request] = field(default_factory=list)
    """Parallel sampling: the other sequences of this request, which the scheduler forks from it
    once its first token is applied (``Scheduler._fork``); empty after that."""
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    """With ``sampling_params.prompt_logprobs``: one entry per prompt token computed so far (the
    first token has none)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        assert self.num_computed_tokens <= self.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_started_tokens(self) -> int:
        """Tokens whose KV is computed or being computed: where the next step starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    def length_capped_ahead(self, max_model_len: int) -> bool:
        """Whether the tokens in flight will end the request by length: nothing more to schedule.

        ``max_tokens`` and ``max_model_len`` are known before the tokens are; stop tokens and
        stop strings are not, so a request they end computes one token more, which is dropped.
        """
        if not self.num_output_placeholders:
            return False
        max_tokens = self.sampling_params.max_tokens
        num_outputs = self.num_output_tokens + self.num_output_placeholders
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            self.num_tokens_with_placeholders >= max_model_len
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and some are still missing: every prompt position must be
        computed, so the prefix cache may not skip any."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def generated_token_ids(self) -> list[int]:
        """The output as the grammar and the output penalties see it: a resumed request's output
        from before it moved (the prompt's last ``resumed_tokens``), then this node's."""
        k = min(self.sampling_params.resumed_tokens, len(self.prompt_token_ids))
        if not k:
            return self.output_token_ids
        return self.prompt_token_ids[-k:] + self.output_token_ids

    @property
    def ready_to_schedule(self) -> bool:
        """False while its grammar is still compiling (vLLM's ``WAITING_FOR_FSM``)."""
        return self.structured_output is None or self.structured_output.ready

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest output token implies, or None to keep going.

        Stop strings need detokenized text and are checked by the output processor.
        """
        params = self.sampling_params
        if self.num_output_tokens == 0:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
