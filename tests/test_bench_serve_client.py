"""What `pdserve bench serve` records for streams of known chunks at known times (a stand-in server on
loopback, pdserve.benchmarks.sse_stand_in), and its HTTP/1.1 body framing byte by byte."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.benchmarks.serve_client import CHAT, COMPLETIONS, RequestOptions, _Stream, send
from pdserve.benchmarks.serve_datasets import Message
from pdserve.benchmarks.serve_http import Client, _Dechunker
from pdserve.benchmarks.sse_stand_in import pdserve_script, start

LATE_S = 0.04
"""How much later than scripted an arrival may be on a busy 2-core machine (never earlier)."""


def _completion(text: str, finish: str | None = None) -> str:
    return json.dumps({"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def _chat(content: str | None, role: str | None = None) -> str:
    delta = {"role": role} if role else {}
    if content is not None:
        delta["content"] = content
    return json.dumps({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def _usage(prompt: int, completion: int, cached: int) -> str:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return json.dumps({"id": "c", "choices": [], "usage": usage})


def _close(value: float, expected: float) -> bool:
    return expected - 0.002 <= value <= expected + LATE_S


async def _run(script, opts: RequestOptions, count_prompt=None, repeat: int = 1, read_timeout_s: float = 5.0):
    server = await start(lambda body, chat: script(body, chat))
    port = server.sockets[0].getsockname()[1]
    client = Client(f"http://127.0.0.1:{port}", read_timeout_s=read_timeout_s)
    connect = client._connect
    connects = []

    async def counted():
        connects.append(1)
        return await connect()

    client._connect = counted
    try:
        replies = []
        for _ in range(repeat):
            reply = await send(client, opts, [Message("user", "hi")], 3, time.perf_counter(), count_prompt)
            replies.append(reply)
        return replies, len(connects)
    finally:
        client.close()
        server.close()
        await server.wait_closed()


def test_completion_stream_times_text_chunks_and_takes_counts_from_usage():
    # text at 0.10, an empty chunk at 0.15 (no token: no step), text at 0.20 and 0.35, then usage.
    events = [
        (0.10, _completion("a")),
        (0.05, _completion("")),
        (0.05, _completion("b")),
        (0.15, _completion("c", "length")),
        (0.0, _usage(11, 3, 4)),
    ]
    (reply,), _ = asyncio.run(_run(lambda body, chat: events, RequestOptions(endpoint=COMPLETIONS)))
    r = reply.record
    assert r.success and not r.error and reply.text == "abc"
    assert _close(r.ttft_s, 0.10)
    assert len(r.itl_s) == 2 and _close(r.itl_s[0], 0.10) and _close(r.itl_s[1], 0.15)
    assert _close(r.e2e_s, 0.35) and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9
    assert (r.num_input_tokens, r.num_output_tokens, r.num_cached_tokens) == (11, 3, 4)
    assert r.usage_reported and abs(r.tpot_s - (r.e2e_s - r.ttft_s) / 2) < 1e-12


def test_chat_stream_without_usage_counts_chunks_and_the_tokenizer_counts_the_prompt():
    # The role chunk carries no text: TTFT is the first content, not the first event.
    events = [
        (0.05, _chat("", role="assistant")),
        (0.05, _chat("He")),
        (0.05, _chat("llo")),
        (0.0, _chat(None)),
    ]
    opts = RequestOptions(endpoint=CHAT, include_usage=False)
    (reply,), _ = asyncio.run(_run(lambda body, chat: events, opts, count_prompt=lambda messages: 5))
    r = reply.record
    assert r.success and reply.text == "Hello"
    assert _close(r.ttft_s, 0.10) and len(r.itl_s) == 1 and _close(r.itl_s[0], 0.05)
    assert (r.num_input_tokens, r.num_output_tokens, r.usage_reported) == (5, 2, False)


def test_kept_alive_connection_carries_the_next_request():
    (first, second), connects = asyncio.run(
        _run(pdserve_script(0.001), RequestOptions(endpoint=COMPLETIONS), repeat=2)
    )
    assert first.record.success and second.record.success and connects == 1
    assert second.record.num_output_tokens == 3 and second.text == " t t t"
    assert second.record.usage_reported and second.record.num_input_tokens == 7


@pytest.mark.parametrize(
    ("events", "error"),
    [
        (
            [(0.01, _completion("a")), (0.01, json.dumps({"error": {"message": "lease expired"}}))],
            "error event: lease expired",
        ),
        ([(0.01, _completion("a")), (0.01, None)], "mid-response"),  # a close or a reset
        ([(0.01, "{not json")], "bad event: '{not json'"),
    ],
)
def test_failures_end_the_request_with_a_message(events, error):
    (reply,), _ = asyncio.run(_run(lambda body, chat: events, RequestOptions(endpoint=COMPLETIONS)))
    assert not reply.record.success and error in reply.record.error


def test_a_stream_silent_for_longer_than_the_read_timeout_fails():
    events = [
        (0.01, _completion("a")),
        (0.15, _completion("b")),
        (0.15, _completion("c")),
        (0.6, _completion("d")),
    ]
    (reply,), _ = asyncio.run(
        _run(lambda body, chat: events, RequestOptions(endpoint=COMPLETIONS), read_timeout_s=0.3)
    )
    assert reply.record.error == "ReadTimeout: no byte in 0.3 s" and reply.text == "abc"
    assert 0.3 + 0.3 <= reply.record.e2e_s < 0.3 + 0.6  # silence counts from the last byte


def test_unreachable_server_is_a_failed_request():
    async def main():
        client = Client("http://127.0.0.1:9", read_timeout_s=1.0)  # discard port: nobody listens
        return await send(client, RequestOptions(endpoint=COMPLETIONS), [Message("user", "x")], 1, 0.0)

    reply = asyncio.run(main())
    assert not reply.record.success and reply.record.error.startswith("ConnectError")


def test_body_framing_and_sse_lines_survive_any_split():
    events = [_completion("a"), _completion("b", "length"), _usage(3, 2, 0), "[DONE]"]
    sse = b"".join(b"data: " + e.encode() + b"\n\n" for e in events)
    framed = b"".join(b"%x\r\n%b\r\n" % (len(sse[i : i + 7]), sse[i : i + 7]) for i in range(0, len(sse), 7))
    framed += b"0\r\n\r\n"
    for step in (1, 3, 64, len(framed)):
        dechunk, stream, alive = _Dechunker(), _Stream(0.0), True
        for i in range(0, len(framed), step):
            body = dechunk.feed(framed[i : i + step])
            if body and alive:
                alive = stream.feed(body, now=float(i), chat=False)
        assert dechunk.done and dechunk.clean and not alive
        assert (
            "".join(stream.parts) == "ab"
            and stream.num_chunks == 2
            and stream.usage["completion_tokens"] == 2
        )
        # Events that arrived in one read share its time: the gap between them is 0.
        assert (stream.itl == [0.0]) == (step == len(framed))
