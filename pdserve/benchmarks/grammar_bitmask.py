"""What the structured-output bitmask costs per engine step, against the step without it.

Two parts, each at batch 1, 16 and 64 with requests cycling through the twenty JSON schemas of
``json_schemas.py``:

1. **Engine** (the default model): the same prompts decoded with and without a JSON schema each
   (temperature 0.8; with, an array of eight instances of the schema, so that no request ends
   before the measured steps do; without, ``ignore_eos``). Per full decode step:
   the step's time, and within it the time to fill the bitmask (the matchers) and to apply it to
   the logits. "Overhead" is the step with the mask over the step without it, minus one.
2. **Sampling** at two vocabularies, the default model's (49,152, its real tokenizer) and
   Llama-3's size (128,256): fill and apply against the sampler's own cost on the same logits
   (``Sampler.sample`` at temperature 0.8). No Llama-3 tokenizer is available offline here, so its
   vocabulary is synthetic: the default tokenizer's byte-level tokens plus concatenations of pairs
   of them, 128,256 distinct tokens; what the mask costs depends on the vocabulary's size and the
   shape of its token trie, which this keeps byte-level-BPE-like.

    python -m pdserve.benchmarks.grammar_bitmask --output docs/benchmarks/grammar_bitmask_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import Future
from importlib.metadata import version
from pathlib import Path

import torch

from pdserve.benchmarks.json_schemas import PROMPTS, SCHEMAS
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.structured_output import StructuredOutputManager, StructuredOutputRequest
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams

LLAMA3_VOCAB = 128256
NOTE = (
    "fill_ms and apply_ms are timed inside each step and are the mask's own cost; step_ms and overhead "
    "compare two runs made one after the other, so on a busy machine they carry its load's noise"
)


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timed:
    """Wraps a method and adds the time of each call to ``total`` (CUDA synchronized before the stop)."""

    def __init__(self, obj, name: str) -> None:
        self.total = 0.0
        inner = getattr(obj, name)

        def timed(*a, **kw):
            start = time.perf_counter()
            out = inner(*a, **kw)
            _sync()
            self.total += time.perf_counter() - start
            return out

        setattr(obj, name, timed)


def _long(schema: dict) -> dict:
    """Eight instances of ``schema`` in an array: long enough that no request ends (by its grammar)
    before the measured steps do, so every measured step has the whole batch."""
    return {"type": "array", "items": schema, "minItems": 8, "maxItems": 8}


def engine_part(model: str, batches: list[int], num_steps: int, engine_flags: dict) -> list[dict]:
    from pdserve import LLM

    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=4096, **engine_flags)
    engine = llm.engine
    tok = llm.get_tokenizer()
    fill = _Timed(engine.structured, "fill_bitmask")
    apply = _Timed(engine.structured, "apply_bitmask")
    rows = []
    for batch in batches:
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for i in range(batch)
        ]
        figures = {}
        for mode in ("without", "with"):
            params = []
            for i in range(batch):
                so = (
                    StructuredOutputsParams(json=_long(SCHEMAS[i % len(SCHEMAS)][1]))
                    if mode == "with"
                    else None
                )
                params.append(
                    SamplingParams(
                        temperature=0.8,
                        seed=i,
                        max_tokens=num_steps + 1,
                        ignore_eos=mode == "without",
                        structured_outputs=so,
                    )
                )
            for i, (p, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"{mode}-{batch}-{i}", p, sp)
            step_s, fill_s, apply_s = [], [], []
            while engine.has_unfinished_requests():
                fill.total = apply.total = 0.0
                start = time.perf_counter()
                outs = engine.step()
                _sync()
                elapsed = time.perf_counter() - start
                # A full decode step: every request of the batch got a token, none finished.
                if (
                    len(outs) == batch
                    and all(not o.finished for o in outs)
                    and outs[0].outputs[0].token_ids[1:]
                ):
                    step_s.append(elapsed)
                    fill_s.append(fill.total)
                    apply_s.append(apply.total)
            engine.reset_prefix_cache()
            figures[mode] = (step_s, fill_s, apply_s)
        with_s, fill_s, apply_s = figures["with"]
        without_s = figures["without"][0]
        step_with = statistics.median(with_s)
        step_without = statistics.median(without_s)
        row = {
            "batch": batch,
            "steps_measured": {"with": len(with_s), "without": len(without_s)},
            "step_ms_without": step_without * 1e3,
            "step_ms_with": step_with * 1e3,
            "fill_ms": statistics.median(fill_s) * 1e3,
            "apply_ms": statistics.median(apply_s) * 1e3,
            "overhead": step_with / step_without - 1,
            "mask_share_of_step": (statistics.median(fill_s) + statistics.median(apply_s)) / step_with,
        }
        rows.append(row)
        print(
            f"engine batch {batch:>3}: step {row['step_ms_without']:8.2f} ms without, "
            f"{row['step_ms_with']:8.2f} ms with (fill {row['fill_ms']:.3f} ms, "
            f"apply {row['apply_ms']:.3f} ms, "
            f"{100 * row['mask_share_of_step']:.1f} % of the step; overhead {100 * row['overhead']:+.1f} %)",
            flush=True,
        )
    return rows


def _synthetic_vocab(tokenizer, size: int) -> list[str]:
    """The tokenizer's byte-level tokens, then distinct concatenations of pairs of them up to ``size``."""
    base = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = [t for t in base[200:] if t.isprintable()]
    rng = random.Random(0)
    vocab = list(base)
    seen = set(vocab)
    while len(vocab) < size:
        token = rng.choice(words) + rng.choice(words)
        if token not in seen and len(token) <= 24:
            seen.add(token)
            vocab.append(token)
    return vocab


def sampling_part(tokenizer, batches: list[int], num_steps: int) -> list[dict]:
    import xgrammar as xgr

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    eos = tokenizer.eos_token_id
    infos = {
        "default (49,152, real)": xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos]
        ),
        "llama-3 size (128,256, synthetic)": xgr.TokenizerInfo(
            _synthetic_vocab(tokenizer, LLAMA3_VOCAB), xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos]
        ),
    }
    rows = []
    for name, info in infos.items():
        vocab = info.vocab_size
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = [compiler.compile_json_schema(json.dumps(s)) for _, s in SCHEMAS]
        manager = StructuredOutputManager(None, vocab, [eos], device)
        sampler = Sampler([eos], device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        for batch in batches:

            def fresh(i: int, compiled: list = compiled) -> StructuredOutputRequest:
                fut: Future = Future()
                fut.set_result(compiled[i % len(compiled)])
                return StructuredOutputRequest(fut)

            grammars = [fresh(i) for i in range(batch)]
            outputs: list[list[int]] = [[] for _ in range(batch)]
            params = SamplingParams(temperature=0.8)
            fill_s, apply_s, sample_s = [], [], []
            for _ in range(num_steps):
                logits = torch.randn(batch, vocab, generator=gen, device=device) * 4  # [B, V]
                _sync()
                t0 = time.perf_counter()
                bitmask, mask_rows = manager.fill_bitmask(grammars)
                t1 = time.perf_counter()
                manager.apply_bitmask(logits, bitmask, mask_rows)
                _sync()
                t2 = time.perf_counter()
                sampled = sampler(logits, [SamplingRow(params, [0], outputs[i]) for i in range(batch)])
                _sync()
                t3 = time.perf_counter()
                fill_s.append(t1 - t0)
                apply_s.append(t2 - t1)
                sample_s.append(t3 - t2)
                for i, token in enumerate(sampled.token_ids):
                    outputs[i].append(token)
                    grammars[i].advance(outputs[i])
                    if grammars[i].is_terminated:  # the JSON is complete: a new request takes the row
                        grammars[i], outputs[i] = fresh(i + batch), []
            row = {
                "vocab": name,
                "vocab_size": vocab,
                "batch": batch,
                "fill_ms": statistics.median(fill_s) * 1e3,
                "apply_ms": statistics.median(apply_s) * 1e3,
                "sampler_ms": statistics.median(sample_s) * 1e3,
            }
            row["mask_over_sampler"] = (row["fill_ms"] + row["apply_ms"]) / row["sampler_ms"]
            rows.append(row)
            print(
                f"sampling {name:<34} batch {batch:>3}: fill {row['fill_ms']:7.3f} ms, "
                f"apply {row['apply_ms']:7.3f} ms, sampler {row['sampler_ms']:7.3f} ms "
                f"(mask = {row['mask_over_sampler']:.2f}x the sampler)",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=24, help="decode steps per run")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--output", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    from pdserve.config import ModelConfig
    from pdserve.model_source import resolve_model
    from pdserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(ModelConfig(model=args.model)).tokenizer_dir)
    sampling = sampling_part(tokenizer, batches, args.steps)
    engine = [] if args.skip_engine else engine_part(args.model, batches, args.steps, {})
    if args.output:
        result = {
            "benchmark": "grammar_bitmask",
            "command": "python -m pdserve.benchmarks.grammar_bitmask " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "device": _device_name(),
            "versions": {"torch": torch.__version__, "xgrammar": version("xgrammar")},
            "model": args.model,
            "steps": args.steps,
            "note": NOTE,
            "engine": engine,
            "sampling": sampling,
        }
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
