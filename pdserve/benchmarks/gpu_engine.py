"""GPU engine check and benchmark on a random Llama-3-8B-shaped bf16 model.

One run, every figure against an anchor measured in the same run:

* ceilings: device copy bandwidth (HBM roofline of decode) and a bf16 square matmul
  (compute roofline of prefill);
* teacher-forced agreement: pdserve's greedy tokens and their log-probs against one
  transformers forward over the same sequence (same weights, copied from HF's model);
* decode throughput at batch 1, 8, 32 and 64 (1k-token prompts) against HF ``generate``,
  against the same engine without CUDA graphs, with async scheduling off and on (the sync
  anchor: the host schedules and prepares a step only after the previous one's tokens are on
  the host) and against the HBM roofline (weight + KV bytes per step over the copy bandwidth
  measured here);
* the same decode workloads end to end (prefill included) against HF's continuous-batching
  ``generate_batch``, with the same prompts, output length, greedy and EOS ignored;
* prefill throughput of a 2048-token prompt against one HF forward and the matmul roofline.

The JSON (``notes``) says what each number means and ``targets`` says which goals are met.

``python -m pdserve.benchmarks.gpu_engine --out docs/benchmarks/gpu_engine_<device>.json``
``python -m pdserve.benchmarks.gpu_engine --dry-run`` runs the whole flow on the CPU, tiny model.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pdserve import SamplingParams
from pdserve.benchmarks.offline import (
    _auto_num_blocks,
    _hf_configs,
    _hf_generate,
    _resolved_hf_config,
    _timed,
)
from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.loader import load_named_tensors
from pdserve.model_source import _PRESETS

TARGETS = {
    "decode_batch1_share_of_hbm_roofline": 0.70,
    "decode_batch64_share_of_hbm_roofline": 0.50,
    "prefill_ratio_vs_hf_forward": 1.10,
}
NOTES = {
    "hbm_copy_gbps": "device-to-device copy of a large bf16 buffer, (bytes read + bytes written) / time",
    "matmul_tflops": "torch.matmul of two NxN bf16 matrices, 2*N^3 / time, median of several samples",
    "decode.pdserve_tok_s": (
        "batch * (new_tokens - 1) / (time of a run generating new_tokens - time of a run generating 1); "
        "both runs start from an empty prefix cache, so the difference is the decode steps alone"
    ),
    "decode.hf_tok_s": "the same subtraction with HF generate (DynamicCache, sdpa) on the same prompts",
    "decode.eager_tok_s": "the same engine with its CUDA graphs switched off (anchor for the graphs)",
    "decode.async_scheduling": (
        "whether pdserve_tok_s (and eager_tok_s, generate_batch) ran with async scheduling"
    ),
    "decode.sync_tok_s": (
        "decode.pdserve_tok_s measured with async scheduling off: each step's tokens are read on the "
        "host before the next step is scheduled (the anchor for async scheduling)"
    ),
    "decode.async_tok_s": "decode.pdserve_tok_s measured with async scheduling on",
    "decode.ratio_async_vs_sync": "async_tok_s / sync_tok_s",
    "decode.roofline_tok_s": (
        "batch * hbm_copy_gbps / (weight_bytes + batch * context * kv_bytes_per_token), "
        "context = prompt_len + new_tokens / 2 (the mean over the decode steps)"
    ),
    "decode.generate_batch": (
        "end-to-end output tok/s of the whole workload (batch prompts of prompt_len tokens, "
        "new_tokens greedy tokens each, EOS ignored) = "
        "batch * new_tokens / wall time of one call, prefill included; "
        "hf_tok_s is transformers generate_batch (continuous batching, explicit ContinuousBatchingConfig, "
        "persistent manager warmed by a full run on other prompts of the same shape, so no prefix reuse); "
        "pdserve_tok_s is "
        "LLM.generate of the same prompts from an empty prefix cache "
        "(the new_tokens run of decode.pdserve_tok_s); "
        "ratio = pdserve_tok_s / hf_tok_s; the HF time also includes starting/joining its generation thread"
    ),
    "decode.generate_batch.workload_roofline_tok_s": (
        "batch * new_tokens / (batch * prefill_flops(prompt_len) / matmul_flops + "
        "(new_tokens - 1) * (weight_bytes + batch * context * kv_bytes_per_token) / hbm_bytes_per_s)"
    ),
    "prefill.pdserve_tok_s": (
        "tokens / time of one LLM.generate(max_tokens=1) of a fresh prompt (empty prefix cache)"
    ),
    "prefill.hf_tok_s": (
        "tokens / time of one HF forward over the prompt with logits_to_keep=1, warmed at that length, "
        "best of 3 (pdserve: best of 3 with its prefix cache emptied before each)"
    ),
    "prefill.flops": (
        "2 * layer_params * T + 2 * vocab * hidden (lm head, last token only) + "
        "2 * num_layers * num_heads * head_dim * T^2 "
        "(causal QK^T and PV: 4*T^2*d per head, halved by the mask); "
        "layer_params = parameters of the decoder layers (embeddings excluded)"
    ),
    "prefill.roofline_tok_s": "T / (prefill.flops / matmul_tflops)",
    "short_prefill": (
        "per prompt length T (--short-prefill-lens): milliseconds of one LLM.generate(max_tokens=1) "
        "of a fresh T-token prompt (empty prefix cache), best and median of 7 after one at the same "
        "length: pdserve as configured (piecewise CUDA graphs for steps of up to "
        "piecewise_graph_max_tokens), eager_ms the same engine with its piecewise graphs switched off "
        "(the anchor for them; decode graphs stay), hf_ms one HF forward over the prompt with "
        "logits_to_keep=1 (warmed at T); ratio_vs_eager = eager_ms / pdserve_ms (best to best)"
    ),
}


def _sync_time() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def hbm_copy_gbps(device: str, nbytes: int = 4 << 30) -> float:
    """Device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = _sync_time()
    n = 10
    for _ in range(n):
        dst.copy_(src)
    dt = (_sync_time() - t) / n
    del src, dst
    return 2 * nbytes / dt / 1e9


def matmul_tflops(device: str, n: int = 8192, samples: int = 5, reps: int = 10) -> float:
    """bf16 NxN @ NxN throughput, median over ``samples`` timings of ``reps`` back-to-back matmuls."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(samples):
        t = _sync_time()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        times.append((_sync_time() - t) / reps)
    del a, b, c
    return 2 * n**3 / statistics.median(times) / 1e12


def build_hf(preset: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(_PRESETS[preset])
    arch = cfg.pop("architectures")[0]
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[arch]
    cfg.pop("dtype", None)
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    return model.eval()


def make_llm(hf_model, preset: str, **kwargs) -> LLM:
    """A pdserve LLM over the preset whose weights are copied from ``hf_model``."""
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig.from_kwargs(model=f"random:{preset}", dtype="bfloat16", **kwargs))
    tensors = ((n, "hf", t) for n, t in hf_model.state_dict().items())
    load_named_tensors(llm.engine.model, tensors, "the transformers model")
    return llm


def prefill_flops(hf_model, tokens: int) -> float:
    """Matmul FLOPs of one prefill of ``tokens`` tokens (formula in ``NOTES['prefill.flops']``)."""
    c = hf_model.config
    layer_params = sum(p.numel() for p in hf_model.model.layers.parameters())
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * tokens**2
    return 2 * layer_params * tokens + 2 * c.vocab_size * c.hidden_size + attn


def decode_prompts(batch: int, prompt_len: int, vocab: int, seed: int | None = None) -> list[list[int]]:
    """The decode workload's prompts, seeded by the batch size so every engine sees the same ones."""
    gen = torch.Generator().manual_seed(batch if seed is None else seed)
    return [torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def teacher_forced(llm: LLM, hf_model, vocab: int, prompt_len: int, steps: int) -> dict:
    device = hf_model.device
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1),
    )[0].outputs[0]
    ours = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
    seq = torch.tensor([prompt + out.token_ids[:-1]], device=device)
    with torch.inference_mode():
        logits = hf_model(seq).logits[0, prompt_len - 1 :].float()
    ref_lp = torch.log_softmax(logits, -1)
    tokens = torch.tensor(out.token_ids, device=device)
    ref = ref_lp.gather(1, tokens[:, None])[:, 0].double().cpu()
    diff = (ours - ref).abs()
    hf_argmax = logits.argmax(-1).cpu()
    return {
        "prompt_len": prompt_len,
        "steps": steps,
        "logprob_abs_diff_max": diff.max().item(),
        "logprob_abs_diff_mean": diff.mean().item(),
        "greedy_agreement": (hf_argmax == tokens.cpu()).float().mean().item(),
    }


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> tuple[float, float]:
    """Output tokens after the first over the time after the prefill, and the full run's wall time.

    Both timed runs start from an empty prefix cache, so their prefills cost the same and
    the difference is the decode steps alone; a warm-up run first compiles every kernel.
    """
    prompts = [{"prompt_token_ids": ids} for ids in decode_prompts(batch, prompt_len, vocab)]
    reset = llm.engine.reset_prefix_cache

    def timed(max_tokens: int) -> float:
        assert reset(), "the prefix cache can only be reset while no request runs"
        t = _sync_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return _sync_time() - t

    timed(4)
    prefill_s = timed(1)
    total_s = timed(new_tokens)
    reset()
    return batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9), total_s


def hf_decode_tok_s(hf_model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    x = torch.tensor(decode_prompts(batch, prompt_len, vocab), device=hf_model.device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf_model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)
        t = _sync_time()
        hf_model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill_s = _sync_time() - t
        t = _sync_time()
        hf_model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total_s = _sync_time() - t
    return batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def hf_generate_batch_runs(
    hf_model,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    block_size: int,
    max_tokens: int,
) -> tuple[dict[int, dict], dict]:
    """HF ``generate_batch`` on each decode workload, one kept manager sized for the largest batch.

    Each timed call is preceded by a full warm-up call on other prompts of the same shape and
    output length (the same padded sizes, so any graphs HF captures are captured there), so the
    timed prompts share no prefix with anything cached and the timed call captures nothing new.
    """
    device = str(hf_model.device)
    shape = SimpleNamespace(
        block_size=block_size,
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max(batches),
        num_prompts=max(batches),
        input_len=prompt_len,
        output_len=new_tokens,
    )
    num_blocks = _auto_num_blocks(shape)
    cb_config, hf_config = _hf_configs(shape, num_blocks)
    original_attn = hf_model.config._attn_implementation
    if hf_config["attn_implementation"] != original_attn:
        hf_model.set_attn_implementation(hf_config["attn_implementation"])
    rows: dict[int, dict] = {}
    try:
        for batch in batches:
            prompts = decode_prompts(batch, prompt_len, vocab)
            warm = decode_prompts(batch, prompt_len, vocab, seed=10_000 + batch)
            _hf_generate(hf_model, cb_config, warm, new_tokens)
            hf_config.setdefault("resolved", _resolved_hf_config(hf_model))
            elapsed, tokens = _timed(
                device, lambda p=prompts: _hf_generate(hf_model, cb_config, p, new_tokens)
            )
            n_out = sum(len(t) for t in tokens)
            rows[batch] = {
                "elapsed_s": elapsed,
                "num_output_tokens": n_out,
                "num_exact_length": sum(len(t) == new_tokens for t in tokens),
                "tok_s": n_out / elapsed,
            }
    finally:
        hf_model.destroy_cached_continuous_batching_manager()
        if hf_model.config._attn_implementation != original_attn:
            hf_model.set_attn_implementation(original_attn)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows, hf_config


def prefill_tok_s(llm: LLM, hf_model, n: int, vocab: int, repeats: int = 3) -> tuple[float, float]:
    """Prefill tok/s of an ``n``-token prompt, ours and one HF forward's. Both sides are warmed at the
    timed shape (a shorter warm-up leaves HF kernels for n tokens untuned: the anchor then ran 1.7x
    slow) and both take the best of ``repeats``; our prefix cache is emptied before each run, so
    every run computes the whole prompt."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ours_once() -> float:
        assert llm.engine.reset_prefix_cache()
        t = _sync_time()
        llm.generate({"prompt_token_ids": ids}, params)
        return n / (_sync_time() - t)

    def hf_once(x: torch.Tensor) -> float:
        t = _sync_time()
        hf_model(x, logits_to_keep=1)
        return n / (_sync_time() - t)

    ours_once()  # warm-up at the timed shape
    ours = max(ours_once() for _ in range(repeats))
    x = torch.tensor([ids], device=hf_model.device)
    with torch.inference_mode():
        hf_once(x)  # warm-up at the timed shape
        ref = max(hf_once(x) for _ in range(repeats))
    return ours, ref


def short_prefill_ms(llm: LLM, hf_model, n: int, vocab: int, repeats: int = 7) -> dict:
    """Milliseconds of one prefill of an ``n``-token prompt (``NOTES['short_prefill']``): ours, ours
    with the piecewise graphs off (the anchor), one HF forward; each warmed at ``n``, best and
    median of ``repeats``, the three interleaved run by run."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    runner = llm.engine.runner
    piecewise = runner.piecewise
    x = torch.tensor([ids], device=hf_model.device)

    def ours(graphs) -> float:
        runner.piecewise = graphs
        try:
            assert llm.engine.reset_prefix_cache()
            t = _sync_time()
            llm.generate({"prompt_token_ids": ids}, params)
            return (_sync_time() - t) * 1e3
        finally:
            runner.piecewise = piecewise

    def hf() -> float:
        with torch.inference_mode():
            t = _sync_time()
            hf_model(x, logits_to_keep=1)
            return (_sync_time() - t) * 1e3

    ways = {"pdserve": lambda: ours(piecewise), "eager": lambda: ours(None), "hf": hf}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way()  # warm-up at the timed shape
    for _ in range(repeats):
        for name, way in ways.items():
            times[name].append(way())
    row: dict = {
        "tokens": n,
        "piecewise_graphs": piecewise is not None and piecewise.bucket_for(n) is not None,
    }
    for name, taken in times.items():
        row[f"{name}_ms"] = min(taken)
        row[f"{name}_median_ms"] = statistics.median(taken)
    row["ratio_vs_eager"] = row["eager_ms"] / row["pdserve_ms"]
    row["ratio_vs_hf"] = row["hf_ms"] / row["pdserve_ms"]
    return row


def _target(measured: float | None, target: float) -> dict:
    if measured is None:
        return {"target": target, "measured": None, "met": None, "note": "not measured in this run"}
    return {
        "target": target,
        "measured": measured,
        "met": measured >= target,
        "margin": measured - target,  # > 0: met by this much, < 0: missed by this much
        "measured_over_target": measured / target,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--decode-batches", default="1,8,32,64")
    p.add_argument("--decode-prompt-len", type=int, default=1024)
    p.add_argument("--decode-new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument(
        "--short-prefill-lens",
        default="128,512",
        help="prompt lengths timed in ms against the engine without piecewise graphs ('' for none)",
    )
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--skip-hf-decode", action="store_true", help="no HF generate decode anchor")
    p.add_argument("--skip-generate-batch", action="store_true", help="no HF generate_batch anchor")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at all")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's mode for the main figures (default: the engine's, on for CUDA); "
        "the other mode is measured as well, as the anchor",
    )
    p.add_argument("--out", default=None, help="default docs/benchmarks/gpu_engine.json")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the whole flow on the CPU with the tiny preset and small sizes (checks the code path only)",
    )
    args = p.parse_args(argv)
    device = "cuda"
    engine_kwargs: dict = {"gpu_memory_utilization": 0.55}
    copy_bytes = 4 << 30
    if args.dry_run:
        device = "cpu"
        args.preset, args.steps, args.matmul_n = "tiny", 8, 256
        args.decode_batches, args.decode_prompt_len, args.decode_new_tokens = "1,8", 64, 8
        args.prefill_len = 128
        args.short_prefill_lens = "32"
        args.out = args.out or "/tmp/gpu_engine_dry_run.json"
        engine_kwargs = {"device": "cpu", "num_kv_blocks": 512}
        copy_bytes = 64 << 20
    args.out = args.out or "docs/benchmarks/gpu_engine.json"
    batches = [int(b) for b in args.decode_batches.split(",")]

    bw = hbm_copy_gbps(device, copy_bytes)
    print(f"HBM copy: {bw:.0f} GB/s (anchor of the decode roofline)", flush=True)
    tflops = matmul_tflops(device, args.matmul_n)
    print(f"bf16 matmul {args.matmul_n}^3: {tflops:.1f} TFLOP/s (anchor of the prefill roofline)", flush=True)
    hf = build_hf(args.preset, device)
    vocab = hf.config.vocab_size
    # HF holds its own copy of the weights and, while generating, its own KV cache: leave it room.
    llm = make_llm(
        hf,
        args.preset,
        max_num_seqs=64,
        max_num_batched_tokens=max(4096, args.prefill_len),
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        **engine_kwargs,
    )
    arch = llm.engine.arch
    weight_bytes = sum(t.numel() * t.element_size() for t in llm.engine.model.parameters())
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result: dict = {
        "benchmark": "gpu_engine",
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [sys.executable.split("/")[-1], "-m", "pdserve.benchmarks.gpu_engine", *sys.argv[1:]]
        ),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "triton": triton_version,
        },
        "model": f"random:{args.preset}",
        "weight_bytes": weight_bytes,
        "hbm_copy_gbps": bw,
        "matmul": {"n": args.matmul_n, "dtype": "bfloat16", "tflops": tflops},
        "attention_backend": llm.engine.runner.backend.name,
        "notes": NOTES,
    }
    tf = teacher_forced(llm, hf, vocab, 64, args.steps)
    result["teacher_forced"] = tf
    print(f"teacher-forced: {tf}", flush=True)

    ours, ref = prefill_tok_s(llm, hf, args.prefill_len, vocab)
    flops = prefill_flops(hf, args.prefill_len)
    roof = args.prefill_len / (flops / (tflops * 1e12))
    result["prefill"] = {
        "tokens": args.prefill_len,
        "pdserve_tok_s": ours,
        "hf_tok_s": ref,
        "ratio": ours / ref,
        "flops": flops,
        "roofline_tok_s": roof,
        "share_of_matmul_roofline": ours / roof,
        "hf_share_of_matmul_roofline": ref / roof,
    }
    print(
        f"prefill {args.prefill_len}: pdserve {ours:.0f} tok/s = {ours / ref:.2f}x HF forward ({ref:.0f}), "
        f"{ours / roof:.1%} of matmul roofline ({roof:.0f}; HF {ref / roof:.1%})",
        flush=True,
    )

    result["short_prefill"] = []
    for n in [int(x) for x in args.short_prefill_lens.split(",") if x]:
        row = short_prefill_ms(llm, hf, n, vocab)
        result["short_prefill"].append(row)
        print(
            f"prefill {n}: pdserve {row['pdserve_ms']:.2f} ms (median {row['pdserve_median_ms']:.2f}), "
            f"{row['ratio_vs_eager']:.2f}x faster than without piecewise graphs ({row['eager_ms']:.2f}), "
            f"{row['ratio_vs_hf']:.2f}x faster than an HF forward ({row['hf_ms']:.2f})",
            flush=True,
        )

    kv_per_token = arch.kv_bytes_per_token(torch.bfloat16)
    runner = llm.engine.runner
    graphs = runner.graphs
    result["decode"] = []
    new = args.decode_new_tokens
    for batch in batches:
        ctx = args.decode_prompt_len + new // 2
        step_bytes = weight_bytes + batch * ctx * kv_per_token
        roofline = bw * 1e9 / step_bytes * batch
        ours, total_s = decode_tok_s(llm, batch, args.decode_prompt_len, new, vocab)
        wl_roof = batch * new / (batch * prefill_flops(hf, args.decode_prompt_len) / (tflops * 1e12)
                                 + (new - 1) * step_bytes / (bw * 1e9))  # fmt: skip
        row = {
            "batch": batch,
            "prompt_len": args.decode_prompt_len,
            "new_tokens": new,
            "context": ctx,
            "pdserve_tok_s": ours,
            "roofline_tok_s": roofline,
            "share_of_roofline": ours / roofline,
            "cuda_graphs": graphs is not None,
            "generate_batch": {
                "pdserve_tok_s": batch * new / total_s,
                "pdserve_elapsed_s": total_s,
                "workload_roofline_tok_s": wl_roof,
            },
        }
        line = (
            f"decode b={batch}: pdserve {ours:.0f} tok/s, {ours / roofline:.1%} of roofline ({roofline:.0f})"
        )
        # The other scheduling mode on the same engine and prompts: sync is async's anchor.
        mode = llm.engine.async_scheduling
        llm.engine.async_scheduling = not mode
        other, _ = decode_tok_s(llm, batch, args.decode_prompt_len, new, vocab)
        llm.engine.async_scheduling = mode
        rate = {mode: ours, not mode: other}
        row.update(
            async_scheduling=mode,
            async_tok_s=rate[True],
            sync_tok_s=rate[False],
            ratio_async_vs_sync=rate[True] / rate[False],
            async_share_of_roofline=rate[True] / roofline,
            sync_share_of_roofline=rate[False] / roofline,
        )
        line += (
            f"; async scheduling {'on' if mode else 'off'}: async {rate[True]:.0f} = "
            f"{rate[True] / rate[False]:.2f}x sync ({rate[False]:.0f}, {rate[False] / roofline:.1%})"
        )
        if graphs is not None:  # the same engine without its graphs, as the eager anchor
            runner.graphs = None
            eager, _ = decode_tok_s(llm, batch, args.decode_prompt_len, new, vocab)
            runner.graphs = graphs
            row.update(
                eager_tok_s=eager, eager_share_of_roofline=eager / roofline, ratio_vs_eager=ours / eager
            )
            line += f"; {ours / eager:.2f}x eager ({eager:.0f}, {eager / roofline:.1%})"
        if not args.skip_hf_decode:
            hf_rate = hf_decode_tok_s(hf, batch, args.decode_prompt_len, new, vocab)
            row.update(hf_tok_s=hf_rate, ratio_vs_hf=ours / hf_rate, hf_share_of_roofline=hf_rate / roofline)
            line += f"; {ours / hf_rate:.2f}x HF generate ({hf_rate:.0f}, {hf_rate / roofline:.1%})"
        result["decode"].append(row)
        print(line, flush=True)

    if not args.skip_generate_batch:
        block_size = llm.engine.config.cache.block_size
        max_tokens = max(4096, args.prefill_len)
        gb_rows, gb_config = hf_generate_batch_runs(
            hf, batches, args.decode_prompt_len, new, vocab, block_size, max_tokens
        )
        result["generate_batch_config"] = gb_config
        for row in result["decode"]:
            gb = row["generate_batch"]
            hf_gb = gb_rows[row["batch"]]
            gb.update(
                hf_tok_s=hf_gb["tok_s"],
                hf_elapsed_s=hf_gb["elapsed_s"],
                hf_num_output_tokens=hf_gb["num_output_tokens"],
                hf_num_exact_length=hf_gb["num_exact_length"],
                ratio_vs_hf=gb["pdserve_tok_s"] / hf_gb["tok_s"],
                share_of_workload_roofline=gb["pdserve_tok_s"] / gb["workload_roofline_tok_s"],
                hf_share_of_workload_roofline=hf_gb["tok_s"] / gb["workload_roofline_tok_s"],
            )
            print(
                f"end-to-end b={row['batch']} ({args.decode_prompt_len} in/{new} out, prefill included): "
                f"pdserve {gb['pdserve_tok_s']:.0f} out tok/s = {gb['ratio_vs_hf']:.2f}x HF generate_batch "
                f"({hf_gb['tok_s']:.0f}); {gb['share_of_workload_roofline']:.1%} of workload roofline "
                f"({gb['workload_roofline_tok_s']:.0f}; HF {gb['hf_share_of_workload_roofline']:.1%}); "
                f"HF exact length {hf_gb['num_exact_length']}/{row['batch']}",
                flush=True,
            )

    by_batch = {row["batch"]: row for row in result["decode"]}
    result["targets"] = {
        "decode_batch1_share_of_hbm_roofline": _target(
            by_batch[1]["share_of_roofline"] if 1 in by_batch else None,
            TARGETS["decode_batch1_share_of_hbm_roofline"],
        ),
        "decode_batch64_share_of_hbm_roofline": _target(
            by_batch[64]["share_of_roofline"] if 64 in by_batch else None,
            TARGETS["decode_batch64_share_of_hbm_roofline"],
        ),
        "prefill_ratio_vs_hf_forward": _target(
            result["prefill"]["ratio"], TARGETS["prefill_ratio_vs_hf_forward"]
        ),
    }
    for name, t in result["targets"].items():
        if t["measured"] is None:
            print(f"target {name} >= {t['target']}: not measured", flush=True)
        else:
            verdict = "met" if t["met"] else "MISSED"
            print(
                f"target {name} >= {t['target']}: {t['measured']:.3f} {verdict} by {abs(t['margin']):.3f}",
                flush=True,
            )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
