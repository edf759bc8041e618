"""Fuzzing the proxy's public HTTP surface on a real cluster.

Requests come from the running proxy's own OpenAPI schema (``/openapi.json``; a small
schema-to-hypothesis walker, so no extra dependency) plus deliberately malformed variants:
random JSON, fields of the wrong type, random bytes, random Unicode (lone surrogates
included), wrong methods and content types. Every answer must be below 500 and every error
OpenAI-shaped; at the end every process is alive, the pools are idle and a normal request is
served. ``PDSERVE_FUZZ_CASES`` sets the number of cases (default 200: 300 took 75 s on two
loaded cores, plus about 40 s to start the cluster).

Generation stays cheap: nodes run with --max-model-len 512, the proxy with
--default-max-tokens 8, and generated integers never fall between 13 and 999, so a request
that does generate asks for at most 16 tokens (the completions default).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdserve.cluster import LocalCluster
from pdserve.messages import NodeLoad, decode

MODEL = "SmolLM2-135M-Instruct"
NUM_CASES = int(os.environ.get("PDSERVE_FUZZ_CASES", "200"))
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/nope"]


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(
        ["--max-model-len", "512"],
        redis_url="none",
        min_remote_prefill_tokens=0,
        extra_proxy_flags="--default-max-tokens 8 --max-request-body-bytes 262144",
    ) as c:
        yield c


def _load(node_url: str) -> NodeLoad:
    return decode(httpx.get(f"{node_url}/internal/load", timeout=10).content, NodeLoad)


def _wait_idle(c: LocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    nodes = [x for x in c.children if not x.role.startswith("proxy")]
    while True:
        loads = {x.role: _load(x.url) for x in nodes}
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


# -- strategies from the OpenAPI schema ------------------------------------------------------

# Any Unicode, lone surrogates included (json.dumps escapes them as \udXXX, which JSON allows).
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["", "Hello", "\ud800", "\U0001f600" * 5, "e\u0301\u0301", "\u4e2d" * 600, "hello " * 600]
)
INTS = (
    st.integers(-3, 12)
    | st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, 49152])
    | st.integers(min_value=1000)
    | st.integers(max_value=-4)
)
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.1, 2.0])
JSON = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a JSON schema (the subset FastAPI writes); now and then any JSON instead."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if depth > 6:
        return JSON
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs, depth + 1) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {
            name: from_schema(sub, defs, depth + 1) | (JSON if depth else st.nothing())
            for name, sub in props.items()
        }
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        ) | (st.dictionaries(TEXT, JSON, max_size=3) if schema.get("additionalProperties") else st.nothing())
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs, depth + 1), max_size=4)
    return {
        "string": TEXT,
        "integer": INTS,
        "number": FLOATS | INTS,
        "boolean": st.booleans(),
        "null": st.none(),
    }.get(kind, JSON)


def _body_schema(spec: dict, path: str) -> dict:
    content = spec["paths"][path]["post"]["requestBody"]["content"]
    return content["application/json"]["schema"]


def cases(spec: dict) -> st.SearchStrategy:
    """(method, path, headers, body bytes) of one request."""
    defs = spec.get("components", {}).get("schemas", {})
    json_ct = {"content-type": "application/json"}
    posts = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = from_schema(_body_schema(spec, path), defs)
        # Mostly the served model, so that requests get past the model check and generate.
        body = st.tuples(body, st.sampled_from([MODEL, MODEL, MODEL, None, "other"])).map(
            lambda t: {**t[0], "model": t[1]} if isinstance(t[0], dict) and t[1] else t[0]
        )
        posts.append(st.tuples(st.just("POST"), st.just(path), st.just(json_ct), body.map(_dumps)))
    # Plausible requests, so that many get past validation and exercise generation and streaming.
    plausible = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 8)},
        optional={
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "top_k": st.integers(-1, 50),
            "min_p": st.floats(0, 1),
            "seed": st.integers(0, 2**32),
            "stop": st.lists(TEXT.filter(bool), max_size=3),
            "ignore_eos": st.booleans(),
            "presence_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.5, 2),
            "min_tokens": st.integers(0, 2),
        },
    )
    completion = st.tuples(
        plausible,
        TEXT.filter(bool) | st.lists(st.integers(0, 49151), min_size=1, max_size=20),
        st.booleans(),
        st.none() | st.integers(0, 3),
    ).map(lambda t: {**t[0], "prompt": t[1], "echo": t[2] and t[3] is None, "logprobs": t[3]})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
    )
    chat = st.tuples(plausible, st.lists(message, min_size=1, max_size=3), st.booleans()).map(
        lambda t: {**t[0], "messages": t[1], "logprobs": t[2]}
    )
    posts.append(
        st.tuples(st.just("POST"), st.just("/v1/completions"), st.just(json_ct), completion.map(_dumps))
    )
    posts.append(
        st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.just(json_ct), chat.map(_dumps))
    )
    generation_paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    malformed = st.one_of(
        # valid-looking bodies with one field of the wrong type
        st.tuples(
            st.just("POST"),
            generation_paths,
            st.just(json_ct),
            st.tuples(
                st.sampled_from(
                    [
                        "prompt",
                        "messages",
                        "max_tokens",
                        "temperature",
                        "stop",
                        "stream",
                        "logprobs",
                        "top_k",
                        "n",
                        "stream_options",
                        "seed",
                        "stop_token_ids",
                    ]
                ),
                JSON,
            ).map(
                lambda kv: _dumps(
                    {
                        "model": MODEL,
                        "prompt": "Hi",
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 2,
                        kv[0]: kv[1],
                    }
                )
            ),
        ),
        st.tuples(st.just("POST"), generation_paths, st.just(json_ct), JSON.map(_dumps)),
        st.tuples(st.just("POST"), generation_paths, st.just(json_ct), st.binary(max_size=200)),
        st.tuples(
            st.just("POST"),
            generation_paths,
            st.just(json_ct),
            TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
        ),
        st.tuples(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
            st.sampled_from(ROUTES),
            st.sampled_from(
                [
                    {},
                    json_ct,
                    {"content-type": "text/plain"},
                    {"content-type": "application/x-bad; charset=zz"},
                ]
            ),
            st.one_of(st.just(b""), JSON.map(_dumps), st.binary(max_size=50)),
        ),
    )
    return st.one_of(*posts, malformed)


def _dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=True).encode()


# -- the run ---------------------------------------------------------------------------------


def check_answer(r: httpx.Response, text: str) -> str | None:
    """What is wrong with one answer, or None."""
    if r.status_code >= 500:
        return f"{r.status_code}: {text[:300]}"
    if r.status_code >= 400 and r.request.method != "HEAD":
        try:
            error = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} without an OpenAI body: {text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not isinstance(error["message"], str):
            return f"{r.status_code} with a malformed error: {text[:300]}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [x for x in text.splitlines() if x]
        if not lines or lines[-1] != "data: [DONE]":
            return f"stream without [DONE]: {text[-300:]}"
        for line in lines[:-1]:
            event = json.loads(line.removeprefix("data: "))
            if "error" in event and (set(event["error"]) != {"message", "type", "param", "code"}):
                return f"stream with a malformed error: {line[:300]}"
            if "error" in event and int(event["error"].get("code") or 0) >= 500:
                return f"stream ended with a server error: {line[:300]}"
    return None


def test_fuzz_public_http_surface(cluster):
    url = next(x.url for x in cluster.children if x.role.startswith("proxy"))
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    start = time.monotonic()

    with httpx.Client(base_url=url, timeout=120) as client:

        @settings(
            max_examples=NUM_CASES,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # no shrinking against a live cluster: failures are listed below
            suppress_health_check=list(HealthCheck),
        )
        @given(cases(spec))
        def run(case):
            method, path, headers, body = case
            try:
                r = client.request(method, path, content=body or None, headers=headers)
                text = r.text
            except httpx.HTTPError as exc:
                failures.append(f"{method} {path}: {type(exc).__name__}: {exc} (body {body[:200]!r})")
                return
            statuses[r.status_code] += 1
            problem = check_answer(r, text)
            if problem:
                failures.append(f"{method} {path} {body[:200]!r} -> {problem}")

        run()

    elapsed = time.monotonic() - start
    total = sum(statuses.values()) + len([f for f in failures if "HTTPError" in f])
    print(f"\nproxy fuzz: {total} cases in {elapsed:.1f} s, statuses {dict(sorted(statuses.items()))}")
    assert not failures, f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures[:20])
    assert total >= min(NUM_CASES, 100) and statuses[200] > 0, statuses

    exited = [(c.role, c.proc.poll()) for c in cluster.children if c.proc.poll() is not None]
    assert not exited, exited
    _wait_idle(cluster)
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
