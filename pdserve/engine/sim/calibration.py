"""What a simulated GPU is: bandwidth, matmul throughput, the engine's measured efficiency, its link.

A ``SimCalibration`` is derived from two of this project's own benchmark files (``calibrate``):

* ``python -m pdserve.benchmarks.gpu_engine`` (``docs/benchmarks/gpu_engine_*.json``) measured, on
  the GPU, the HBM copy bandwidth (``hbm_copy_gbps``), the bf16 matmul throughput
  (``matmul.tflops``), and pdserve's engine on an 8B-shaped model: decode tok/s at several batch
  sizes with its share of the HBM roofline (``decode[i].share_of_roofline``: batch x bandwidth /
  (weight bytes + batch x context x KV bytes per token)), and a 2048-token prefill with its share of
  the matmul roofline (``prefill.share_of_matmul_roofline``: FLOPs / throughput). Those shares are
  the engine's efficiency; ``StepTimeModel`` applies them to any step of any model shape.
* ``python -m pdserve.benchmarks.kv_transfer`` (``docs/benchmarks/kv_transfer_*.json``) measured
  pdserve's KV transfer (``pdserve_<transport>_gb_s``) at several sizes; a least-squares line
  ``time = latency + bytes / bandwidth`` through those points is the simulated link.

The presets below are ``calibrate`` applied to the files named in their ``sources`` (a test checks
that they still agree). ``--sim-calibration FILE`` takes either a calibration written by
``python -m pdserve.engine.sim.calibration`` or a ``gpu_engine`` JSON measured on your own GPU
(the link then stays the preset's); ``memory_gib`` is the GPU's memory, which the benchmark does
not record.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30


@dataclass(frozen=True)
class LinkModel:
    """One KV transfer takes ``latency_s + bytes / (gbps * 1e9)`` seconds."""

    latency_s: float
    gbps: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.gbps <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class SimCalibration:
    gpu: str
    """Short name, as in ``sim:<shape>@<gpu>``."""
    device: str
    """The device the figures were measured on."""
    memory_gib: float
    """The GPU's memory: sizes the simulated KV cache (with ``--gpu-memory-utilization``)."""
    hbm_gbps: float
    """Measured HBM copy bandwidth, (bytes read + written) / s, in GB/s."""
    matmul_tflops: float
    """Measured bf16 matmul throughput."""
    decode_efficiency: tuple[tuple[int, float], ...]
    """(batch size, share of the HBM roofline pdserve's decode reached), by batch size."""
    prefill_efficiency: float
    """Share of the matmul roofline pdserve's prefill reached."""
    link: LinkModel
    """The KV link between a prefill and a decode node."""
    sources: tuple[str, ...] = ()
    """The benchmark files these figures come from."""

    def __post_init__(self) -> None:
        batches = [b for b, _ in self.decode_efficiency]
        if not batches or batches != sorted(set(batches)):
            raise ValueError("decode_efficiency needs distinct batch sizes in increasing order")
        shares = [s for _, s in self.decode_efficiency] + [self.prefill_efficiency]
        if not all(0 < s <= 1 for s in shares):
            raise ValueError(f"efficiencies must be in (0, 1], got {shares}")
        if min(self.memory_gib, self.hbm_gbps, self.matmul_tflops) <= 0:
            raise ValueError("memory, bandwidth and matmul throughput must be > 0")

    def decode_share(self, num_seqs: int) -> float:
        """Share of the HBM roofline at ``num_seqs`` sequences: linear between measured batch
        sizes, the nearest measured one outside them."""
        points = self.decode_efficiency
        batches = [b for b, _ in points]
        i = bisect.bisect_left(batches, num_seqs)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (num_seqs - b0) / (b1 - b0)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> SimCalibration:
        d = dict(d)
        d["decode_efficiency"] = tuple((int(b), float(s)) for b, s in d["decode_efficiency"])
        d["link"] = LinkModel(**d["link"])
        d["sources"] = tuple(d.get("sources", ()))
        return cls(**d)


def fit_link(kv_transfer: dict, transport: str = "nixl") -> LinkModel:
    """Least-squares ``latency + bytes / bandwidth`` through a kv_transfer benchmark's
    ``pdserve_<transport>_gb_s`` at each size."""
    points = [
        (r["bytes"], r["bytes"] / (r[f"pdserve_{transport}_gb_s"] * 1e9))
        for r in kv_transfer["results"]
        if r.get(f"pdserve_{transport}_gb_s")
    ]
    if len(points) < 2:
        raise ValueError(f"the kv_transfer figures hold fewer than two sizes for {transport}")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return LinkModel(latency_s=max(0.0, my - slope * mx), gbps=1e-9 / slope)


def calibrate(
    gpu: str, memory_gib: float, gpu_engine: dict, link: LinkModel, sources: tuple[str, ...] = ()
) -> SimCalibration:
    """A calibration from a ``gpu_engine`` benchmark's figures (see the module docstring)."""
    if gpu_engine.get("benchmark") != "gpu_engine" or gpu_engine.get("dry_run"):
        raise ValueError("not the JSON of a (non-dry) run of pdserve.benchmarks.gpu_engine")
    decode = sorted((int(e["batch"]), float(e["share_of_roofline"])) for e in gpu_engine["decode"])
    return SimCalibration(
        gpu=gpu,
        device=gpu_engine["device"],
        memory_gib=memory_gib,
        hbm_gbps=float(gpu_engine["hbm_copy_gbps"]),
        matmul_tflops=float(gpu_engine["matmul"]["tflops"]),
        decode_efficiency=tuple(decode),
        prefill_efficiency=float(gpu_engine["prefill"]["share_of_matmul_roofline"]),
        link=link,
        sources=sources,
    )


# NVLink between two H200s (kv_transfer_h200x2.json, nixl): the only two-GPU link measured; the H100
# preset uses it too (its own file measures two processes on one GPU, not a link).
_NVLINK = LinkModel(latency_s=0.0008009968308478892, gbps=257.0159795393923)

PRESETS: dict[str, SimCalibration] = {
    "h100": SimCalibration(
        gpu="h100",
        device="NVIDIA H100 80GB HBM3",
        memory_gib=79.2,
        hbm_gbps=3018.1251537845983,
        matmul_tflops=736.5126683367967,
        decode_efficiency=(
            (1, 0.7645291371728052),
            (8, 0.6840980846384851),
            (32, 0.6372696161467476),
            (64, 0.6074532125852342),
        ),
        prefill_efficiency=0.7584031830655169,
        link=_NVLINK,
        sources=("docs/benchmarks/gpu_engine_h100.json", "docs/benchmarks/kv_transfer_h200x2.json"),
    ),
    "h200": SimCalibration(
        gpu="h200",
        device="NVIDIA H200",
        memory_gib=140.4,
        hbm_gbps=4300.266299150248,
        matmul_tflops=710.7491266835175,
        decode_efficiency=((1, 0.7589290753033434), (32, 0.6850706500209915), (64, 0.6804361470150669)),
        prefill_efficiency=0.7970290954821174,
        link=_NVLINK,
        sources=("docs/benchmarks/gpu_engine_async_h200.json", "docs/benchmarks/kv_transfer_h200x2.json"),
    ),
}
"""``calibrate`` of each preset's ``sources`` (``tests/test_sim_engine.py`` keeps them equal)."""


def load_calibration(gpu: str, path: str = "") -> SimCalibration:
    """The preset named ``gpu``, or the calibration in ``path`` (a calibration JSON, or a
    gpu_engine benchmark JSON that replaces the preset's GPU figures and keeps its link and memory)."""
    if gpu not in PRESETS:
        raise ValueError(f"unknown simulated GPU {gpu!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[gpu]
    if not path:
        return preset
    d = json.loads(Path(path).read_text())
    if d.get("benchmark") == "gpu_engine":
        return calibrate(gpu, preset.memory_gib, d, preset.link, (str(path),))
    return SimCalibration.from_json(d)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.engine.sim.calibration",
        description="A simulator calibration from pdserve's gpu_engine and kv_transfer benchmark JSONs.",
    )
    p.add_argument("--gpu", required=True, help="short name, e.g. h100")
    p.add_argument("--memory-gib", type=float, required=True, help="the GPU's memory in GiB")
    p.add_argument("--gpu-engine", required=True, help="a gpu_engine benchmark JSON")
    p.add_argument("--kv-transfer", required=True, help="a kv_transfer benchmark JSON (two GPUs)")
    p.add_argument("--transport", default="nixl", help="whose figures make the link (nixl, nccl)")
    p.add_argument("--out", default="", help="write here (default: stdout)")
    args = p.parse_args(argv)
    link = fit_link(json.loads(Path(args.kv_transfer).read_text()), args.transport)
    cal = calibrate(
        args.gpu,
        args.memory_gib,
        json.loads(Path(args.gpu_engine).read_text()),
        link,
        (args.gpu_engine, args.kv_transfer),
    )
    text = json.dumps(cal.to_json(), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
