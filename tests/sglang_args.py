"""SGLang's command-line arguments, read from a released wheel's source with `ast` (never imported:
importing sglang needs torch and a GPU stack).

SGLang declares most flags as annotated fields of namespace classes in
`sglang/srt/arg_groups/fields/*.py`:

    kv_cache_dtype: A[str, Arg(help=..., choices=[...])] = "auto"
    enable_metrics: A[bool, "help"] = False          # bool -> store_true

and `add_cli_args_from_dataclass` turns each into `--kv-cache-dtype` (plus `Arg.aliases`,
`Arg.cli_name`; `Arg.no_cli` skips it; Literal types give choices; list types nargs). A few flags
(`--reasoning-parser`, `--tool-call-parser`, `--config`, deprecated spellings) are added by hand in
`ServerArgs.add_cli_args` in `sglang/srt/server_args.py`. Both are read here; choice lists are
resolved through module constants, imports and the small helper functions SGLang uses.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass, field
from typing import Any

UNRESOLVED = object()


class Unresolved(Exception):
    pass


@dataclass
class ArgDef:
    dest: str
    options: list[str]
    kind: str  # "store_true" | "value" | "list" | "action"
    type: str  # "str" | "int" | "float" | "bool" | "any"
    choices: Any = None  # list, None (free), or UNRESOLVED
    source: str = ""

    @property
    def config_keys(self) -> set[str]:
        """Keys a --config YAML may use for it (SGLang's _config_keys)."""
        return {self.dest} | {o[2:].replace("-", "_") for o in self.options if o.startswith("--")}


@dataclass
class Wheel:
    zf: zipfile.ZipFile
    _asts: dict[str, ast.Module] = field(default_factory=dict)

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._asts:
            base = dotted.replace(".", "/")
            names = set(self.zf.namelist())
            path = base + ".py" if base + ".py" in names else base + "/__init__.py"
            self._asts[dotted] = ast.parse(self.zf.read(path).decode(), path)
        return self._asts[dotted]

    # -- resolving expressions (choice lists) ----------------------------------------------------
    def _lookup(self, name: str, module: str, scope: list[ast.stmt]) -> tuple[ast.AST, str, list[ast.stmt]]:
        for body in (scope, self.module(module).body):
            for stmt in reversed(body):
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in stmt.targets
                ):
                    return stmt.value, module, body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and stmt.target.id == name and stmt.value is not None:
                    return stmt.value, module, body
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    for alias in stmt.names:
                        if (alias.asname or alias.name) == name:
                            return self._lookup(alias.name, stmt.module, [])
                if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
                    return stmt, module, body
        raise Unresolved(f"{name} in {module}")

    def resolve(self, node: ast.AST, module: str, scope: list[ast.stmt] | None = None) -> Any:
        scope = scope or []
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return [self.resolve(e, module, scope) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.resolve(node.left, module, scope) + self.resolve(node.right, module, scope)
        if isinstance(node, ast.Name):
            target, mod, body = self._lookup(node.id, module, scope)
            return self.resolve(target, mod, body if body is not self.module(mod).body else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("list", "set", "sorted", "tuple", "frozenset") and len(node.args) == 1:
                return list(self.resolve(node.args[0], module, scope))
            target, mod, _ = self._lookup(node.func.id, module, scope)
            if isinstance(target, ast.FunctionDef) and not node.args:
                returns = [s for s in target.body if isinstance(s, ast.Return) and s.value is not None]
                if returns:
                    return self.resolve(returns[-1].value, mod, target.body)  # type: ignore[arg-type]
        if isinstance(node, ast.FunctionDef):
            raise Unresolved(f"function {node.name}")
        raise Unresolved(ast.unparse(node))


def _unwrap_type(node: ast.AST) -> tuple[ast.AST, bool]:
    """Optional[X] / Union[X, None] / X | None -> (X, True)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        return node.slice, True
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Union":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        rest = [e for e in elts if not (isinstance(e, ast.Constant) and e.value is None)]
        if len(rest) == 1:
            return rest[0], True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        for a, b in ((node.left, node.right), (node.right, node.left)):
            if isinstance(b, ast.Constant) and b.value is None:
                return a, True
    return node, False


_SCALARS = {"str": "str", "int": "int", "float": "float", "bool": "bool"}


def _field_arg(wheel: Wheel, module: str, stmt: ast.AnnAssign) -> ArgDef | None:
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
            and ann.value.id in ("A", "Annotated") and isinstance(ann.slice, ast.Tuple)):
        return None
    name = stmt.target.id  # type: ignore[union-attr]
    type_node, meta = ann.slice.elts[0], ann.slice.elts[1]
    kw: dict[str, ast.AST] = {}
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        kw = {k.arg: k.value for k in meta.keywords if k.arg}
    elif not isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp)):
        return None  # e.g. Derived(...): not a CLI input
    if "no_cli" in kw and wheel.resolve(kw["no_cli"], module) is True:
        return None
    cli_name = wheel.resolve(kw["cli_name"], module) if "cli_name" in kw else "--" + name.replace("_", "-")
    options = [cli_name] + (wheel.resolve(kw["aliases"], module) if "aliases" in kw else [])
    inner, _ = _unwrap_type(type_node)
    choices: Any = None
    if "choices" in kw:
        try:
            choices = wheel.resolve(kw["choices"], module)
        except Unresolved:
            choices = UNRESOLVED
    if "action" in kw:
        return ArgDef(name, options, "action", "any", choices, module)
    if isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name) and inner.value.id == "Literal":
        values = wheel.resolve(inner.slice, module)
        values = values if isinstance(values, list) else [values]
        typ = {bool: "bool", int: "int", float: "float"}.get(type(values[0]), "str")
        return ArgDef(name, options, "value", typ, choices if choices is not None else values, module)
    if isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name) \
            and inner.value.id in ("List", "list") and "type_parser" not in kw:
        return ArgDef(name, options, "list", "any", choices, module)
    typ = _SCALARS.get(inner.id, "any") if isinstance(inner, ast.Name) else "any"
    if typ == "bool":
        return ArgDef(name, options, "store_true", "bool", None, module)
    if "type_parser" in kw:
        parser = ast.unparse(kw["type_parser"])
        typ = "int" if "int" in parser else "any"
    return ArgDef(name, options, "value", typ, choices, module)


def _manual_args(wheel: Wheel) -> list[ArgDef]:
    """parser.add_argument(...) calls in ServerArgs.add_cli_args."""
    module = "sglang.srt.server_args"
    tree = wheel.module(module)
    out = []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "add_cli_args"):
            continue
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "add_argument"):
                continue
            options = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if not options:
                continue
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            dest = wheel.resolve(kw["dest"], module) if "dest" in kw else options[0].lstrip("-").replace("-", "_")
            action = kw.get("action")
            typ = ast.unparse(kw["type"]) if "type" in kw else "str"
            choices: Any = None
            if "choices" in kw:
                try:
                    choices = wheel.resolve(kw["choices"], module, fn.body)
                except Unresolved:
                    choices = UNRESOLVED
            if isinstance(action, ast.Constant) and action.value == "store_true":
                out.append(ArgDef(dest, options, "store_true", "bool", None, module))
            elif action is not None:
                out.append(ArgDef(dest, options, "action", "any", choices, module))
            else:
                out.append(ArgDef(dest, options, "value", _SCALARS.get(typ, "any"), choices, module))
    return out


def sglang_arguments(wheel_path: str) -> dict[str, ArgDef]:
    """Every config key (flag name with underscores) -> its ArgDef."""
    wheel = Wheel(zipfile.ZipFile(wheel_path))
    defs: list[ArgDef] = []
    fields = sorted(n for n in wheel.zf.namelist()
                    if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py"))
    for path in fields:
        module = path[:-3].replace("/", ".")
        for cls in wheel.module(module).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            if not any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NS_PATH"
                                                         for t in s.targets) for s in cls.body):
                continue
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    arg = _field_arg(wheel, module, stmt)
                    if arg is not None:
                        defs.append(arg)
    manual = _manual_args(wheel)
    by_key: dict[str, ArgDef] = {}
    for arg in defs + manual:  # hand-added ones (dynamic choices) win, as argparse's last add does
        for key in arg.config_keys:
            by_key[key] = arg
    return by_key


def pydantic_fields(wheel_path: str, module: str, cls_name: str) -> set[str]:
    wheel = Wheel(zipfile.ZipFile(wheel_path))
    for node in wheel.module(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return {s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and not s.target.id.startswith("_")}
    raise KeyError(cls_name)


def check_config(config: dict[str, Any], args: dict[str, ArgDef]) -> list[str]:
    """Problems SGLang's --config merge + argparse would raise for this YAML mapping."""
    problems = []
    for key, value in config.items():
        norm = key.replace("-", "_")
        arg = args.get(norm)
        if arg is None:
            problems.append(f"{key}: no such SGLang argument")
            continue
        if arg.kind == "store_true":
            if not isinstance(value, bool):
                problems.append(f"{key}: a switch, wants true/false, got {value!r}")
            continue
        if arg.kind == "action":
            problems.append(f"{key}: custom action {arg.options[0]}, not settable from --config")
            continue
        if isinstance(value, bool):
            problems.append(f"{key}: not a switch, got {value!r}")
            continue
        if arg.kind == "list":
            continue
        if isinstance(value, dict):
            value = "json"  # the merger json.dumps() mappings
            if arg.type != "str":
                problems.append(f"{key}: mapping given for a {arg.type} argument")
            continue
        if arg.type == "int" and not isinstance(value, int):
            problems.append(f"{key}: wants an integer, got {value!r}")
        if arg.type == "float" and not isinstance(value, (int, float)):
            problems.append(f"{key}: wants a number, got {value!r}")
        if arg.choices is UNRESOLVED:
            problems.append(f"{key}: its choices could not be read from the source (extend tests/sglang_args.py)")
        elif arg.choices is not None and str(value) not in {str(c) for c in arg.choices}:
            problems.append(f"{key}: {value!r} not one of {sorted(map(str, arg.choices))}")
    return problems
