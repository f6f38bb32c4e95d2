"""Varied structured-output requests: chat prompts with JSON schemas (nested objects, enums, arrays, bounded numbers,
required fields), regexes and choices, and the check that an output satisfies its constraint.

Strings and arrays are bounded (``maxLength``, ``maxItems``): a 135M model otherwise repeats itself inside a string
until ``max_tokens``, and a cut-off output cannot parse whatever the guide does.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from infer.guide import Constraint

NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    (
        "Describe a fictional person.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "maxLength": 40},
            },
            "required": ["name", "age"],
        },
    ),
    (
        "Give a book recommendation.",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1500, "maximum": 2026},
                "genre": {"enum": ["fiction", "history", "science", "poetry"]},
            },
            "required": ["title", "author", "year", "genre"],
        },
    ),
    (
        "Plan a three-item shopping list.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 12}},
                        "required": ["name", "quantity"],
                    },
                }
            },
            "required": ["items"],
        },
    ),
    (
        "Report the weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "wind": {
                    "type": "object",
                    "properties": {
                        "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                        "direction": {"enum": ["N", "E", "S", "W"]},
                    },
                    "required": ["speed_kmh", "direction"],
                },
            },
            "required": ["city", "temperature_c", "conditions", "wind"],
        },
    ),
    (
        "Summarize a movie.",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "rating": {"type": "integer", "minimum": 1, "maximum": 10},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                "recommended": {"type": "boolean"},
            },
            "required": ["title", "rating", "recommended"],
        },
    ),
    (
        "Create a user account record.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z]{3,10}$"},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "active": {"type": "boolean"},
            },
            "required": ["username", "role", "active"],
        },
    ),
]
REGEXES: list[tuple[str, str]] = [
    ("Write a phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("Write a date.", r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"),
    ("Write a time of day.", r"([01]\d|2[0-3]):[0-5]\d"),
    ("Name a color in lower case.", r"[a-z]{3,10}"),
    ("Write an IPv4 address.", r"(\d{1,3}\.){3}\d{1,3}"),
]
CHOICES: list[tuple[str, tuple[str, ...]]] = [
    ("Is the sky blue? Answer yes or no.", ("yes", "no")),
    ("Pick a primary color.", ("red", "yellow", "blue")),
    ("How do you feel today?", ("happy", "sad", "tired", "excited")),
    ("Which is a planet?", ("Mars", "Sun", "Moon")),
]
TOPICS = ["", " Keep it short.", " Be creative.", " Use a European example.", " Think of the 1990s."]


@dataclass(frozen=True, slots=True)
class StructuredRequest:
    messages: list[dict[str, str]]
    constraint: Constraint


def structured_requests(num_requests: int, seed: int = 0) -> list[StructuredRequest]:
    """``num_requests`` requests cycling through schemas, regexes and choices (about 1/2, 3/10 and 1/5), each with
    a varied instruction; the same list for the same arguments."""
    rng = random.Random(seed)
    kinds = ["json_schema"] * 5 + ["regex"] * 3 + ["choice"] * 2
    requests = []
    for index in range(num_requests):
        kind = kinds[index % len(kinds)]
        topic = rng.choice(TOPICS)
        if kind == "json_schema":
            task, schema = SCHEMAS[index % len(SCHEMAS)]
            constraint = Constraint(json_schema=schema)
            text = f"{task}{topic} Reply in JSON."
        elif kind == "regex":
            task, pattern = REGEXES[index % len(REGEXES)]
            constraint, text = Constraint(regex=pattern), f"{task}{topic}"
        else:
            task, options = CHOICES[index % len(CHOICES)]
            constraint, text = Constraint(choice=options), f"{task}{topic}"
        requests.append(StructuredRequest([{"role": "user", "content": text}], constraint))
    return requests


def satisfies(text: str, constraint: Constraint) -> str | None:
    """None when ``text`` satisfies ``constraint``, else why not (JSON schemas checked with ``jsonschema``)."""
    kind = constraint.kind
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            return f"not JSON: {error}"
        if kind == "json_object":
            return None if isinstance(value, dict) else "not a JSON object"
        import jsonschema

        try:
            jsonschema.validate(value, json.loads(constraint.json_schema))
        except jsonschema.ValidationError as error:
            return f"violates the schema: {error.message}"
        return None
    if kind == "regex":
        return None if re.fullmatch(constraint.regex, text) else f"does not match {constraint.regex!r}"
    if kind == "choice":
        return None if text in constraint.choice else f"not one of {constraint.choice}"
    return None
