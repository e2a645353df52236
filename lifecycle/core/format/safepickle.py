"""Read a pickle that holds only plain data (dicts, lists, tuples, sets, strings, bytes,
numbers, booleans, None) without unpickling it: its opcodes are evaluated here, and any opcode
that would name a global, call one or build an object is refused before anything is built.

PyTorch's Flight Recorder writes its dumps as such pickles; a file that claims to be one may
come from anywhere, and `pickle.load` on it would run whatever code it names. Nor is what it
builds left unbounded: no container nests deeper than `max_depth` (a deeply nested tuple used
as a dict key is hashed recursively in C, past the end of the stack), no container is changed
once it is inside another or fetched from the memo (so none holds itself), and the value is
refused once it would take more than `max_bytes` with every memo reference counted as the copy
a reader of the value makes of it (a small pickle can share one long string a million times).
"""

from __future__ import annotations

import pickletools
from typing import Any


class UnsafePickle(ValueError):
    """The data is not a pickle of plain data: what it is, in one line."""


MAX_DEPTH = 64
MAX_BYTES = 512 << 20

# What building a value costs, roughly as CPython lays it out: a reference to it, the
# object itself, and a memo entry for each value remembered.
_SLOT = 8
_OBJECT = 32
_CONTAINER = 64
_MEMO_ENTRY = 64

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
_CONTAINERS = (list, dict, tuple, set, frozenset)


class _Mark:
    """Where a MARK opcode stood on the stack."""


_MARK = _Mark()


def loads(data: bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> Any:
    """The plain value `data` pickles; UnsafePickle for anything else, a damaged pickle, or a
    value nested deeper than `max_depth` or larger than `max_bytes` once expanded."""
    return _Evaluator(max_depth=max_depth, max_bytes=max_bytes).run(data)


class _Evaluator:
    """The pickle machine's stack and memo, and what has been built so far."""

    def __init__(self, *, max_depth: int, max_bytes: int) -> None:
        self.max_depth = max_depth
        self.max_bytes = max_bytes
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.built = 0  # bytes, every value pushed counted as a copy of what it expands to
        # By id, for the containers built here (an id is reset when a new container takes it).
        self.depth: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.sealed: set[int] = set()  # inside another container, or fetched from the memo

    def run(self, data: bytes) -> Any:
        try:
            for opcode, arg, pos in pickletools.genops(data):
                name = opcode.name
                if name == "STOP":
                    if len(self.stack) != 1 or self.stack[0] is _MARK:
                        raise UnsafePickle("a damaged pickle: STOP with no single value")
                    return self.stack[0]
                self._step(name, arg, pos or 0)
        except UnsafePickle:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            raise UnsafePickle(f"not a pickle of plain data: {exc}") from None
        raise UnsafePickle("a damaged pickle: it ends before STOP")

    def _step(self, name: str, arg: Any, pos: int) -> None:
        stack = self.stack
        if name in _IGNORED:
            return
        if name in _VALUES:
            self._push(arg)
        elif name in _CONSTANTS:
            self._push(_CONSTANTS[name])
        elif name in _EMPTY:
            self._push(self._made(_EMPTY[name](), ()))
        elif name == "MARK":
            stack.append(_MARK)
        elif name in _PUT or name == "MEMOIZE":
            self._charge(_MEMO_ENTRY)
            self.memo[len(self.memo) if name == "MEMOIZE" else int(arg or 0)] = self._top()
        elif name in _GET:
            if arg not in self.memo:
                raise UnsafePickle(f"a damaged pickle: no memo entry {arg} at byte {pos}")
            self._push(self._seal(self.memo[arg]))
        elif name == "DUP":
            self._push(self._seal(self._top()))
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            self._to_mark()
        else:
            self._build(name, pos)

    def _build(self, name: str, pos: int) -> None:
        """The container opcodes; anything else is refused."""
        stack = self.stack
        if name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            if len(stack) < count:
                raise UnsafePickle(f"a damaged pickle: {name} on a short stack")
            items = stack[-count:]
            del stack[-count:]
            self._push_new(tuple(items), items)
        elif name == "TUPLE":
            items = self._to_mark()
            self._push_new(tuple(items), items)
        elif name == "LIST":
            items = self._to_mark()
            self._push_new(list(items), items)
        elif name == "DICT":
            items = self._to_mark()
            self._push_new(dict(zip(items[::2], items[1::2], strict=True)), items)
        elif name == "FROZENSET":
            items = self._to_mark()
            self._push_new(frozenset(items), items)
        elif name == "APPEND":
            value = stack.pop()
            self._target(list, (value,)).append(value)
        elif name == "APPENDS":
            items = self._to_mark()
            self._target(list, items).extend(items)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            self._target(dict, (key, value))[key] = value
        elif name == "SETITEMS":
            items = self._to_mark()
            self._target(dict, items).update(zip(items[::2], items[1::2], strict=True))
        elif name == "ADDITEMS":
            items = self._to_mark()
            self._target(set, items).update(items)
        else:
            # GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, PERSID, EXT... : code.
            raise UnsafePickle(f"refused: opcode {name} at byte {pos} names or calls code")

    def _push(self, value: Any) -> None:
        self._charge(_SLOT + self._size_of(value))
        self.stack.append(value)

    def _push_new(self, container: Any, items: list[Any]) -> None:
        """A container made from items already on the stack (and already paid for)."""
        self._charge(_SLOT + _CONTAINER)
        self.stack.append(self._made(container, items))

    def _charge(self, cost: int) -> None:
        self.built += cost
        if self.built > self.max_bytes:
            raise UnsafePickle(
                f"refused: it expands to more than {self.max_bytes} bytes"
                " (each shared value counted as a copy)"
            )

    def _made(self, container: Any, items: Any) -> Any:
        """Register a container new to this pickle, built of `items`: they are inside it now."""
        key = id(container)
        self.sealed.discard(key)
        self.depth[key] = 1
        self.size[key] = _CONTAINER
        self._place(container, items)
        return container

    def _target(self, kind: type, items: Any) -> Any:
        """The container on the top of the stack that `items` go into."""
        target = self._top()
        if not isinstance(target, kind):
            raise UnsafePickle(f"a damaged pickle: expected a {kind.__name__} on the stack")
        if id(target) in self.sealed:
            raise UnsafePickle("refused: a container changed after it was used")
        self._place(target, items)
        return target

    def _place(self, container: Any, items: Any) -> None:
        key = id(container)
        depth = self.depth[key]
        size = self.size[key]
        for item in items:
            if item is _MARK:
                raise UnsafePickle("a damaged pickle: a MARK inside a container")
            if item is container:
                raise UnsafePickle("refused: a container inside itself")
            self._seal(item)
            depth = max(depth, 1 + self._depth_of(item))
            size += _SLOT + self._size_of(item)
        if depth > self.max_depth:
            raise UnsafePickle(f"refused: nested deeper than {self.max_depth} levels")
        self.depth[key] = depth
        self.size[key] = size

    def _seal(self, value: Any) -> Any:
        if isinstance(value, _CONTAINERS):
            self.sealed.add(id(value))
        return value

    def _depth_of(self, value: Any) -> int:
        return self.depth[id(value)] if isinstance(value, _CONTAINERS) else 0

    def _size_of(self, value: Any) -> int:
        if isinstance(value, _CONTAINERS):
            return self.size[id(value)]
        if isinstance(value, str | bytes):
            return _OBJECT + len(value)
        if isinstance(value, int):
            return _OBJECT + value.bit_length() // 8
        return _OBJECT

    def _top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise UnsafePickle("a damaged pickle: nothing to remember")
        return self.stack[-1]

    def _to_mark(self) -> list[Any]:
        """Pop the items above the topmost MARK, and the MARK."""
        stack = self.stack
        for index in range(len(stack) - 1, -1, -1):
            if stack[index] is _MARK:
                items = stack[index + 1 :]
                del stack[index:]
                return items
        raise UnsafePickle("a damaged pickle: no MARK")
