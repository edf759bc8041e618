"""GPU engine check and benchmark on a random Llama-3-8B-shaped bf16 model.

One run, every figure against an anchor measured in the same run:

* teacher-forced agreement: pdserve's greedy tokens and their log-probs against one
  transformers forward over the same sequence (same weights, copied from HF's model);
* decode throughput at batch 1, 32 and 64 against HF ``generate`` and against the
  roofline (weight + KV bytes per step over the HBM copy bandwidth measured here);
* prefill throughput of a 2048-token prompt against one HF forward.

``python -m pdserve.benchmarks.gpu_engine --out docs/benchmarks/gpu_engine_<device>.json``
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.llm import LLM
from pdserve.models import _PRESETS
from pdserve.models.loader import load_named_tensors


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def hbm_copy_gbps(nbytes: int = 4 << 30) -> float:
    """Device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
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


def build_hf(preset: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(_PRESETS[preset])
    arch = cfg.pop("architectures")[0]
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[arch]
    cfg.pop("dtype", None)
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    return model.eval()


def make_llm(hf_model, preset: str, **kwargs) -> LLM:
    """A pdserve LLM over the preset whose weights are copied from ``hf_model``."""
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig.from_kwargs(model=f"random:{preset}", dtype="bfloat16", **kwargs))
    tensors = ((n, "hf", t) for n, t in hf_model.state_dict().items())
    load_named_tensors(llm.engine.model, tensors, "the transformers model")
    return llm


def teacher_forced(llm: LLM, hf_model, vocab: int, prompt_len: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1),
    )[0].outputs[0]
    ours = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
    seq = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
    with torch.inference_mode():
        logits = hf_model(seq).logits[0, prompt_len - 1 :].float()
    ref_lp = torch.log_softmax(logits, -1)
    tokens = torch.tensor(out.token_ids, device="cuda")
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


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Output tokens after the first over the time after the prefill.

    Both timed runs start from an empty prefix cache, so their prefills cost the same and
    the difference is the decode steps alone; a warm-up run first compiles every kernel.
    """
    gen = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()}
        for _ in range(batch)
    ]
    reset = llm.engine.scheduler.kv.pool.reset_prefix_cache

    def timed(max_tokens: int) -> float:
        assert reset(), "the prefix cache can only be reset while no request runs"
        t = _sync_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return _sync_time() - t

    timed(4)
    prefill_s = timed(1)
    total_s = timed(new_tokens)
    reset()
    return batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def hf_decode_tok_s(hf_model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    x = torch.randint(100, vocab - 100, (batch, prompt_len), generator=gen).cuda()
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


def prefill_tok_s(llm: LLM, hf_model, n: int, vocab: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": ids[::-1]}, params)  # warm, no prefix overlap
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    t = _sync_time()
    llm.generate({"prompt_token_ids": ids}, params)
    ours = n / (_sync_time() - t)
    x = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        hf_model(x[:, : n // 2])
        t = _sync_time()
        hf_model(x, logits_to_keep=1)
        ref = n / (_sync_time() - t)
    return ours, ref


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--decode-batches", default="1,32,64")
    p.add_argument("--decode-prompt-len", type=int, default=1024)
    p.add_argument("--decode-new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--skip-hf-decode", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at all")
    p.add_argument("--out", default="docs/benchmarks/gpu_engine.json")
    args = p.parse_args(argv)

    bw = hbm_copy_gbps()
    print(f"HBM copy: {bw:.0f} GB/s", flush=True)
    hf = build_hf(args.preset)
    vocab = hf.config.vocab_size
    # HF holds its own copy of the weights and, while generating, its own KV cache: leave it room.
    llm = make_llm(
        hf,
        args.preset,
        max_num_seqs=64,
        max_num_batched_tokens=max(4096, args.prefill_len),
        gpu_memory_utilization=0.55,
        enforce_eager=args.enforce_eager,
    )
    arch = llm.engine.arch
    weight_bytes = sum(t.numel() * t.element_size() for t in llm.engine.model.parameters())
    result: dict = {
        "benchmark": "gpu_engine",
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [sys.executable.split("/")[-1], "-m", "pdserve.benchmarks.gpu_engine", *sys.argv[1:]]
        ),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "triton": __import__("triton").__version__,
        },
        "model": f"random:{args.preset}",
        "weight_bytes": weight_bytes,
        "hbm_copy_gbps": bw,
        "attention_backend": llm.engine.runner.backend.name,
    }
    tf = teacher_forced(llm, hf, vocab, 64, args.steps)
    result["teacher_forced"] = tf
    print(f"teacher-forced: {tf}", flush=True)

    ours, ref = prefill_tok_s(llm, hf, args.prefill_len, vocab)
    result["prefill"] = {
        "tokens": args.prefill_len,
        "pdserve_tok_s": ours,
        "hf_tok_s": ref,
        "ratio": ours / ref,
    }
    print(
        f"prefill {args.prefill_len}: pdserve {ours:.0f} tok/s, HF {ref:.0f} tok/s ({ours / ref:.2f}x)",
        flush=True,
    )

    kv_per_token = arch.kv_bytes_per_token(torch.bfloat16)
    runner = llm.engine.runner
    graphs = runner.graphs
    result["decode"] = []
    for batch in (int(b) for b in args.decode_batches.split(",")):
        ctx = args.decode_prompt_len + args.decode_new_tokens // 2
        roofline = bw * 1e9 / (weight_bytes + batch * ctx * kv_per_token) * batch
        ours = decode_tok_s(llm, batch, args.decode_prompt_len, args.decode_new_tokens, vocab)
        row = {
            "batch": batch,
            "context": ctx,
            "pdserve_tok_s": ours,
            "roofline_tok_s": roofline,
            "share_of_roofline": ours / roofline,
            "cuda_graphs": graphs is not None,
        }
        if graphs is not None:  # the same engine without its graphs, as the eager anchor
            runner.graphs = None
            eager = decode_tok_s(llm, batch, args.decode_prompt_len, args.decode_new_tokens, vocab)
            runner.graphs = graphs
            row.update(eager_tok_s=eager, eager_share_of_roofline=eager / roofline)
        if not args.skip_hf_decode:
            hf_rate = hf_decode_tok_s(hf, batch, args.decode_prompt_len, args.decode_new_tokens, vocab)
            row.update(hf_tok_s=hf_rate, ratio_vs_hf=ours / hf_rate)
        result["decode"].append(row)
        print(f"decode {row}", flush=True)

    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
