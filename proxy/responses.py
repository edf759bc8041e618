"""Turning a request's ``TokenEvent`` stream into OpenAI responses: whole, or as SSE chunks.

One builder per request accumulates text, token counts, cached tokens and logprobs. In
streaming mode ``add`` returns the SSE bytes for each event; ``finish`` returns the closing
chunks (the usage chunk with ``choices: []`` when asked for, then ``[DONE]``); otherwise
``response`` builds the whole body at the end. Chat streams open with a chunk per choice whose
delta is ``{"role": "assistant", "content": ""}``; the chunk of a choice's last token carries
its ``finish_reason``, as in OpenAI and vLLM. Several choices (``n``, ``best_of``, several
prompts) are kept apart by ``TokenEvent.index`` (see ``_Builder``). A chat request with tools
turns each choice's output into ``tool_calls`` (``proxy/tools.py``), streamed as
``delta.tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from pydantic import BaseModel

from pdserve.logprobs import best_sequences
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


_OPEN_TAILS: dict[bytes, bytes] = {}  # template -> its end for an event that finishes nothing


def _tail(template: bytes, event: TokenEvent) -> bytes:
    """A chunk's end: ``template`` with the event's finish and stop reasons (JSON); every event
    but a sequence's last has the same end, formatted once."""
    if event.finish_reason is None and event.stop_reason is None:
        tail = _OPEN_TAILS.get(template)
        if tail is None:
            tail = _OPEN_TAILS[template] = template % (b"null", b"null")
        return tail
    return template % _finish(event)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class _Choice:
    """One sequence's output as it accumulates (``TokenEvent.index``, counted across prompts)."""

    __slots__ = (
        "text_parts",
        "finish_reason",
        "stop_reason",
        "cumulative_logprob",
        "logprobs",
        "started",
        "offset",
    )

    def __init__(self, logprobs) -> None:
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs = logprobs  # the endpoint's accumulated logprobs, None when not asked for
        self.started = False  # its first event came (the echo and prompt logprobs went first)
        self.offset = 0  # completions: where the next token starts in the choice's text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class _Builder:
    """What both endpoints accumulate; subclasses format.

    A request has ``num_prompts`` prompts (several only on /v1/completions), each generating
    ``num_sequences`` sequences (``best_of``, else ``n``) of which ``n`` are returned: event index
    ``g`` is sequence ``g % num_sequences`` of prompt ``g // num_sequences``, and the choice of the
    r-th returned sequence of prompt p has index ``p * n + r`` (OpenAI's order). Streaming
    returns every sequence (best_of is refused there), so a chunk's index is its event's.
    ``num_prompt_tokens`` is the sum over the prompts; usage counts every generated token.
    """

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
        n: int = 1,
        num_sequences: int = 0,
        num_prompts: int = 1,
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        self.num_prompt_tokens = num_prompt_tokens
        self.stream = stream
        self.include_usage = include_usage
        self.num_logprobs = logprobs
        self.strings = token_strings or TokenStrings(None)
        self.n = n
        self.num_sequences = num_sequences or n
        self.num_prompts = num_prompts
        self.num_output_tokens = 0
        self.cached = [0] * num_prompts  # cached prompt tokens, per prompt
        self.prompt_logprobs: list[list[LogprobsMsg | None] | None] = [None] * num_prompts
        self.choices: dict[int, _Choice] = {}

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached)

    def note_cached(self, prompt: int, num_cached_tokens: int) -> None:
        """A prompt's cached tokens as another source reports them (the largest report counts)."""
        self.cached[prompt] = max(self.cached[prompt], num_cached_tokens)

    def usage(self) -> Usage:
        return make_usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def _new_logprobs(self):
        return None

    def _choice(self, index: int) -> _Choice:
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(self._new_logprobs())
        return choice

    def _account(self, event: TokenEvent) -> _Choice:
        choice = self._choice(event.index)
        self.num_output_tokens += len(event.token_ids)
        prompt = event.index // self.num_sequences
        if event.num_cached_tokens > self.cached[prompt]:
            self.cached[prompt] = event.num_cached_tokens
        if event.prompt_logprobs is not None and self.prompt_logprobs[prompt] is None:
            self.prompt_logprobs[prompt] = event.prompt_logprobs
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.stop_reason = event.stop_reason
        if self.num_sequences > self.n and event.logprobs:
            choice.cumulative_logprob += sum(lp.logprob for lp in event.logprobs)
        if not self.stream:
            choice.text_parts.append(event.text)
        return choice

    def returned(self) -> list[tuple[int, int, _Choice]]:
        """(choice index, event index, choice) of what the response returns, in choice order:
        with ``best_of``, each prompt's ``n`` sequences of highest cumulative logprob, best first."""
        out = []
        size = self.num_sequences
        for prompt in range(self.num_prompts):
            indices = list(range(prompt * size, (prompt + 1) * size))
            if size > self.n:
                cumulative = [
                    self.choices[g].cumulative_logprob if g in self.choices else float("-inf")
                    for g in indices
                ]
                indices = [indices[i] for i in best_sequences(cumulative, self.n)]
            for rank, g in enumerate(indices):
                out.append((prompt * self.n + rank, g, self._choice(g)))
        return out

    def start(self) -> list[bytes]:
        """SSE bytes sent before the first event."""
        return []

    def add(self, event: TokenEvent) -> bytes | None:
        raise NotImplementedError

    def finish(self) -> list[bytes]:
        """SSE bytes after the last event: the usage chunk when asked for, then [DONE]."""
        raise NotImplementedError


class CompletionBuilder(_Builder):
    """``/v1/completions``; ``echo_texts`` (one per prompt, or ``echo_text`` for the one prompt) are
    prepended to each choice's text (echo=true); with logprobs too, ``prompt_token_ids`` (one list
    per prompt) name the prompt tokens whose logprobs come first (OpenAI: the first has none)."""

    def __init__(
        self,
        *args,
        echo_text: str = "",
        echo_texts: list[str] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # Chunks without logprobs are spliced from bytes (a few µs instead of ~35 through
        # pydantic); they serialize exactly as CompletionResponse would.
        self._head = (
            b'data: {"id":%b,"object":"text_completion","created":%d,"model":%b,"choices":[{"index":'
            % (
                _json(self.id),
                self.created,
                _json(self.model),
            )
        )
        self.echo_texts = echo_texts if echo_texts is not None else [echo_text] * self.num_prompts
        self.prompt_token_ids = prompt_token_ids

    def _new_logprobs(self):
        return None if self.num_logprobs is None else CompletionLogprobs()

    def _start(self, index: int, choice: _Choice, into: CompletionLogprobs | None) -> str:
        """Sequence ``index``'s first event: its echoed prompt, whose logprobs go into ``into``."""
        choice.started = True
        prompt = index // self.num_sequences
        if into is not None and self.prompt_token_ids is not None:
            self._prompt_logprobs(self.prompt_token_ids[prompt], self.prompt_logprobs[prompt] or [], into)
        echo = self.echo_texts[prompt]
        choice.offset = len(echo)
        return echo

    def _prompt_logprobs(self, token_ids: list[int], entries: list, into: CompletionLogprobs) -> None:
        offset = 0
        for i, token_id in enumerate(token_ids):
            lp = entries[i] if i < len(entries) else None
            token = self.strings.string(token_id)
            into.tokens.append(token)
            into.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            top = {self.strings.string(t): _clamp(v) for t, v in lp.top[: self.num_logprobs]}
            top.setdefault(token, _clamp(lp.logprob))
            into.token_logprobs.append(_clamp(lp.logprob))
            into.top_logprobs.append(top)

    def _logprobs(self, entries: list[LogprobsMsg] | None, into: CompletionLogprobs, choice: _Choice) -> None:
        for lp in entries or ():
            token = self.strings.string(lp.token_id)
            top = {}
            for token_id, logprob in lp.top[: self.num_logprobs]:
                top.setdefault(self.strings.string(token_id), _clamp(logprob))
            top.setdefault(token, _clamp(lp.logprob))  # OpenAI: the sampled token is always listed
            into.tokens.append(token)
            into.token_logprobs.append(_clamp(lp.logprob))
            into.top_logprobs.append(top)
            into.text_offset.append(choice.offset)
            choice.offset += len(token)

    def add(self, event: TokenEvent) -> bytes | None:
        choice = self._account(event)
        if not self.stream:
            if choice.logprobs is not None:
                if not choice.started:
                    self._start(event.index, choice, choice.logprobs)
                self._logprobs(event.logprobs, choice.logprobs, choice)
            return None
        logprobs = None if self.num_logprobs is None else CompletionLogprobs()
        text = event.text
        if not choice.started:
            text = self._start(event.index, choice, logprobs) + text
        if logprobs is not None:
            self._logprobs(event.logprobs, logprobs, choice)
        if not text and not event.token_ids and event.finish_reason is None:
            return None  # nothing new (as vLLM: a token that completes no character still streams)
        if logprobs is None:
            tail = b',"logprobs":null,"finish_reason":%b,"stop_reason":%b}],"system_fingerprint":null}\n\n'
            return self._head + b'%d,"text":' % event.index + _json(text) + _tail(tail, event)
        completion = CompletionChoice(
            index=event.index,
            text=text,
            logprobs=logprobs,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
        )
        return sse(
            CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[completion])
        )

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
        choices = []
        for index, g, choice in self.returned():
            echo = self.echo_texts[g // self.num_sequences]
            logprobs = choice.logprobs
            if logprobs is not None and not choice.started:  # no event came: the echo alone
                self._start(g, choice, logprobs)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


class ChatBuilder(_Builder):
    """``/v1/chat/completions``; ``tools`` is the request's tool plan (calls are parsed out of the text)."""

    def __init__(self, *args, tools: ToolPlan | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its calls so far (streams)
        # Chunks without logprobs are spliced from bytes, as in CompletionBuilder.
        self._head = (
            b'data: {"id":%b,"object":"chat.completion.chunk","created":%d,"model":%b,"choices":[{"index":'
            % (
                _json(self.id),
                self.created,
                _json(self.model),
            )
        )

    def _new_logprobs(self):
        return None if self.num_logprobs is None else []

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
        """One chunk per choice opens it with the assistant's role, as vLLM sends them."""
        return [
            self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
            for index in range(self.num_prompts * self.n)
        ]

    def add(self, event: TokenEvent) -> bytes | None:
        choice = self._account(event)
        if not self.stream:
            if choice.logprobs is not None:
                choice.logprobs.extend(self._logprobs(event.logprobs))
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=self._logprobs(event.logprobs))
        if self.tools is not None:
            return self._tool_chunk(event, logprobs)
        if not event.text and not event.token_ids and event.finish_reason is None:
            return None  # nothing new (as vLLM: a token that completes no character still streams)
        if logprobs is None:
            tail = b'},"logprobs":null,"finish_reason":%b,"stop_reason":%b}]}\n\n'
            return (
                self._head + b'%d,"delta":{"content":' % event.index + _json(event.text) + _tail(tail, event)
            )
        chunk = ChatChunkChoice(
            index=event.index,
            delta=Delta(content=event.text),
            logprobs=logprobs,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
        )
        return self._chunk([chunk])

    def _tool_chunk(self, event: TokenEvent, logprobs: ChatChoiceLogprobs | None) -> bytes | None:
        final = event.finish_reason is not None
        stream = self.tool_streams.get(event.index)
        if stream is None:
            stream = self.tool_streams[event.index] = ToolCallStream(self.tools)
        content, calls = stream.feed(event.text, final)
        finish_reason = event.finish_reason
        if final and stream.calls_sent and finish_reason == "stop":
            finish_reason = "tool_calls"
        if not content and not calls and not final and not (logprobs and logprobs.content):
            return None
        delta = Delta(
            content=content or None,
            tool_calls=[DeltaToolCall.model_validate(c) for c in calls] or None,
        )
        choice = ChatChunkChoice(
            index=event.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=event.stop_reason,
        )
        return self._chunk([choice])

    def finish(self) -> list[bytes]:
        out = []
        if self.include_usage:
            out.append(self._chunk([], self.usage()))
        out.append(SSE_DONE)
        return out

    def response(self) -> ChatCompletionResponse:
        choices = []
        for index, _, choice in self.returned():
            message = AssistantMessage(content=choice.text)
            finish_reason = choice.finish_reason
            if self.tools is not None:
                content, calls = self.tools.parse(choice.text)
                if calls:
                    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(**vars(c))) for c in calls]
                    message = AssistantMessage(content=content, tool_calls=tool_calls)
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=None if choice.logprobs is None else ChatChoiceLogprobs(content=choice.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )
