"""The OpenAI API as pdserve speaks it: request models, their validation into ``SamplingParams``,
response models and error bodies.

Field names and defaults follow OpenAI and vLLM (whose extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``stop_reason`` and
``structured_outputs`` are kept). Structured output (``response_format`` or ``structured_outputs``)
is checked here for shape only; whether a schema, regex or grammar compiles is the node's call
(xgrammar imports torch, which the proxy never does), relayed as a 400. Tool calling lives in
``proxy/tools.py``. Unknown request fields are ignored, as OpenAI does. ``n``, ``best_of``
(completions; not with ``stream``, as in OpenAI and vLLM), ``logit_bias``, ``echo`` with
``logprobs`` (prompt logprobs) and a list of prompts on /v1/completions are served. Anything we
cannot honour (functions, images, ``suffix``) is a 400, never silently dropped. So is
what would fail further on: NaN or infinite numbers, integers a node message cannot carry (64
bits), text that is not valid Unicode (lone surrogates such as ``"\\ud800"``, which JSON can
spell but UTF-8 cannot), roles that OpenAI does not define.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from pdserve.sampling_params import SamplingParams, StructuredOutputsParams

# -- errors --------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    499: "client_closed_request",
}


def _type_of(status: int) -> str:
    """OpenAI's ``type`` for a status: a 4xx without its own is an ``invalid_request_error``."""
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")


class ProxyError(Exception):
    """A request failed in a way the client is told about, as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _type_of(status)
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.error_type, self.param, self.code)

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after)))}


def error_body(
    status: int,
    message: str,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": error_type or _type_of(status),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


# -- requests ------------------------------------------------------------------------------


# What a node message can carry (msgspec refuses ints outside 64 bits).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def find_surrogate(data: Any) -> tuple[str, str] | None:
    """The path and text of the first string (or key) in parsed JSON holding a lone surrogate.

    JSON may escape one (``"\\ud800"``) and Python's parser keeps it, but it has no UTF-8 form:
    the tokenizer and every node message would fail on it. Iterative, so that nesting as deep as
    the JSON parser allows cannot exhaust the stack.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return path, repr(value[exc.start : exc.start + 1])
        elif isinstance(value, dict):
            for key, item in value.items():
                key = str(key)
                found = None if key.isascii() else find_surrogate(key)
                name = key.encode("utf-8", "backslashreplace").decode() if found else key
                sub = f"{path}.{name}" if path else name
                if found:
                    return sub, found[1]
                stack.append((sub, item))
        elif isinstance(value, list):
            # Only what can hold text gets a path: a prompt of token ids costs one scan, no strings.
            stack.extend(
                (f"{path}[{i}]", item) for i, item in enumerate(value) if isinstance(item, (str, dict, list))
            )
    return None


class _Request(BaseModel):
    # allow_inf_nan: Python's JSON parser reads NaN and Infinity, which no sampling field takes.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields the two generation endpoints share."""

    model: str | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: json, regex, choice, grammar

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_surrogate(data)
        if found is not None:
            path, char = found
            raise PydanticCustomError(
                "invalid_unicode",
                "{param} holds a lone surrogate ({char}), which is not valid Unicode: "
                "send text as UTF-8 or as paired \\uXXXX escapes",
                {"param": path, "char": char},
            )
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Int64 | None = 16  # OpenAI's default; an explicit null means "the rest of the context"
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ChatMessage(BaseModel):
    """One message; extra fields (name, tool_calls, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    add_generation_prompt: bool = True  # vLLM extension


def check_model(requested: str | None, served: tuple[str, ...]) -> str:
    """The served name a request addresses; unknown names are a 404 as in OpenAI."""
    if not requested:
        return served[0]
    if requested in served:
        return requested
    raise ProxyError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


MAX_SEQUENCES = 128
"""The most sequences one prompt may ask for (``n``, ``best_of``), OpenAI's bound on ``n``."""


MAX_PROMPTS = 256
"""The most prompts one completion request may hold: each becomes a request of its own."""


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, each as text or token ids (one, or a list of them)."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("the prompt list is empty", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise bad_request(
                "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty", "prompt"
            )
    return prompts


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if vocab_size:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content parts joined into one string, tool calls'
    ``arguments`` as objects (HF chat templates render them with ``tojson``)."""
    if request.functions:
        raise bad_request("functions is not supported: use tools", "functions")
    messages = []
    for i, message in enumerate(request.messages):
        out = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"content part of type {part.get('type')!r} is not supported (text only)",
                        f"messages[{i}].content",
                    )
                texts.append(part["text"])
            out["content"] = "\n".join(texts)
        elif content is None:
            out["content"] = ""
        if out.get("tool_calls") is not None:
            out["tool_calls"] = _template_tool_calls(out["tool_calls"], f"messages[{i}].tool_calls")
        messages.append(out)
    return messages


def _template_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` with each ``arguments`` string parsed (as vLLM does)."""
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be a list", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("each tool call needs a function with a name", f"{param}[{j}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise bad_request("arguments is not valid JSON", f"{param}[{j}].function.arguments") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
_IGNORED_KEYS = {"disable_fallback"}  # one backend: nothing to fall back to


def structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's output constraint from ``response_format`` (OpenAI) or ``structured_outputs``
    (vLLM), checked for shape; None when it has none."""
    spec = None
    fmt = request.response_format
    kind = "text" if fmt is None else fmt.get("type", "text")
    if kind == "json_object":
        spec = StructuredOutputsParams(json_object=True)
    elif kind == "json_schema":
        body = fmt.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                "response_format",
            )
        spec = StructuredOutputsParams(json=schema)
    elif kind != "text":
        raise bad_request(
            f"response_format type {kind!r} is not supported: use text, json_object or json_schema",
            "response_format",
        )
    so = request.structured_outputs
    if so is not None:
        if spec is not None:
            raise bad_request("send response_format or structured_outputs, not both", "structured_outputs")
        unknown = set(so) - _STRUCTURED_KEYS - _IGNORED_KEYS
        if unknown:
            raise bad_request(
                f"structured_outputs.{sorted(unknown)[0]} is not supported "
                f"(supported: {', '.join(sorted(_STRUCTURED_KEYS))})",
                "structured_outputs",
            )
        fields = {k: v for k, v in so.items() if k in _STRUCTURED_KEYS and v is not None}
        types = {"json": (dict, str), "regex": str, "grammar": str, "choice": list}
        types |= {"json_object": bool, "disable_any_whitespace": bool}
        for key, value in fields.items():
            if not isinstance(value, types[key]) or (key == "json" and isinstance(value, bool)):
                raise bad_request(f"structured_outputs.{key} has the wrong type", f"structured_outputs.{key}")
        try:
            spec = StructuredOutputsParams(**fields)
        except ValueError as exc:
            raise bad_request(str(exc), "structured_outputs") from None
    return spec


_PARAM_RE = re.compile(r"^([a-z_]+) ")


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Validate a request's sampling fields against the context and build its SamplingParams;
    ``constraint`` is the output's structured-output constraint (``structured_outputs`` or a tool
    choice's), if any.

    ``max_tokens`` absent (chat) or null fills the rest of the context, capped at
    ``default_max_tokens``; an explicit value that does not fit is a 400, as in vLLM.
    """
    if not 1 <= request.n <= MAX_SEQUENCES:
        raise bad_request(f"n must be between 1 and {MAX_SEQUENCES}, got {request.n}", "n")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    logit_bias = _logit_bias(request.logit_bias)
    best_of = None
    prompt_logprobs = None
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        best_of = request.best_of
        if best_of is not None:
            if not request.n <= best_of <= MAX_SEQUENCES:
                raise bad_request(
                    f"best_of must be between n ({request.n}) and {MAX_SEQUENCES}, got {best_of}", "best_of"
                )
            if request.stream and best_of > request.n:
                raise bad_request(
                    "best_of is not supported with stream: it ranks finished sequences", "best_of"
                )
        if request.suffix:
            raise bad_request("suffix is not supported", "suffix")
        max_tokens = request.max_tokens
        param = "max_tokens"
        logprobs = request.logprobs
        if request.echo and logprobs is not None:
            prompt_logprobs = logprobs  # the echoed prompt's tokens come with theirs

    if num_prompt_tokens >= max_model_len:
        raise ProxyError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens, which leaves no room for output. "
            "Please reduce the length of the input.",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_model_len - num_prompt_tokens)
    elif max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise ProxyError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the input, {max_tokens} in "
            "the completion). Please reduce the length of the input or completion.",
            param=param,
            code="context_length_exceeded",
        )

    def pick(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            n=request.n,
            best_of=best_of,
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs,
            temperature=pick(request.temperature, 1.0),
            top_p=pick(request.top_p, 1.0),
            top_k=pick(request.top_k, 0),
            min_p=pick(request.min_p, 0.0),
            seed=request.seed,
            presence_penalty=pick(request.presence_penalty, 0.0),
            frequency_penalty=pick(request.frequency_penalty, 0.0),
            repetition_penalty=pick(request.repetition_penalty, 1.0),
            stop=request.stop or (),
            stop_token_ids=request.stop_token_ids or (),
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=constraint,
        )
    except ValueError as exc:
        message = str(exc)
        match = _PARAM_RE.match(message)
        name = match.group(1) if match else None
        if name == "logprobs" and isinstance(request, ChatCompletionRequest):
            name = "top_logprobs"
            message = message.replace("logprobs", "top_logprobs", 1)
        raise bad_request(message, name) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) -> a bias in [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if token_id < 0 or token_id >= 2**63:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value} for token {token_id}", "logit_bias"
            )
        out[token_id] = value
    return out


# -- responses -----------------------------------------------------------------------------


class _Response(BaseModel):
    """Response models; keys named in ``_omit_if_none`` are left out when None."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        for key in self._omit_if_none:
            if key in data and data[key] is None:
                del data[key]
        return data


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    _omit_if_none = ("usage",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    _omit_if_none = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A piece of a streamed tool call: the first carries id, type and name; the rest add arguments."""

    _omit_if_none = ("id", "type", "function")

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(_Response):
    _omit_if_none = ("tool_calls",)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(_Response):
    _omit_if_none = ("role", "content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: Delta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    _omit_if_none = ("usage",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
