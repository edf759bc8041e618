"""How long one engine step takes on a simulated GPU: a roofline at the engine's measured efficiency.

A step runs a batch of rows; row i computes ``q_i`` tokens of a sequence whose first ``s_i`` tokens
are already in the KV cache (a decode row: ``q = 1``; a prefill chunk: ``q`` prompt tokens). It runs
two kinds of kernels one after the other, each bound by its own resource, so the step takes the sum
of two rooflines:

* the matmuls (projections, MLP, LM head): the larger of reading the weights once, ``weight
  bytes`` over ``hbm_gbps x decode_share(rows)``, and their arithmetic, ``2 x layer params x sum_i
  q_i + 2 x vocab x hidden`` per sampled row, over ``matmul_tflops x prefill_efficiency``;
* attention: the larger of reading every row's context, ``sum_i (s_i + q_i) x KV bytes per token``
  over the same bandwidth, and its arithmetic, ``4 x layers x heads x head_dim x sum_i q_i (s_i +
  q_i / 2)`` (causal QK^T and PV), over the same throughput.

A pure decode step is bandwidth-bound in both (weights + contexts over the bandwidth) and a long
prefill compute-bound in both (all its FLOPs over the throughput): exactly the rooflines
``pdserve.benchmarks.gpu_engine`` divides by to report its efficiencies (``calibration``), so a
decode step at a measured batch size and context, or the measured 2048-token prefill, takes the
time the GPU took. A mixed step pays its prefill chunk's matmuls and its decode rows' context
reads in turn: a model with one roofline for the whole step hid the reads under the chunk's
arithmetic, and had co-located replicas on shared prefixes stream at a TPOT p50 of 11.7 ms where
the GPUs took 21.1 (docs/benchmarks/README.md). Chunked steps, other shapes and batch sizes follow
the same rooflines.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.sim.calibration import SimCalibration


def weight_bytes(arch: ArchConfig, dtype_bytes: int) -> int:
    """Bytes of the model's weights (embeddings, decoder layers, final norm, LM head)."""
    embed = arch.vocab_size * arch.hidden_size
    lm_head = 0 if arch.tie_word_embeddings else embed
    return (embed + lm_head + arch.num_layers * layer_params(arch) + arch.hidden_size) * dtype_bytes


def layer_params(arch: ArchConfig) -> int:
    """Parameters of one decoder layer (biases and q/k norms left out: they move no needle)."""
    h = arch.hidden_size
    attention = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
    mlp = 3 * h * arch.intermediate_size
    return attention + mlp + 2 * h


class StepTimeModel:
    """Seconds of one step of ``arch`` (its weights and KV cache in ``dtype_bytes``-byte elements)
    on the calibrated GPU."""

    def __init__(self, arch: ArchConfig, dtype_bytes: int, calibration: SimCalibration) -> None:
        self.calibration = calibration
        self.weight_bytes = weight_bytes(arch, dtype_bytes)
        self.kv_bytes_per_token = 2 * arch.num_layers * arch.kv_size * dtype_bytes
        self._matmul_flops_per_token = 2 * arch.num_layers * layer_params(arch)
        self._attention_flops = 4 * arch.num_layers * arch.num_heads * arch.head_dim
        self._lm_head_flops = 2 * arch.vocab_size * arch.hidden_size
        self._bytes_per_s = calibration.hbm_gbps * 1e9
        self._flops_per_s = calibration.matmul_tflops * 1e12 * calibration.prefill_efficiency

    def step_seconds(self, rows: Iterable[tuple[int, int, bool]]) -> float:
        """Rows of ``(s, q, samples)``: cached tokens, tokens computed now, whether the row
        samples a token. No rows: 0."""
        num_rows = context = tokens = attention = samples = 0
        for s, q, sample in rows:
            num_rows += 1
            context += s + q
            tokens += q
            attention += q * s + q * q // 2
            samples += sample
        if not num_rows:
            return 0.0
        bytes_per_s = self._bytes_per_s * self.calibration.decode_share(num_rows)
        matmuls = max(
            self.weight_bytes / bytes_per_s,
            (self._matmul_flops_per_token * tokens + self._lm_head_flops * samples) / self._flops_per_s,
        )
        attends = max(
            context * self.kv_bytes_per_token / bytes_per_s,
            self._attention_flops * attention / self._flops_per_s,
        )
        return matmuls + attends

    def decode_seconds(self, batch: int, context: int) -> float:
        """A pure decode step: ``batch`` rows each with ``context`` tokens in all."""
        return self.step_seconds([(context - 1, 1, True)] * batch)

    def prefill_seconds(self, num_tokens: int) -> float:
        """One prompt of ``num_tokens`` from an empty cache, in one step."""
        return self.step_seconds([(0, num_tokens, True)])
