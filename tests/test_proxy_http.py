"""The proxy's public HTTP surface on a real cluster: bad input gets a 4xx with an OpenAI error
body (never a 5xx), API keys guard /v1/*, bodies are bounded (413) and so are requests in
flight (429 with Retry-After). After all of it, pools are idle and the cluster still serves.
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import threading
import time

import httpx
import pytest

from pdserve.cluster import LocalCluster
from pdserve.messages import NodeLoad, decode
from pdserve.proxy.config import ProxyConfig

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
MAX_BODY = 1024 * 1024
MAX_INFLIGHT = 2
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(
        ["--max-model-len", str(MAX_MODEL_LEN)],
        redis_url="none",
        min_remote_prefill_tokens=0,
        extra_proxy_flags=(
            f"--api-key {KEY} --max-inflight-requests {MAX_INFLIGHT} --max-request-body-bytes {MAX_BODY} "
            "--default-max-tokens 8"
        ),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def url(cluster) -> str:
    return next(x.url for x in cluster.children if x.role.startswith("proxy"))


def _wait_idle(c: LocalCluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    nodes = [x for x in c.children if not x.role.startswith("proxy")]
    while True:
        loads = {
            x.role: decode(httpx.get(f"{x.url}/internal/load", timeout=10).content, NodeLoad) for x in nodes
        }
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "<any>", text: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param != "<any>":
        assert error["param"] == param, error
    assert text.lower() in error["message"].lower(), error
    return error


def post(url: str, path: str, body, headers=None, **kw) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, (bytes, str)) or body is None:
        headers.setdefault("content-type", "application/json")
        return httpx.post(url + path, content=body, headers=headers, timeout=120, **kw)
    return httpx.post(url + path, json=body, headers=headers, timeout=120, **kw)


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


# (name, path, body, status, param, words in the message)
BAD = [
    ("malformed JSON", C, b'{"prompt": ', 400, None, "not valid JSON"),
    ("trailing garbage", C, b'{"prompt": "x"} x', 400, None, "not valid JSON"),
    ("array body", C, b"[1, 2]", 400, None, "JSON object"),
    ("string body", CH, b'"hello"', 400, None, "JSON object"),
    ("null body", C, b"null", 400, None, "JSON object"),
    ("empty body", C, b"", 400, None, "JSON object"),
    ("nested too deep", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nested"),
    ("not UTF-8", C, b'{"prompt": "\xff\xfe hi"}', 400, None, "UTF-8"),
    ("NaN temperature", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", "finite"),
    ("Infinity top_p", C, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p", "finite"),
    ("lone surrogate prompt", C, b'{"prompt": "\\ud800 hi"}', 400, "prompt", "surrogate"),
    (
        "lone low surrogate chat",
        CH,
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages[0].content",
        "surrogate",
    ),
    ("lone surrogate stop", C, b'{"prompt": "hi", "stop": ["\\ud800"]}', 400, "stop[0]", "surrogate"),
    ("lone surrogate model", C, b'{"prompt": "hi", "model": "\\ud800"}', 400, "model", "surrogate"),
    (
        "lone surrogate key",
        CH,
        b'{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
        400,
        "messages[0].\\ud800",  # ASCII-escaped: the error body must stay encodable
        "surrogate",
    ),
    ("max_tokens 0", C, comp(max_tokens=0), 400, "max_tokens", "at least 1"),
    ("max_tokens -1", CH, chat(max_tokens=-1), 400, "max_tokens", "at least 1"),
    ("max_completion_tokens 0", CH, chat(max_completion_tokens=0), 400, "max_completion_tokens", ""),
    ("max_tokens string", C, comp(max_tokens="ten"), 400, "max_tokens", "integer"),
    ("max_tokens 2**70", C, comp(max_tokens=2**70), 400, "max_tokens", ""),
    ("max_tokens over context", C, comp(max_tokens=600), 400, "max_tokens", "512"),
    ("temperature -0.5", C, comp(temperature=-0.5), 400, "temperature", ">= 0"),
    ("temperature string", CH, chat(temperature="hot"), 400, "temperature", ""),
    ("top_p 0", C, comp(top_p=0), 400, "top_p", "(0, 1]"),
    ("top_p 1.01", CH, chat(top_p=1.01), 400, "top_p", "(0, 1]"),
    ("top_k -2", C, comp(top_k=-2), 400, "top_k", ""),
    ("top_k 2**70", C, comp(top_k=2**70), 400, "top_k", ""),
    ("min_p 2", C, comp(min_p=2), 400, "min_p", ""),
    ("presence_penalty 3", C, comp(presence_penalty=3), 400, "presence_penalty", "[-2, 2]"),
    ("frequency_penalty -3", CH, chat(frequency_penalty=-3), 400, "frequency_penalty", "[-2, 2]"),
    ("repetition_penalty 0", C, comp(repetition_penalty=0), 400, "repetition_penalty", ""),
    ("logprobs 21", C, comp(logprobs=21), 400, "logprobs", "[0, 20]"),
    ("logprobs -1", C, comp(logprobs=-1), 400, "logprobs", "[0, 20]"),
    ("top_logprobs 21", CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    ("top_logprobs without logprobs", CH, chat(top_logprobs=2), 400, "top_logprobs", ""),
    ("min_tokens > max_tokens", C, comp(min_tokens=5), 400, "min_tokens", ""),
    ("stop_token_ids outside vocab", C, comp(stop_token_ids=[-5]), 400, "stop_token_ids", "vocabulary"),
    ("stop_token_ids 2**70", C, comp(stop_token_ids=[2**70]), 400, "stop_token_ids.0", ""),
    ("empty stop string", C, comp(stop=[""]), 400, "stop", "non-empty"),
    ("seed 2**70", C, comp(seed=2**70), 400, "seed", ""),
    ("stream string", C, comp(stream="maybe"), 400, "stream", ""),
    (
        "stream_options without stream",
        C,
        comp(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "",
    ),
    (
        "unknown role",
        CH,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages.0.role",
        "user",
    ),
    ("null role", CH, chat(messages=[{"role": None, "content": "hi"}]), 400, "messages.0.role", ""),
    ("missing role", CH, chat(messages=[{"content": "hi"}]), 400, "messages.0.role", "required"),
    ("empty messages", CH, chat(messages=[]), 400, "messages", "at least 1"),
    ("messages a string", CH, chat(messages="hi"), 400, "messages", "list"),
    ("content a number", CH, chat(messages=[{"role": "user", "content": 5}]), 400, "<any>", "string"),
    ("content list of strings", CH, chat(messages=[{"role": "user", "content": ["a"]}]), 400, "<any>", ""),
    ("missing messages", CH, {"model": MODEL}, 400, "messages", "required"),
    ("missing prompt", C, {"model": MODEL}, 400, "prompt", "required"),
    ("empty prompt", C, comp(prompt=""), 400, "prompt", "empty"),
    ("empty token prompt", C, comp(prompt=[]), 400, "prompt", "empty"),
    ("token id outside vocab", C, comp(prompt=[49152]), 400, "prompt", "vocabulary"),
    ("negative token id", C, comp(prompt=[-1]), 400, "prompt", "vocabulary"),
    ("empty prompt in a list", C, comp(prompt=["a", ""]), 400, "prompt", "prompt 1 is empty"),
    ("prompt a dict", C, comp(prompt={"text": "hi"}), 400, "<any>", ""),
    ("n 200", C, comp(n=200), 400, "n", "between 1 and 128"),
    ("n 0", CH, chat(n=0), 400, "n", ""),
    ("best_of below n", C, comp(n=3, best_of=2), 400, "best_of", "between n (3)"),
    ("best_of with stream", C, comp(best_of=3, stream=True), 400, "best_of", "stream"),
    ("logit_bias over 100", CH, chat(logit_bias={"42": 101}), 400, "logit_bias", "[-100, 100]"),
    ("logit_bias key", CH, chat(logit_bias={"foo": 1}), 400, "logit_bias", "token ids"),
    ("logit_bias outside vocab", C, comp(logit_bias={"49152": 1}), 400, "logit_bias", "vocabulary"),
    ("tool_choice without tools", CH, chat(tool_choice="required"), 400, "tool_choice", "needs tools"),
    ("tool not a function", CH, chat(tools=[{"type": "retrieval"}]), 400, "tools[0]", "function"),
    ("functions", CH, chat(functions=[{"name": "f"}]), 400, "functions", "function"),
    (
        "image part",
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content",
        "image_url",
    ),
    ("response_format yaml", CH, chat(response_format={"type": "yaml"}), 400, "response_format", "yaml"),
    (
        "schema that does not compile",  # judged by the node (xgrammar), relayed
        CH,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        ),
        400,
        None,
        "invalid structured output json",
    ),
    ("bad regex", C, comp(structured_outputs={"regex": "(("}), 400, None, "invalid structured output regex"),
    ("suffix", C, comp(suffix="end"), 400, "suffix", "suffix"),
    ("prompt too long", C, comp(prompt="hello " * 1000), 400, "prompt", "maximum context length is 512"),
    (
        "chat too long",
        CH,
        chat(messages=[{"role": "user", "content": "hello " * 1000}]),
        400,
        "messages",
        "maximum context length is 512",
    ),
    ("unknown model", C, comp(model="gpt-4o"), 404, "model", "does not exist"),
]


@pytest.mark.parametrize("name,path,body,status,param,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_in_openai_format(url, name, path, body, status, param, text):
    error = assert_openai_error(post(url, path, body), status, param, text)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_prompt_of_100k_cjk_characters_names_both_lengths(url):
    r = post(url, C, comp(prompt="\u4e2d" * 100_000))
    error = assert_openai_error(r, 400, "prompt", "maximum context length is 512")
    assert "100000 input tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "prompt",
    [
        "\U0001f600\U0001f680 4-byte emoji",
        "e" + "\u0301" * 40 + " combining",
        "\u4e2d\u6587 CJK",
        "\ud83d\ude00",
    ],
    ids=["emoji", "combining", "cjk", "escaped-surrogate-pair"],
)
def test_unusual_but_valid_unicode_is_served(url, prompt):
    # ensure_ascii: non-ASCII goes as \\uXXXX escapes, and emoji as escaped surrogate pairs.
    for path, body in ((C, comp(prompt=prompt)), (CH, chat(messages=[{"role": "user", "content": prompt}]))):
        r = post(url, path, json.dumps(body, ensure_ascii=True).encode())
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None], ids=str)
def test_json_without_a_json_content_type_is_a_400(url, content_type):
    headers = {**AUTH, "content-type": content_type} if content_type else AUTH
    r = httpx.post(url + C, content=json.dumps(comp()).encode(), headers=headers, timeout=60)
    assert_openai_error(r, 400, None, "application/json")


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("GET", C, "POST"),
        ("GET", CH, "POST"),
        ("PUT", CH, "POST"),
        ("POST", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
        ("DELETE", "/metrics", "GET"),
    ],
)
def test_wrong_method_is_a_405_in_openai_format(url, method, path, allow):
    r = httpx.request(method, url + path, headers=AUTH, timeout=30)
    assert_openai_error(r, 405)
    assert r.headers["allow"] == allow


def test_unknown_route_is_a_404_in_openai_format(url):
    assert_openai_error(httpx.get(url + "/v1/nothing", headers=AUTH, timeout=30), 404)
    assert_openai_error(httpx.get(url + "/nothing", timeout=30), 404)


# -- size -----------------------------------------------------------------------------------


def test_body_over_the_limit_is_a_413_by_content_length(url):
    body = json.dumps(comp(prompt="x" * MAX_BODY)).encode()
    error = assert_openai_error(post(url, C, body), 413, None, f"limit of {MAX_BODY} bytes")
    assert error["type"] == "invalid_request_error"


def test_refused_and_unknown_requests_are_counted(url):
    """pdserve_requests_total counts what the gate refuses (401, 413) and both kinds of 404."""

    def count(status: int) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        found = re.search(rf'^pdserve_requests_total{{status="{status}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = {s: count(s) for s in (401, 404, 413)}
    assert post(url, C, json.dumps(comp(prompt="x" * MAX_BODY)).encode()).status_code == 413
    assert httpx.post(url + "/v1/completion", json=comp(), headers=AUTH, timeout=30).status_code == 404
    assert post(url, C, json.dumps(comp(model="no-such-model")).encode()).status_code == 404
    assert httpx.post(url + C, json=comp(), timeout=30).status_code == 401
    assert {s: count(s) - n for s, n in before.items()} == {401: 1.0, 404: 2.0, 413: 1.0}


def test_chunked_body_over_the_limit_is_a_413_while_it_streams_in(url):
    """No Content-Length: the proxy counts the bytes as they come and answers once past the limit,
    while the client is still sending."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {C} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"x" * 65536
    sent = 0
    answer = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b'c\r\n{"prompt": "\r\n')
        while sent < 256 * MAX_BODY and not answer:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the proxy answered and closed: read what it said
                break
            sent += len(chunk)
            if select.select([sock], [], [], 0)[0]:
                answer = sock.recv(65536)
        sock.settimeout(10)
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    # Loopback socket buffers hold a few MiB: the answer must come long before 256 MiB went out.
    assert sent < 32 * MAX_BODY, f"{sent} bytes sent before an answer"
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 413"), answer[:300]
    error = json.loads(body)["error"]
    assert f"limit of {MAX_BODY} bytes" in error["message"] and error["type"] == "invalid_request_error"
    assert post(url, C, comp()).status_code == 200


def test_config_defaults_and_flags():
    cfg = ProxyConfig(decode_urls="127.0.0.1:1")
    assert cfg.max_request_body_bytes == 32 * 1024 * 1024 and cfg.max_inflight_requests == 4096
    for bad in ({"max_request_body_bytes": 0}, {"max_inflight_requests": 0}):
        with pytest.raises(ValueError):
            ProxyConfig(decode_urls="127.0.0.1:1", **bad)
    from pdserve.cli import build_parser

    args = build_parser().parse_args(
        ["proxy", "--decode-urls", "x:1", "--max-request-body-bytes", "10", "--max-inflight-requests", "3"]
    )
    assert (args.max_request_body_bytes, args.max_inflight_requests) == (10, 3)


# -- API keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer"},
        {"Authorization": ""},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer caf\u00e9".encode("latin-1")},
    ],
    ids=["missing", "wrong", "basic", "no-scheme", "no-key", "empty", "longer", "latin-1"],
)
@pytest.mark.parametrize("method,path", [("POST", C), ("POST", CH), ("GET", "/v1/models"), ("GET", "/v1/x")])
def test_v1_without_the_right_key_is_a_401(url, headers, method, path):
    r = httpx.request(
        method, url + path, json=comp() if method == "POST" else None, headers=headers, timeout=30
    )
    error = assert_openai_error(r, 401, None)
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_the_key_opens_v1_and_health_and_metrics_stay_open(url):
    assert post(url, C, comp()).status_code == 200
    r = post(url, CH, chat(), headers={"Authorization": f"bearer  {KEY}"})  # scheme in any case
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == MODEL
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert "pdserve_requests_total" in httpx.get(url + "/metrics", timeout=30).text


def test_openai_client_with_a_wrong_key_gets_an_authentication_error(url):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


# -- in-flight bound ------------------------------------------------------------------------


def test_requests_beyond_the_inflight_limit_get_429_with_retry_after(url):
    """Two uploads held open fill the limit; a third request is refused, until they finish."""
    release = threading.Event()
    statuses: list[int] = []

    def slow_body():
        yield b'{"model": "' + MODEL.encode() + b'", '
        release.wait(30)
        yield b'"prompt": "Hello", "max_tokens": 2}'

    def send():
        headers = {**AUTH, "content-type": "application/json"}
        statuses.append(httpx.post(url + C, content=slow_body(), headers=headers, timeout=60).status_code)

    threads = [threading.Thread(target=send) for _ in range(MAX_INFLIGHT)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while _admitted(url) < MAX_INFLIGHT:  # both uploads reached the proxy
            assert time.monotonic() < deadline, f"uploads not admitted: {statuses}"
            time.sleep(0.05)
        r = post(url, C, comp())
        error = assert_openai_error(r, 429, None, f"limit of {MAX_INFLIGHT} requests")
        assert error["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        assert_openai_error(post(url, CH, chat(stream=True)), 429)
        # Not generation requests: never counted, never refused.
        assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        release.set()
        for t in threads:
            t.join(timeout=60)
    assert statuses == [200] * MAX_INFLIGHT
    assert post(url, C, comp()).status_code == 200


def _admitted(url: str) -> float:
    from pdserve.metrics import parse_text

    return parse_text(httpx.get(url + "/metrics", timeout=30).text)["pdserve_requests_admitted"]


def test_concurrent_streams_beyond_the_limit_are_refused_and_admitted_ones_complete(url, cluster):
    num_clients = 6

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, str | None]:
        body = comp(prompt=f"Count to ten, take {i}:", max_tokens=8, ignore_eos=True, stream=True)
        async with client.stream("POST", url + C, json=body, headers=AUTH) as r:
            text = (await r.aread()).decode()
            return r.status_code, text, r.headers.get("retry-after")

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_clients)))

    results = asyncio.run(main())
    ok = [text for status, text, _ in results if status == 200]
    refused = [(text, retry) for status, text, retry in results if status == 429]
    assert len(ok) + len(refused) == num_clients, results
    assert 1 <= len(ok) <= num_clients and refused, [s for s, _, _ in results]
    for text in ok:  # every admitted stream ran to its end
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text, text
    for text, retry in refused:
        assert json.loads(text)["error"]["type"] == "rate_limit_error" and retry == "1"
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'pdserve_requests_total{status="429"}' in metrics
    _wait_idle(cluster)


def test_everything_is_still_up_and_idle(cluster, url):
    assert all(c.proc.poll() is None for c in cluster.children), [
        (c.role, c.proc.poll()) for c in cluster.children
    ]
    _wait_idle(cluster)
    r = post(url, CH, chat(max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
