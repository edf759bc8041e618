"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def apply_chat_template(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """The chat as the model's template writes it; ``tools`` (OpenAI tool objects) go to the template,
    which renders them if it knows how."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, never emitting half a character.

    Decodes a short window of ids before the new ones (``prefix_offset``) so tokenizers
    that drop a leading space at the start of a decode still produce the right delta,
    and holds back text that ends in U+FFFD until the rest of the UTF-8 sequence arrives.

    A fast tokenizer that cleans up no spaces is decoded by its Rust backend directly: the same
    text as ``tokenizer.decode`` (which calls it), without the wrapper's per-call conversions,
    which took three quarters of the time of a decode and a third of an engine step's host time
    at batch 128 (profiled on the simulated engine).
    """

    _WINDOW = 5

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-self._WINDOW :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._backend_decode = backend.decode
        else:
            self._backend_decode = None

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; returns the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
