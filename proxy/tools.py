"""Tool calling on ``/v1/chat/completions``: ``tools`` and ``tool_choice`` as OpenAI and vLLM take them.

1. ``tools`` go to the model's chat template (``apply_chat_template(tools=...)``), which renders
   them the way the model was trained to read them; a template that does not mention tools
   (SmolLM2-135M's) leaves them out of the prompt, as in vLLM.
2. ``tool_choice``:
   - ``"none"``: the output is plain content;
   - ``"auto"`` (the default with tools): the model decides; the family's parser (below) finds the
     calls in its text;
   - ``"required"``: the output is constrained (structured output) to a JSON array of one or more
     ``{"name": ..., "parameters": {...}}`` items, each naming a tool with arguments that follow its
     schema: a valid call whatever the model;
   - ``{"type": "function", "function": {"name": ...}}``: the output is constrained to that tool's
     parameters schema and is its arguments.
3. Parsers, picked by the chat template (``parser_for_template``): ``hermes`` reads
   ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Qwen 2/2.5/3, Hermes; a block
   may hold a list, as SmolLM2's format does); ``llama3_json`` reads a reply that is a
   ``{"name": ..., "parameters": ...}`` object, or several separated by ``;`` (Llama 3.1+, after an
   optional ``<|python_tag|>``). SmolLM2 has no tool template of its own and gets ``hermes``, the
   format its family was trained on.
4. A reply with calls has ``message.tool_calls`` and ``finish_reason`` "tool_calls"; in a stream the
   calls arrive as ``delta.tool_calls`` (a named call's arguments as they are generated; otherwise
   whole, once the reply is complete, while text that cannot be a call streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.proxy.protocol import ChatCompletionRequest, bad_request
from pdserve.sampling_params import StructuredOutputsParams

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"


def parser_for_template(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "<|eot_id|>" in template:
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(obj: dict[str, Any]) -> str | None:
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _calls(value: Any) -> list[Call] | None:
    """Calls from a parsed JSON value (an object or a list of them); None if it is not that."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = _arguments(item)
        if args is None:
            return None
        calls.append(Call(item["name"], args))
    return calls or None


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """(content before the first block, calls); no calls when a block is not valid JSON."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[Call] = []
    for body in _HERMES_BLOCK.findall(text[start:]):
        try:
            found = _calls(json.loads(body))
        except ValueError:
            found = None
        if found is None:
            return text, []
        calls += found
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """The whole reply as calls (``{...}; {...}``), or as content if any part is not a call."""
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[Call] = []
    pos = 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        found = _calls(value)
        if found is None:
            return text, []
        calls += found
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


PARSERS = {HERMES: parse_hermes, LLAMA3_JSON: parse_llama3_json}
_START = {HERMES: "<tool_call>", LLAMA3_JSON: "{"}


@dataclass
class ToolPlan:
    """How one request's tools shape its prompt, its constraint and its reply."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]
    parser: str = HERMES
    name: str = ""  # the named function
    constraint: StructuredOutputsParams | None = None

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The reply's content and calls."""
        if self.mode == "named":
            return None, [Call(self.name, text)]
        if self.mode == "required":
            try:
                calls = _calls(json.loads(text))
            except ValueError:
                calls = None
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            return PARSERS[self.parser](text)
        return text, []

    def may_hold_call(self, text: str) -> int:
        """Where, in streamed ``text``, a tool call may begin (the rest is held back); len(text) if
        nowhere: everything before is content."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode != "auto":
            return len(text)
        start = _START[self.parser]
        if self.parser == LLAMA3_JSON:
            stripped = text.lstrip()
            head = stripped[: len("<|python_tag|>")]
            if stripped.startswith("{") or "<|python_tag|>".startswith(head):
                return 0
            return len(text)
        at = text.find(start)
        if at >= 0:
            return at
        # A suffix that could grow into the start marker stays back too.
        for k in range(min(len(start) - 1, len(text)), 0, -1):
            if start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def _function(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request("each tool must be {'type': 'function', 'function': {...}}", f"tools[{i}]")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request("each tool needs function.name", f"tools[{i}].function")
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request("parameters must be a JSON schema object", f"tools[{i}].function.parameters")
    return function


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_plan(request: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400 for tools or a choice that cannot work."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = [_function(t, i) for i, t in enumerate(request.tools)]
    tools = [{"type": "function", "function": f} for f in functions]
    if choice is None or choice == "auto":
        return ToolPlan("auto", tools, parser)
    if choice == "none":
        return ToolPlan("none", tools, parser)
    if choice == "required":
        items = [
            {
                "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _schema(f)},
                "required": ["name", "parameters"],
            }
            for f in functions
        ]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        return ToolPlan("required", tools, parser, constraint=StructuredOutputsParams(json=schema))
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        match = [f for f in functions if f["name"] == name]
        if not match:
            raise bad_request(f"tool_choice names no tool in tools: {name!r}", "tool_choice")
        constraint = StructuredOutputsParams(json=_schema(match[0]))
        return ToolPlan("named", tools, parser, name=name, constraint=constraint)
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


@dataclass
class ToolCallStream:
    """A streamed reply under a tool plan: what goes out as content and as tool-call deltas."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    calls_sent: int = 0
    named_id: str = field(default_factory=new_call_id)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now) after ``delta``; ``final`` when the
        reply is complete. Deltas are dicts shaped like ``DeltaToolCall``."""
        self.text += delta
        plan = self.plan
        if plan.mode == "named":
            calls = []
            if self.calls_sent == 0:
                self.calls_sent = 1
                head = {"name": plan.name, "arguments": ""}
                calls.append({"index": 0, "id": self.named_id, "type": "function", "function": head})
            if delta:
                calls.append({"index": 0, "function": {"arguments": delta}})
            return "", calls
        if not final:
            upto = max(self.sent, plan.may_hold_call(self.text))
            content, self.sent = self.text[self.sent : upto], upto
            return content, []
        content, calls = plan.parse(self.text)
        if not calls:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, []
        # The content before the calls may have gone out already; send what is left of it.
        rest = self.text[self.sent : max(self.sent, plan.may_hold_call(self.text))]
        rest = rest if rest.strip() else ""
        deltas = [
            {
                "index": i,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ]
        self.calls_sent = len(calls)
        return rest, deltas
