"""The fault-injection suite at full size: ``python -m pdserve.benchmarks.soak --requests 2000``.

Runs the scenarios of ``pdserve.benchmarks.faults`` (client aborts, dropped connections, slow and
stalled KV transfers, kill -9 of Redis, the proxy, a prefill and a decode node) on one local
cluster of 2 prefill and 2 decode nodes with the default model, prints the summary table and
writes the JSON report. ``--requests`` sizes the client-abort soak; each fault scenario sends a
tenth of it (at least its CI size). Exits 1 if any request hung, any block leaked or the cluster
stopped serving.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from pdserve.benchmarks import faults

    prog = "python -m pdserve.benchmarks.soak"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests of the client-abort soak")
    parser.add_argument("--scenarios", default=",".join(faults.SCENARIOS), help="comma-separated, in order")
    parser.add_argument("--report", default="", help="JSON report path (default: in the log folder)")
    parser.add_argument("--log-dir", default="", help="nodes' logs (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = sorted(set(names) - set(faults.SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {sorted(faults.SCENARIOS)}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-soak-"))
    faults.REPORT_PATH = Path(args.report) if args.report else log_dir / "soak_report.json"

    with faults.fault_cluster(str(log_dir)) as fc:
        for name in names:
            if name == "redis_kill" and fc.cluster.redis is None:
                print("skipping redis_kill: no redis-server", file=sys.stderr)
                continue
            if (name == "prefill_kill" and len(fc.alive("prefill")) < 2) or (
                name == "decode_kill" and len(fc.alive("decode")) < 2
            ):
                print(f"skipping {name}: needs two live nodes of its role", file=sys.stderr)
                continue
            size = max(faults.CI_SIZES[name], args.requests // 10)
            if name == "client_aborts":
                size = args.requests
            try:
                result = faults.SCENARIOS[name](fc, size, seed=args.seed + len(faults.RESULTS) + 1)
            except Exception as exc:  # noqa: BLE001 - one broken scenario does not stop the soak
                print(f"{name} failed to run: {exc!r}", file=sys.stderr)
                faults.record(faults.ScenarioResult(name, notes=f"failed to run: {exc!r}"))
                continue
            print(f"{result.scenario}: {result.completed}/{result.sent} completed {result.notes}", flush=True)

    print(faults.format_table(faults.RESULTS))
    print(f"report: {faults.REPORT_PATH}; logs: {log_dir}")
    bad = [r for r in faults.RESULTS if r.hung or r.leaked_blocks or r.busy_requests or r.crashed]
    bad += [r for r in faults.RESULTS if not r.served_after]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
