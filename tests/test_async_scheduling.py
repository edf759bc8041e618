"""Async scheduling: the same tokens as the synchronous engine, no leaked blocks, real overlap.

The engine's ``async_scheduling`` attribute is switched on one engine so both modes share the
weights; the prefix cache is reset between runs so both compute the same prompts.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampler import PendingSample


def _run(llm: LLM, async_scheduling: bool, prompts, params) -> list[RequestOutput]:
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    outs = llm.generate(prompts, params)
    while engine.has_work():  # the step that a late stop left in flight
        assert engine.step() == []
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    engine.scheduler.check_integrity()
    assert kv.pool.reset_prefix_cache()
    return outs


def _summary(out: RequestOutput) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)


def test_every_stop_and_sampling_option_matches_sync(llm):
    tok = llm.get_tokenizer()
    chat = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is the capital of France?", "Name three colors.")
    ]
    days = "The days of the week are Monday,"
    comma = tok.encode(",")[0]
    cases = [
        (chat[0], SamplingParams(temperature=0, max_tokens=40)),  # EOS
        (chat[1], SamplingParams(temperature=0, max_tokens=40, min_tokens=16)),  # EOS masked, then length
        (days, SamplingParams(temperature=0, max_tokens=30, stop=["Wednesday"])),  # stop string
        (days, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[comma])),  # stop id
        (days, SamplingParams(temperature=0, max_tokens=5)),  # length
        (days, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4)),
        (chat[1], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, presence_penalty=0.5)),
        (days, SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=12, ignore_eos=True)),
        (chat[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3)),
    ]
    prompts = [p for p, _ in cases]
    params = [p for _, p in cases]
    sync = _run(llm, False, prompts, params)
    reasons = {(o.outputs[0].finish_reason, type(o.outputs[0].stop_reason).__name__) for o in sync}
    assert reasons >= {("stop", "NoneType"), ("stop", "str"), ("stop", "int"), ("length", "NoneType")}
    assert len(sync[1].outputs[0].token_ids) >= 16  # 12 without min_tokens
    # Alone, with penalties in the batch (their steps are applied before the next is scheduled),
    # and without them (every step overlaps).
    for subset in (range(len(cases)), [0, 1, 2, 3, 4, 7, 8]):
        outs = _run(llm, True, [prompts[i] for i in subset], [params[i] for i in subset])
        for i, out in zip(subset, outs):
            assert _summary(out) == _summary(sync[i]), cases[i]
            ours, ref = out.outputs[0].logprobs, sync[i].outputs[0].logprobs
            if ref is not None:
                assert [lp.token_id for lp in ours] == [lp.token_id for lp in ref]
                assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in ref], abs=1e-5)
                assert [lp.rank for lp in ours] == [lp.rank for lp in ref]


def test_abort_mid_stream_leaves_no_blocks(llm):
    prompts = [f"Write a long story about {x}." for x in ("a fox", "the sea", "a robot", "winter")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync = _run(llm, False, prompts, params)

    engine = llm.engine
    engine.async_scheduling = True
    ids = [engine.new_request_id() for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished: dict[str, RequestOutput] = {}
    aborted = False
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
            elif out.request_id == ids[1] and len(out.outputs[0].token_ids) == 5 and not aborted:
                engine.abort_request([ids[1]])  # the step holding its 6th token is in flight
                aborted = True
        engine.scheduler.check_integrity()
    assert aborted and ids[1] not in finished
    assert [_summary(finished[i]) for i in (ids[0], ids[2], ids[3])] == [_summary(sync[i]) for i in (0, 2, 3)]
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert kv.pool.reset_prefix_cache()


def _tiny(async_scheduling: bool, **kwargs) -> LLMEngine:
    kwargs = dict(device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=4, **kwargs)
    return LLM("random:tiny", async_scheduling=async_scheduling, **kwargs).engine


def test_step_n_plus_1_is_launched_before_step_n_is_read(monkeypatch):
    """The order of device launches and host reads of sampled tokens, on an instrumented engine."""
    events: list[tuple[str, int]] = []
    engine = _tiny(True)
    execute = engine.runner.execute
    launches: list[PendingSample] = []  # each step's sampled tokens, held (ids are never reused)

    def traced_execute(out, *args):
        events.append(("launch", len(launches) + 1))
        return execute(out, *args)

    sample = engine.sampler.sample

    def traced_sample(logits, rows):
        pending = sample(logits, rows)
        launches.append(pending)
        return pending

    get = PendingSample.get

    def traced_get(self):
        events.append(("read", next(i for i, p in enumerate(launches, 1) if p is self)))
        return get(self)

    monkeypatch.setattr(engine.runner, "execute", traced_execute)
    monkeypatch.setattr(engine.sampler, "sample", traced_sample)
    monkeypatch.setattr(PendingSample, "get", traced_get)

    def run(params: SamplingParams) -> list[int]:
        events.clear()
        launches.clear()
        engine.add_request(engine.new_request_id(), None, params, prompt_token_ids=[5, 6, 7, 8])
        tokens = []
        while engine.has_work():
            tokens = next((o.outputs[0].token_ids for o in engine.step()), tokens)
        return tokens

    assert len(run(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))) == 4
    # Step N's tokens reach the host only after step N+1 was launched; max_tokens is known
    # ahead, so no fifth step is launched.
    assert events == [
        ("launch", 1),
        ("launch", 2),
        ("read", 1),
        ("launch", 3),
        ("read", 2),
        ("launch", 4),
        ("read", 3),
        ("read", 4),
    ]
    # Penalties count the output tokens on the host: every step is read before the next launch.
    assert len(run(SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.2))) == 3
    assert events == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2), ("launch", 3), ("read", 3)]


def test_stop_found_a_step_late_drops_the_extra_token(monkeypatch):
    sync, lagged = _tiny(False), _tiny(True)
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    sync.add_request("ref", None, params, prompt_token_ids=prompt)
    tokens = []
    while sync.has_work():
        tokens = next((o.outputs[0].token_ids for o in sync.step() if o.finished), tokens)
    assert len(tokens) == 8
    stop_id = tokens[2]
    want = tokens[: tokens.index(stop_id) + 1]

    execute = lagged.runner.execute
    launched = []
    monkeypatch.setattr(lagged.runner, "execute", lambda out, *a: launched.append(1) or execute(out, *a))
    stop = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    lagged.add_request("r", None, stop, prompt_token_ids=prompt)
    outputs = []
    while lagged.has_work():
        outputs += lagged.step()
        lagged.scheduler.check_integrity()
    assert [o.outputs[0].token_ids for o in outputs] == [want[: i + 1] for i in range(len(want))]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
    assert len(launched) == len(want) + 1  # the step that ran past the stop; its token is dropped
    kv = lagged.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_prefill_handoff_to_a_decode_engine():
    """hold_blocks prefill (max_tokens=1) on one engine, KV copied into another's reserved blocks."""
    prompt = list(range(20, 61))  # 41 tokens: the last block is partial
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    local = _tiny(False)
    local.add_request("ref", None, params, prompt_token_ids=prompt)
    want = None
    while local.has_work():
        want = next((o for o in local.step() if o.finished), want)

    prefill, decode = _tiny(True), _tiny(True)
    one = SamplingParams(temperature=0.8, seed=5, max_tokens=1, ignore_eos=True, logprobs=2)
    prefill.add_request("r", None, one, prompt_token_ids=prompt, hold_blocks=True)
    first = None
    steps = 0
    while prefill.has_work():
        first = next((o for o in prefill.step() if o.finished), first)
        steps += 1
    assert steps == 2  # launched once, applied by the next call: never scheduled a second time
    src = prefill.held_block_ids("r")
    dst = decode.reserve_remote("r", prompt, params)
    assert dst is not None and len(dst) == len(src)
    decode.runner.kv_cache[:, dst] = prefill.runner.kv_cache[:, src]
    state = prefill.generator_state("r")
    prefill.release_held("r")
    assert prefill.scheduler.kv.num_free_blocks == prefill.scheduler.kv.pool.num_blocks
    completion = first.outputs[0]
    landed = decode.remote_kv_landed("r", completion.token_ids[0], completion.logprobs[0], state, 0)
    assert landed is not None and not landed.finished
    got = None
    while decode.has_work():
        got = next((o for o in decode.step() if o.finished), got)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert [lp.logprob for lp in got.outputs[0].logprobs] == pytest.approx(
        [lp.logprob for lp in want.outputs[0].logprobs], abs=1e-5
    )
    assert decode.scheduler.kv.num_free_blocks == decode.scheduler.kv.pool.num_blocks
    decode.scheduler.check_integrity()
    assert got.outputs[0].finish_reason == "length" and decode.scheduler.requests == {}
