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

import httpx

from pdserve.benchmarks.serve_datasets import Message, render_prompt
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

    def text_arrived(self, piece: str) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1
        self.parts.append(piece)

    def event(self, data: str, chat: bool) -> bool:
        """Handle one SSE data payload; False at the end of the stream."""
        if data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad event: {data[:200]!r}"
            return False
        if "error" in chunk:
            self.error = f"error event: {_message(chunk)}"
            return False
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ""
            else:
                piece = choice.get("text") or ""
            # A chunk that carries logprobs is a step even without text (a model without a
            # tokenizer, prompted with token ids and `"logprobs": 0` in --extra-body).
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or [c.get("token", "") for c in logprobs.get("content") or ()]
            self.token_ids.extend(_token_id(t) for t in tokens if t.startswith(TOKEN_ID_PREFIX))
            if piece or tokens:
                self.text_arrived(piece)
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
    client: httpx.AsyncClient,
    base_url: str,
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
    s = _Stream(time.perf_counter())
    try:
        async with client.stream(
            "POST", base_url + opts.endpoint, json=opts.body(messages, max_tokens), headers=opts.headers
        ) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    detail = _message(json.loads(raw))
                except ValueError:
                    detail = raw.decode(errors="replace")[:200]
                s.error = f"HTTP {resp.status_code}: {detail}"
            else:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and not s.event(line[5:].strip(), opts.chat):
                        break
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    end = time.perf_counter()
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
