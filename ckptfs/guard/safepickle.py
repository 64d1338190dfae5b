"""A pickle decoder that runs nothing: an opcode interpreter (protocols 0–5) producing plain Python values.

Nothing named by a pickle is ever imported or called. ``GLOBAL``/``STACK_GLOBAL`` are looked up in an allow-list of
*decoders* (pure functions of ours that check their arguments and return plain values or descriptions); every other
global, and every opcode that would instantiate a class (``INST``, ``OBJ``, ``NEWOBJ``, ``EXT*``) or reach outside
the stream (out-of-band buffers), is refused with one line naming it (``PickleRefused``).

Two modes:

* ``loads_plain(data)`` — dicts, lists, tuples, str, bytes, int, float, bool and None only (protocols below 3
  spell bytes as ``_codecs.encode(text, 'latin1')`` / ``bytes()``: those two are decoded, nothing else).
* ``loads_torch(data, persistent_load)`` — what ``torch.save`` writes into ``data.pkl`` for a state dict of tensors
  (torch 1.6 to 2.13): ``collections.OrderedDict`` (with the ``_metadata`` that ``state_dict()`` attaches),
  ``torch._utils._rebuild_tensor_v2`` / ``_v3`` / ``_rebuild_parameter`` / ``_rebuild_parameter_with_state``,
  ``torch.<X>Storage`` / ``torch.storage.UntypedStorage`` and ``torch.<dtype>`` — each turned into a plain
  description (``TorchTensor``: storage key, dtype, offset, shape, stride). Persistent ids (torch's
  ``('storage', type, key, location, numel)``) go to the caller's ``persistent_load``; ``torch_storage`` is the
  usual one.

Every resource the stream can claim is bounded (``Limits``): input size, stack and memo entries, items created,
container sizes, nesting depth, the expanded size of the result (a DAG of shared tuples cannot stand for 2^60
values), the size of integers, of strings and of dict keys. The result is checked acyclic. Pure: no I/O.
"""
from __future__ import annotations

import codecs
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from ..dtypes import BY_NAME, DType

__all__ = ["Limits", "PickleRefused", "loads_plain", "loads_torch", "torch_storage", "StorageType",
           "TorchStorage", "TorchTensor", "tensor_extent"]


class PickleRefused(ValueError):
    """A pickle this decoder will not (or cannot) decode; the message is one line naming what and where."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what a pickle may make the decoder hold or do."""

    max_bytes: int = 256 << 20  # length of the pickle itself
    max_items: int = 16_000_000  # objects created + container slots filled, over the whole stream
    max_container: int = 8_000_000  # items in one list/dict/tuple, and on the stack
    max_memo: int = 4_000_000  # memo entries
    max_depth: int = 200  # nesting of marks while decoding, and of containers in the result
    max_expanded: int = 16_000_000  # nodes of the result counted as a tree (shared objects counted each time)
    max_int_bytes: int = 1024  # bytes of one integer (LONG4, text INT/LONG)
    max_key_nodes: int = 1000  # nodes of one dict key (a tuple of tuples…)
    max_str_bytes: int = 256 << 20  # bytes of one str or bytes value (its encoded length in the stream)


DEFAULT_LIMITS = Limits()


# -- plain values and descriptions the decoders return -----------------------------------------------------

@dataclass(frozen=True)
class StorageType:
    """``torch.<X>Storage`` (dtype set) or ``torch.UntypedStorage`` (dtype None, numel counts bytes)."""

    name: str
    dtype: DType | None


@dataclass(frozen=True)
class TorchStorage:
    """One storage of a torch zip: the record ``data/<key>``, its element type and its length in elements."""

    key: str
    dtype: DType | None  # None: an untyped storage (bytes); the tensor's own dtype says how to read it
    location: str
    numel: int


@dataclass(frozen=True)
class TorchTensor:
    """A tensor as ``torch.save`` describes it: ``shape``/``stride`` in elements of ``dtype`` from element
    ``offset`` of ``storage``."""

    storage: TorchStorage
    dtype: DType
    offset: int
    shape: tuple
    stride: tuple
    requires_grad: bool = False


class _Global:
    """A decoder the stream named (allowed): called by REDUCE with the arguments the stream gives."""

    __slots__ = ("qualname", "call")

    def __init__(self, qualname: str, call: Callable):
        self.qualname = qualname
        self.call = call


_DECIMAL = re.compile(rb"-?(?:0|[1-9][0-9]*)")  # no leading zero: C reads 010 as octal
_U32 = struct.Struct("<I")
_SCALARS = (str, bytes, int, float, bool, type(None))

# opcode bytes
_OPNAMES = {
    b"(": "MARK", b".": "STOP", b"0": "POP", b"1": "POP_MARK", b"2": "DUP", b"F": "FLOAT", b"I": "INT",
    b"J": "BININT", b"K": "BININT1", b"L": "LONG", b"M": "BININT2", b"N": "NONE", b"P": "PERSID",
    b"Q": "BINPERSID", b"R": "REDUCE", b"S": "STRING", b"T": "BINSTRING", b"U": "SHORT_BINSTRING",
    b"V": "UNICODE", b"X": "BINUNICODE", b"a": "APPEND", b"b": "BUILD", b"c": "GLOBAL", b"d": "DICT",
    b"}": "EMPTY_DICT", b"e": "APPENDS", b"g": "GET", b"h": "BINGET", b"i": "INST", b"j": "LONG_BINGET",
    b"l": "LIST", b"]": "EMPTY_LIST", b"o": "OBJ", b"p": "PUT", b"q": "BINPUT", b"r": "LONG_BINPUT",
    b"s": "SETITEM", b"t": "TUPLE", b")": "EMPTY_TUPLE", b"u": "SETITEMS", b"G": "BINFLOAT",
    b"\x80": "PROTO", b"\x81": "NEWOBJ", b"\x82": "EXT1", b"\x83": "EXT2", b"\x84": "EXT4", b"\x85": "TUPLE1",
    b"\x86": "TUPLE2", b"\x87": "TUPLE3", b"\x88": "NEWTRUE", b"\x89": "NEWFALSE", b"\x8a": "LONG1",
    b"\x8b": "LONG4", b"B": "BINBYTES", b"C": "SHORT_BINBYTES", b"\x8c": "SHORT_BINUNICODE",
    b"\x8d": "BINUNICODE8", b"\x8e": "BINBYTES8", b"\x8f": "EMPTY_SET", b"\x90": "ADDITEMS",
    b"\x91": "FROZENSET", b"\x92": "NEWOBJ_EX", b"\x93": "STACK_GLOBAL", b"\x94": "MEMOIZE", b"\x95": "FRAME",
    b"\x96": "BYTEARRAY8", b"\x97": "NEXT_BUFFER", b"\x98": "READONLY_BUFFER",
}
#: opcodes that are never decoded, with what they would do
_REFUSED_OPS = {
    "INST": "instantiates a class", "OBJ": "instantiates a class", "NEWOBJ": "instantiates a class",
    "NEWOBJ_EX": "instantiates a class", "EXT1": "names an extension-registry object",
    "EXT2": "names an extension-registry object", "EXT4": "names an extension-registry object",
    "EMPTY_SET": "makes a set", "ADDITEMS": "fills a set", "FROZENSET": "makes a frozenset",
    "BYTEARRAY8": "makes a bytearray", "NEXT_BUFFER": "reads an out-of-band buffer",
    "READONLY_BUFFER": "reads an out-of-band buffer",
}


def _name(qualname_value) -> str:
    return qualname_value.qualname if isinstance(qualname_value, _Global) else type(qualname_value).__name__


# -- decoders of the plain mode -------------------------------------------------------------------------------

def _codecs_encode(*args):
    if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
        raise PickleRefused(f"_codecs.encode called with {_describe_args(args)}, not (text, 'latin1')")
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:
        raise PickleRefused("_codecs.encode of text outside latin-1") from None


def _bytes_empty(*args):
    if args:
        raise PickleRefused(f"bytes called with {_describe_args(args)}, not ()")
    return b""


def _describe_args(args) -> str:
    return "(" + ", ".join(type(a).__name__ for a in args) + ")"


_PLAIN_GLOBALS = {
    "_codecs.encode": _codecs_encode,  # protocols 0–2 spell bytes this way
    "builtins.bytes": _bytes_empty,  # … and empty bytes this way (``__builtin__`` with fix_imports)
    "__builtin__.bytes": _bytes_empty,
}


# -- decoders of the torch mode -------------------------------------------------------------------------------

def _ordered_dict(*args):
    if args:
        raise PickleRefused(f"collections.OrderedDict called with {_describe_args(args)}, not ()")
    return OrderedDict()


def _check_ints(name: str, value, what: str) -> tuple:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise PickleRefused(f"{name}: {what} is not a tuple of integers")
    return value


def _tensor(name: str, storage, offset, size, stride, requires_grad, hooks, dtype: DType | None, metadata):
    if not isinstance(storage, TorchStorage):
        raise PickleRefused(f"{name}: its storage is a {type(storage).__name__}, not a storage reference")
    if type(offset) is not int or offset < 0:
        raise PickleRefused(f"{name}: storage offset {offset!r} is not a non-negative integer")
    size = _check_ints(name, size, "size")
    stride = _check_ints(name, stride, "stride")
    if len(size) != len(stride):
        raise PickleRefused(f"{name}: size {list(size)} and stride {list(stride)} differ in length")
    if any(v < 0 for v in size + stride):
        raise PickleRefused(f"{name}: negative size or stride ({list(size)}, {list(stride)})")
    if not isinstance(requires_grad, bool):
        raise PickleRefused(f"{name}: requires_grad is a {type(requires_grad).__name__}")
    if not isinstance(hooks, dict) or hooks:
        raise PickleRefused(f"{name}: backward hooks are not an empty dict")
    if metadata is not None and (not isinstance(metadata, dict) or any(metadata.values())):
        raise PickleRefused(f"{name}: tensor metadata {metadata!r} (conjugate/negative bits) is not supported")
    if dtype is None:
        if storage.dtype is None:
            raise PickleRefused(f"{name}: an untyped storage needs a dtype argument")
        dtype = storage.dtype
    elif storage.dtype is not None and storage.dtype != dtype:
        raise PickleRefused(f"{name}: dtype {dtype.name} differs from the storage's {storage.dtype.name}")
    return TorchTensor(storage, dtype, offset, size, stride, requires_grad)


def _rebuild_tensor_v2(*args):
    name = "torch._utils._rebuild_tensor_v2"
    if len(args) not in (6, 7):
        raise PickleRefused(f"{name} called with {len(args)} arguments, not 6 or 7")
    return _tensor(name, *args[:6], None, args[6] if len(args) == 7 else None)


def _rebuild_tensor_v3(*args):
    name = "torch._utils._rebuild_tensor_v3"
    if len(args) not in (7, 8):
        raise PickleRefused(f"{name} called with {len(args)} arguments, not 7 or 8")
    if not isinstance(args[6], DType):
        raise PickleRefused(f"{name}: its dtype argument is a {type(args[6]).__name__}, not a torch dtype")
    if isinstance(args[0], TorchStorage) and args[0].dtype is not None:
        raise PickleRefused(f"{name}: its storage is typed ({args[0].dtype.name}), not untyped")
    return _tensor(name, *args[:6], args[6], args[7] if len(args) == 8 else None)


def _rebuild_parameter(*args):
    name = "torch._utils._rebuild_parameter"
    if len(args) != 3 or not isinstance(args[0], TorchTensor) or not isinstance(args[1], bool):
        raise PickleRefused(f"{name} called with {_describe_args(args)}, not (tensor, bool, hooks)")
    if not isinstance(args[2], dict) or args[2]:
        raise PickleRefused(f"{name}: backward hooks are not an empty dict")
    t = args[0]
    return TorchTensor(t.storage, t.dtype, t.offset, t.shape, t.stride, args[1])


def _rebuild_parameter_with_state(*args):
    name = "torch._utils._rebuild_parameter_with_state"
    if len(args) != 4:
        raise PickleRefused(f"{name} called with {len(args)} arguments, not 4")
    if args[3] is not None and not isinstance(args[3], (dict, tuple)):
        raise PickleRefused(f"{name}: its state is a {type(args[3]).__name__}")
    return _rebuild_parameter(*args[:3])


def _torch_globals() -> dict:
    g = {
        "collections.OrderedDict": _ordered_dict,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    }
    for d in BY_NAME.values():
        g[f"torch.{d.name}"] = d  # a dtype (the v3 path: float8, uint16…)
        if d.torch_storage:
            g[f"torch.{d.torch_storage}"] = StorageType(d.torch_storage, d)
    for mod in ("torch", "torch.storage"):
        g[f"{mod}.UntypedStorage"] = StorageType("UntypedStorage", None)
    return g


_TORCH_GLOBALS = {**_PLAIN_GLOBALS, **_torch_globals()}


def torch_storage(pid) -> TorchStorage:
    """torch.save's persistent id ``('storage', StorageType, key, location, numel)`` as a ``TorchStorage``."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise PickleRefused(f"persistent id {_short(pid)} is not ('storage', type, key, location, numel)")
    _, stype, key, location, numel = pid
    if not isinstance(stype, StorageType):
        raise PickleRefused(f"persistent id names storage type {_short(stype)}, not a torch storage class")
    if not isinstance(key, str) or not isinstance(location, str):
        raise PickleRefused(f"persistent id has key {_short(key)} and location {_short(location)}, not strings")
    if type(numel) is not int or numel < 0:
        raise PickleRefused(f"persistent id has storage size {_short(numel)}")
    return TorchStorage(key, stype.dtype, location, numel)


def _short(v) -> str:
    r = repr(v) if isinstance(v, _SCALARS + (tuple,)) else type(v).__name__
    return r if len(r) <= 80 else r[:77] + "..."


def _build_torch(obj, state):
    """BUILD as ``state_dict()`` uses it: the ``_metadata`` attribute of an OrderedDict."""
    if type(obj) is OrderedDict and isinstance(state, dict) and set(state) <= {"_metadata"}:
        if "_metadata" in state:
            obj._metadata = state["_metadata"]
        return
    keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
    raise PickleRefused(f"BUILD sets {keys} on a {type(obj).__name__}")


# -- the interpreter ----------------------------------------------------------------------------------------------

class _Machine:
    def __init__(self, data, globals_: dict, persistent_load, build, limits: Limits):
        if len(data) > limits.max_bytes:
            raise PickleRefused(f"pickle of {len(data)} bytes exceeds the {limits.max_bytes}-byte limit")
        self.data = bytes(data)
        self.pos = 0
        self.globals = globals_
        self.persistent_load = persistent_load
        self.build = build
        self.limits = limits
        self.stack: list = []
        self.metastack: list = []
        self.memo: dict = {}
        self.items = 0
        self.op_pos = 0
        self.frame_end = 0  # where the last FRAME's bytes end (an opcode may not cross it, as pickle's own reader says)

    # errors -------------------------------------------------------------------------------------
    def refuse(self, what: str):
        raise PickleRefused(f"{what} (pickle byte {self.op_pos})")

    def spend(self, n: int = 1):
        self.items += n
        if self.items > self.limits.max_items:
            self.refuse(f"more than {self.limits.max_items} objects and items")

    # reading --------------------------------------------------------------------------------------
    def take(self, n: int) -> bytes:
        p = self.pos
        if n < 0 or p + n > len(self.data):
            self.refuse(f"truncated: {n} bytes needed, {len(self.data) - p} left")
        self.pos = p + n
        return self.data[p:p + n]

    def take_str(self, n: int) -> bytes:
        """The ``n`` encoded bytes of a str or bytes value (refused over ``max_str_bytes`` before they are copied)."""
        if n > self.limits.max_str_bytes:
            self.refuse(f"a string of {n} bytes, more than the {self.limits.max_str_bytes} accepted")
        return self.take(n)

    def str_line(self) -> bytes:
        """A text-mode string argument's line (refused over ``max_str_bytes``)."""
        raw = self.line()
        if len(raw) > self.limits.max_str_bytes:
            self.refuse(f"a string of {len(raw)} bytes, more than the {self.limits.max_str_bytes} accepted")
        return raw

    def line(self) -> bytes:
        p = self.pos
        q = self.data.find(b"\n", p)
        if q < 0:
            self.refuse("truncated: a text argument has no end of line")
        self.pos = q + 1
        return self.data[p:q]

    def u8(self) -> int:
        p = self.pos
        if p >= len(self.data):
            self.take(1)  # refuses
        self.pos = p + 1
        return self.data[p]

    def u32(self) -> int:
        p = self.pos
        if p + 4 > len(self.data):
            self.take(4)  # refuses
        self.pos = p + 4
        return _U32.unpack_from(self.data, p)[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    # stack ----------------------------------------------------------------------------------------
    def push(self, v):
        if len(self.stack) >= self.limits.max_container:
            self.refuse(f"stack deeper than {self.limits.max_container} entries")
        self.stack.append(v)

    def pop(self):
        if not self.stack:
            self.refuse("stack underflow")
        return self.stack.pop()

    def top(self):
        if not self.stack:
            self.refuse("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list:
        if not self.metastack:
            self.refuse("no MARK to pop to")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def put_memo(self, idx: int, v):
        if idx not in self.memo and len(self.memo) >= self.limits.max_memo:
            self.refuse(f"more than {self.limits.max_memo} memo entries")
        if idx < 0:
            self.refuse(f"negative memo index {idx}")
        self.memo[idx] = v

    def get_memo(self, idx: int):
        try:
            return self.memo[idx]
        except KeyError:
            self.refuse(f"memo entry {idx} does not exist")

    def text_int(self, raw: bytes, what: str) -> int:
        if len(raw) > 3 * self.limits.max_int_bytes:
            self.refuse(f"{what} of {len(raw)} digits")
        if not _DECIMAL.fullmatch(raw):  # what pickle writes; other spellings parse differently in C and Python
            self.refuse(f"{what} {raw[:40]!r} is not a decimal integer")
        return int(raw)

    def long_bytes(self, raw: bytes) -> int:
        if len(raw) > self.limits.max_int_bytes:
            self.refuse(f"integer of {len(raw)} bytes")
        return int.from_bytes(raw, "little", signed=True)

    # containers ------------------------------------------------------------------------------------
    def check_key(self, k):
        """A dict key must be a scalar or a small tuple of them (hashing a big shared tuple is exponential)."""
        if isinstance(k, _SCALARS):
            return
        budget = self.limits.max_key_nodes
        todo = [k]
        while todo:
            x = todo.pop()
            budget -= 1
            if budget < 0:
                self.refuse(f"a dict key of more than {self.limits.max_key_nodes} parts")
            if isinstance(x, tuple):
                todo.extend(x)
            elif not isinstance(x, _SCALARS):
                self.refuse(f"a dict key holds a {type(x).__name__}")

    def set_items(self, d, kvs: list):
        if not isinstance(d, dict):
            self.refuse(f"SETITEM(S) on a {_name(d)}, not a dict")
        if len(kvs) % 2:
            self.refuse("SETITEMS with an odd number of items")
        if len(d) + len(kvs) // 2 > self.limits.max_container:
            self.refuse(f"a dict of more than {self.limits.max_container} items")
        self.spend(len(kvs) // 2)
        for i in range(0, len(kvs), 2):
            k = kvs[i]
            self.check_key(k)
            d[k] = kvs[i + 1]

    def append_items(self, lst, items: list):
        if type(lst) is not list:
            self.refuse(f"APPEND(S) on a {_name(lst)}, not a list")
        if len(lst) + len(items) > self.limits.max_container:
            self.refuse(f"a list of more than {self.limits.max_container} items")
        self.spend(len(items))
        lst.extend(items)

    def make_tuple(self, items) -> tuple:
        self.spend(len(items) + 1)
        return tuple(items)

    # globals and calls -----------------------------------------------------------------------------
    def find_global(self, module: str, name: str):
        qual = f"{module}.{name}"
        v = self.globals.get(qual)
        if v is None:
            self.refuse(f"global {qual[:200]} is not allowed")
        if isinstance(v, (StorageType, DType)):
            return v
        return _Global(qual, v)

    def reduce(self, func, args):
        if not isinstance(func, _Global):
            self.refuse(f"REDUCE calls a {_name(func)}, not an allowed global")
        if not isinstance(args, tuple):
            self.refuse(f"REDUCE of {func.qualname} with {type(args).__name__} arguments")
        try:
            out = func.call(*args)
        except PickleRefused as e:
            self.refuse(str(e))
        self.spend()
        return out

    # the loop ---------------------------------------------------------------------------------------
    def run(self):
        data = self.data
        n = len(data)
        handlers = _BY_BYTE
        while True:
            pos = self.pos
            if pos >= n:
                self.refuse("truncated: no STOP")
            self.op_pos = pos
            op = data[pos]
            self.pos = pos + 1
            handler = handlers[op]
            if handler is None:
                if op == 0x2E:  # STOP
                    if len(self.stack) != 1 or self.metastack:
                        self.refuse(f"STOP with {len(self.stack)} values on the stack"
                                    + (" and an open MARK" if self.metastack else ""))
                    return self.stack[0]
                name = _OPNAMES.get(bytes([op]))
                if name is None:
                    self.refuse(f"unknown opcode {bytes([op])!r}")
                self.refuse(f"opcode {name} {_REFUSED_OPS.get(name, 'is not supported')}")
            try:
                handler(self)
            except PickleRefused:
                raise
            except (ValueError, TypeError, OverflowError, struct.error, UnicodeError) as e:  # a case missed above
                self.refuse(f"malformed {_OPNAMES.get(bytes([op]), 'opcode')} ({type(e).__name__})")
            if pos < self.frame_end < self.pos:  # CPython's C reader then reads on past the frame; a frame is whole
                self.refuse(f"{_OPNAMES.get(bytes([op]), 'opcode')} crosses the end of its frame")


def _op_proto(m):
    v = m.u8()
    if v > 5:
        m.refuse(f"protocol {v} (at most 5)")


def _op_frame(m):
    if m.op_pos < m.frame_end:
        m.refuse("a frame begins before the end of the current frame")
    size = m.u64()
    if size > len(m.data) - m.pos:
        m.refuse(f"frame of {size} bytes, {len(m.data) - m.pos} left")
    m.frame_end = m.pos + size


def _op_mark(m):
    if len(m.metastack) >= m.limits.max_depth:
        m.refuse(f"MARKs nested deeper than {m.limits.max_depth}")
    m.metastack.append(m.stack)
    m.stack = []


def _op_pop(m):
    if m.stack:
        m.stack.pop()
    else:
        m.pop_mark()


def _op_dup(m):
    m.push(m.top())


def _push_new(m, v):
    m.spend()
    m.push(v)


def _op_float(m):
    try:
        _push_new(m, float(m.line()))
    except ValueError:
        m.refuse("FLOAT argument is not a number")


def _op_int(m):
    raw = m.line()
    if raw == b"00":
        m.push(False)
    elif raw == b"01":
        m.push(True)
    else:
        _push_new(m, m.text_int(raw, "INT"))


def _op_long(m):
    raw = m.line()
    _push_new(m, m.text_int(raw[:-1] if raw.endswith(b"L") else raw, "LONG"))


def _op_string(m):
    raw = m.str_line().rstrip()
    if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
        m.refuse("STRING argument is not quoted")
    try:
        _push_new(m, _py2_str(codecs.escape_decode(raw[1:-1])[0]))
    except ValueError as e:
        m.refuse(f"STRING argument cannot be decoded ({e})")


def _py2_str(raw: bytes) -> str:
    return raw.decode("ascii")  # what pickle.load's default encoding does with a Python 2 str


def _op_binstring(m, n):
    raw = m.take_str(n)
    try:
        _push_new(m, _py2_str(raw))
    except UnicodeDecodeError:
        m.refuse("a Python 2 str that is not ASCII")


def _op_unicode(m):
    try:
        _push_new(m, str(m.str_line(), "raw-unicode-escape"))
    except UnicodeDecodeError:
        m.refuse("UNICODE argument has a bad escape")


def _utf8(m, raw: bytes):
    try:
        _push_new(m, str(raw, "utf-8", "surrogatepass"))
    except UnicodeDecodeError:
        m.refuse("a string that is not UTF-8")


def _op_binfloat(m):
    _push_new(m, struct.unpack(">d", m.take(8))[0])


def _op_persid(m, pid):
    if m.persistent_load is None:
        m.refuse(f"persistent id {_short(pid)} (no persistent references allowed here)")
    try:
        v = m.persistent_load(pid)
    except PickleRefused as e:
        m.refuse(str(e))
    _push_new(m, v)


def _op_reduce(m):
    args = m.pop()
    func = m.pop()
    m.push(m.reduce(func, args))


def _op_build(m):
    state = m.pop()
    obj = m.top()
    if m.build is None:
        m.refuse(f"BUILD on a {_name(obj)} (sets an object's state)")
    try:
        m.build(obj, state)
    except PickleRefused as e:
        m.refuse(str(e))


def _op_global(m):
    try:
        module = m.line().decode("utf-8")
        name = m.line().decode("utf-8")
    except UnicodeDecodeError:
        m.refuse("GLOBAL name is not UTF-8")
    m.push(m.find_global(module, name))


def _op_stack_global(m):
    name = m.pop()
    module = m.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        m.refuse("STACK_GLOBAL names are not strings")
    m.push(m.find_global(module, name))


def _op_dict(m):
    items = m.pop_mark()
    d = {}
    m.spend()
    m.set_items(d, items)
    m.push(d)


def _op_list(m):
    items = m.pop_mark()
    m.spend(len(items) + 1)
    m.push(items)


def _op_tuple(m):
    m.push(m.make_tuple(m.pop_mark()))


def _op_tuple_n(m, k):
    if len(m.stack) < k:
        m.refuse(f"TUPLE{k} with {len(m.stack)} values on the stack")
    items = m.stack[-k:]
    del m.stack[-k:]
    m.push(m.make_tuple(items))


def _op_append(m):
    v = m.pop()
    m.append_items(m.top(), [v])


def _op_appends(m):
    items = m.pop_mark()
    m.append_items(m.top(), items)


def _op_setitem(m):
    v = m.pop()
    k = m.pop()
    m.set_items(m.top(), [k, v])


def _op_setitems(m):
    items = m.pop_mark()
    m.set_items(m.top(), items)


def _op_put_text(m):
    m.put_memo(m.text_int(m.line(), "PUT index"), m.top())


def _op_get_text(m):
    m.push(m.get_memo(m.text_int(m.line(), "GET index")))


def _op_memoize(m):
    m.put_memo(len(m.memo), m.top())


_HANDLERS: dict[str, Callable] = {
    "PROTO": _op_proto, "FRAME": _op_frame, "MARK": _op_mark, "POP": _op_pop,
    "POP_MARK": lambda m: m.pop_mark(), "DUP": _op_dup,
    "NONE": lambda m: m.push(None), "NEWTRUE": lambda m: m.push(True), "NEWFALSE": lambda m: m.push(False),
    "INT": _op_int, "LONG": _op_long, "FLOAT": _op_float,
    "BININT": lambda m: _push_new(m, struct.unpack("<i", m.take(4))[0]),
    "BININT1": lambda m: m.push(m.u8()),
    "BININT2": lambda m: _push_new(m, struct.unpack("<H", m.take(2))[0]),
    "LONG1": lambda m: _push_new(m, m.long_bytes(m.take(m.u8()))),
    "LONG4": lambda m: _push_new(m, m.long_bytes(m.take(struct.unpack("<i", m.take(4))[0]))),
    "BINFLOAT": _op_binfloat,
    "STRING": _op_string,
    "BINSTRING": lambda m: _op_binstring(m, struct.unpack("<i", m.take(4))[0]),
    "SHORT_BINSTRING": lambda m: _op_binstring(m, m.u8()),
    "UNICODE": _op_unicode,
    "BINUNICODE": lambda m: _utf8(m, m.take_str(m.u32())),
    "SHORT_BINUNICODE": lambda m: _utf8(m, m.take(m.u8())),
    "BINUNICODE8": lambda m: _utf8(m, m.take_str(m.u64())),
    "BINBYTES": lambda m: _push_new(m, m.take_str(m.u32())),
    "SHORT_BINBYTES": lambda m: _push_new(m, m.take(m.u8())),
    "BINBYTES8": lambda m: _push_new(m, m.take_str(m.u64())),
    "PERSID": lambda m: _op_persid(m, m.line().decode("ascii", "replace")),
    "BINPERSID": lambda m: _op_persid(m, m.pop()),
    "REDUCE": _op_reduce, "BUILD": _op_build, "GLOBAL": _op_global, "STACK_GLOBAL": _op_stack_global,
    "EMPTY_DICT": lambda m: _push_new(m, {}), "EMPTY_LIST": lambda m: _push_new(m, []),
    "EMPTY_TUPLE": lambda m: m.push(()),
    "DICT": _op_dict, "LIST": _op_list, "TUPLE": _op_tuple,
    "TUPLE1": lambda m: _op_tuple_n(m, 1), "TUPLE2": lambda m: _op_tuple_n(m, 2),
    "TUPLE3": lambda m: _op_tuple_n(m, 3),
    "APPEND": _op_append, "APPENDS": _op_appends, "SETITEM": _op_setitem, "SETITEMS": _op_setitems,
    "PUT": _op_put_text, "BINPUT": lambda m: m.put_memo(m.u8(), m.top()),
    "LONG_BINPUT": lambda m: m.put_memo(m.u32(), m.top()),
    "GET": _op_get_text, "BINGET": lambda m: m.push(m.get_memo(m.u8())),
    "LONG_BINGET": lambda m: m.push(m.get_memo(m.u32())),
    "MEMOIZE": _op_memoize,
}

_BY_BYTE: list = [None] * 256
for _op, _n in _OPNAMES.items():
    _BY_BYTE[_op[0]] = _HANDLERS.get(_n)


# -- the result: acyclic, bounded, plain ------------------------------------------------------------------------

_LEAVES = _SCALARS + (TorchTensor, TorchStorage, StorageType, DType)


def _check_result(value, limits: Limits, leaves: tuple) -> None:
    """Refuse a result that holds a cycle, nests deeper than ``max_depth``, expands (shared parts counted each time)
    beyond ``max_expanded`` nodes, or holds anything but plain values and ``leaves`` (e.g. a bare global)."""
    size: dict[int, int] = {}  # id -> expanded size of a finished container
    keep = []  # the containers measured (their ids must stay theirs while we walk)
    on_path: set[int] = set()
    stack = [(value, False)]
    depth = 0
    while stack:
        obj, done = stack.pop()
        if isinstance(obj, leaves):
            continue
        oid = id(obj)
        if done:
            on_path.discard(oid)
            depth -= 1
            children = obj.values() if isinstance(obj, dict) else obj
            total = 1 + sum(size.get(id(c), 1) for c in children)
            if total > limits.max_expanded:
                raise PickleRefused(f"the pickled value expands to more than {limits.max_expanded} parts")
            size[oid] = total
            keep.append(obj)
            continue
        if not isinstance(obj, (dict, list, tuple)):
            raise PickleRefused(f"the pickled value holds a {_name(obj)}, not a plain value")
        if oid in on_path:
            raise PickleRefused("the pickled value contains itself (a cycle)")
        if oid in size:
            continue
        depth += 1
        if depth > limits.max_depth:
            raise PickleRefused(f"the pickled value nests deeper than {limits.max_depth}")
        on_path.add(oid)
        stack.append((obj, True))
        children = obj.values() if isinstance(obj, dict) else obj
        for c in children:
            if not isinstance(c, leaves):
                stack.append((c, False))
        if isinstance(obj, OrderedDict) and hasattr(obj, "_metadata"):
            stack.append((obj._metadata, False))  # noqa: SLF001 - torch's state_dict() attribute


def _run(data, globals_, persistent_load, build, limits: Limits, leaves: tuple):
    try:
        m = _Machine(data, globals_, persistent_load, build, limits)
        value = m.run()
    except RecursionError:  # defensive: nothing in the interpreter recurses on the stream's shape
        raise PickleRefused("pickle nests too deeply") from None
    except MemoryError:
        raise PickleRefused("pickle needs more memory than is available") from None
    _check_result(value, limits, leaves)
    return value


def loads_plain(data, *, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode a pickle of dicts, lists, tuples, str, bytes, int, float, bool and None (any protocol 0–5);
    ``PickleRefused`` for anything else."""
    return _run(data, _PLAIN_GLOBALS, None, None, limits, _SCALARS)


def loads_torch(data, persistent_load: Callable[[Any], Any] = torch_storage, *,
                limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode the ``data.pkl`` of a ``torch.save`` zip holding a state dict of tensors: dicts (``OrderedDict`` kept,
    with its ``_metadata``), lists, tuples, scalars, and ``TorchTensor`` descriptions whose storages come from
    ``persistent_load(pid)`` (default: ``torch_storage``). ``PickleRefused`` for anything else."""
    return _run(data, _TORCH_GLOBALS, persistent_load, _build_torch, limits, _LEAVES)


def tensor_extent(t: TorchTensor) -> int:
    """Elements of the storage a tensor's view reaches: 1 + offset + Σ (size-1)·stride (0 for an empty tensor).
    ``PickleRefused`` for a negative stride (torch never saves one)."""
    if any(s < 0 for s in t.stride):
        raise PickleRefused(f"negative stride {list(t.stride)}")
    if math.prod(t.shape) == 0:
        return 0
    return 1 + t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
