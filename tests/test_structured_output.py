"""Structured output in the engine: the bitmask, the matcher's life cycle, and outputs that obey
their grammar under sync and async scheduling, preemption, abort and P/D's first token.

The bitmask and matcher tests are pure logic (a handful of tokens); the engine tests run
``random:tiny`` (random weights, the default model's tokenizer), whose unconstrained output is
noise, so a valid output is the mask's doing.
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import Future

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.engine.structured_output import (
    StructuredOutputRequest,
    apply_token_bitmask,
    choice_grammar,
    parse,
    unpack_bitmask,
)
from pdserve.sampling_params import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

# -- the bitmask -------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [37, 1000, 49152])
def test_bitmask_application_matches_its_plain_meaning(vocab):
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 5
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(num_rows, vocab, generator=gen)
    rows = [0, 3, 4]
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask, vocab)
    for i in rows:
        expected[i][~allowed[i]] = float("-inf")
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[2]).all()  # rows without a mask


def test_unpack_bitmask_bit_order():
    bitmask = torch.tensor([[0b101, -1]], dtype=torch.int32)  # tokens 0 and 2; then 32..63 all
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[0, :32].nonzero().flatten().tolist() == [0, 2]
    assert allowed[0, 32:].all()


# -- the matcher on a toy vocabulary -----------------------------------------------------------

VOCAB = ["<eos>", "a", "b", "c", "ab", "-", "1", "2"]
EOS = 0


def _grammar(regex: str) -> StructuredOutputRequest:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex)
    fut: Future = Future()
    fut.set_result(compiled)
    return StructuredOutputRequest(fut)


def _allowed(g: StructuredOutputRequest) -> list[str]:
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    g.matcher.fill_next_token_bitmask(bitmask, 0)
    return [VOCAB[t] for t in unpack_bitmask(bitmask, len(VOCAB))[0].nonzero().flatten().tolist()]


def test_matcher_follows_outputs_and_terminates_at_eos():
    g = _grammar(r"a+-[12]")
    assert g.ready and _allowed(g) == ["a"]
    out = [1, 1]  # "a", "a"
    g.advance(out)
    assert g.num_accepted == 2 and _allowed(g) == ["a", "-"]
    g.advance(out)  # nothing new: nothing fed twice
    assert g.num_accepted == 2
    out += [5, 7]  # "-", "2": the grammar is complete, only its end may follow
    g.advance(out)
    assert _allowed(g) == ["<eos>"] and not g.is_terminated
    out.append(EOS)
    g.advance(out)
    assert g.is_terminated and not g.rejected


def test_matcher_created_late_catches_up_and_flags_a_rejected_token():
    fut: Future = Future()
    g = StructuredOutputRequest(fut)
    out = [1, 5]  # a first token that came from elsewhere (a prefill node), then one more
    g.advance(out)  # not compiled yet: nothing is fed, nothing lost
    assert not g.ready and g.matcher is None and g.num_accepted == 0
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    fut.set_result(xgr.GrammarCompiler(info, max_threads=1).compile_regex(r"a-[12]"))
    g.advance(out)
    assert g.num_accepted == 2 and _allowed(g) == ["1", "2"]
    g.advance(out + [3])  # "c" breaks the grammar: flagged, counted, not fatal
    assert g.rejected and g.num_accepted == 3
    g.close()
    assert g.closed and g.matcher is None


def test_choice_grammar_and_malformed_constraints():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    spec = StructuredOutputsParams(choice=["ab", 'a"b'])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parse(spec)))
    assert matcher.accept_string("ab") and matcher.is_completed()
    assert choice_grammar(['a"b']) == 'root ::= "a\\"b"'
    for bad, kind in [
        (StructuredOutputsParams(json={"type": "frobnicate"}), "json"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
    ]:
        with pytest.raises(ValueError, match=f"invalid structured output {kind}: ") as info_:
            parse(bad)
        assert ".cc:" not in str(info_.value)  # xgrammar's source location is cut


def test_params_shape():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.json == '{"type":"object","properties":{"b":{},"a":{}}}'  # the order is kept
    assert spec.kind == "json" and StructuredOutputsParams(json_object=True).kind == "json_object"


# -- in the engine (random:tiny) ---------------------------------------------------------------

PATTERN = r"[a-c]{2,4}-[0-9]{3}"


def _params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=PATTERN),
        **kw,
    )


@pytest.fixture(scope="module")
def tiny():
    return LLM(
        "random:tiny",
        num_kv_blocks=64,
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=512,
        max_num_seqs=8,
    )


def _check_idle(llm: LLM) -> None:
    engine = llm.engine
    while engine.has_work():
        engine.step()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    engine.scheduler.check_integrity()
    assert not engine._states  # every request's grammar state was dropped


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_follow_the_grammar_and_stop_at_its_end(tiny, async_scheduling):
    tiny.engine.async_scheduling = async_scheduling
    prompts = [f"prompt {i} " * (i + 1) for i in range(6)]
    unconstrained = tiny.generate(prompts[:2], SamplingParams(temperature=1.0, seed=0, max_tokens=12))
    assert not any(re.fullmatch(PATTERN, o.outputs[0].text) for o in unconstrained)
    outs = tiny.generate(prompts, [_params(i) for i in range(6)])
    for o in outs:
        c = o.outputs[0]
        assert re.fullmatch(PATTERN, c.text), c.text
        assert c.finish_reason == "stop" and c.stop_reason is None  # the grammar's end: EOS
        assert c.token_ids[-1] in tiny.engine.eos_token_ids
    _check_idle(tiny)


def test_same_tokens_sync_and_async(tiny):
    prompts = ["alpha", "beta beta", "gamma gamma gamma"]
    runs = []
    for async_scheduling in (False, True):
        tiny.engine.async_scheduling = async_scheduling
        runs.append([o.outputs[0].token_ids for o in tiny.generate(prompts, [_params(i) for i in range(3)])])
        assert tiny.engine.scheduler.kv.pool.reset_prefix_cache() or True
    assert runs[0] == runs[1]
    _check_idle(tiny)


def test_ignore_eos_still_ends_when_the_grammar_does(tiny):
    tiny.engine.async_scheduling = False
    out = tiny.generate(["x"], _params(3, ignore_eos=True))[0].outputs[0]
    assert re.fullmatch(PATTERN, out.text) and out.finish_reason == "stop"
    _check_idle(tiny)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_the_matcher_in_step(async_scheduling):
    # 6 blocks of 16 tokens cannot hold four ~40-token prompts and their outputs at once.
    llm = LLM(
        "random:tiny",
        num_kv_blocks=12,
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    pattern = r"[a-c]{20,30}"
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=pattern)
        )
        for i in range(4)
    ]
    outs = llm.generate([f"{i} " + "word " * 40 for i in range(4)], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    _check_idle(llm)


def test_abort_and_finish_close_the_matcher(tiny):
    engine = tiny.engine
    engine.async_scheduling = True
    a = engine.add_request("so-a", "abort me", _params(1))
    b = engine.add_request("so-b", "finish me", _params(2))
    while b.structured_output.num_accepted < 2:
        engine.step()
    engine.abort_request(["so-a"])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.structured_output.closed
    while not b.is_finished:
        engine.step()
    assert b.structured_output.closed and b.structured_output.num_accepted == len(b.output_token_ids)
    _check_idle(tiny)


def _prefill_first_token(engine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    """The prefill side: max_tokens=1 and hold_blocks, as the prefill node runs it."""
    import dataclasses

    engine.add_request(rid, None, dataclasses.replace(params, max_tokens=1), prompt, hold_blocks=True)
    while True:
        for out in engine.step():
            return out.outputs[0].token_ids[0]


def _land_and_finish(engine, request_id: str, prompt, params, first: int):
    """The decode side: reserve, the KV "lands" with the prefill node's first token, run to the
    end; the request's last completion."""
    assert engine.reserve_remote(request_id, prompt, params) is not None
    engine.remote_kv_landed(request_id, first, None, b"", 0)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].outputs[0]


def test_remote_first_token_advances_the_decode_side_matcher(tiny):
    """P/D: the prefill engine samples the first token under the mask; the decode engine's matcher
    takes it before its first step, so the whole output obeys the grammar."""
    engine = tiny.engine
    engine.async_scheduling = False
    prompt = engine.tokenize("first token elsewhere")
    params = _params(5)
    first = _prefill_first_token(engine, "pre", prompt, params)
    assert re.fullmatch(r"[a-c]", tiny.get_tokenizer().decode([first]).strip()[:1])
    engine.release_held("pre")
    out = _land_and_finish(engine, "dec", prompt, params, first)
    assert out.token_ids[0] == first and re.fullmatch(PATTERN, out.text), out.text
    _check_idle(tiny)


def test_landed_request_whose_grammar_compiles_late_waits_and_catches_up(tiny, monkeypatch):
    """P/D race: the decode node's grammar is still compiling when the prompt's KV lands with the
    first token. The first decode step must wait for it and mask from the state after that token
    (a matcher made late once started from scratch there and let the grammar begin again)."""
    import threading

    engine = tiny.engine
    engine.async_scheduling = False
    prompt = engine.tokenize("first token elsewhere")
    params = _params(11)
    first = _prefill_first_token(engine, "pre2", prompt, params)
    engine.release_held("pre2")
    real = engine.structured.request

    def late(spec):
        compiled = real(spec)._compiled
        fut: Future = Future()
        threading.Timer(0.3, lambda: fut.set_result(compiled.result())).start()
        return StructuredOutputRequest(fut)

    monkeypatch.setattr(engine.structured, "request", late)
    out = _land_and_finish(engine, "dec2", prompt, params, first)
    assert out.token_ids[0] == first and re.fullmatch(PATTERN, out.text), out.text
    _check_idle(tiny)


def test_malformed_constraint_is_refused_when_added(tiny):
    with pytest.raises(ValueError, match="invalid structured output json"):
        tiny.engine.add_request(
            "bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(json="{"))
        )
    assert not tiny.engine.has_request("bad")


@pytest.mark.gpu
def test_gpu_mask_with_cuda_graphs_and_async_scheduling():
    """On CUDA the mask is applied to the logits after a graph replay: the same tokens whether
    decode steps replay graphs under async scheduling or run eagerly and synchronously, and every
    output follows its grammar. Random weights (``random:tiny``, the default model's tokenizer),
    so the GPU host needs no model download: a valid output is the mask's doing."""
    # Both engines live at once: a fixed KV cache each (a sized one would take the GPU's memory).
    kwargs = dict(
        dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=512
    )
    fast = LLM("random:tiny", async_scheduling=True, **kwargs)
    assert fast.engine.runner.graphs is not None and fast.engine.async_scheduling
    replays = []
    run = fast.engine.runner.graphs.run
    fast.engine.runner.graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    plain = LLM("random:tiny", async_scheduling=False, enforce_eager=True, **kwargs)
    prompts = [f"prompt {i} " * (i + 1) for i in range(12)]
    # Greedy: graphs and eager agree bit for bit on greedy tokens (test_cuda_graphs).
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=PATTERN)
    )
    got = fast.generate(prompts, params)
    assert replays, "no decode step replayed a graph"
    for out in got:
        assert re.fullmatch(PATTERN, out.outputs[0].text), out.outputs[0].text
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, params)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_resumed_request_goes_on_where_it_stopped(tiny, async_scheduling):
    """The proxy resumes a request whose node died as prompt + the tokens streamed so far
    (``resumed_tokens``): the grammar and the output penalties take those as output, so the rest
    is what the unmoved request would have produced (greedy: the very same tokens)."""
    tiny.engine.async_scheduling = async_scheduling
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        structured_outputs=StructuredOutputsParams(regex=PATTERN),
    )
    whole = tiny.generate("resume me", params)[0]
    tokens, text = whole.outputs[0].token_ids, whole.outputs[0].text
    assert re.fullmatch(PATTERN, text), text
    k = 3
    assert len(tokens) > k + 1
    resumed = dataclasses.replace(params, max_tokens=40 - k, resumed_tokens=k)
    rest = tiny.generate({"prompt_token_ids": whole.prompt_token_ids + tokens[:k]}, resumed)[0].outputs[0]
    assert rest.token_ids == tokens[k:]
    # Without it the grammar would start afresh after the moved tokens (and the penalties forget them).
    fresh = dataclasses.replace(params, max_tokens=40 - k)
    again = tiny.generate({"prompt_token_ids": whole.prompt_token_ids + tokens[:k]}, fresh)[0].outputs[0]
    assert again.token_ids != tokens[k:]
    _check_idle(tiny)
