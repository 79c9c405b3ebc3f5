"""A bytes object that a large request body is read straight into, so its handler gets the body
with no copy made after the kernel's.

A body read by the event loop into a buffer takes one more copy to become `bytes` (a pass over
the whole body, into fresh pages), for every turn of a long conversation.
CPython's own `socket.recv` makes none: it allocates a bytes object of the size asked for, has
the kernel fill it, and returns it. The data port does the same here: `blank_body` gives a
bytes object of the body's length that nothing else has seen yet and a writable view of its
storage; the connection reads the body through the view, drops the view once the body is
whole, and only then hands the bytes over. They are never written again, so they are as
immutable as any other bytes from then on (their hash is computed, and cached, only after).

Where that storage cannot be reached (not CPython, or a layout that fails the check below at
import), the body goes into a bytearray, which the request copies into bytes once, as before.
"""

from __future__ import annotations

import ctypes
import sys


def _bytes_storage_offset() -> int | None:
    """Where a bytes object's storage starts, from its address: the fixed header, whose size
    `bytes.__basicsize__` counts with the storage's trailing NUL. None unless a bytes object
    made and filled that way reads back exactly what was written. Known bytes are read there
    first, so nothing is written at an offset that does not hold a bytes object's contents."""
    if sys.implementation.name != "cpython":
        return None
    offset = bytes.__basicsize__ - 1
    known = b"kvrouter body probe" * 4
    try:
        if ctypes.string_at(id(known) + offset, len(known)) != known:
            return None
        probe = _new_bytes(None, 64)
        view = _memory_view(id(probe) + offset, 64, _WRITABLE)
        view[:] = bytes(range(64))
        del view
    except (AttributeError, TypeError, ValueError):
        return None
    return offset if probe == bytes(range(64)) else None


_WRITABLE = 0x200  # PyBUF_WRITE
try:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    # a view straight over memory (not a ctypes array: that makes a type per body length)
    _memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
    _memory_view.restype = ctypes.py_object
    _memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    _OFFSET = _bytes_storage_offset()
except (AttributeError, OSError):  # no C API to call: bytearrays
    _OFFSET = None


def blank_body(size: int, in_place: bool = True) -> tuple[bytes | bytearray, memoryview]:
    """An object to hold a body of `size` bytes and a writable view of all of it: a bytes
    object nobody else has seen (its contents are undefined until written), or, without
    `in_place` or where that cannot be done, a bytearray. The view must be dropped before the
    object is handed to anyone. A view of bytes does not keep them alive: whoever fills it
    holds the object until the view is dropped."""
    if in_place and _OFFSET is not None and size > 0:
        body = _new_bytes(None, size)
        return body, _memory_view(id(body) + _OFFSET, size, _WRITABLE)
    buffer = bytearray(size)
    return buffer, memoryview(buffer)


def body_with_room(received: list[bytes | memoryview], left: int) -> tuple[bytes | bytearray, memoryview]:
    """`blank_body` for a body whose first bytes are `received` (copied in) and whose last
    `left` are still to come: the body, and a writable view of where those go (which, as
    `blank_body`'s, does not keep the body alive)."""
    start = sum(map(len, received))
    body, view = blank_body(start + left)
    at = 0
    for chunk in received:
        view[at:at + len(chunk)] = chunk
        at += len(chunk)
    return body, view[start:]


def in_place_available() -> bool:
    return _OFFSET is not None
