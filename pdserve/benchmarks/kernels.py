"""Kernel microbenchmarks: the Triton kernels of ``kernels/`` against torch anchors measured in the same run.

- decode paged attention (Llama-3-8B attention: Hq=32, Hkv=8, D=128, bf16, block 16) for batch
  1/8/64 x context 1k/4k/8k: GB/s of K/V read (+ q read, out written) against a device copy
  ``dst.copy_(src)`` moving the same number of bytes (read + write). Decode is memory-bound, so
  the ratio says how close to copy bandwidth the kernel gets;
- prefill attention, 2048 new tokens, and 1024 new over 1024 cached: TFLOP/s of the causal
  products (4 * D * Hq per visible (query, key) pair) against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same values laid out contiguously
  (K/V repeated to Hq heads beforehand, untimed, so that every SDPA backend applies; the cached
  case uses a lower-right causal mask);
- ``write_kv`` and ``gather_blocks``/``scatter_blocks``: GB/s (read + write) against the copy anchor.

Timing: CUDA events around each call, median of ``--iters`` after ``--warmup`` calls, with the
L2 cache flushed (a 256 MiB memset) before every call, kernel and anchor alike: in serving, each
layer's K/V is cold. Each case is also checked against its torch reference once. Output JSON has
the device, versions, date, command and every figure.

    python -m pdserve.benchmarks.kernels --out docs/benchmarks/kernels_h100.json
    python -m pdserve.benchmarks.kernels --dry-run          # CPU: tiny shapes, Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Setup:
    """Shapes of one run: the model's attention, the cases and the timing effort."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_cases: tuple[tuple[int, int], ...]  # (new tokens, cached tokens)
    write_tokens: tuple[int, ...]
    copy_layers: int
    copy_blocks: tuple[int, ...]  # blocks per request moved by gather/scatter
    warmup: int
    iters: int


LLAMA3_8B = Setup(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    dtype=torch.bfloat16,
    decode_batches=(1, 8, 64),
    decode_contexts=(1024, 4096, 8192),
    prefill_cases=((2048, 0), (1024, 1024)),
    write_tokens=(2048, 16384),
    copy_layers=32,
    copy_blocks=(8, 128, 512),  # 128, 2k and 8k tokens: 16 MiB, 256 MiB, 1 GiB
    warmup=5,
    iters=30,
)
DRY_RUN = Setup(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    block_size=16,
    dtype=torch.float16,  # the interpreter cannot tl.dot bf16
    decode_batches=(1, 2),
    decode_contexts=(40, 300),  # 300: three split-K partitions at batch 1
    prefill_cases=((24, 0), (16, 20)),
    write_tokens=(20,),
    copy_layers=2,
    copy_blocks=(3,),
    warmup=1,
    iters=2,
)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median seconds of ``fn()`` over ``iters`` calls after ``warmup``, each on a cold L2."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.cuda = device.type == "cuda"
        flush_bytes = L2_FLUSH_BYTES if self.cuda else 1024
        self.flush_buffer = torch.empty(flush_bytes, dtype=torch.int8, device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            events = []
            for _ in range(self.iters):
                self.flush_buffer.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize(self.device)
            times = [start.elapsed_time(end) / 1e3 for start, end in events]
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def copy_gbps(self, num_bytes: int) -> float:
        """The anchor: GB/s of ``dst.copy_(src)`` moving ``num_bytes`` in all (half read, half written)."""
        half = max(1, num_bytes // 2)
        src = torch.empty(half, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        seconds = self(lambda: dst.copy_(src))
        return 2 * half / seconds / 1e9


# ----------------------------------------------------------------------------- cases


def _paged_cache(num_tokens_per_seq: list[int], setup: Setup, device: torch.device, gen: torch.Generator):
    """A cache holding each sequence in randomly permuted blocks, and the [B, max_blocks] table."""
    bs = setup.block_size
    blocks_per_seq = [math.ceil(n / bs) for n in num_tokens_per_seq]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, 2, bs, setup.num_kv_heads, setup.head_dim)
    cache = torch.randn(shape, dtype=setup.dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks, device="cpu", generator=_cpu_gen(gen)).to(torch.int32)
    width = max(blocks_per_seq)
    table = torch.zeros(len(blocks_per_seq), width, dtype=torch.int32)
    start = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = perm[start : start + nb]
        start += nb
    return cache, table.to(device)


def _cpu_gen(gen: torch.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(gen.initial_seed()))


def _max_err(got: torch.Tensor, expect: torch.Tensor) -> float:
    return float((got.float() - expect.float()).abs().max())


def bench_decode(setup: Setup, timer: Timer, device: torch.device) -> list[dict]:
    from pdserve.kernels import paged_attention as pa

    rows = []
    itemsize = torch.empty((), dtype=setup.dtype).element_size()
    for context in setup.decode_contexts:
        for batch in setup.decode_batches:
            gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
            cache, table = _paged_cache([context] * batch, setup, device, gen)
            q = torch.randn(
                batch, setup.num_heads, setup.head_dim, dtype=setup.dtype, device=device, generator=gen
            )
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
            scale = setup.head_dim**-0.5
            out = torch.empty_like(q)

            run = functools.partial(
                pa.paged_attention, q, cache, table, seq_lens, starts, scale, 1, context, out
            )
            run()
            err = None
            if batch == min(setup.decode_batches):  # the reference gathers every context: check the smallest
                expect = pa.paged_attention_ref(q, cache, table, [context] * batch, [1] * batch, scale)
                err = _max_err(out, expect)
            kv_bytes = batch * context * setup.num_kv_heads * setup.head_dim * 2 * itemsize
            io_bytes = 2 * q.numel() * itemsize  # q read, out written
            num_bytes = kv_bytes + io_bytes
            seconds = timer(run)
            no_split = timer(functools.partial(run, num_splits=1))
            copy = timer.copy_gbps(num_bytes)
            gbps = num_bytes / seconds / 1e9
            num_splits, _ = pa.decode_partition(batch, setup.num_kv_heads, context, pa._num_sms(device))
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "num_splits": num_splits,
                    "bytes": num_bytes,
                    "time_us": seconds * 1e6,
                    "gb_s": gbps,
                    "copy_gb_s": copy,
                    "ratio_to_copy": gbps / copy,
                    "no_split_gb_s": num_bytes / no_split / 1e9,
                    "max_abs_err_vs_ref": err,
                }
            )
            _print_row("decode", rows[-1])
            del cache, table, q, out
    return rows


def _causal_pairs(new: int, cached: int) -> int:
    """Visible (query, key) pairs: new token i at position cached + i sees cached + i + 1 keys."""
    return new * cached + new * (new + 1) // 2


def bench_prefill(setup: Setup, timer: Timer, device: torch.device) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from pdserve.kernels import paged_attention as pa

    rows = []
    rep = setup.num_heads // setup.num_kv_heads
    for new, cached in setup.prefill_cases:
        total = new + cached
        gen = torch.Generator(device=device).manual_seed(total * 7 + new)
        cache, table = _paged_cache([total], setup, device, gen)
        q = torch.randn(new, setup.num_heads, setup.head_dim, dtype=setup.dtype, device=device, generator=gen)
        seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
        starts = torch.tensor([0, new], dtype=torch.int32, device=device)
        scale = setup.head_dim**-0.5
        out = torch.empty_like(q)

        run = functools.partial(pa.paged_attention, q, cache, table, seq_lens, starts, scale, new, total, out)
        run()
        expect = pa.paged_attention_ref(q, cache, table, [total], [new], scale)
        err = _max_err(out, expect)

        # The anchor's operands: the same values, contiguous, K/V repeated to Hq heads.
        k, v = pa.gather_kv_ref(cache, table, total)  # [1, Hkv, S, D]
        k = k.repeat_interleave(rep, dim=1).contiguous()  # [1, Hq, S, D]
        v = v.repeat_interleave(rep, dim=1).contiguous()
        qs = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, L, D]
        # Top-left and bottom-right causal coincide without a cached prefix.
        causal = dict(is_causal=True) if cached == 0 else dict(attn_mask=causal_lower_right(new, total))
        sdpa = functools.partial(F.scaled_dot_product_attention, qs, k, v, scale=scale, **causal)
        sdpa_err = _max_err(sdpa()[0].transpose(0, 1), expect)

        flops = 4 * setup.head_dim * setup.num_heads * _causal_pairs(new, cached)
        seconds = timer(run)
        sdpa_seconds = timer(sdpa)
        rows.append(
            {
                "new_tokens": new,
                "cached_tokens": cached,
                "flops": flops,
                "time_us": seconds * 1e6,
                "tflop_s": flops / seconds / 1e12,
                "sdpa_time_us": sdpa_seconds * 1e6,
                "sdpa_tflop_s": flops / sdpa_seconds / 1e12,
                "ratio_to_sdpa": sdpa_seconds / seconds,
                "max_abs_err_vs_ref": err,
                "sdpa_max_abs_err_vs_ref": sdpa_err,
            }
        )
        _print_row("prefill", rows[-1])
        del cache, table, q, out, k, v, qs
    return rows


def bench_write_kv(setup: Setup, timer: Timer, device: torch.device) -> list[dict]:
    from pdserve.kernels.kv_write import write_kv, write_kv_ref

    rows = []
    for tokens in setup.write_tokens:
        gen = torch.Generator(device=device).manual_seed(tokens)
        shape = (tokens, setup.num_kv_heads, setup.head_dim)
        key = torch.randn(shape, dtype=setup.dtype, device=device, generator=gen)
        value = torch.randn(shape, dtype=setup.dtype, device=device, generator=gen)
        num_blocks = math.ceil(tokens / setup.block_size) + 1
        cache = torch.zeros(
            num_blocks,
            2,
            setup.block_size,
            setup.num_kv_heads,
            setup.head_dim,
            dtype=setup.dtype,
            device=device,
        )
        # Whole blocks in a random order, consecutive slots inside a block: as the block pool hands them out.
        perm = torch.randperm(num_blocks, generator=_cpu_gen(gen)).to(device)
        positions = torch.arange(tokens, device=device)
        slots = perm[positions // setup.block_size] * setup.block_size + positions % setup.block_size

        write_kv(key, value, cache, slots)
        expect = torch.zeros_like(cache)
        write_kv_ref(key, value, expect, slots)
        exact = bool(torch.equal(cache, expect))
        num_bytes = 2 * 2 * key.numel() * key.element_size()  # K and V, each read once and written once
        seconds = timer(functools.partial(write_kv, key, value, cache, slots))
        copy = timer.copy_gbps(num_bytes)
        gbps = num_bytes / seconds / 1e9
        rows.append(
            {
                "tokens": tokens,
                "bytes": num_bytes,
                "time_us": seconds * 1e6,
                "gb_s": gbps,
                "copy_gb_s": copy,
                "ratio_to_copy": gbps / copy,
                "matches_ref": exact,
            }
        )
        _print_row("write_kv", rows[-1])
    return rows


def bench_block_copy(setup: Setup, timer: Timer, device: torch.device) -> list[dict]:
    from pdserve.kernels.block_copy import (
        gather_blocks,
        gather_blocks_ref,
        scatter_blocks,
        scatter_blocks_ref,
    )

    rows = []
    most = max(setup.copy_blocks)
    num_blocks = 2 * most + 1
    shape = (setup.copy_layers, num_blocks, 2, setup.block_size, setup.num_kv_heads, setup.head_dim)
    gen = torch.Generator(device=device).manual_seed(1)
    cache = torch.randn(shape, dtype=setup.dtype, device=device, generator=gen)
    for n in setup.copy_blocks:
        ids = torch.randperm(num_blocks, generator=_cpu_gen(gen))[:n].to(device)
        buffer = gather_blocks(cache, ids)
        exact = bool(torch.equal(buffer, gather_blocks_ref(cache, ids)))
        landed_ids = torch.randperm(num_blocks, generator=_cpu_gen(gen))[:n].to(device)
        expect = cache.clone()
        scatter_blocks_ref(buffer, expect, landed_ids)
        scatter_blocks(buffer, cache, landed_ids)
        exact = exact and bool(torch.equal(cache, expect))
        del expect
        num_bytes = 2 * buffer.numel() * buffer.element_size()  # read + write
        gather_s = timer(functools.partial(gather_blocks, cache, ids, out=buffer))
        scatter_s = timer(functools.partial(scatter_blocks, buffer, cache, landed_ids))
        copy = timer.copy_gbps(num_bytes)
        rows.append(
            {
                "layers": setup.copy_layers,
                "blocks": n,
                "bytes": num_bytes,
                "gather_time_us": gather_s * 1e6,
                "gather_gb_s": num_bytes / gather_s / 1e9,
                "scatter_time_us": scatter_s * 1e6,
                "scatter_gb_s": num_bytes / scatter_s / 1e9,
                "copy_gb_s": copy,
                "gather_ratio_to_copy": num_bytes / gather_s / 1e9 / copy,
                "scatter_ratio_to_copy": num_bytes / scatter_s / 1e9 / copy,
                "matches_ref": exact,
            }
        )
        _print_row("block_copy", rows[-1])
    return rows


# ----------------------------------------------------------------------------- driver


def _print_row(kind: str, row: dict) -> None:
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
    print(f"[{kind}] " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the first token with a digit, else the whole name."""
    tokens = [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t != "nvidia"]
    with_digit = [t for t in tokens if any(c.isdigit() for c in t)]
    return (with_digit[0] if with_digit else "_".join(tokens)) or "device"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default=None, help="JSON path (default: docs/benchmarks/kernels_<device>.json)"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per case")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case (median reported)")
    parser.add_argument(
        "--only",
        choices=("decode", "prefill", "write_kv", "block_copy"),
        action="append",
        help="run these groups only (repeatable)",
    )


def run(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("the kernel benchmark needs CUDA; use --dry-run to smoke-test it on the CPU")
    import triton

    setup = DRY_RUN if args.dry_run else LLAMA3_8B
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    timer = Timer(
        device,
        setup.warmup if args.warmup is None else args.warmup,
        setup.iters if args.iters is None else args.iters,
    )
    groups = {
        "decode": bench_decode,
        "prefill": bench_prefill,
        "write_kv": bench_write_kv,
        "block_copy": bench_block_copy,
    }
    result = {
        "benchmark": "kernels",
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "pdserve.benchmarks.kernels", *sys.argv[1:]]),
        "dry_run": args.dry_run,
        "shape": {
            "num_heads": setup.num_heads,
            "num_kv_heads": setup.num_kv_heads,
            "head_dim": setup.head_dim,
            "block_size": setup.block_size,
            "dtype": str(setup.dtype).removeprefix("torch."),
        },
        "timing": (
            f"CUDA events, median of {timer.iters} after {timer.warmup} warmup, L2 flushed before each call"
            if cuda
            else "perf_counter (interpreter smoke test, not a measurement)"
        ),
    }
    for group, fn in groups.items():
        if args.only is None or group in args.only:
            result[group] = fn(setup, timer, device)
            if cuda:
                torch.cuda.empty_cache()

    out = args.out
    if out is None and not args.dry_run:
        out = f"docs/benchmarks/kernels_{device_slug(name)}.json"
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.kernels", description=__doc__.split("\n")[0]
    )
    add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.dry_run and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # `import pdserve` already imported the kernels, and triton.jit fixed them as compiled
        # when they were decorated: start again with the interpreter switched on from the start.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "pdserve.benchmarks.kernels", *argv], env)
    run(args)


if __name__ == "__main__":
    main()
