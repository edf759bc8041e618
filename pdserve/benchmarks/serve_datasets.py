"""Workloads of `pdserve bench serve`: conversations of one or more user turns.

Every dataset yields ``Conversation``s. A single-turn request is a conversation of one
turn; in a multi-turn conversation each later turn is sent after the previous answer
arrived, with the earlier turns and their answers in front of it.

* ``random``: ``--num-prompts`` prompts of ``--input-len`` tokens (uniform within
  ``--range-ratio`` around it) asking for ``--output-len`` tokens (same spread). With
  ``--tokenizer`` a prompt is random token ids of that tokenizer, decoded (and re-encoded
  and cut so that it holds the drawn number of tokens); without one it is random common
  English words, about one token each in BPE vocabularies.
* ``shared-prefix``: ``--prefix-groups`` system prompts of ``--prefix-len`` tokens, each with
  ``--prompts-per-group`` distinct questions of ``--input-len`` tokens, shuffled with
  ``--seed`` so that groups arrive interleaved.
* ``multi-turn``: ``--num-prompts`` conversations of ``--num-turns`` user turns, each turn
  drawn like a ``random`` prompt.
* ``jsonl``: one JSON object per line of ``--dataset-path``, with one of
    - ``"prompt": "..."``: one request (the user message; the raw prompt on /v1/completions);
    - ``"prompt": [token ids]``: one raw /v1/completions request (models without a tokenizer,
      e.g. random weights; add ``--extra-body '{"logprobs": 0}'`` so every step sends a chunk);
    - ``"messages": [{"role": ..., "content": ...}, ...]``: one request with this history,
      ending with a user message;
    - ``"turns": ["...", "..."]`` and optionally ``"system": "..."``: a multi-turn
      conversation, one user turn per string; or ``"turns": [[ids], [ids]]`` and ``"system":
      [ids]``, a token-id conversation on /v1/completions whose history carries each answer's
      token ids (read from ``"logprobs": 0`` chunks as ``token_id:N``);
  and optionally ``"output_len"`` (or ``"max_tokens"``): an int, or for ``turns`` a list of
  ints (one per turn); ``--output-len`` otherwise. Blank lines are skipped.

``--num-prompts`` cuts a dataset (or repeats it, for jsonl) to that many conversations; the
runs of a rate sweep take consecutive slices of a jsonl file (``DatasetConfig.run_index``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl")

# Common English words that BPE vocabularies (GPT-2, Llama, SmolLM2) hold as single tokens.
_WORD_TEXT = """
the of and to in is was for that on as with by he at from his an were are which this be or has had
not but first one their its new after who they have her she two been other when there all during
into school time may years more most only over city some world would where later up such used many
can state about national out known university united then made also part team three film high well
people year between under second both group game through series called house life while could south
north day work music war four five place early being back club party since same river area water
name land small great long light hand end line old number air field power sound word point way
market page king story book paper night color model order money table stone road plan wind fire tree
bird green blue red
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))


@dataclass(frozen=True)
class Message:
    role: str
    content: str | tuple[int, ...]
    """Text, or token ids (a raw /v1/completions prompt for models without a tokenizer)."""


@dataclass(frozen=True)
class Turn:
    """One user message and the number of tokens to ask for in reply."""

    content: str | tuple[int, ...]
    output_len: int

    def __post_init__(self) -> None:
        assert self.output_len >= 1, "a turn asks for at least one token"


@dataclass(frozen=True)
class Conversation:
    """History sent before the first turn (system prompt, earlier exchanges), then user turns."""

    turns: tuple[Turn, ...]
    preamble: tuple[Message, ...] = ()

    def __post_init__(self) -> None:
        assert self.turns, "a conversation has at least one turn"


@dataclass(frozen=True)
class DatasetConfig:
    """What the --dataset flags ask for; lengths are tokens (or words without a tokenizer)."""

    name: str = "random"
    num_prompts: int | None = None
    """None: the dataset's own size (100 for the synthetic random and multi-turn sets)."""
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_groups: int = 4
    prompts_per_group: int = 8
    prefix_len: int = 256
    num_turns: int = 3
    path: str = ""
    seed: int = 0
    run_index: int = 0
    """Which run of a rate sweep this is: a jsonl file gives run i its lines from
    i * num_prompts on (wrapping), so that no run finds an earlier run's prompts cached."""

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if min(self.input_len, self.output_len, self.prefix_groups, self.prompts_per_group) < 1:
            raise ValueError("lengths and counts must be at least 1")
        if self.num_turns < 1:
            raise ValueError("--num-turns must be at least 1")
        if self.name == "jsonl" and not self.path:
            raise ValueError("--dataset jsonl needs --dataset-path")


class TextSource:
    """Random text of a given number of tokens: tokenizer ids decoded, or words."""

    def __init__(self, rng: random.Random, tokenizer=None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.ids = [i for i in range(len(tokenizer)) if i not in special]

    def text(self, num_tokens: int) -> str:
        if self.tokenizer is None:
            return " ".join(self.rng.choice(WORDS) for _ in range(num_tokens))
        ids = [self.rng.choice(self.ids) for _ in range(num_tokens)]
        # Decoding and re-encoding may merge or split tokens: cut (or pad) to the drawn count.
        ids = self.tokenizer.encode(self.tokenizer.decode(ids), add_special_tokens=False)[:num_tokens]
        while len(ids) < num_tokens:
            ids.append(self.rng.choice(self.ids))
        return self.tokenizer.decode(ids)


def _spread(rng: random.Random, mean: int, ratio: float) -> int:
    """A length uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's range ratio)."""
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random(cfg: DatasetConfig, src: TextSource, rng: random.Random, num_turns: int) -> list[Conversation]:
    out = []
    for _ in range(cfg.num_prompts or 100):
        turns = tuple(
            Turn(
                src.text(_spread(rng, cfg.input_len, cfg.range_ratio)),
                _spread(rng, cfg.output_len, cfg.range_ratio),
            )
            for _ in range(num_turns)
        )
        out.append(Conversation(turns))
    return out


def _shared_prefix(cfg: DatasetConfig, src: TextSource, rng: random.Random) -> list[Conversation]:
    out = []
    for _ in range(cfg.prefix_groups):
        system = Message("system", src.text(cfg.prefix_len))
        for _ in range(cfg.prompts_per_group):
            out.append(Conversation((Turn(src.text(cfg.input_len), cfg.output_len),), (system,)))
    rng.shuffle(out)
    return out[: cfg.num_prompts] if cfg.num_prompts else out


def _output_lens(line: dict, default: int, n: int, where: str) -> list[int]:
    value = line.get("output_len", line.get("max_tokens", default))
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"{where}: output_len must be a positive int (or one per turn), got {value!r}")
    return values


def _token_ids(value: object, where: str) -> tuple[int, ...]:
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise ValueError(f"{where}: token-id turns and system prompts must be non-empty lists of ints >= 0")
    return tuple(value)


def parse_jsonl_line(line: dict, default_output_len: int, where: str = "jsonl") -> Conversation:
    """One line of a jsonl dataset (fields in the module docstring) as a conversation."""
    if not isinstance(line, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt = line.get("prompt")
    if isinstance(prompt, str):
        (n,) = _output_lens(line, default_output_len, 1, where)
        return Conversation((Turn(prompt, n),))
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError(f"{where}: a token-id prompt must be a non-empty list of ints >= 0")
        (n,) = _output_lens(line, default_output_len, 1, where)
        return Conversation((Turn(tuple(prompt), n),))
    if isinstance(line.get("messages"), list):
        msgs = [Message(str(m["role"]), str(m.get("content") or "")) for m in line["messages"]]
        if not msgs or msgs[-1].role != "user":
            raise ValueError(f"{where}: messages must end with a user message")
        (n,) = _output_lens(line, default_output_len, 1, where)
        return Conversation((Turn(msgs[-1].content, n),), tuple(msgs[:-1]))
    if isinstance(line.get("turns"), list) and line["turns"]:
        turns = line["turns"]
        system = line.get("system")
        if any(isinstance(t, list) for t in [*turns, system]):
            texts = [_token_ids(t, where) for t in turns]
            system = _token_ids(system, where) if system else None
        else:
            texts = [str(t) for t in turns]
            system = str(system) if system else None
        lens = _output_lens(line, default_output_len, len(texts), where)
        preamble = (Message("system", system),) if system else ()
        return Conversation(tuple(Turn(t, n) for t, n in zip(texts, lens)), preamble)
    raise ValueError(f"{where}: a line needs 'prompt', 'messages' or 'turns'")


def _jsonl(cfg: DatasetConfig) -> list[Conversation]:
    out = []
    with open(Path(cfg.path)) as f:
        for i, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{cfg.path}:{i}: not JSON: {exc}") from None
                out.append(parse_jsonl_line(line, cfg.output_len, f"{cfg.path}:{i}"))
    if not out:
        raise ValueError(f"{cfg.path}: no requests")
    if cfg.num_prompts:
        start = cfg.run_index * cfg.num_prompts
        if start + cfg.num_prompts > len(out):
            logger.warning(
                "%s has %d requests, fewer than the %d that run %d needs: prompts repeat, and a "
                "server's prefix cache may hold them from an earlier run",
                cfg.path,
                len(out),
                start + cfg.num_prompts,
                cfg.run_index,
            )
        out = [out[(start + i) % len(out)] for i in range(cfg.num_prompts)]
    return out


def build_dataset(cfg: DatasetConfig, tokenizer=None) -> list[Conversation]:
    """The conversations of ``cfg``; the same config and tokenizer always give the same list."""
    rng = random.Random(cfg.seed)
    src = TextSource(random.Random(cfg.seed + 1), tokenizer)
    if cfg.name == "random":
        return _random(cfg, src, rng, 1)
    if cfg.name == "multi-turn":
        return _random(cfg, src, rng, cfg.num_turns)
    if cfg.name == "shared-prefix":
        return _shared_prefix(cfg, src, rng)
    return _jsonl(cfg)


def render_prompt(messages: Sequence[Message]) -> str | list[int]:
    """What /v1/completions gets for a message list: the contents, one paragraph each, or the
    token ids of token-id messages end to end (a multi-turn history: system, user, answer, ...)."""
    if any(isinstance(m.content, tuple) for m in messages):
        if not all(isinstance(m.content, tuple) for m in messages):
            raise ValueError("a history mixes token-id and text messages")
        return [t for m in messages for t in m.content]
    return "\n\n".join(m.content for m in messages)
