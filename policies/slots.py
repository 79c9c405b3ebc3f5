"""Frozen slotted dataclasses made fast, for the objects routing makes once or more per request.

A frozen dataclass's generated __init__ sets each field through object.__setattr__ (the way
round the frozen guard), which looks the field up by name every time. Two ways round it, one
per way such an object is made:

- `slot_setters`: a class built by its constructor (`Decision(replica, reason)` in every policy)
  gets a hand-written __init__ (`init=False`) that stores through each slot's own setter: no
  lookup by name, about half the time of the generated __init__ for a few fields.
- `slot_filler`: a factory making many fields at once (replica views, snapshots, request
  summaries, usage reports) fills an object of a plain class with the same __slots__ (plain
  slot stores, the interpreter's fastest attribute write) and then gives it its class: Python
  lets an object change class between two identical layouts. On this interpreter, under
  callgrind, a replica view (18 fields) took ~20k instructions through its generated __init__
  and about as many through the slots' setters (a call per field), ~7k filled this way (its
  __post_init__ included). Nothing else ever sees the object writable.
- `slot_replacer`: `dataclasses.replace` of a few fields (a request summary given its KV-index
  matches, a snapshot given its session), the rest copied into the twin the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

_new_object = object.__new__


def _twin(cls: type) -> type:
    """A plain class with `cls`'s __slots__: the same memory layout, so an object of it can be
    given `cls` as its class once filled."""
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": cls.__slots__})
    _new_object(twin).__class__ = cls  # the layouts agree (else TypeError here, at import)
    return twin


def slot_setters(cls: type, *names: str) -> tuple[Callable[[object, object], None], ...]:
    """The setters of the frozen slotted dataclass `cls`'s fields `names`, for its hand-written
    `__init__` (`init=False`). The instance is the same: same fields, still frozen to everyone
    else."""
    return tuple(getattr(cls, name).__set__ for name in names)


def slot_filler(cls: type, names: tuple[str, ...],
                defaults: tuple[tuple[str, Any], ...] = ()) -> Callable[[Sequence[Any]], Any]:
    """A function making the instance of the frozen slotted dataclass `cls` whose fields `names`
    hold `values` (in that order) and the fields of `defaults` their defaults, then running its
    __post_init__ if it has one, as the constructor does. Every field must be filled here, but
    the derived ones (init=False) of a class whose __post_init__ computes them: a field added
    to `cls` and forgotten here is a TypeError at import, not a slot left unset."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = [*names, *(name for name, _ in defaults)]
    post_init = hasattr(cls, "__post_init__")
    unknown = [name for name in given if name not in fields or not name.isidentifier()]
    left = [name for name, f in fields.items() if name not in given and (f.init or not post_init)]
    if unknown or left or len(set(given)) != len(given):
        raise TypeError(f"{cls.__name__}: fields not filled {left}, not fields {unknown}")
    twin = _twin(cls)
    lines = ["def fill(values):", "    obj = new(twin)"]
    lines += [f"    obj.{name} = values[{i}]" for i, name in enumerate(names)]
    lines += [f"    obj.{name} = default_{i}" for i, (name, _) in enumerate(defaults)]
    lines += ["    obj.__class__ = cls"]
    lines += ["    obj.__post_init__()"] if post_init else []
    lines += ["    return obj"]
    namespace: dict[str, Any] = {"new": _new_object, "twin": twin, "cls": cls,
                                 **{f"default_{i}": value for i, (_, value) in enumerate(defaults)}}
    exec("\n".join(lines), namespace)  # one store per field, unrolled (the names are the class's own fields)
    fill: Callable[[Sequence[Any]], Any] = namespace["fill"]
    return fill


def slot_replacer(cls: type, names: tuple[str, ...]) -> Callable[..., Any]:
    """A function `replace(obj, *values)` that is `dataclasses.replace(obj, **dict(zip(names,
    values)))` for the frozen slotted dataclass `cls`: the new object is filled as `slot_filler`
    fills one, every other field copied from `obj` (the same objects), with no __init__ and no
    field loop. A class with derived fields (init=False) or a __post_init__ is refused at import:
    `replace` would compute them again."""
    fields = dataclasses.fields(cls)
    unknown = [name for name in names if name not in {f.name for f in fields}]
    derived = hasattr(cls, "__post_init__") or not all(f.init for f in fields)
    if unknown or len(set(names)) != len(names) or derived:
        raise TypeError(f"{cls.__name__}: cannot replace {list(names)} by slot stores")
    given = {name: f"value_{i}" for i, name in enumerate(names)}
    lines = [f"def replace(obj, {', '.join(given.values())}):", "    new = new_object(twin)"]
    lines += [f"    new.{f.name} = {given.get(f.name, f'obj.{f.name}')}" for f in fields]
    lines += ["    new.__class__ = cls", "    return new"]
    namespace: dict[str, Any] = {"new_object": _new_object, "twin": _twin(cls), "cls": cls}
    exec("\n".join(lines), namespace)  # (the names are the class's own fields)
    replace: Callable[..., Any] = namespace["replace"]
    return replace
