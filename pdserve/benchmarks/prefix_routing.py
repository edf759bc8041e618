"""Prefix-aware routing against round-robin on a shared-prefix workload (issue: Redis prefix index).

For each policy, a fresh local cluster (Redis, N prefill nodes, one decode node, the proxy with
that ``--routing``) serves the same workload: P long system prompts x Q short questions, shuffled
with a seed so that prompts sharing a prefix arrive interleaved, sent as streaming chat requests
with a fixed concurrency. Fresh clusters mean both policies start from cold caches.

Reported per policy: prompt tokens computed (``pdserve_prompt_tokens_computed_total`` summed
over every node), prefix-cache hit tokens, TTFT p50/p90 measured by the client, and the routing
decisions; then the reduction of computed tokens and whether the greedy outputs are identical.

    python -m pdserve.benchmarks.prefix_routing --output docs/benchmarks/prefix_routing_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.benchmarks.serve_metrics import percentile
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import DEFAULT_MODEL, ModelConfig
from pdserve.metrics import parse_text

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo")
WORDS = tuple(a + b + c for a in SYLLABLES for b in SYLLABLES for c in ("n", "r", "s", "l"))
"""256 made-up words: system prompts differ in content, not in how they tokenize on average."""


def workload(num_prefixes: int, num_questions: int, system_words: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = [
        f"System {p}: you are assistant {p}. " + " ".join(rng.choice(WORDS) for _ in range(system_words))
        for p in range(num_prefixes)
    ]
    convs = [
        [
            {"role": "system", "content": systems[p]},
            {"role": "user", "content": f"Question {q}: which word comes first, {rng.choice(WORDS)}?"},
        ]
        for p in range(num_prefixes)
        for q in range(num_questions)
    ]
    rng.shuffle(convs)
    return convs


def _metrics(url: str) -> dict[str, float]:
    return parse_text(httpx.get(f"{url}/metrics", timeout=10).text)


async def _stream_chat(client: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    parts = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(chunk["choices"][0]["delta"]["content"])
    return "".join(parts), ttft if ttft is not None else time.perf_counter() - start


async def _drive(url: str, model: str, convs, max_tokens: int, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(messages):
            async with sem:
                return await _stream_chat(client, url, model, messages, max_tokens)

        return await asyncio.gather(*(one(c) for c in convs))


def run_policy(policy: str, convs, args: argparse.Namespace) -> dict:
    log_dir = tempfile.mkdtemp(prefix=f"pdserve-bench-{policy}-")
    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=args.prefill_nodes,
        decode_nodes=1,
        threads_per_node=args.threads_per_node,
        log_dir=log_dir,
        routing=policy,
        min_remote_prefill_tokens=0,  # every prompt on a prefill node: the routing is what is measured
    )
    cluster = LocalCluster(cfg, ["--seed", "0"], ModelConfig(model=args.model))
    try:
        url = cluster.start()
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        started = time.perf_counter()
        results = asyncio.run(_drive(url, model, convs, args.max_tokens, args.concurrency))
        wall = time.perf_counter() - started
        nodes = cluster.node_urls("prefill") + cluster.node_urls("decode")
        per_node = {u: _metrics(u) for u in nodes}
        proxy = _metrics(url)
    finally:
        cluster.stop()
    ttfts = [t for _, t in results]
    decisions = {
        k.split('reason="')[1].rstrip('"}'): v
        for k, v in proxy.items()
        if k.startswith("pdserve_routing_decisions_total{")
    }
    return {
        "policy": policy,
        "prompt_tokens_computed": sum(m["pdserve_prompt_tokens_computed_total"] for m in per_node.values()),
        "prompt_tokens_computed_per_prefill_node": [
            per_node[u]["pdserve_prompt_tokens_computed_total"] for u in cluster.node_urls("prefill")
        ],
        "prefix_hit_tokens": sum(m["pdserve_prefix_cache_hit_tokens_total"] for m in per_node.values()),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_mean_s": statistics.fmean(ttfts),
        "wall_s": wall,
        "decisions": decisions,
        "index_lookup_mean_s": proxy.get("pdserve_prefix_index_lookup_seconds_sum", 0.0)
        / max(1.0, proxy.get("pdserve_prefix_index_lookup_seconds_count", 0.0)),
        "outputs": [text for text, _ in results],
    }


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefixes", type=int, default=8, help="distinct long system prompts")
    p.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    p.add_argument("--system-words", type=int, default=800, help="words per system prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefill-nodes", type=int, default=2)
    p.add_argument("--threads-per-node", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="", help="write the results as JSON here")


def run(args: argparse.Namespace) -> dict:
    convs = workload(args.prefixes, args.questions, args.system_words, args.seed)
    runs = {policy: run_policy(policy, convs, args) for policy in ("prefix-aware", "round-robin")}
    pa, rr = runs["prefix-aware"], runs["round-robin"]
    identical = pa["outputs"] == rr["outputs"]
    reduction = 1.0 - pa["prompt_tokens_computed"] / rr["prompt_tokens_computed"]
    print(f"{'policy':<14}{'computed':>10}{'hit':>10}{'ttft p50':>10}{'ttft p90':>10}{'wall s':>8}")
    for r in runs.values():
        print(
            f"{r['policy']:<14}{r['prompt_tokens_computed']:>10.0f}{r['prefix_hit_tokens']:>10.0f}"
            f"{r['ttft_p50_s']:>10.3f}{r['ttft_p90_s']:>10.3f}{r['wall_s']:>8.1f}"
        )
    print(f"prefix-aware computes {100 * reduction:.1f} % fewer prompt tokens; identical: {identical}")
    result = {
        "benchmark": "prefix_routing",
        "machine": f"{platform.machine()} CPU, {args.threads_per_node} torch thread(s) per node",
        "workload": {
            "prefixes": args.prefixes,
            "questions_per_prefix": args.questions,
            "system_words": args.system_words,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "prefill_nodes": args.prefill_nodes,
            "seed": args.seed,
            "model": args.model,
        },
        "reduction_of_computed_prompt_tokens": reduction,
        "identical_greedy_outputs": identical,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in runs.items()},
        "command": "python -m pdserve.benchmarks.prefix_routing --output " + (args.output or "FILE"),
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cli_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
