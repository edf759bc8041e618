"""Structured output through the OpenAI API: 20 JSON schemas x 5 prompts at temperature 0.8, through a
P/D pair and a co-located node, every output validated against its schema (``jsonschema``).

One local cluster (a prefill node and a ``--role both`` node) and two proxies over it: ``pd``
(the prefill node computes the prompt and samples the first token under the mask, the KV moves,
the both node decodes the rest as a decode node) and ``colocated`` (the both node alone). Every
request is ``response_format={"type": "json_schema", ...}`` on ``/v1/chat/completions``, sent
through the official ``openai`` client, a few at a time. Prints the counts; exits 1 if any output
is invalid.

    python -m pdserve.benchmarks.structured_output --output docs/benchmarks/structured_output_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.benchmarks.json_schemas import PROMPTS, SCHEMAS
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig


def run_topology(url: str, model: str, args) -> dict:
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    jobs = [(i, j) for i in range(len(SCHEMAS)) for j in range(len(PROMPTS))]

    def one(job: tuple[int, int]) -> dict:
        i, j = job
        name, schema = SCHEMAS[i]
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[j]}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
            temperature=args.temperature,
            seed=1000 * i + j,
            max_tokens=args.max_tokens,
        )
        choice = r.choices[0]
        text = choice.message.content or ""
        try:
            jsonschema.validate(json.loads(text), schema)
            error = ""
        except (ValueError, jsonschema.ValidationError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return {
            "schema": name,
            "prompt": j,
            "finish_reason": choice.finish_reason,
            "completion_tokens": r.usage.completion_tokens,
            "valid": not error,
            "error": error,
            "text": text,
        }

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, jobs))
    elapsed = time.perf_counter() - start
    invalid = [r for r in results if not r["valid"]]
    return {
        "requests": len(results),
        "valid": len(results) - len(invalid),
        "invalid": len(invalid),
        "finish_reasons": {f: sum(r["finish_reason"] == f for r in results) for f in ("stop", "length")},
        "completion_tokens": sum(r["completion_tokens"] for r in results),
        "seconds": elapsed,
        "invalid_outputs": invalid,
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument(
        "--threads-per-node", type=int, default=0, help="torch threads per node (0: split the cores)"
    )
    p.add_argument("--engine-flags", default="", help="more engine flags for both nodes")
    p.add_argument("--output", default="", help="write the figures as JSON here")
    args = p.parse_args()

    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=1,
        decode_nodes=0,
        both_nodes=1,
        redis_url="none",
        threads_per_node=args.threads_per_node,
        log_dir=tempfile.mkdtemp(prefix="pdserve-structured-"),
        startup_timeout_s=900.0,
    )
    cluster = LocalCluster(cfg, ["--model", args.model, *args.engine_flags.split()], ModelConfig(args.model))
    runs = {}
    try:
        cluster.start()
        (prefill,) = cluster.node_urls("prefill")
        (both,) = cluster.node_urls("both")
        proxies = {
            "pd": cluster.add_proxy(
                "--prefill-urls", prefill, "--decode-urls", both, "--min-remote-prefill-tokens", "0"
            ),
            "colocated": cluster.add_proxy("--both-urls", both),
        }
        import httpx

        model = httpx.get(f"{proxies['pd']}/v1/models").json()["data"][0]["id"]
        for topology, url in proxies.items():
            runs[topology] = run_topology(url, model, args)
            r = runs[topology]
            print(
                f"{topology:<10} {r['valid']}/{r['requests']} valid, {r['invalid']} invalid "
                f"(finish: {r['finish_reasons']}, {r['completion_tokens']} tokens in {r['seconds']:.0f} s)",
                flush=True,
            )
            for bad in r["invalid_outputs"]:
                print(
                    f"  invalid: {bad['schema']} prompt {bad['prompt']}: {bad['error']}: {bad['text'][:99]!r}"
                )
    finally:
        cluster.stop()
    total_invalid = sum(r["invalid"] for r in runs.values())
    print(f"total: {sum(r['requests'] for r in runs.values())} requests, {total_invalid} invalid")
    if args.output:
        from importlib.metadata import version

        import torch
        import xgrammar  # noqa: F401 - its version is reported

        device = (
            torch.cuda.get_device_name(0)
            if torch.cuda.is_available()
            else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
        )
        result = {
            "benchmark": "structured_output",
            "command": "python -m pdserve.benchmarks.structured_output " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "device": device,
            "versions": {"torch": torch.__version__, "xgrammar": version("xgrammar")},
            "model": args.model,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "num_schemas": len(SCHEMAS),
            "num_prompts": len(PROMPTS),
            "runs": {k: {kk: vv for kk, vv in v.items() if kk != "results"} for k, v in runs.items()},
            "outputs": {k: v["results"] for k, v in runs.items()},
        }
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if total_invalid or len(runs) < 2 else 0)


if __name__ == "__main__":
    main()
