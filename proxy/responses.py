"""Turning a request's ``TokenEvent`` stream into OpenAI responses: whole, or as SSE chunks.

One builder per request accumulates text, token counts, cached tokens and logprobs. In
streaming mode ``add`` returns the SSE bytes for each event; ``finish`` returns the closing
chunks (the usage chunk with ``choices: []`` when asked for, then ``[DONE]``); otherwise
``response`` builds the whole body at the end. Chat streams open with a chunk whose delta
is ``{"role": "assistant", "content": ""}``; the chunk of the last token carries
``finish_reason``, as in OpenAI and vLLM. A chat request with tools turns its output into
``tool_calls`` (``proxy/tools.py``), streamed as ``delta.tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from pydantic import BaseModel

from pdserve.messages import LogprobsMsg, TokenEvent
from pdserve.proxy.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    Usage,
    make_usage,
)
from pdserve.proxy.tools import ToolCallStream, ToolPlan, new_call_id

SSE_DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


_json = msgspec.json.encode


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + body.encode() + b"\n\n"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenStrings:
    """Token id -> display string and UTF-8 bytes for logprobs, cached per id.

    The string is the id decoded alone (special tokens kept), as vLLM shows it. The bytes
    are the token's true bytes where the vocabulary says them (byte-level BPE, SentencePiece
    ``<0xNN>`` pieces), so a character split across tokens still reassembles.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = False
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            decoder = getattr(backend, "decoder", None)
            self._byte_level = type(decoder).__name__ == "ByteLevel"

    def string(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._strings[token_id] = s
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = list(self._raw_bytes(token_id))
        return b

    def _raw_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self._byte_level and all(c in _BYTE_DECODER for c in piece):
                    return bytes(_BYTE_DECODER[c] for c in piece)
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    try:
                        return bytes([int(piece[3:5], 16)])
                    except ValueError:
                        pass
        return self.string(token_id).encode("utf-8", "replace")


def _finish(event: TokenEvent) -> tuple[bytes, bytes]:
    return _json(event.finish_reason), _json(event.stop_reason)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class _Builder:
    """What both endpoints accumulate; subclasses format."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        num_prompt_tokens: int,
        *,
        stream: bool,
        include_usage: bool = False,
        logprobs: int | None = None,
        token_strings: TokenStrings | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        self.num_prompt_tokens = num_prompt_tokens
        self.stream = stream
        self.include_usage = include_usage
        self.num_logprobs = logprobs
        self.strings = token_strings or TokenStrings(None)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> Usage:
        return make_usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def _account(self, event: TokenEvent) -> None:
        self.num_output_tokens += len(event.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason
        if not self.stream:
            self.text_parts.append(event.text)

    def start(self) -> list[bytes]:
        """SSE bytes sent before the first event."""
        return []

    def add(self, event: TokenEvent) -> bytes | None:
        raise NotImplementedError

    def finish(self) -> list[bytes]:
        """SSE bytes after the last event: the usage chunk when asked for, then [DONE]."""
        raise NotImplementedError


class CompletionBuilder(_Builder):
    """``/v1/completions``; ``echo_text`` is prepended to the output (echo=true)."""

    def __init__(self, *args, echo_text: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Chunks without logprobs are spliced from bytes (a few µs instead of ~35 through
        # pydantic); they serialize exactly as CompletionResponse would.
        self._head = (
            b'data: {"id":%b,"object":"text_completion","created":%d,"model":%b,"choices":[{"index":0,"text":'
            % (_json(self.id), self.created, _json(self.model))
        )
        self.echo_text = echo_text
        self.text_offset = len(echo_text)
        self.logprobs: CompletionLogprobs | None = None if self.num_logprobs is None else CompletionLogprobs()

    def _logprobs(self, entries: list[LogprobsMsg] | None, into: CompletionLogprobs) -> None:
        for lp in entries or ():
            token = self.strings.string(lp.token_id)
            top = {}
            for token_id, logprob in lp.top[: self.num_logprobs]:
                top.setdefault(self.strings.string(token_id), _clamp(logprob))
            top.setdefault(token, _clamp(lp.logprob))  # OpenAI: the sampled token is always listed
            into.tokens.append(token)
            into.token_logprobs.append(_clamp(lp.logprob))
            into.top_logprobs.append(top)
            into.text_offset.append(self.text_offset)
            self.text_offset += len(token)

    def add(self, event: TokenEvent) -> bytes | None:
        self._account(event)
        if not self.stream:
            if self.logprobs is not None:
                self._logprobs(event.logprobs, self.logprobs)
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = CompletionLogprobs()
            self._logprobs(event.logprobs, logprobs)
        text = event.text
        if self.echo_text:
            text, self.echo_text = self.echo_text + text, ""
        if not text and not event.token_ids and event.finish_reason is None:
            return None  # nothing new (as vLLM: a token that completes no character still streams)
        if logprobs is None:
            tail = b',"logprobs":null,"finish_reason":%b,"stop_reason":%b}],"system_fingerprint":null}\n\n'
            return self._head + _json(text) + tail % _finish(event)
        choice = CompletionChoice(
            text=text, logprobs=logprobs, finish_reason=event.finish_reason, stop_reason=event.stop_reason
        )
        return sse(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def finish(self) -> list[bytes]:
        out = []
        if self.include_usage:
            chunk = CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()
            )
            out.append(sse(chunk))
        out.append(SSE_DONE)
        return out

    def response(self) -> CompletionResponse:
        choice = CompletionChoice(
            text=self.echo_text + self.text,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        )


class ChatBuilder(_Builder):
    """``/v1/chat/completions``; ``tools`` is the request's tool plan (calls are parsed out of the text)."""

    def __init__(self, *args, tools: ToolPlan | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self.tool_stream = ToolCallStream(tools) if tools is not None and self.stream else None
        self.logprob_entries: list[ChatLogprob] | None = None if self.num_logprobs is None else []
        # Chunks without logprobs are spliced from bytes, as in CompletionBuilder.
        self._head = (
            b'data: {"id":%b,"object":"chat.completion.chunk","created":%d,"model":%b,'
            b'"choices":[{"index":0,"delta":{"content":' % (_json(self.id), self.created, _json(self.model))
        )

    def _logprobs(self, entries: list[LogprobsMsg] | None) -> list[ChatLogprob]:
        out = []
        s = self.strings
        for lp in entries or ():
            top = [
                TopLogprob(token=s.string(t), logprob=_clamp(v), bytes=s.bytes(t))
                for t, v in lp.top[: self.num_logprobs]
            ]
            out.append(
                ChatLogprob(
                    token=s.string(lp.token_id),
                    logprob=_clamp(lp.logprob),
                    bytes=s.bytes(lp.token_id),
                    top_logprobs=top,
                )
            )
        return out

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))])]

    def add(self, event: TokenEvent) -> bytes | None:
        self._account(event)
        if not self.stream:
            if self.logprob_entries is not None:
                self.logprob_entries.extend(self._logprobs(event.logprobs))
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=self._logprobs(event.logprobs))
        if self.tool_stream is not None:
            return self._tool_chunk(event, logprobs)
        if not event.text and not event.token_ids and event.finish_reason is None:
            return None  # nothing new (as vLLM: a token that completes no character still streams)
        if logprobs is None:
            tail = b'},"logprobs":null,"finish_reason":%b,"stop_reason":%b}]}\n\n'
            return self._head + _json(event.text) + tail % _finish(event)
        choice = ChatChunkChoice(
            delta=Delta(content=event.text),
            logprobs=logprobs,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
        )
        return self._chunk([choice])

    def _tool_chunk(self, event: TokenEvent, logprobs: ChatChoiceLogprobs | None) -> bytes | None:
        final = event.finish_reason is not None
        content, calls = self.tool_stream.feed(event.text, final)
        finish_reason = event.finish_reason
        if final and self.tool_stream.calls_sent and finish_reason == "stop":
            finish_reason = "tool_calls"
        if not content and not calls and not final and not (logprobs and logprobs.content):
            return None
        delta = Delta(
            content=content or None,
            tool_calls=[DeltaToolCall.model_validate(c) for c in calls] or None,
        )
        choice = ChatChunkChoice(
            delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=event.stop_reason
        )
        return self._chunk([choice])

    def finish(self) -> list[bytes]:
        out = []
        if self.include_usage:
            out.append(self._chunk([], self.usage()))
        out.append(SSE_DONE)
        return out

    def response(self) -> ChatCompletionResponse:
        logprobs = None
        if self.logprob_entries is not None:
            logprobs = ChatChoiceLogprobs(content=self.logprob_entries)
        message = AssistantMessage(content=self.text)
        finish_reason = self.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(self.text)
            if calls:
                tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(**vars(c))) for c in calls]
                message = AssistantMessage(content=content, tool_calls=tool_calls)
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        choice = ChatChoice(
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=self.stop_reason,
        )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        )
