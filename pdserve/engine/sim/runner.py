"""The simulated model runner and sampler: what ``LLMEngine`` runs instead of the model's forward.

``SimModelRunner`` has ``ModelRunner``'s interface. ``execute`` puts the step on a simulated device
timeline: the step starts when the previous one ends, or now if the device is idle, and ends
``StepTimeModel.step_seconds`` later; it returns at once (as a CUDA launch does). The sampler's
``PendingSample.get`` then sleeps until the step's end, as the host waits for a GPU's copy, so a
simulated node spends its time asleep, not computing. Under async scheduling (on for simulated
nodes, as on CUDA) the host prepares step N+1 while step N "runs", so the host's own cost per step
is hidden as long as it stays under the step's modelled time, as it is on a GPU.

Tokens are a deterministic function of the prompt and the position (a hash, never EOS, within the
first ``SIM_VOCAB`` ids so that the default model's tokenizer reads them): the same prompt gives
the same text on every node, so a decode node continues the first token a prefill node sampled.
Sampling parameters do not change them; a row that asks for logprobs gets its token at logprob 0.

The KV cache is real in its block ids and layers, tiny in its payload: ``[L, NB, 2, 1, 1, 1]``,
one element per layer, K or V and block. Transports move these few bytes; the ``sim`` transport
adds the time the real bytes (``bytes_per_block``) would take on the calibrated link.
"""

from __future__ import annotations

import array
import hashlib
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.request import Request
from pdserve.engine.sampler import SamplerOutput, SamplingRow
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sim.calibration import GIB, SimCalibration
from pdserve.engine.sim.step_time import StepTimeModel
from pdserve.logprobs import TokenLogprobs

SIM_VOCAB = 49152
"""Token ids stay under this: the vocabulary of the default model, whose tokenizer simulated
models use."""
_FIRST_TOKEN = 256  # above every special token of that tokenizer
_MASK = (1 << 64) - 1
_RUNTIME_RESERVE_BYTES = 1 * GIB
"""GPU memory a real node loses to the CUDA context, CUDA graphs and allocator slack."""


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of ``x``."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class SimStep:
    """A launched step: when it ends on the simulated device, and the tokens its rows sample."""

    done_at: float  # time.monotonic()
    token_ids: list[int]


class SimModelRunner:
    """``ModelRunner``'s stand-in: real block ids and scheduling, modelled step times."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, calibration: SimCalibration) -> None:
        self.config = config
        self.arch = arch
        self.calibration = calibration
        self.block_size = config.cache.block_size
        dtype_bytes = config.torch_dtype.itemsize
        self.timing = StepTimeModel(arch, dtype_bytes, calibration)
        self.kv_cache: torch.Tensor | None = None  # [L, NB, 2, 1, 1, 1]
        self.num_steps = 0
        self.busy_s = 0.0
        """Modelled device time of every step so far."""
        self._device_free_at = 0.0
        self._token_range = max(1, min(arch.vocab_size, SIM_VOCAB) - _FIRST_TOKEN)
        self._eos = frozenset(arch.eos_token_ids)
        self._seeds: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    @property
    def bytes_per_block(self) -> int:
        """What a block of the simulated model's KV cache holds on the GPU."""
        return self.timing.kv_bytes_per_token * self.block_size

    def determine_num_blocks(self, sample=None) -> int:
        """As on the GPU: its memory x ``gpu_memory_utilization``, less weights, the activations of
        a full-budget step and a runtime reserve, in blocks of the real size (``sample``, the
        sampler's profile on the GPU, is not run: it has no device). Against the real engine's
        plans on one H100 (``docs/benchmarks/kv_memory_plan_h100.json``, which measure the sampler's
        worst case and the CUDA graphs instead): -1.0 to +0.9 % of its blocks."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        sched = self.config.scheduler
        a = self.arch
        dtype_bytes = self.config.torch_dtype.itemsize
        per_token = (2 * a.intermediate_size + 4 * a.hidden_size) * dtype_bytes
        activations = sched.max_num_batched_tokens * per_token
        activations += sched.max_num_seqs * a.vocab_size * 4  # float32 logits
        budget = self.calibration.memory_gib * GIB * cache.gpu_memory_utilization
        budget -= self.timing.weight_bytes + activations + _RUNTIME_RESERVE_BYTES
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the model's weights leave no room for a KV cache on a simulated {self.calibration.gpu}"
            )
        return num_blocks

    def warm_up(self) -> None:
        """Nothing to compile: the simulated device runs no kernels."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = torch.zeros(  # block-major, as the real runner's
            num_blocks, self.arch.num_layers, 2, 1, 1, 1, dtype=self.config.torch_dtype
        ).transpose(0, 1)

    def execute(
        self,
        out: SchedulerOutput,
        device_inputs: object = None,
        layer_events: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> SimStep:
        """Queue the step on the simulated device; returns when it ends and what it samples.

        ``device_inputs`` (the previous step's tokens) are not read: tokens depend on the prompt
        and the position alone. A simulated model has no logits: ``prompt_logprobs`` stays empty
        (echo with logprobs returns none). ``layer_events`` stays empty: the KV counts as written at launch.
        """
        rows = []
        tokens = []
        for s in out.scheduled:
            rows.append((s.start, s.num_tokens, s.needs_sample))
            if s.needs_sample:
                tokens.append(self._token(s.request, s.start + s.num_tokens))
        seconds = self.timing.step_seconds(rows)
        now = time.monotonic()
        done_at = max(now, self._device_free_at) + seconds
        self._device_free_at = done_at
        self.num_steps += 1
        self.busy_s += seconds
        return SimStep(done_at, tokens)

    def _token(self, request: Request, position: int) -> int:
        """The token at ``position`` (0-based, in prompt + output) of ``request``'s sequence."""
        seed = self._seeds.get(request)
        if seed is None:
            ids = request.prompt_token_ids
            digest = hashlib.blake2b(array.array("q", ids).tobytes(), digest_size=8).digest()
            seed = self._seeds[request] = int.from_bytes(digest, "little")
        token = _FIRST_TOKEN + _mix((seed + position * 0x9E3779B97F4A7C15) & _MASK) % self._token_range
        return _FIRST_TOKEN if token in self._eos else token


class SimPendingSample:
    """``PendingSample``'s stand-in: the tokens are known at launch, the host waits for the step."""

    def __init__(self, step: SimStep, rows: Sequence[SamplingRow]) -> None:
        self.done_at = step.done_at
        self.token_ids = step.token_ids  # what a next step's device inputs would read
        self._rows = rows

    def synchronize(self) -> None:
        """Sleep until the step has run on the simulated device."""
        delay = self.done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def get(self) -> SamplerOutput:
        self.synchronize()
        logprobs: list[TokenLogprobs | None] = []
        for token, row in zip(self.token_ids, self._rows):
            n = row.params.logprobs
            if n is None:
                logprobs.append(None)
                continue
            # All the probability on the token; the runners-up far behind, in id order.
            span = SIM_VOCAB - _FIRST_TOKEN
            others = [(_FIRST_TOKEN + (token - _FIRST_TOKEN + k) % span, -30.0) for k in range(1, n)]
            top = [(token, 0.0), *others]
            logprobs.append(TokenLogprobs(token_id=token, logprob=0.0, rank=1, top=tuple(top[:n])))
        return SamplerOutput(token_ids=list(self.token_ids), logprobs=logprobs)


class SimSampler:
    """``Sampler``'s stand-in: the tokens come with the step (``SimStep``)."""

    def sample(self, step: SimStep, rows: Sequence[SamplingRow]) -> SimPendingSample:
        if len(step.token_ids) != len(rows):
            raise ValueError(f"{len(step.token_ids)} simulated tokens for {len(rows)} rows")
        return SimPendingSample(step, rows)
