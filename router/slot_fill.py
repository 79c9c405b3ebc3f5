"""Frozen slotted dataclass instances made without their __init__, for the objects the request
path makes once or more per request (replica views, snapshots, request summaries).

A frozen dataclass's __init__ sets each field through object.__setattr__, and filling its slots
through their member descriptors is no cheaper: on this interpreter, under callgrind, a replica
view (18 fields) took ~20k instructions either way. An object of a plain class with the same
__slots__ takes plain slot stores (the interpreter's fastest attribute write), and Python lets
an object change class between two identical layouts: filled that way and then given its class,
the view takes ~7k (its __post_init__ included). Nothing else ever sees the object writable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_new_object = object.__new__


def slot_filler(cls: type, names: tuple[str, ...],
                defaults: tuple[tuple[str, Any], ...] = ()) -> Callable[[Sequence[Any]], Any]:
    """A function making the instance of the frozen slotted dataclass `cls` whose fields `names`
    hold `values` (in that order) and the fields of `defaults` their defaults, without its
    __init__ (nor __post_init__: the caller runs it if `cls` has one)."""
    twin = type(f"_{cls.__name__}Filler", (), {"__slots__": cls.__slots__})
    _new_object(twin).__class__ = cls  # the layouts agree (else TypeError here, at import)
    lines = ["def fill(values):", "    obj = new(twin)"]
    lines += [f"    obj.{name} = values[{i}]" for i, name in enumerate(names)]
    lines += [f"    obj.{name} = default_{i}" for i, (name, _) in enumerate(defaults)]
    lines += ["    obj.__class__ = cls", "    return obj"]
    namespace: dict[str, Any] = {"new": _new_object, "twin": twin, "cls": cls,
                                 **{f"default_{i}": value for i, (_, value) in enumerate(defaults)}}
    exec("\n".join(lines), namespace)  # one store per field, unrolled (the names are the class's own fields)
    fill: Callable[[Sequence[Any]], Any] = namespace["fill"]
    return fill
