"""MkDocs hook: the config reference, rendered from the config's JSON Schema at build time.

A page that contains the line ``<!-- config-reference -->`` gets it replaced by one table per config section, every
key with its type, default and description, from ``infer.config.config_json_schema`` (what ``infer config
--schema`` prints), over the built-in plugins only. The keys, defaults and descriptions therefore come from the
pydantic models themselves and cannot drift from the code.
"""

from __future__ import annotations

import json
import os
from typing import Any

MARKER = "<!-- config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_reference(built_in_schema()))


def built_in_schema() -> dict[str, Any]:
    """The config schema with infer's own plugins only (an installed third-party plugin must not change the docs)."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from infer.config import config_json_schema
    from infer.registry import get_registry

    return config_json_schema(get_registry(["none"]))


def render_reference(schema: dict[str, Any]) -> str:
    definitions = schema.get("$defs", {})
    parts = []
    for section, prop in schema["properties"].items():
        models = [_resolve(option, definitions) for option in _options(prop)]
        parts.append(f"### `{section}`\n")
        if len(models) == 1:
            parts.append(_section_doc(models[0]))
            parts.append(_table(section, models[0], definitions))
            continue
        parts.append(f"The keys depend on `{section}.name`; every implementation takes the keys of its own model.\n")
        for model in models:
            parts.append(f"#### `{section}.name: {_name_of(model)}`\n")
            parts.append(_section_doc(model))
            parts.append(_table(section, model, definitions))
    return "\n".join(parts)


def _options(prop: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return prop[key]
    return [prop]


def _resolve(node: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = definitions[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _name_of(model: dict[str, Any]) -> str:
    name = model.get("properties", {}).get("name", {})
    return str(name.get("default", name.get("const", model.get("title", "?"))))


def _section_doc(model: dict[str, Any]) -> str:
    description = " ".join(model.get("description", "").split()).replace("``", "`")
    return f"{_escape(description)}\n" if description else ""


def _table(section: str, model: dict[str, Any], definitions: dict[str, Any]) -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, field in model.get("properties", {}).items():
        description = " ".join(field.get("description", "").split())
        if key == "name" and not description:
            description = f"Which {section} implementation runs (`infer plugins` lists them)."
        default = f"`{json.dumps(field['default'])}`" if "default" in field else "required"
        rows.append(f"| `{section}.{key}` | {_type(field, definitions)} | {default} | {_escape(description)} |")
    return "\n".join(rows) + "\n"


def _type(field: dict[str, Any], definitions: dict[str, Any]) -> str:
    field = _resolve(field, definitions)
    if "enum" in field:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in field["enum"])
    if "const" in field:
        return f"`{json.dumps(field['const'])}`"
    if "anyOf" in field:
        return " \\| ".join(_type(option, definitions) for option in field["anyOf"])
    kind = field.get("type", "any")
    if kind == "array":
        return f"list of {_type(field.get('items', {}), definitions)}"
    return str(kind)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
