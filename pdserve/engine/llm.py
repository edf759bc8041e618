"""Offline inference API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from pdserve.config import DEFAULT_MODEL, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.logprobs import best_sequences
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import apply_chat_template

PromptType = str | dict[str, Any]
"""A text prompt, or ``{"prompt_token_ids": [...]}`` (optionally with ``"prompt"``)."""


class LLM:
    """Generate from a batch of prompts with continuous batching, prefix caching and chunked prefill.

    ``LLM(model="default").generate(["Hello"], SamplingParams(max_tokens=32))``. Keyword
    arguments are the fields of the config dataclasses in ``pdserve.config`` (``dtype``,
    ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``max_model_len``, ``num_kv_blocks``, ``seed``, ``device``, ``num_threads``, ...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def model_path(self) -> str | None:
        folder = self.engine.source.weights_dir
        return str(folder) if folder else None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        With ``n`` > 1 each ``RequestOutput`` holds ``n`` completions (index 0..n-1), computed from
        one prefill of the prompt; with ``best_of`` the ``n`` of highest cumulative logprob among
        ``best_of``, best first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")

        ids = []
        params_of: dict[str, SamplingParams] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = self.engine.new_request_id()
                params_of[request_id] = params
                if isinstance(prompt, str):
                    self.engine.add_request(request_id, prompt, params)
                else:
                    self.engine.add_request(
                        request_id, prompt.get("prompt"), params, prompt_token_ids=prompt["prompt_token_ids"]
                    )
                ids.append(request_id)
            return self._run(ids, params_of, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = apply_chat_template(tokenizer, conversation, add_generation_prompt)
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, ids: list[str], params_of: dict[str, SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids)) if use_tqdm else None
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    finished[output.request_id] = _keep_best(output, params_of[output.request_id])
                    if progress:
                        progress.update()
        if progress:
            progress.close()
        return [finished[i] for i in ids]


def _keep_best(output: RequestOutput, params: SamplingParams) -> RequestOutput:
    """``best_of``: the ``n`` completions of highest cumulative logprob, best first, indexed 0..n-1."""
    if not params.ranks_sequences:
        return output
    cumulative = [c.cumulative_logprob or 0.0 for c in output.outputs]
    best = [output.outputs[i] for i in best_sequences(cumulative, params.n)]
    for index, completion in enumerate(best):
        completion.index = index
        if params.logprobs is None:  # kept only to rank the sequences
            completion.logprobs = None
    output.outputs = best
    return output


class _Progress:
    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="generate", file=sys.stderr)
        except ImportError:
            self._bar = None

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
