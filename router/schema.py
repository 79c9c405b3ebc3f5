"""The config file's JSON Schema (for editors) and its Markdown reference, both generated from the
pydantic models in `router/config.py`, so neither can drift from what the router accepts.

    kvrouter config-schema > kvrouter.schema.json          # JSON Schema (draft 2020-12)
    python -m kvrouter.router.schema --markdown > docs/config-reference.md
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Sequence
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .config import RouterConfig

def json_schema() -> dict[str, Any]:
    schema = RouterConfig.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# -- Markdown --------------------------------------------------------------------------------------
def _model(annotation: Any) -> type[BaseModel] | None:
    """The model inside `Model` or `Model | None`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _type(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is tuple:
        return f"list[{_type(args[0])}]" if args else "list"
    if origin is dict:
        return f"map[{_type(args[0])}, {_type(args[1])}]"
    if get_origin(annotation) is not None and hasattr(annotation, "__metadata__"):
        return _type(args[0])  # Annotated
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown() -> str:
    out = [
        "# kvrouter configuration reference",
        "",
        "<!-- Generated from the pydantic models in router/config.py by",
        "     `python -m kvrouter.router.schema --markdown > docs/config-reference.md`.",
        "     Do not edit by hand: tests/test_config_schema.py fails when this file is stale. -->",
        "",
        "The router reads one YAML file (`kvrouter serve --config FILE`, checked by",
        "`kvrouter check-config FILE`). Every section and key is optional unless marked **required**;",
        "an unknown key is an error. `kvrouter config-schema` prints the same rules as a JSON Schema",
        "for editor validation (e.g. `# yaml-language-server: $schema=kvrouter.schema.json`).",
        "",
    ]
    seen: set[type[BaseModel]] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("", RouterConfig)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        title = f"`{path}`" if path else "top level"
        out += [f"## {model.__name__}", "", f"Section: {title}.", ""]
        doc = (model.__doc__ or "").strip()
        if doc and model is not RouterConfig and not doc.startswith(("A base class", "Usage docs")):
            out += [" ".join(doc.split()), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        nested: list[tuple[str, type[BaseModel]]] = []
        for name, field in model.model_fields.items():
            sub = _model(field.annotation)
            desc = field.description or (f"See [{sub.__name__}](#{sub.__name__.lower()})." if sub else "")
            out.append(f"| `{name}` | {_cell(_type(field.annotation))} | {_default(field)} | {_cell(desc)} |")
            key = f"{path}.{name}" if path else name
            if sub is not None:
                nested.append((key, sub))
            elif get_origin(field.annotation) is dict:
                inner = _model(get_args(field.annotation)[1])
                if inner is not None:
                    nested.append((f"{key}.<key>", inner))
        out.append("")
        queue = nested + queue
    return "\n".join(out).rstrip() + "\n"


# -- command ------------------------------------------------------------------------------------
def config_schema_command(args: argparse.Namespace) -> int:
    """`kvrouter config-schema [--markdown]`: print the JSON Schema (or Markdown reference)."""
    if getattr(args, "markdown", False):
        sys.stdout.write(markdown())
    else:
        sys.stdout.write(json.dumps(json_schema(), indent=2, sort_keys=False) + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("config-schema", help="print the config file's JSON Schema (editor validation)")
    p.add_argument("--markdown", action="store_true", help="print the Markdown config reference instead")
    p.set_defaults(func=config_schema_command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrouter.router.schema", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="Markdown reference instead of JSON Schema")
    return config_schema_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
