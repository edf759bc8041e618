"""Twenty JSON schemas and five prompts for structured-output checks (``structured_output`` benchmark
and its CI test): objects, nesting, arrays, enums, bounded numbers and strings, optional fields,
``anyOf``, ``const``, a ``format`` and ``pattern``s. Strings and arrays are bounded so that a 135M model
sampled at temperature 0.8 ends its JSON within the token budget; the constraint, not the model,
makes the output valid."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_WORD = {"type": "string", "maxLength": 16}
# xgrammar's "format": "email" bounds neither part of the address: a rambling model never ends it.
_EMAIL = {"type": "string", "pattern": "^[a-z0-9._]{1,16}@[a-z]{1,12}\\.(com|org|net)$"}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "city",
        {
            "type": "object",
            "properties": {
                "city": _NAME,
                "country": _NAME,
                "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
            },
            "required": ["city", "country", "population"],
        },
    ),
    (
        "boolean_answer",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "sentiment",
        {
            "type": "object",
            "properties": {"label": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
            "required": ["label"],
        },
    ),
    (
        "colors",
        {
            "type": "object",
            "properties": {"colors": {"type": "array", "items": _WORD, "minItems": 1, "maxItems": 4}},
            "required": ["colors"],
        },
    ),
    (
        "point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["x", "y"],
        },
    ),
    (
        "book",
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "author": {
                    "type": "object",
                    "properties": {"first": _WORD, "last": _WORD},
                    "required": ["first", "last"],
                },
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "todo",
        {
            "type": "object",
            "properties": {
                "tasks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"task": _NAME, "done": {"type": "boolean"}},
                        "required": ["task", "done"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["tasks"],
        },
    ),
    ("numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 5}),
    ("just_a_word", _NAME),
    (
        "optional_fields",
        {
            "type": "object",
            "properties": {"name": _NAME, "nickname": _WORD, "email": _EMAIL},
            "required": ["name"],
        },
    ),
    (
        "weather",
        {
            "type": "object",
            "properties": {
                "city": _NAME,
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "temperature": {"type": "integer", "minimum": -60, "maximum": 60},
            },
            "required": ["city", "unit", "temperature"],
        },
    ),
    (
        "any_of",
        {
            "type": "object",
            "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, _WORD]}},
            "required": ["value"],
        },
    ),
    (
        "const_version",
        {
            "type": "object",
            "properties": {"version": {"const": 2}, "name": _NAME},
            "required": ["version", "name"],
        },
    ),
    (
        "date",
        {
            "type": "object",
            "properties": {"date": {"type": "string", "format": "date"}},
            "required": ["date"],
        },
    ),
    (
        "rating",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "comment": {"type": "string", "maxLength": 40},
            },
            "required": ["stars", "comment"],
        },
    ),
    (
        "pattern_code",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
            "required": ["code"],
        },
    ),
    (
        "matrix",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "product",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
                "tags": {"type": "array", "items": _WORD, "maxItems": 3},
                "in_stock": {"type": "boolean"},
            },
            "required": ["name", "price_cents", "tags", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "event": _NAME,
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": _WORD, "role": {"type": "string", "enum": ["host", "guest"]}},
                        "required": ["name", "role"],
                    },
                    "maxItems": 3,
                },
            },
            "required": ["event", "attendees"],
        },
    ),
]

PROMPTS: list[str] = [
    "Answer in JSON.",
    "Describe something from everyday life as JSON.",
    "Give me an example that fits the requested format.",
    "Return your answer as a JSON value about a famous city.",
    "Make up realistic data and output it as JSON.",
]
