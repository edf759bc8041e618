"""Offline throughput: pdserve ``LLM.generate`` against HF transformers' ``generate_batch``.

Both sides run in one process, one after the other (never concurrently), on the same random
prompts, the same weights (HF loads the folder pdserve converted), the same dtype and the same
number of torch threads. Each side makes one small warmup call first; only the timed generation
call is measured, never model loading. Both are forced to emit exactly ``--output-len`` greedy
tokens (EOS ignored), so the token counts match and the ratio of output tokens/s is the inverse
ratio of wall times.

The HF side gets an explicit ``ContinuousBatchingConfig`` that mirrors pdserve's scheduler: the
same page (block) size, token budget per step, request cap and number of KV blocks. Its manager
is built by the warmup call and kept (``persistent_manager=True``), so the timed call, like
``LLM.generate``, runs the batching loop on an allocated cache; it still pays for starting and
joining HF's background generation thread, which is how ``generate_batch`` works.

    python -m pdserve.benchmarks.offline --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import CacheConfig, parse_dtype

DEFAULT_OUTPUT = "docs/benchmarks/offline_cpu.json"
HF_ATTN_IMPL = "sdpa"
"""The one CB attention of HF that runs on the CPU besides ``paged|eager`` (flash needs CUDA)."""
KV_BLOCK_HEADROOM = 1.25
"""Auto KV blocks = this x what the busiest moment needs: HF's FIFO scheduler stops admitting
prefills below 15% free blocks, so a cache sized exactly would throttle it."""
NUM_WARMUP_PROMPTS = 2
NUM_WARMUP_TOKENS = 8


@dataclass(frozen=True)
class SideResult:
    """One engine's timed call; the rates are derived so they cannot disagree with the counts."""

    name: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_exact_length: int
    """Requests that produced exactly ``output_len`` tokens (all of them unless EOS leaked)."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "requests_per_s": self.num_requests / self.elapsed_s,
        }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="`default`, an HF folder or a preset")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (forced)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="request cap per step, both sides")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="token budget per step, both sides"
    )
    parser.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="KV block/page size")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks on both sides; default: enough for the workload",
    )
    parser.add_argument(
        "--threads", type=int, default=_num_cores(), help="torch threads (default: all cores)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], both sides")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and both engines")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON result path")
    parser.add_argument("--skip-hf", action="store_true", help="measure pdserve only")
    parser.add_argument(
        "--skip-pdserve", action="store_true", help="measure HF only (--model must then be an HF folder)"
    )


def run(args: argparse.Namespace) -> dict:
    """Run both sides, print a summary, write the JSON result and return it."""
    import torch  # in the functions: `pdserve proxy` and `bench serve` build this parser without torch

    if args.skip_hf and args.skip_pdserve:
        raise ValueError("--skip-hf and --skip-pdserve leave nothing to measure")
    if args.skip_pdserve and not Path(args.model).is_dir():
        raise ValueError("--skip-pdserve needs --model to be an HF-format folder")
    torch.set_num_threads(args.threads)
    num_blocks = args.num_blocks or _auto_num_blocks(args)
    result: dict = {
        "benchmark": "offline",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(),
        "device": _device_description(args.device, args.threads),
        # Other processes on the machine skew CPU figures; a load near 0 means they are clean.
        "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "versions": _versions(),
        "args": {**vars(args), "num_blocks": num_blocks},
    }

    pd_result = pd_tokens = hf_result = hf_tokens = None
    llm = None if args.skip_pdserve else _load_pdserve(args, num_blocks)
    model_path = args.model if llm is None else llm.model_path
    if model_path is None:  # random-weight presets have no folder for HF to load
        raise ValueError(f"--model {args.model!r} has no HF-format folder; use --skip-hf")
    result["model_path"] = str(model_path)
    prompts, warmup_prompts = _make_prompts(args, _vocab_size(model_path))

    if llm is not None:
        pd_result, pd_tokens = _bench_pdserve(llm, args, prompts, warmup_prompts)
        result["pdserve"] = pd_result.to_dict()
        del llm  # frees its KV cache before HF allocates its own
        gc.collect()

    if not args.skip_hf:
        torch.set_num_threads(args.threads)  # the engine may have changed it
        cb_config, hf_config = _hf_configs(args, num_blocks)
        model = _load_hf(args, model_path, hf_config["attn_implementation"])
        hf_result, hf_tokens, hf_config["resolved"] = _bench_hf(
            model, cb_config, args, prompts, warmup_prompts
        )
        result["hf"] = {**hf_result.to_dict(), "continuous_batching_config": hf_config}
        del model
        gc.collect()

    if pd_result is not None and hf_result is not None:
        result["ratio_output_tokens_per_s"] = pd_result.output_tokens_per_s / hf_result.output_tokens_per_s
        result["num_identical_outputs"] = sum(a == b for a, b in zip(pd_tokens, hf_tokens))

    _print_summary(result)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.split("\n")[0])
    add_cli_args(parser)
    run(parser.parse_args(argv))


# ----------------------------------------------------------------------------- the two sides


def _load_pdserve(args: argparse.Namespace, num_blocks: int):
    from pdserve import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        # The engine insists that one request of max_model_len fits in the cache; the workload's is enough.
        max_model_len=args.input_len + args.output_len,
        num_threads=args.threads,
        seed=args.seed,
    )


def _pdserve_generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _bench_pdserve(llm, args, prompts, warmup_prompts) -> tuple[SideResult, list[list[int]]]:
    _pdserve_generate(llm, warmup_prompts, NUM_WARMUP_TOKENS)
    elapsed, tokens = _timed(args.device, lambda: _pdserve_generate(llm, prompts, args.output_len))
    return _side_result("pdserve", args, prompts, tokens, elapsed), tokens


def _hf_configs(args: argparse.Namespace, num_blocks: int):
    """The ``ContinuousBatchingConfig`` to run with, and a record of what was asked for."""
    from transformers import ContinuousBatchingConfig

    cb_fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    # 5.17 has `block_size` and prefixes any attention with `paged|` itself; later versions renamed it
    # `page_size`, take `sdpa` as is and would switch it to flash if installed unless told not to.
    attn = HF_ATTN_IMPL if "auto_switch_to_flash" in cb_fields else f"paged|{HF_ATTN_IMPL}"
    requested = {
        "page_size" if "page_size" in cb_fields else "block_size": args.block_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": args.max_num_batched_tokens,
        "max_requests_per_batch": args.max_num_seqs,
        "allow_block_sharing": True,  # pdserve's prefix caching is on by default as well
        "scheduler_type": "fifo",
        "default_compile_level": 0,  # eager, like pdserve on the CPU
        "auto_switch_to_flash": False,
    }
    requested = {k: v for k, v in requested.items() if k in cb_fields}
    return ContinuousBatchingConfig(**requested), {"attn_implementation": attn, "requested": requested}


def _load_hf(args: argparse.Namespace, model_path: str, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=parse_dtype(args.dtype), attn_implementation=attn
    )
    return model.to(args.device).eval()


def _hf_generate(model, cb_config, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

    # eos_token_id=-1 disables EOS; None would fall back to model.config.eos_token_id in add_requests.
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=-1)
    # persistent_manager: the first call builds the manager (cache, scheduler) and later calls reuse
    # it, as LLM.generate reuses its engine.
    outs = model.generate_batch(
        prompts,
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        progress_bar=False,
        persistent_manager=True,
    )
    failed = [o.request_id for o in outs.values() if o.error is not None]
    if len(outs) != len(prompts) or failed:
        raise RuntimeError(f"generate_batch returned {len(outs)}/{len(prompts)} outputs, failed: {failed}")
    return [list(o.generated_tokens) for o in outs.values()]  # in input order


def _bench_hf(model, cb_config, args, prompts, warmup_prompts) -> tuple[SideResult, list[list[int]], dict]:
    import torch

    torch.manual_seed(args.seed)
    _hf_generate(model, cb_config, warmup_prompts, NUM_WARMUP_TOKENS)
    resolved = _resolved_hf_config(model)
    elapsed, tokens = _timed(args.device, lambda: _hf_generate(model, cb_config, prompts, args.output_len))
    model.destroy_cached_continuous_batching_manager()
    return _side_result("hf", args, prompts, tokens, elapsed), tokens, resolved


def _resolved_hf_config(model) -> dict:
    """What the kept manager actually runs with, read back to check that our config was honoured."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    if manager is None:
        return {}
    cfg = manager.continuous_batching_config
    names = (
        "page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
        "max_blocks_per_request", "allow_block_sharing", "use_cuda_graph", "use_async_batching",
        "scheduler_type", "safety_margin", "varlen_compile_config", "decode_compile_config",
    )  # fmt: skip
    resolved = {n: getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None}
    cache = getattr(manager.batch_processor, "cache", None)
    if cache is not None:
        resolved["cache_num_blocks"] = cache.num_blocks
        resolved["cache_max_batch_tokens"] = cache.max_batch_tokens
    resolved["attn_implementation_in_use"] = model.config._attn_implementation
    return resolved


# ----------------------------------------------------------------------------- helpers


def _make_prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Seeded random token ids in [100, vocab - 100), away from special tokens; warmup prompts are drawn
    after the timed ones so they share no prefix with them."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    num = args.num_prompts + NUM_WARMUP_PROMPTS
    # ids: [num, input_len]
    ids = torch.randint(100, vocab_size - 100, (num, args.input_len), generator=gen).tolist()
    return ids[: args.num_prompts], ids[args.num_prompts :]


def _auto_num_blocks(args: argparse.Namespace) -> int:
    blocks_per_seq = math.ceil((args.input_len + args.output_len) / args.block_size)
    concurrency = min(args.num_prompts, args.max_num_seqs)
    return math.ceil(KV_BLOCK_HEADROOM * concurrency * blocks_per_seq)


def _timed(device: str, fn):
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    gc.collect()
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def _side_result(name, args, prompts, tokens: list[list[int]], elapsed: float) -> SideResult:
    return SideResult(
        name=name,
        elapsed_s=elapsed,
        num_requests=len(prompts),
        num_prompt_tokens=sum(len(p) for p in prompts),
        num_output_tokens=sum(len(t) for t in tokens),
        num_exact_length=sum(len(t) == args.output_len for t in tokens),
    )


def _vocab_size(model_path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config().vocab_size


def _num_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _device_description(device: str, threads: int) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{device}: {torch.cuda.get_device_name(torch.device(device))}, {threads} CPU threads"
    name = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {name}, {threads} threads"


def _versions() -> dict:
    import importlib.metadata

    import torch
    import transformers

    try:
        pdserve_version = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout
        import pdserve

        pdserve_version = getattr(pdserve, "__version__", "unknown")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pdserve": pdserve_version,
    }


def _command_line() -> str:
    argv0 = sys.argv[0]
    prog = "python -m pdserve.benchmarks.offline" if argv0.endswith(".py") else Path(argv0).name
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def _print_summary(result: dict) -> None:
    a = result["args"]
    print(
        f"offline: {a['num_prompts']} prompts x {a['input_len']} in / {a['output_len']} out, "
        f"{result['device']}, {a['dtype']}"
    )
    for key in ("pdserve", "hf"):
        if key in result:
            r = result[key]
            print(
                f"  {key:8s} {r['elapsed_s']:8.2f} s  {r['output_tokens_per_s']:9.1f} out tok/s  "
                f"{r['total_tokens_per_s']:9.1f} total tok/s  ({r['num_exact_length']}/{r['num_requests']} "
                f"exact length)"
            )
    if "ratio_output_tokens_per_s" in result:
        print(
            f"  pdserve/hf output tok/s: {result['ratio_output_tokens_per_s']:.2f}x; "
            f"identical greedy outputs: {result['num_identical_outputs']}/{a['num_prompts']}"
        )


if __name__ == "__main__":
    main()
