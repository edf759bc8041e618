"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, shaped like vLLM's ``StructuredOutputsParams``: exactly one of
    ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (EBNF, as xgrammar reads it).

    Torch-free and checked for shape only: whether a schema, regex or grammar compiles is for the
    engine to say (``ValueError`` from ``LLMEngine.add_request``, a 400 through the API). ``json``
    may be given as a dict; it is kept as JSON text (properties in the order given: the output
    follows it), the key of the engine's grammar cache. ``disable_any_whitespace`` makes JSON
    output compact.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice and grammar, "
                f"got {len(kinds)}" + (f" ({', '.join(kinds)})" if kinds else "")
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p`` of 1
    and ``min_p`` of 0 disable those filters. Penalties follow vLLM: ``repetition_penalty``
    (HF/CTRL style, over prompt and output tokens), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI style, over output tokens). ``logprobs`` asks for the
    sampled token's log-probability plus that many top alternatives, taken from the raw
    model distribution.

    Parallel sampling as in vLLM: ``n`` sequences from one prompt, or ``best_of`` of them of
    which the ``n`` with the highest cumulative logprob are returned. The prompt is computed
    once and its KV shared (``for_sequence`` gives each sequence's own parameters: sequence j
    of a seeded request draws from ``seed + j``). ``logit_bias`` adds to the logits of the
    token ids it names before sampling (OpenAI's range, [-100, 100]); ``prompt_logprobs``
    asks for the logprob of every prompt token after the first, plus that many top
    alternatives (such a prompt takes no prefix-cache hits: every position's logits count).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a token bitmask each step)."""
    resumed_tokens: int = 0
    """The last this many prompt tokens are output the request already produced elsewhere: the
    proxy resumes a request whose node died as prompt + tokens streamed so far. The grammar and the
    frequency and presence penalties take them as output, so the rest continues as if unmoved.
    Set by the proxy, not an API field."""

    def __post_init__(self) -> None:
        # Accept a single string / any iterable for the tuple fields, as vLLM does.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias or None)
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n ({self.n}), got {self.best_of}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.resumed_tokens < 0:
            raise ValueError(f"resumed_tokens must be >= 0, got {self.resumed_tokens}")

    @property
    def num_sequences(self) -> int:
        """Sequences generated from the prompt: ``best_of`` when set, else ``n``."""
        return self.best_of or self.n

    @property
    def ranks_sequences(self) -> bool:
        """More sequences are generated than returned: they are ranked by cumulative logprob."""
        return self.num_sequences > self.n

    def for_sequence(self, index: int) -> SamplingParams:
        """The parameters of sequence ``index`` of a parallel request: one sequence, seeded
        ``seed + index``; its sampled tokens' logprobs are kept when sequences are ranked; only
        sequence 0 computes the prompt, so only it asks for prompt logprobs."""
        if self.num_sequences == 1:
            return self
        logprobs = self.logprobs
        if logprobs is None and self.ranks_sequences:
            logprobs = 0
        return dataclasses.replace(
            self,
            n=1,
            best_of=None,
            seed=None if self.seed is None else (self.seed + index) % (1 << 64),
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
