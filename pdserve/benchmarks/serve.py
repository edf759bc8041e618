"""`pdserve bench serve`: load any OpenAI-compatible server and measure latency, throughput, goodput.

Works against pdserve, vLLM, SGLang and ``transformers serve`` alike, with the flags users
of ``vllm bench serve`` and SGLang's ``bench_serving`` know. Each request streams; TTFT,
TPOT, ITL and end-to-end latency are measured per request, token counts come from the
server's usage (``stream_options.include_usage``) when it sends one. Definitions are in
``serve_metrics.py``, workloads in ``serve_datasets.py``, arrivals in ``serve_load.py``.

    pdserve bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 64 \\
        --input-len 128 --output-len 64 --request-rate 4 --slo-ttft-ms 2000 --slo-tpot-ms 200 \\
        --output-json serve.json --plot-dir plots/

``--sweep-rates 1,2,4`` runs the workload at each rate in turn and reports the highest rate
at which at least 90 % of requests meet both SLOs (DistServe's goodput). Each rate gets the
same workload shape with its own prompts (``--seed`` + the rate's index; warmups get the
next seed), so that no run is served from a prefix cache that an earlier run filled; with a
jsonl file and ``--num-prompts N``, run i takes lines i*N to (i+1)*N - 1 (warmups the slice after
the last run), so give it N * (rates + 1) lines.

Exit status: 0 when the run finished and some request succeeded, 1 when every request
failed, 2 for bad arguments or a server that never answered (``/health`` when ``--model``
is given, else ``/v1/models``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.benchmarks import serve_datasets as datasets
from pdserve.benchmarks.serve_client import CHAT, ENDPOINTS, RequestOptions
from pdserve.benchmarks.serve_http import Client, HttpError
from pdserve.benchmarks.serve_load import ARRIVALS, arrival_times, offer
from pdserve.benchmarks.serve_metrics import DEFAULT_ATTAINMENT_TARGET, DEFAULT_PERCENTILES, SLO, summarize
from pdserve.benchmarks.serve_report import (
    RateRun,
    jsonable,
    print_summary,
    rate_name,
    run_json,
    sweep_json,
    write_plots,
)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = datasets.DatasetConfig()
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", required=True, help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)"
    )
    server.add_argument("--endpoint", default=CHAT, choices=ENDPOINTS)
    server.add_argument("--model", default="", help="model name to send (default: the first of /v1/models)")
    server.add_argument("--api-key", default="", help="sent as a Bearer token")
    server.add_argument(
        "--tokenizer",
        default="",
        help="HF tokenizer folder (or `default`, pdserve's default model) for random prompts and for "
        "counting prompt tokens when the server sends no usage",
    )
    server.add_argument("--request-timeout-s", type=float, default=600.0)
    server.add_argument(
        "--ready-timeout-s",
        type=float,
        default=60.0,
        help="wait this long for the server: /health with --model, else /v1/models",
    )

    data = parser.add_argument_group("workload (see pdserve/benchmarks/serve_datasets.py)")
    data.add_argument("--dataset", "--dataset-name", default=d.name, choices=datasets.DATASETS)
    data.add_argument("--dataset-path", default="", help="the file of --dataset jsonl")
    data.add_argument(
        "--num-prompts", type=int, default=None, help="conversations (= requests unless multi-turn)"
    )
    data.add_argument("--input-len", "--random-input-len", type=int, default=d.input_len)
    data.add_argument(
        "--output-len", "--random-output-len", type=int, default=d.output_len, help="max_tokens"
    )
    data.add_argument("--range-ratio", "--random-range-ratio", type=float, default=d.range_ratio)
    data.add_argument("--prefix-groups", "--gsp-num-groups", type=int, default=d.prefix_groups)
    data.add_argument("--prompts-per-group", "--gsp-prompts-per-group", type=int, default=d.prompts_per_group)
    data.add_argument("--prefix-len", "--gsp-system-prompt-len", type=int, default=d.prefix_len)
    data.add_argument(
        "--num-turns", type=int, default=d.num_turns, help="user turns per multi-turn conversation"
    )
    data.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, shuffling and arrivals")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="conversations/s; inf = all at once"
    )
    load.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--sweep-rates", type=_floats, default=None, help="e.g. 1,2,4: one run per rate")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not counted) first")

    req = parser.add_argument_group("requests")
    req.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so that every output has --output-len tokens (servers that reject "
        "unknown fields, such as transformers serve, need --no-ignore-eos)",
    )
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--include-usage", action=argparse.BooleanOptionalAction, default=True)
    req.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=None)
    report.add_argument("--slo-tpot-ms", type=float, default=None)
    report.add_argument("--slo-attainment-target", type=float, default=DEFAULT_ATTAINMENT_TARGET)
    report.add_argument("--percentiles", type=_floats, default=DEFAULT_PERCENTILES)
    report.add_argument("--label", default="", help="name of this run in the JSON and the plots")
    report.add_argument("--output-json", default="", help="write the results here")
    report.add_argument("--save-detailed", action="store_true", help="also write every request's ITLs")
    report.add_argument("--plot-dir", default="", help="write latency CDFs (and the sweep) as PNGs here")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    rates: tuple[float, ...]
    arrival: str
    max_concurrency: int | None
    num_warmups: int

    def __post_init__(self) -> None:
        if not self.rates or not all(r > 0 for r in self.rates):
            raise ValueError("request rates must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")


def _dataset_config(args: argparse.Namespace) -> datasets.DatasetConfig:
    return datasets.DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_groups=args.prefix_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        path=args.dataset_path,
        seed=args.seed,
    )


def _request_options(args: argparse.Namespace, model: str) -> RequestOptions:
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return RequestOptions(
        endpoint=args.endpoint,
        model=model,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        include_usage=args.include_usage,
        extra_body=extra,
        api_key=args.api_key,
    )


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _wait_ready(client: Client, headers: dict, timeout_s: float, model: str) -> str:
    """Poll the server until it answers; returns the model name to send.

    With ``--model`` given, ``/health`` is enough (``transformers serve`` lists only the HF hub
    cache in /v1/models, so a model served from a folder is not there); otherwise the first
    model of ``/v1/models``. Raises TimeoutError.
    """
    deadline = time.monotonic() + timeout_s
    path = "/health" if model else "/v1/models"
    while True:
        try:
            status, body = await client.get(path, headers)
            if status == 200:
                return model or json.loads(body)["data"][0]["id"]
            last = f"HTTP {status}"
        except (HttpError, ValueError, KeyError, IndexError, TypeError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.base}{path} did not answer in {timeout_s:g} s ({last})")
        await asyncio.sleep(0.5)


def _load_tokenizer(name: str):
    if not name:
        return None
    if name == "default":
        from pdserve.config import ModelConfig
        from pdserve.model_source import resolve_model

        name = str(resolve_model(ModelConfig()).tokenizer_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _prompt_counter(tokenizer, chat: bool):
    if tokenizer is None:
        return None

    def count(messages: list[datasets.Message]) -> int:
        if not chat:
            return len(tokenizer.encode(datasets.render_prompt(messages)))
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        ids = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return count


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable, unit="req", dynamic_ncols=True)


def _command_line() -> str:
    prog = "python -m pdserve.benchmarks.serve" if sys.argv[0].endswith("serve.py") else "pdserve"
    return shlex.join([prog, *sys.argv[1:]])


def _run_dataset(dcfg: datasets.DatasetConfig, index: int) -> datasets.DatasetConfig:
    """The workload of the index-th run of a sweep: same shape, its own prompts (seed + index), so
    that a server's prefix cache does not carry one rate's prompts into the next."""
    return dataclasses.replace(dcfg, seed=dcfg.seed + index, run_index=index)


@dataclasses.dataclass(frozen=True)
class Outcome:
    opts: RequestOptions
    slo: SLO
    runs: tuple[RateRun, ...]


async def _bench(args: argparse.Namespace, plan: LoadPlan, dcfg: datasets.DatasetConfig) -> Outcome:
    base = _base_url(args.base_url)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    client = Client(base, read_timeout_s=args.request_timeout_s)
    try:
        key_headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = await _wait_ready(client, key_headers, args.ready_timeout_s, args.model)
        opts = _request_options(args, model)
        tokenizer = await asyncio.to_thread(_load_tokenizer, args.tokenizer)
        count_prompt = _prompt_counter(tokenizer, opts.chat)
        if plan.num_warmups:
            # Prompts of their own, so that the measured runs find none of them in a prefix cache.
            warm = datasets.build_dataset(_run_dataset(dcfg, len(plan.rates)), tokenizer)
            warm = [datasets.Conversation(c.turns[:1], c.preamble) for c in warm[: plan.num_warmups]]
            await offer(client, opts, warm, [0.0] * len(warm), plan.max_concurrency)

        runs = []
        for index, rate in enumerate(plan.rates):
            run_cfg = _run_dataset(dcfg, index)
            conversations = datasets.build_dataset(run_cfg, tokenizer)
            num_requests = sum(len(c.turns) for c in conversations)
            starts = arrival_times(len(conversations), rate, plan.arrival, run_cfg.seed)
            desc = f"rate {rate_name(rate)}"
            with _progress(num_requests, desc, args.disable_tqdm) as bar:
                result = await offer(
                    client,
                    opts,
                    conversations,
                    starts,
                    plan.max_concurrency,
                    count_prompt,
                    on_done=lambda r: bar.update(1),
                )
            summary = summarize(result.records, result.duration_s, slo, args.percentiles, result.num_skipped)
            print_summary(f"{args.label or 'serve'} @ {desc} req/s", summary)
            runs.append(RateRun(rate, result, summary))
    finally:
        client.close()
    return Outcome(opts, slo, tuple(runs))


def _result_json(args: argparse.Namespace, plan: LoadPlan, dcfg, outcome: Outcome) -> dict:
    opts = outcome.opts
    result = {
        "benchmark": "serve",
        "label": args.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "base_url": _base_url(args.base_url),
        "endpoint": opts.endpoint,
        "model": opts.model,
        "tokenizer": args.tokenizer or None,
        "dataset": dataclasses.asdict(dcfg),
        "load": {
            "arrival": plan.arrival,
            "max_concurrency": plan.max_concurrency,
            "request_rates": [rate_name(r) for r in plan.rates],
            "num_warmups": plan.num_warmups,
        },
        "request": {
            "ignore_eos": opts.ignore_eos,
            "temperature": opts.temperature,
            "include_usage": opts.include_usage,
            "extra_body": opts.extra_body,
        },
        "runs": [run_json(run, args.save_detailed) for run in outcome.runs],
    }
    if len(outcome.runs) > 1:
        result["sweep"] = sweep_json(outcome.runs, outcome.slo, args.slo_attainment_target)
    return result


def _run_loop(main):
    """``asyncio.run`` on uvloop where it is installed (as the proxy and uvicorn do): its loop and
    socket reads cost a fraction of asyncio's, on every token the client reads."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; returns the exit status."""
    # Other processes skew the figures (CPU above all); a load near 0 means a clean run.
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    try:
        dcfg = _dataset_config(args)
        plan = LoadPlan(
            tuple(args.sweep_rates or (args.request_rate,)),
            args.arrival,
            args.max_concurrency,
            args.num_warmups,
        )
        _request_options(args, "")
        if args.dataset == "jsonl" and not Path(args.dataset_path).is_file():
            raise ValueError(f"--dataset-path {args.dataset_path!r} is not a file")
    except ValueError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        outcome = _run_loop(_bench(args, plan, dcfg))
    except (TimeoutError, ValueError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 2
    result = _result_json(args, plan, dcfg, outcome)
    result["load_avg_1m_at_start"] = load_at_start
    sweep = result.get("sweep")
    if sweep is not None and outcome.slo.is_set:
        best = sweep["max_goodput_rate"]
        shown = "none of the rates" if best is None else f"{best:g} req/s"
        print(f"max goodput rate (>= {args.slo_attainment_target:.0%} of requests meet both SLOs): {shown}")
    if args.plot_dir:
        label = args.label or "serve"
        target = args.slo_attainment_target
        result["plots"] = write_plots(outcome.runs, outcome.slo, label, target, Path(args.plot_dir))
        print(f"plots: {', '.join(result['plots'])}")
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(result), indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if any(run.summary.num_completed for run in outcome.runs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n")[0])
    add_cli_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
