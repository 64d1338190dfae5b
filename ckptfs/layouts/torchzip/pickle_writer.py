"""A protocol-2 pickle writer that reproduces CPython's C pickler byte for byte, without importing torch.

``dumps2(obj)`` writes what ``pickle.dumps(obj, protocol=2)`` writes for plain values (dict,
OrderedDict, list, tuple, set, str, int, float, bool, None) — same opcodes, same MARK/SETITEMS
batching, same memo numbering (memo keyed by object identity, as CPython) — plus three marker types
that let a caller describe objects it cannot build (torch tensors and their storages):

* ``Global(module, name)``: a class/function reference (``GLOBAL`` + memo; one memo per name).
* ``Reduce(func, args)``: an object pickled by ``save_reduce(func, args)``: func, args, ``REDUCE``,
  then memoized as the instance itself (a second appearance of the same instance is a ``BINGET``).
* ``PersistentId(pid)``: ``pid`` then ``BINPERSID``; never memoized (as torch's storages).

Any other object goes to the caller's ``reducer``, which returns a fresh replacement (e.g. a
``Reduce``) per appearance — how torch turns each tensor into ``_rebuild_tensor_v2(...)``.

Only protocol-2 opcodes accepted by torch's ``weights_only`` unpickler are emitted (except POP/POP_MARK for a
tuple that contains itself through a list or dict, which torch.save never produces either).
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

__all__ = ["Global", "Reduce", "PersistentId", "dumps2", "PickleTypeError"]

BATCHSIZE = 1000

# opcodes (protocol <= 2)
MARK, STOP, POP, POP_MARK = b"(", b".", b"0", b"1"
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"
BININT, BININT1, BININT2, LONG1, LONG4 = b"J", b"K", b"M", b"\x8a", b"\x8b"
BINFLOAT, BINUNICODE = b"G", b"X"
EMPTY_TUPLE, TUPLE, TUPLE1, TUPLE2, TUPLE3 = b")", b"t", b"\x85", b"\x86", b"\x87"
EMPTY_LIST, APPEND, APPENDS = b"]", b"a", b"e"
EMPTY_DICT, SETITEM, SETITEMS = b"}", b"s", b"u"
GLOBAL, REDUCE, BUILD, BINPERSID = b"c", b"R", b"b", b"Q"
BINPUT, LONG_BINPUT, BINGET, LONG_BINGET = b"q", b"r", b"h", b"j"
PROTO = b"\x80"


class PickleTypeError(TypeError):
    """An object of a type this writer does not produce."""


@dataclass(frozen=True)
class Global:
    """Reference to ``module.name`` (a class, function or torch dtype), written as ``GLOBAL``."""

    module: str
    name: str


class Reduce:
    """An object rebuilt as ``func(*args)``; memoized by instance identity, like a real object."""

    __slots__ = ("func", "args")

    def __init__(self, func: Global, args: tuple):
        self.func = func
        self.args = args


class PersistentId:
    """An external reference: ``pid`` is pickled, then ``BINPERSID`` (torch's storage tuples)."""

    __slots__ = ("pid",)

    def __init__(self, pid):
        self.pid = pid


_SHORT_PUTS = [BINPUT + bytes([i]) for i in range(256)]
_SHORT_GETS = [BINGET + bytes([i]) for i in range(256)]
_SMALL_INTS = [BININT1 + bytes([i]) for i in range(256)]
_TUPLESIZE_OPS = {1: TUPLE1, 2: TUPLE2, 3: TUPLE3}
_OD = Global("collections", "OrderedDict")
_SET = Global("__builtin__", "set")  # protocol 2 maps builtins → __builtin__ (fix_imports), as CPython


def _encode_long(x: int) -> bytes:
    """Two's-complement little-endian bytes of ``x``, minimal length (pickle's ``encode_long``)."""
    if x == 0:
        return b""
    nbytes = (x.bit_length() >> 3) + 1
    result = x.to_bytes(nbytes, byteorder="little", signed=True)
    if x < 0 and nbytes > 1:
        if result[-1] == 0xFF and (result[-2] & 0x80) != 0:
            result = result[:-1]
    return result


class _Pickler:
    def __init__(self, reducer=None):
        self.reducer = reducer
        self.out = bytearray()  # one growing buffer, not a list of millions of small bytes objects
        self.memo: dict = {}  # key → memo index
        self.keep: list = []  # keeps temporaries alive so that ids stay unique

    # -- memo --------------------------------------------------------------------------------------
    def _put(self, key) -> None:
        idx = len(self.memo)
        self.memo[key] = idx
        self.out.extend(_SHORT_PUTS[idx] if idx < 256 else LONG_BINPUT + struct.pack("<I", idx))

    def _get(self, idx: int) -> bytes:
        return _SHORT_GETS[idx] if idx < 256 else LONG_BINGET + struct.pack("<I", idx)

    # -- dispatch ----------------------------------------------------------------------------------
    def save(self, obj) -> None:
        w = self.out.extend
        t = type(obj)
        if t is PersistentId:
            self.save(obj.pid)
            w(BINPERSID)
            return
        # values that are never memoized
        if obj is None:
            w(NONE)
            return
        if t is bool:
            w(NEWTRUE if obj else NEWFALSE)
            return
        if t is int:
            self._save_int(obj)
            return
        if t is float:
            w(BINFLOAT + struct.pack(">d", obj))
            return
        if t is tuple and not obj:
            w(EMPTY_TUPLE)
            return
        key = ("global", obj.module, obj.name) if t is Global else id(obj)  # one class object per qualified name
        idx = self.memo.get(key)
        if idx is not None:
            w(self._get(idx))
            return
        if t is str:
            data = obj.encode("utf-8", "surrogatepass")
            w(BINUNICODE + struct.pack("<I", len(data)) + data)
            self._put(key)
        elif t is tuple:
            self._save_tuple(obj, key)
        elif t is list:
            w(EMPTY_LIST)
            self._put(key)
            self._batch_list(obj)
        elif t is dict:
            w(EMPTY_DICT)
            self._put(key)
            self._batch_dict_exact(obj)
        elif t is OrderedDict:
            state = obj.__dict__ or None
            self._save_reduce(_OD, (), obj, key, dictitems=list(obj.items()), state=state)
        elif t is set:
            items = list(obj)
            self.keep.append(items)
            args = (items,)
            self.keep.append(args)
            self._save_reduce(_SET, args, obj, key)
        elif t is Global:
            w(GLOBAL + obj.module.encode("utf-8") + b"\n" + obj.name.encode("utf-8") + b"\n")
            self._put(key)
        elif t is Reduce:
            self._save_reduce(obj.func, obj.args, obj, key)
        else:
            red = self.reducer(obj) if self.reducer is not None else None
            if red is None:
                raise PickleTypeError(f"cannot pickle an object of type {t.__name__}")
            self.keep.append(red)  # a fresh object per appearance, like torch's Tensor.__reduce_ex__
            self.save(red)

    def _save_int(self, x: int) -> None:
        w = self.out.extend
        if 0 <= x <= 0xFF:
            w(_SMALL_INTS[x])
        elif 0 <= x <= 0xFFFF:
            w(BININT2 + struct.pack("<H", x))
        elif -0x80000000 <= x <= 0x7FFFFFFF:
            w(BININT + struct.pack("<i", x))
        else:
            enc = _encode_long(x)
            n = len(enc)
            w((LONG1 + bytes([n]) if n < 256 else LONG4 + struct.pack("<i", n)) + enc)

    def _save_tuple(self, obj: tuple, key) -> None:
        w = self.out.extend
        n = len(obj)
        if n <= 3:
            for el in obj:
                self.save(el)
            if key in self.memo:  # the tuple was memoized recursively while saving its items
                w(POP * n + self._get(self.memo[key]))
                return
            w(_TUPLESIZE_OPS[n])
            self._put(key)
            return
        w(MARK)
        for el in obj:
            self.save(el)
        if key in self.memo:
            w(POP_MARK + self._get(self.memo[key]))
            return
        w(TUPLE)
        self._put(key)

    def _batch_list(self, items: list) -> None:
        w = self.out.extend
        n = len(items)
        if n == 0:
            return
        if n == 1:
            self.save(items[0])
            w(APPEND)
            return
        total = 0
        while total < n:
            w(MARK)
            for el in items[total:total + BATCHSIZE]:
                self.save(el)
            total = min(n, total + BATCHSIZE)
            w(APPENDS)

    def _batch_dict_exact(self, d: dict) -> None:
        """CPython's ``batch_dict_exact``: one item → SETITEM; else MARK…SETITEMS per 1000 (an exact
        multiple of 1000 ends with an empty MARK SETITEMS batch, as CPython does)."""
        w = self.out.extend
        n = len(d)
        if n == 0:
            return
        if n == 1:
            (k, v), = d.items()
            self.save(k)
            self.save(v)
            w(SETITEM)
            return
        items = list(d.items())
        i = 0
        while True:
            w(MARK)
            batch = items[i:i + BATCHSIZE]
            for k, v in batch:
                self.save(k)
                self.save(v)
            w(SETITEMS)
            i += len(batch)
            if len(batch) != BATCHSIZE:
                break

    def _batch_dict(self, items: list) -> None:
        """CPython's ``batch_dict`` (dict items from ``__reduce__``): a lone trailing item → SETITEM."""
        w = self.out.extend
        for i in range(0, len(items), BATCHSIZE):
            batch = items[i:i + BATCHSIZE]
            if len(batch) == 1:
                self.save(batch[0][0])
                self.save(batch[0][1])
                w(SETITEM)
                break
            w(MARK)
            for k, v in batch:
                self.save(k)
                self.save(v)
            w(SETITEMS)

    def _save_reduce(self, func: Global, args: tuple, obj, key, dictitems=None, state=None) -> None:
        self.save(func)
        self.save(args)
        self.out.extend(REDUCE)
        self._put(key)
        if dictitems:
            self._batch_dict(dictitems)
        if state is not None:
            self.save(state)
            self.out.extend(BUILD)


def dumps2(obj, reducer: Callable[[object], object] | None = None) -> bytes:
    """The protocol-2 pickle of ``obj`` (see the module docstring for the accepted types).

    ``reducer(x)`` is asked for any other object ``x`` and returns its replacement (typically a
    new ``Reduce``), or None to refuse it; it is called once per appearance, in pickle order.
    """
    p = _Pickler(reducer)
    p.out.extend(PROTO + b"\x02")
    p.save(obj)
    p.out.extend(STOP)
    return bytes(p.out)
