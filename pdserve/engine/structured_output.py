"""Structured output: grammars compiled by xgrammar, one matcher per request, a token bitmask per step.

As in vLLM V1 (``vllm/v1/structured_output``):

1. ``StructuredOutputManager.validate`` parses the constraint without the vocabulary (a fraction
   of a millisecond): a schema, regex or grammar that cannot work is a ``ValueError`` when the
   request is added, which the nodes answer with a 400.
2. ``StructuredOutputManager.request`` starts compiling the grammar against the vocabulary on a
   thread of its own, off the engine's step; the compiler keeps every compiled grammar, so a
   schema seen before costs a cache look-up. The scheduler admits the request only once its
   grammar is ``ready`` (vLLM's ``WAITING_FOR_FSM``); other requests go ahead meanwhile.
3. Each step, after the forward was launched (outside any CUDA graph), ``fill_bitmask`` asks the
   matcher of every sampling row that has one for the tokens allowed next (one bit per token,
   ``int32 [rows, ceil(V / 32)]``) and ``apply_bitmask`` sets the others' logits to -inf; the
   sampler then sees only allowed tokens, greedy or not. Raw logprobs are taken after the mask,
   as vLLM's are.
4. Every token the request gets is fed to its matcher (``StructuredOutputRequest.advance``); a
   matcher created after some output exists (a decode node whose first token came from the
   prefill node) catches up with all of it first. When the grammar is complete the mask allows
   only the end-of-sequence tokens, so the request stops as any other does at EOS
   (``finish_reason`` "stop"); a matcher that ends otherwise (``ignore_eos``) stops it too.

With async scheduling the mask of step N+1 needs step N's token, which the host does not have
when step N+1 is launched: the engine launches step N+1's forward, applies step N (which
advances the matchers) and only then fills the mask and samples step N+1, as vLLM defers the
sampling of a step whose structured-output requests have tokens in flight.

xgrammar imports torch and transformers, so it is imported on first use and stays off the
proxy; the proxy checks a request's shape, the engine whether its grammar compiles.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.copies import to_device
from pdserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

MAX_WHITESPACE = 24
"""Whitespace characters allowed between two JSON tokens of a schema's output: room for any
indentation people use, not for a small model's runs of blank lines until ``max_tokens`` (seen at
temperature 0.8 on the default model), which would leave the JSON unfinished."""

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured output needs xgrammar, which this install lacks: pip install 'pdserve[structured]'"
        ) from None
    return xgrammar


def _message(exc: Exception) -> str:
    """xgrammar's error without its C++ source location."""
    return _XGR_PREFIX.sub("", str(exc).strip())


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are valid EBNF)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    """The constraint as an xgrammar ``Grammar`` (no vocabulary needed); ValueError if it is malformed."""
    xgr = _xgr()
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                spec.json,
                any_whitespace=not spec.disable_any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE if not spec.disable_any_whitespace else None,
            )
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid structured output {kind}: {_message(exc)}") from None


class StructuredOutputRequest:
    """One request's grammar: compiled in the background, then a matcher fed with every output token.

    ``advance`` accepts the output tokens the matcher has not seen (all of them once the grammar is
    ready, if it was not when they came); ``close`` drops the matcher when the request ends.
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher: Any = None
        self.num_accepted = 0
        """Output tokens fed to the matcher so far."""
        self.rejected = False
        """A token the grammar does not allow was fed (only possible where the mask was not applied)."""
        self.closed = False

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (the request may be scheduled)."""
        return self._compiled.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the grammar is compiled or ``timeout`` passed."""
        futures.wait([self._compiled], timeout)

    @property
    def matcher(self):
        """The request's ``xgrammar.GrammarMatcher``; None while the grammar compiles and after ``close``."""
        if self._matcher is None and self.ready and not self.closed:
            self._matcher = _xgr().GrammarMatcher(self._compiled.result())
        return self._matcher

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Feed the matcher the output tokens it has not seen (none while the grammar compiles)."""
        matcher = self.matcher
        if matcher is None:
            return
        for token_id in output_token_ids[self.num_accepted :]:
            if not matcher.is_terminated() and not matcher.accept_token(token_id):
                self.rejected = True
                logger.warning("the grammar rejected token %d after %d accepted", token_id, self.num_accepted)
            self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted: nothing more may follow."""
        matcher = self.matcher
        return matcher is not None and matcher.is_terminated()

    def close(self) -> None:
        self.closed = True
        self._matcher = None


class StructuredOutputManager:
    """Compiles grammars for one engine's vocabulary and turns its requests' matchers into masks.

    The tokenizer's vocabulary (and the compiler over it) is read the first time a request asks for
    a grammar, so engines that never see one never load xgrammar.
    """

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, used on the compile thread

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError when the constraint cannot be compiled (malformed schema, regex, grammar)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        parse(spec)

    def request(self, spec: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start compiling the grammar of a validated constraint; returns at once (but for the first
        call, which reads the vocabulary: about 0.1 s for 49k tokens, here rather than on the compile
        thread because HF tokenizers are not safe to share between threads)."""
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-grammar")
        return StructuredOutputRequest(self._executor.submit(self._compile, spec))

    def _compile(self, spec: StructuredOutputsParams):
        # The compiler caches by the grammar's text: a repeated constraint is a look-up.
        return self._compiler.compile_grammar(parse(spec))

    def fill_bitmask(
        self, grammars: Sequence[StructuredOutputRequest | None]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask of a step's sampling rows, ``int32 [N, ceil(V / 32)]`` on the host
        (all ones where a row has no matcher), and the rows that have one; None when no row has."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.matcher is not None]
        if not rows:
            return None
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)  # all allowed
        if self.device.type == "cuda":
            bitmask = bitmask.pin_memory()
        for i in rows:
            matcher = grammars[i].matcher
            if not matcher.is_terminated():  # a finished grammar's row is dropped; leave it unmasked
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, rows

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of disallowed tokens in ``rows`` to -inf, in place. logits [N, V] float32.

        On CUDA the bitmask and the row list go up from pinned memory without a sync (xgrammar
        would copy a Python list from pageable memory, which waits for the forward)."""
        device = logits.device
        if device.type == "cpu":
            apply_token_bitmask(logits, bitmask, rows)
        else:
            index = to_device(rows, torch.int32, device)
            apply_token_bitmask(logits, bitmask.to(device, non_blocking=True), index)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
    """logits[i, t] = -inf for every row i in ``rows`` and token t whose bit is 0 in bitmask[i].

    Bit t % 32 of bitmask[i, t // 32] allows token t; tokens past the bitmask's width (a padded
    vocabulary) are not touched. xgrammar's kernel: C++ on the CPU (about 0.12 ms per 49k-token
    row here), CUDA or Triton on the GPU.
    """
    _xgr().apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size], True where allowed: the plain-torch meaning of a bitmask (for tests)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


__all__ = [
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "apply_token_bitmask",
    "choice_grammar",
    "parse",
    "unpack_bitmask",
]
