"""Read a pickle that holds only plain data (dicts, lists, tuples, sets, strings, bytes,
numbers, booleans, None) without unpickling it: its opcodes are evaluated here, and any opcode
that would name a global, call one or build an object is refused before anything is built.

PyTorch's Flight Recorder writes its dumps as such pickles; a file that claims to be one may
come from anywhere, and `pickle.load` on it would run whatever code it names.
"""

from __future__ import annotations

import pickletools
from typing import Any


class UnsafePickle(ValueError):
    """The data is not a pickle of plain data: what it is, in one line."""


_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
# Opcodes whose argument is the value they push.
_VALUES = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
    "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
})  # fmt: skip
_EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_SET": set}
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_IGNORED = frozenset({"PROTO", "FRAME"})


class _Mark:
    """Where a MARK opcode stood on the stack."""


_MARK = _Mark()


def loads(data: bytes) -> Any:
    """The plain value `data` pickles; UnsafePickle for anything else, or a damaged pickle."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, pos in pickletools.genops(data):
            name = opcode.name
            if name == "STOP":
                if len(stack) != 1 or stack[0] is _MARK:
                    raise UnsafePickle("a damaged pickle: STOP with no single value")
                return stack[0]
            if name in _IGNORED:
                continue
            if name in _VALUES:
                stack.append(arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name in _EMPTY:
                stack.append(_EMPTY[name]())
            elif name == "MARK":
                stack.append(_MARK)
            elif name in _PUT:
                memo[int(arg or 0)] = _top(stack)
            elif name == "MEMOIZE":
                memo[len(memo)] = _top(stack)
            elif name in _GET:
                if arg not in memo:
                    raise UnsafePickle(f"a damaged pickle: no memo entry {arg} at byte {pos}")
                stack.append(memo[arg])
            else:
                _build(name, stack, pos or 0)
    except UnsafePickle:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise UnsafePickle(f"not a pickle of plain data: {exc}") from None
    raise UnsafePickle("a damaged pickle: it ends before STOP")


def _top(stack: list[Any]) -> Any:
    if not stack or stack[-1] is _MARK:
        raise UnsafePickle("a damaged pickle: nothing to remember")
    return stack[-1]


def _to_mark(stack: list[Any]) -> list[Any]:
    """Pop the items above the topmost MARK, and the MARK."""
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is _MARK:
            items = stack[index + 1 :]
            del stack[index:]
            return items
    raise UnsafePickle("a damaged pickle: no MARK")


def _build(name: str, stack: list[Any], pos: int) -> None:
    """The container opcodes; anything else is refused."""
    if name in ("TUPLE1", "TUPLE2", "TUPLE3"):
        count = int(name[-1])
        if len(stack) < count:
            raise UnsafePickle(f"a damaged pickle: {name} on a short stack")
        items = stack[-count:]
        del stack[-count:]
        stack.append(tuple(items))
    elif name == "TUPLE":
        stack.append(tuple(_to_mark(stack)))
    elif name == "LIST":
        stack.append(_to_mark(stack))
    elif name == "DICT":
        items = _to_mark(stack)
        stack.append(dict(zip(items[::2], items[1::2], strict=True)))
    elif name == "FROZENSET":
        stack.append(frozenset(_to_mark(stack)))
    elif name == "APPEND":
        value = stack.pop()
        _target(stack, list).append(value)
    elif name == "APPENDS":
        items = _to_mark(stack)
        _target(stack, list).extend(items)
    elif name == "SETITEM":
        value, key = stack.pop(), stack.pop()
        _target(stack, dict)[key] = value
    elif name == "SETITEMS":
        items = _to_mark(stack)
        _target(stack, dict).update(zip(items[::2], items[1::2], strict=True))
    elif name == "ADDITEMS":
        items = _to_mark(stack)
        _target(stack, set).update(items)
    elif name == "POP":
        stack.pop()
    elif name == "POP_MARK":
        _to_mark(stack)
    elif name == "DUP":
        stack.append(_top(stack))
    else:
        # GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, PERSID, EXT... : code.
        raise UnsafePickle(f"refused: opcode {name} at byte {pos} names or calls code")


def _target(stack: list[Any], kind: type) -> Any:
    target = _top(stack)
    if not isinstance(target, kind):
        raise UnsafePickle(f"a damaged pickle: expected a {kind.__name__} on the stack")
    return target
