"""The small expression language of the mapping YAML (a safe subset of Python expression syntax).

Used for tensor operations (``transpose(concat(x, k, v))``, ``permute_rows(x, heads=num_kv_heads,
rotary_dim=rotary_dim)``), conditions (``p == 'bias'``) and config values (``hidden_size // num_heads``,
``lookup('nonlinearity', {'swiglu': 'silu'})``). Allowed: literals, names, ``a.b`` / ``a['b']`` on
dicts, arithmetic, comparisons, ``and``/``or``/``not``, ``x if c else y``, lists/tuples/dicts, and calls
of the functions the caller registers. Nothing else (no attribute access on objects, no imports, no
lambdas) — expressions come from YAML files and never run arbitrary code.
"""
from __future__ import annotations

import ast
import math
import operator
from functools import lru_cache
from typing import Any, Callable, Mapping


class ExprError(Exception):
    """An expression is malformed or fails; callers add the YAML file and rule to the message."""


class MissingName(ExprError):
    """A name the expression needs is not defined (usually a CS params key that is absent)."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name!r} is not defined")


class Omit:
    """The value ``omit``: an HF config entry / output evaluating to it is not written."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "omit"


OMIT = Omit()

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_ALLOWED = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Attribute, ast.Subscript, ast.Call,
            ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.List, ast.Tuple,
            ast.Dict, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Slice, *_BIN, *_CMP)


@lru_cache(maxsize=4096)
def parse(text: str) -> ast.Expression:
    """Parse and vet an expression (cached); ExprError when it is not in the allowed subset."""
    if not isinstance(text, str):
        raise ExprError(f"expression must be a string, got {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"syntax error in {text!r}: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"{type(node).__name__} is not allowed in {text!r}")
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            raise ExprError(f"only named functions may be called in {text!r}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise ExprError(f"private name {node.attr!r} in {text!r}")
    return tree


class Scope:
    """Where names resolve: ``lookup(name)`` returns a value or raises MissingName.

    ``path_lookup(path)`` resolves a dotted path (``moe.num_experts``) so that a config scope can record
    exactly which nested keys were used.
    """

    def __init__(self, values: Mapping[str, Any] | None = None, parent: "Scope | None" = None):
        self.values = dict(values or {})
        self.parent = parent

    def lookup(self, name: str):
        if name in self.values:
            return self.values[name]
        if self.parent is not None:
            return self.parent.lookup(name)
        raise MissingName(name)

    def path_lookup(self, path: tuple):
        if path[0] in self.values:
            value = self.values[path[0]]
            for part in path[1:]:
                value = _index(value, part, ".".join(path))
            return value
        if self.parent is not None:
            return self.parent.path_lookup(path)
        raise MissingName(path[0])

    def child(self, values: Mapping[str, Any]) -> "Scope":
        return Scope(values, self)


def _index(value, key, where):
    if isinstance(value, Mapping):
        if key not in value:
            raise MissingName(f"{where}")
        return value[key]
    if isinstance(value, (list, tuple)) and isinstance(key, int):
        return value[key]
    raise ExprError(f"cannot take {key!r} of {type(value).__name__} in {where}")


BASE_FUNCTIONS: dict[str, Callable] = {
    "sqrt": math.sqrt, "int": int, "float": float, "bool": bool, "str": str, "abs": abs, "min": min,
    "max": max, "round": round, "len": len, "range": lambda *a: list(range(*a)), "list": list,
    "isclose": lambda a, b, rel=1e-9, tol=0.0: math.isclose(a, b, rel_tol=rel, abs_tol=tol),
    "log2": math.log2,
    "merge": lambda *dicts: {k: v for d in dicts for k, v in (d or {}).items()},
}


def evaluate(text: str, scope: Scope, functions: Mapping[str, Callable]) -> Any:
    """Evaluate ``text`` with names from ``scope`` and callables from ``functions``."""
    tree = parse(text)
    return _Eval(scope, functions, text).visit(tree.body)


class _Eval:
    def __init__(self, scope, functions, text):
        self.scope, self.functions, self.text = scope, functions, text

    def visit(self, node):
        method = getattr(self, "v_" + type(node).__name__, None)
        if method is None:  # parse() vetted the tree, so this is a missing handler
            raise ExprError(f"cannot evaluate {type(node).__name__} in {self.text!r}")
        return method(node)

    def v_Constant(self, node):
        return node.value

    def v_Name(self, node):
        if node.id == "omit":
            return OMIT
        return self.scope.lookup(node.id)

    def _path(self, node):
        parts = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
            else:
                if not isinstance(node.slice, ast.Constant):
                    return None
                parts.append(node.slice.value)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(node.id)
        return tuple(reversed(parts))

    def v_Attribute(self, node):
        path = self._path(node)
        if path is not None:
            return self.scope.path_lookup(path)
        return _index(self.visit(node.value), node.attr, self.text)

    def v_Subscript(self, node):
        path = self._path(node)
        if path is not None:
            return self.scope.path_lookup(path)
        base = self.visit(node.value)
        if isinstance(node.slice, ast.Slice):
            lo = self.visit(node.slice.lower) if node.slice.lower else None
            hi = self.visit(node.slice.upper) if node.slice.upper else None
            return base[lo:hi]
        key = self.visit(node.slice)
        try:
            return base[key]
        except (KeyError, IndexError, TypeError) as e:
            raise ExprError(f"cannot index {base!r} with {key!r} in {self.text!r}: {e}") from None

    def v_Call(self, node):
        fn = self.functions.get(node.func.id)
        if fn is None:
            raise ExprError(f"unknown function {node.func.id!r} in {self.text!r}")
        args = [self.visit(a) for a in node.args]
        kwargs = {k.arg: self.visit(k.value) for k in node.keywords}
        if any(k is None for k in kwargs):
            raise ExprError(f"**kwargs are not allowed in {self.text!r}")
        return fn(*args, **kwargs)

    def v_BinOp(self, node):
        left, right = self.visit(node.left), self.visit(node.right)
        try:
            return _BIN[type(node.op)](left, right)
        except (TypeError, ZeroDivisionError, OverflowError) as e:
            raise ExprError(f"{e} in {self.text!r}") from None

    def v_UnaryOp(self, node):
        v = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return not v
        return -v if isinstance(node.op, ast.USub) else +v

    def v_BoolOp(self, node):
        if isinstance(node.op, ast.And):
            v = True
            for n in node.values:
                v = self.visit(n)
                if not v:
                    return v
            return v
        v = False
        for n in node.values:
            v = self.visit(n)
            if v:
                return v
        return v

    def v_Compare(self, node):
        left = self.visit(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.visit(right_node)
            try:
                ok = _CMP[type(op)](left, right)
            except TypeError as e:
                raise ExprError(f"{e} in {self.text!r}") from None
            if not ok:
                return False
            left = right
        return True

    def v_IfExp(self, node):
        return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)

    def v_List(self, node):
        return [self.visit(e) for e in node.elts]

    def v_Tuple(self, node):
        return tuple(self.visit(e) for e in node.elts)

    def v_Dict(self, node):
        if any(k is None for k in node.keys):
            raise ExprError(f"**dict is not allowed in {self.text!r}")
        return {self.visit(k): self.visit(v) for k, v in zip(node.keys, node.values)}
