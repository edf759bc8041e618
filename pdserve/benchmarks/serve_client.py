"""One streaming request against an OpenAI-compatible server, timed as the client sees it.

The body asks for ``stream_options.include_usage`` so that token counts are the server's
own; a server that sends no usage gets its output counted as chunks carrying text and its
prompt counted with ``--tokenizer`` when one is given. Errors (an HTTP status, an
``{"error": ...}`` event, a dropped connection, a timeout) end the request as failed with a
message; they never raise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.benchmarks.serve_datasets import Message, render_prompt
from pdserve.benchmarks.serve_http import Client, HttpError
from pdserve.benchmarks.serve_metrics import RequestRecord

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


@dataclass(frozen=True)
class RequestOptions:
    """Fields every request of a run carries."""

    endpoint: str = CHAT
    model: str = ""
    ignore_eos: bool = True
    """Send vLLM's ``ignore_eos`` extension (pdserve, vLLM and SGLang take it) so outputs have
    exactly the asked length; servers that reject unknown fields need --no-ignore-eos."""
    temperature: float = 0.0
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str = ""

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    def body(self, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True}
        if self.chat:
            if any(isinstance(m.content, tuple) for m in messages):
                raise ValueError("token-id prompts need --endpoint /v1/completions")
            body["messages"] = [{"role": m.role, "content": m.content} for m in messages]
        else:
            body["prompt"] = render_prompt(messages)
        body["temperature"] = self.temperature
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _LogprobEntry(msgspec.Struct):
    token: str = ""


class _Logprobs(msgspec.Struct):
    tokens: list[str] | None = None
    """/v1/completions"""
    content: list[_LogprobEntry] | None = None
    """/v1/chat/completions"""


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    logprobs: _Logprobs | None = None


class _Chunk(msgspec.Struct):
    """The fields of an SSE chunk the client reads; msgspec skips the rest without building them."""

    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = msgspec.UNSET


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
DONE = "[DONE]"


@dataclass
class _Stream:
    """Running state of one response stream."""

    start: float
    ttft: float | None = None
    last: float = 0.0
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """Output token ids where the server names them in logprobs as ``token_id:N`` (pdserve for a
    model without a tokenizer; vLLM with ``return_tokens_as_token_ids``)."""
    usage: dict[str, Any] | None = None
    error: str = ""
    pending: bytes = b""
    """An SSE line whose end has not arrived yet."""

    def text_arrived(self, piece: str, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1
        self.parts.append(piece)

    def feed(self, data: bytes, now: float, chat: bool) -> bool:
        """Handle the body bytes of one socket read, all of which arrived at ``now`` (several events
        in one read are one arrival: the gaps between them are 0, as the client saw them); False at
        the end of the stream."""
        lines = (self.pending + data if self.pending else data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and not self.event(line[5:].strip(), chat, now):
                return False
        return True

    def event(self, data: str | bytes, chat: bool, now: float | None = None) -> bool:
        """Handle one SSE data payload (arrived at ``now``, default: this call); False at the end of
        the stream."""
        if data == b"[DONE]" or data == DONE:
            return False
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError:  # not JSON, or not an object of the fields above
            text = data.decode(errors="replace") if isinstance(data, bytes) else data
            self.error = f"bad event: {text[:200]!r}"
            return False
        if chunk.error is not msgspec.UNSET:
            self.error = f"error event: {_message(json.loads(data))}"
            return False
        if chunk.usage:
            self.usage = chunk.usage
        for choice in chunk.choices or ():
            if chat:
                delta = choice.delta
                piece = (delta.content or delta.reasoning_content or "") if delta is not None else ""
            else:
                piece = choice.text or ""
            # A chunk that carries logprobs is a step even without text (a model without a
            # tokenizer, prompted with token ids and `"logprobs": 0` in --extra-body).
            lp = choice.logprobs
            tokens = (lp.tokens or [c.token for c in lp.content or ()]) if lp is not None else ()
            if tokens:
                self.token_ids.extend(_token_id(t) for t in tokens if t.startswith(TOKEN_ID_PREFIX))
            if piece or tokens:
                self.text_arrived(piece, time.perf_counter() if now is None else now)
        return True


TOKEN_ID_PREFIX = "token_id:"


def _token_id(token: str) -> int:
    return int(token[len(TOKEN_ID_PREFIX) :])


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(payload)


@dataclass(frozen=True)
class Reply:
    """A finished request: its record, and the answer (the next turn's history) as text and, where
    the server named them, as token ids."""

    record: RequestRecord
    text: str
    token_ids: tuple[int, ...] = ()


async def send(
    client: Client,
    opts: RequestOptions,
    messages: list[Message],
    max_tokens: int,
    t0: float,
    count_prompt=None,
    conversation: int = 0,
    turn: int = 0,
) -> Reply:
    """Send one streaming request and time it; ``count_prompt(messages)`` counts input tokens
    when the server reports no usage."""
    body = msgspec.json.encode(opts.body(messages, max_tokens))
    s = _Stream(time.perf_counter())
    end = None
    try:
        resp = await client.request("POST", opts.endpoint, body, opts.headers)
        try:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    detail = _message(json.loads(raw))
                except ValueError:
                    detail = raw.decode(errors="replace")[:200]
                s.error = f"HTTP {resp.status}: {detail}"
            else:
                chat = opts.chat
                end = await resp.stream(lambda data, now: s.feed(data, now, chat))
                if end is None and s.pending.startswith(b"data:"):  # a last event without its newline
                    s.event(s.pending[5:].strip(), chat)
        finally:
            resp.release()
    except HttpError as exc:
        s.error = str(exc)
    end = end or time.perf_counter()
    usage = s.usage or {}
    num_input = usage.get("prompt_tokens")
    if num_input is None and count_prompt is not None:
        num_input = count_prompt(messages)
    details = usage.get("prompt_tokens_details") or {}
    record = RequestRecord(
        success=not s.error,
        start_s=s.start - t0,
        e2e_s=end - s.start,
        ttft_s=s.ttft,
        itl_s=tuple(s.itl),
        num_input_tokens=num_input,
        num_output_tokens=usage.get("completion_tokens", s.num_chunks),
        usage_reported=s.usage is not None,
        num_cached_tokens=details.get("cached_tokens") or 0,
        error=s.error,
        conversation=conversation,
        turn=turn,
    )
    return Reply(record, "".join(s.parts), tuple(s.token_ids))
