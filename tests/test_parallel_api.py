"""Integration: n, best_of, several prompts, logit_bias and echo with logprobs through the `openai`
client, on a P/D pair (prefill node -> decode node) and on a co-located node, against LLM.generate.

One cluster holds a prefill, a decode and a co-located node; a proxy over the first two and one over
the third serve the two cases.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.messages import NodeLoad, decode
from pdserve.metrics import parse_text

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "Three primary colors are",
    "The ocean is",
    "Twelve times twelve equals",
    "A synonym for happy is",
    "Romeo and Juliet was written by",
    "Two planets of the solar system are",
    "In Spanish, good morning is",
]


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(prefill_nodes=1, decode_nodes=1, both_nodes=1, redis_url="none") as c:
        yield c


@pytest.fixture(scope="module", params=["pd", "colocated"])
def setup(request, cluster):
    """(proxy url, the node that computes prompts, the node that decodes) for one of the two cases."""
    if request.param == "pd":
        (prefill,), (decode,) = cluster.node_urls("prefill"), cluster.node_urls("decode")
        proxy = cluster.add_proxy(
            "--prefill-urls", prefill, "--decode-urls", decode, "--min-remote-prefill-tokens", "0"
        )
        return request.param, proxy, prefill, decode
    (both,) = cluster.node_urls("both")
    return request.param, cluster.add_proxy("--both-urls", both), both, both


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def client(setup):
    from openai import OpenAI

    return OpenAI(base_url=f"{setup[1]}/v1", api_key="none", max_retries=0, timeout=300)


def prompt_tokens_computed(url: str) -> float:
    return parse_text(httpx.get(f"{url}/metrics").text)["pdserve_prompt_tokens_computed_total"]


def wait_idle(*urls: str, timeout: float = 20.0) -> None:
    """Every pool back to its idle free count, nothing queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [decode(httpx.get(f"{u}/internal/load", timeout=10).content, NodeLoad) for u in set(urls)]
        if all(lo.free_blocks == lo.total_blocks and not (lo.running or lo.waiting) for lo in loads):
            return
        assert time.monotonic() < deadline, f"pools not idle: {loads}"
        time.sleep(0.2)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n4_greedy_equals_llm_generate_and_the_prompt_runs_once(setup, client, llm, chat, stream):
    case, _, computes, decodes = setup
    text = f"Request {uuid.uuid4().hex[:8]}: the capital of France is"  # no prefix cache holds it
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    messages = [{"role": "user", "content": text}]
    ref = (llm.chat(messages, greedy) if chat else llm.generate(text, greedy))[0]
    four = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=4)
    offline = (llm.chat(messages, four) if chat else llm.generate(text, four))[0]
    assert [c.text for c in offline.outputs] == [ref.outputs[0].text] * 4

    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, n=4)
    create = client.chat.completions.create if chat else client.completions.create
    kw.update(messages=messages) if chat else kw.update(prompt=text)
    before, before_decode = prompt_tokens_computed(computes), prompt_tokens_computed(decodes)
    texts: dict[int, str] = {}
    if stream:
        finished = set()
        for chunk in create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if chat else c.text)
                if c.finish_reason:
                    finished.add(c.index)
            usage = chunk.usage
        assert finished == {0, 1, 2, 3}
    else:
        r = create(**kw)
        texts = {c.index: c.message.content if chat else c.text for c in r.choices}
        usage = r.usage
    assert sorted(texts) == [0, 1, 2, 3] and list(texts.values()) == [ref.outputs[0].text] * 4
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == 4 * len(ref.outputs[0].token_ids)
    # The prompt runs once (never 4 times; its cached prefix not at all); each forked sequence
    # recomputes its last token.
    num_prompt = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    if case == "pd":
        assert prompt_tokens_computed(computes) - before == num_prompt
        assert prompt_tokens_computed(decodes) - before_decode == 3
    else:
        assert prompt_tokens_computed(computes) - before == num_prompt + 3
    wait_idle(computes, decodes)


def test_seeded_sequences_equal_llm_generate(client, llm):
    prompt = "Once upon a time"
    ref = llm.generate(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=8, n=3))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.text for c in r.choices] == [c.text for c in ref.outputs]
    assert len(set(c.text for c in r.choices)) > 1


def test_best_of_returns_the_n_most_likely(client, llm):
    prompt = "My favourite animal is"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=3)
    every = client.completions.create(n=4, logprobs=0, **kw)
    cumulative = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(range(4), key=lambda i: -cumulative[i])[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked]
    assert all(c.logprobs is None for c in best.choices)
    ref = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=2, best_of=4))[0]
    assert [c.text for c in best.choices] == [c.text for c in ref.outputs]


def test_eight_prompts_in_one_request_come_back_in_order(client, llm):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ref = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    kw = dict(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(8)) and [c.text for c in r.choices] == ref
    singles = [client.completions.create(**{**kw, "prompt": p}).usage for p in PROMPTS[:2]]
    assert r.usage.prompt_tokens > sum(u.prompt_tokens for u in singles)  # all eight counted

    texts = [""] * 8
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == ref
    with_n = client.completions.create(**{**kw, "prompt": PROMPTS[:2], "n": 2})
    assert [c.text for c in with_n.choices] == [ref[0], ref[0], ref[1], ref[1]]


def test_logit_bias(client, llm):
    prompt = "The capital of France is"
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    banned = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0]
    first_text = llm.get_tokenizer().decode([first])
    assert banned.logprobs.tokens[0] != first_text
    forced = client.completions.create(logit_bias={"1820": 100}, **{**kw, "temperature": 0.9}).choices[0]
    assert forced.logprobs.tokens == [llm.get_tokenizer().decode([1820])] * 4


def test_echo_with_logprobs(client, llm):
    prompt = "Paris is the capital of"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, logprobs=1))[0]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    num_prompt = len(ref.prompt_token_ids)
    for stream in (False, True):
        if stream:
            text, tokens, lps = "", [], []
            for chunk in client.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.text
                    if c.logprobs:
                        tokens += c.logprobs.tokens
                        lps += c.logprobs.token_logprobs
        else:
            choice = client.completions.create(**kw).choices[0]
            text, tokens, lps = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        assert text == prompt + ref.outputs[0].text
        assert len(tokens) == num_prompt + 3 and lps[0] is None
        expected = [lp.logprob for lp in ref.prompt_logprobs[1:]] + [
            lp.logprob for lp in ref.outputs[0].logprobs
        ]
        assert lps[1:] == pytest.approx(expected, abs=2e-3)


def test_pools_are_idle_afterwards(setup):
    wait_idle(setup[2], setup[3])
