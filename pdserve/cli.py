"""The ``pdserve`` command line. Engine flags and their defaults come from ``pdserve.config``."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import logging
import sys
import types
import typing

from pdserve import config as config_module
from pdserve import envs

ENGINE_CONFIGS = (
    config_module.ModelConfig,
    config_module.CacheConfig,
    config_module.SchedulerConfig,
    config_module.DeviceConfig,
)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar_type(cls: type, annotation: str) -> type:
    hint = eval(annotation, vars(sys.modules[cls.__module__]))  # annotations are strings (PEP 563)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return str  # comma-separated on the command line; the dataclass splits it
    return hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, ENGINE_CONFIGS)


def add_config_args(parser: argparse.ArgumentParser, classes) -> None:
    """One flag per dataclass field, named after it, with the field's default and docstring."""
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _scalar_type(cls, f.type)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f"{docs.get(f.name, '')} (default: {default})"
            if kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
            elif isinstance(kind, type) and issubclass(kind, enum.Enum):
                group.add_argument(flag, type=kind, choices=list(kind), default=default, help=help_text)
            else:
                group.add_argument(flag, type=kind, default=default, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for cls in ENGINE_CONFIGS for f in dataclasses.fields(cls)}


def config_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _cmd_node(args: argparse.Namespace) -> None:
    import uvicorn

    from pdserve import kv_transfer
    from pdserve.config import EngineConfig, NodeConfig, Role

    try:
        node = config_from_args(NodeConfig, args)
        kv_transfer.options_from_config(node.kv_transfer_config)  # refused here, before the model loads
    except ValueError as e:  # a bad flag combination: one line, no traceback
        sys.exit(f"pdserve node: {e}")
    if node.role == Role.PREFILL:
        from pdserve.prefill_node.server import create_app
    else:  # decode, or both: a decode node that also prefills for others
        from pdserve.decode_node.server import create_app
    app = create_app(EngineConfig.from_kwargs(**engine_kwargs(args)), node)
    print(f"pdserve {node.role} node: http://{node.host}:{node.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=node.host, port=node.port, log_level="warning", timeout_graceful_shutdown=5)


def _cmd_generate(args: argparse.Namespace) -> None:
    from pdserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Write a haiku about the sea."]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"--- prompt: {prompt!r}")
        print(completion.text)
        print(
            f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
            f"cached prompt tokens={out.num_cached_tokens}"
        )


def _cmd_proxy(args: argparse.Namespace) -> None:
    from pdserve.proxy.config import ProxyConfig
    from pdserve.proxy.router import ClusterError
    from pdserve.proxy.server import serve

    config = config_from_args(ProxyConfig, args)
    workers = f" ({config.workers} workers)" if config.workers > 1 else ""
    print(f"pdserve proxy: http://{config.host}:{config.port}/v1{workers}", file=sys.stderr, flush=True)
    try:
        status = serve(config, log_level="warning")
    except ClusterError as e:  # incompatible nodes, or nodes that never answered
        sys.exit(f"pdserve proxy: {e}")
    except OSError as e:  # the port, with several workers (bound before they start)
        sys.exit(f"pdserve proxy: cannot listen on {config.host}:{config.port}: {e.strerror}")
    sys.exit(status)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as command-line words."""
    flags = []
    for cls in ENGINE_CONFIGS:
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name)
            if value == f.default or f.name == "num_threads":
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags += [flag, str(value)]
    return flags


def _cmd_up(args: argparse.Namespace) -> None:
    from pdserve.cluster import ClusterConfig, run
    from pdserve.config import ModelConfig

    cfg = config_from_args(ClusterConfig, args)
    sys.exit(run(cfg, _engine_flags(args), config_from_args(ModelConfig, args)))


def _cmd_bench_offline(args: argparse.Namespace) -> None:
    from pdserve.benchmarks import offline

    offline.run(args)


def _cmd_bench_serve(args: argparse.Namespace) -> None:
    from pdserve.benchmarks import serve

    sys.exit(serve.run(args))


# The scripts behind these have their own argparse main(argv); `pdserve bench NAME ARGS...` runs
# `python -m pdserve.benchmarks.MODULE ARGS...` in this process, so behaviour and the command line
# that their JSON records are those of the module run.
_SCRIPT_BENCHMARKS = {
    "transfer": ("kv_transfer", "zmq KV transfer between two processes against raw TCP (CPU)"),
    "kernels": ("kernels", "Triton kernels against copy/SDPA anchors (GPU; --dry-run on the CPU)"),
    "gpu-engine": ("gpu_engine", "8B-shaped engine against transformers and the rooflines (GPU; --dry-run)"),
}


def _cmd_bench_script(args: argparse.Namespace) -> None:
    import importlib

    module_name = _SCRIPT_BENCHMARKS[args.bench_command][0]
    module = importlib.import_module(f"pdserve.benchmarks.{module_name}")
    sys.argv = [module.__file__, *args.script_args]
    module.main(args.script_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving. `pdserve up` starts a local "
        "cluster with the OpenAI API on port 8000; `pdserve COMMAND --help` lists a command's flags, "
        "each with its default.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation on the local machine")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt as a user message in the chat template",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    node = sub.add_parser("node", help="run a node: --role prefill, decode or both")
    add_config_args(node, (config_module.NodeConfig,))
    add_engine_args(node)
    node.set_defaults(func=_cmd_node)

    from pdserve.cluster import ClusterConfig
    from pdserve.proxy.config import ProxyConfig

    proxy = sub.add_parser("proxy", help="run the OpenAI-compatible proxy in front of running nodes")
    add_config_args(proxy, (ProxyConfig,))
    proxy.set_defaults(func=_cmd_proxy)

    up = sub.add_parser("up", help="start a local cluster: prefill and decode nodes plus the proxy")
    add_config_args(up, (ClusterConfig,))
    add_engine_args(up)
    up.set_defaults(func=_cmd_up)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pdserve.benchmarks import offline

    off = bench_sub.add_parser("offline", help="LLM.generate throughput against transformers generate_batch")
    offline.add_cli_args(off)
    off.set_defaults(func=_cmd_bench_offline)
    from pdserve.benchmarks import serve

    srv = bench_sub.add_parser(
        "serve",
        help="load an OpenAI-compatible server: latency, throughput, goodput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: pdserve bench serve --base-url http://127.0.0.1:8000 --dataset random "
        "--num-prompts 64 --input-len 128 --output-len 64 --request-rate 4 --slo-ttft-ms 2000 "
        "--slo-tpot-ms 200 --output-json serve.json (--sweep-rates 1,2,4,8 instead of --request-rate: "
        "one run per rate, and the highest rate that meets both SLOs)",
    )
    serve.add_cli_args(srv)
    srv.set_defaults(func=_cmd_bench_serve)
    for name, (_, help_text) in _SCRIPT_BENCHMARKS.items():
        # No options of its own: every word after the name goes to the script (--help too).
        script = bench_sub.add_parser(
            name,
            help=f"{help_text}; `pdserve bench {name} --help` for its flags",
            add_help=False,
            prefix_chars="\0",
        )
        script.add_argument("script_args", nargs=argparse.REMAINDER)
        script.set_defaults(func=_cmd_bench_script)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=envs.PDSERVE_LOG_LEVEL.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per node call otherwise
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
