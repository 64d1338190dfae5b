"""Apply a family's tensor rules: CS model tensors -> HF (name, VirtualTensor) pairs, in converter order.

For each CS key (checkpoint order) the first rule whose ``cs`` pattern matches (and whose ``when`` holds)
fires: it drops the key with a reason, or emits HF tensors built by its ``op`` expressions from the key's
tensor ``x`` and the other CS tensors named in ``with`` (which it consumes). Outputs appear in the order
their triggering CS key appears, like the converter writes them. Keys with an extra ``model.`` prefix
(CS 1.7/1.8) match too. Nothing here reads tensor data.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..dtypes import by_name
from ..errors import CkptfsError, ConfigError, MappingError
from ..tensor.base import VirtualTensor
from ..tensor import ops
from .lang.expr import ExprError, MissingName, Scope, evaluate
from .lang.pattern import PatternError, fill
from .lang.spec import FamilySpec, ModelVariant, TensorRule
from .transforms import collect


@dataclass
class TensorMapping:
    tensors: list  # [(hf name, VirtualTensor)]
    dropped: list = field(default_factory=list)  # [(cs key, reason)]
    unmatched: list = field(default_factory=list)  # [cs key]


def _tensor(value, what) -> VirtualTensor:
    if not isinstance(value, VirtualTensor):
        raise MappingError(None, f"{what} is not a tensor ({value!r})")
    return value


def _flat(items) -> list:
    out = []
    for t in items:
        out.extend(t) if isinstance(t, (list, tuple)) else out.append(t)
    return [_tensor(t, "input") for t in out]


def _chunk(t, chunks, index, dim=0):
    t = _tensor(t, "chunk input")
    n = t.shape[dim]
    if n % chunks:
        raise MappingError(None, f"chunk: dim {dim} of {t.describe()} is not divisible into {chunks} chunks")
    size = n // chunks
    return ops.Slice(t, dim, index * size, (index + 1) * size)


def _transpose_if_2d(t):
    t = _tensor(t, "transpose_if_2d input")
    return ops.Transpose(t) if t.ndim == 2 else t


TENSOR_FUNCTIONS: dict[str, Callable] = {
    "transpose": lambda t, perm=None: ops.Transpose(_tensor(t, "transpose input"), perm),
    "transpose_if_2d": _transpose_if_2d,
    "concat": lambda *ts, dim=0: ops.Concat(_flat(ts), dim),
    "stack": lambda *ts, dim=0: ops.Stack(_flat(ts), dim),
    "slice": lambda t, dim, start, stop: ops.Slice(_tensor(t, "slice input"), dim, start, stop),
    "chunk": _chunk,
    "select": lambda t, dim, index: ops.Select(_tensor(t, "select input"), dim, index),
    "permute_rows": lambda t, heads, rotary_dim, direction="cs_to_hf":
        ops.PermuteRows(_tensor(t, "permute_rows input"), heads, rotary_dim, direction),
    "mul": lambda t, v: ops.Affine(_tensor(t, "mul input"), [("mul", v)]),
    "div": lambda t, v: ops.Affine(_tensor(t, "div input"), [("div", v)]),
    "add": lambda t, v: ops.Affine(_tensor(t, "add input"), [("add", v)]),
    "sub": lambda t, v: ops.Affine(_tensor(t, "sub input"), [("sub", v)]),
    "cast": lambda t, dtype: ops.Cast(_tensor(t, "cast input"), by_name(dtype)),
    "causal_mask": lambda positions: ops.CausalMask(positions),
    "constant": lambda value, dtype="float32", shape=(): ops.Constant(value, by_name(dtype), shape),
    "position_ids": lambda positions: ops.PositionIds(positions),
    "alibi_slopes": lambda heads: ops.AlibiSlopes(heads),
    "size": lambda t, dim: _tensor(t, "size input").shape[dim],
    "ndim": lambda t: _tensor(t, "ndim input").ndim,
    "dtype": lambda t: _tensor(t, "dtype input").dtype.name,
}


def _with_family_transforms(base: dict) -> dict:
    extra = collect()
    clash = sorted(set(extra) & set(base))
    if clash:
        raise ValueError(f"family transforms redefine generic tensor functions: {clash}")
    return {**base, **extra}


TENSOR_FUNCTIONS = _with_family_transforms(TENSOR_FUNCTIONS)


def evaluate_rule(text: str, scope: Scope, functions: dict, spec_path, where: str, about: str,
                  missing: Callable) -> object:
    """A rule's expression ``text`` (``where``: the rule and its part, ``about``: the tensor it is evaluated for)
    evaluated in ``scope``; every failure as one error: ``missing(name)`` for a params value it lacks, else a
    MappingError naming the mapping file ``spec_path`` and the rule."""
    try:
        return evaluate(text, scope, functions)
    except MissingName as e:
        raise missing(e.name) from None
    except ExprError as e:
        raise MappingError(spec_path, f"{where}: {e}") from None
    except CkptfsError as e:
        if isinstance(e, MappingError) and e.path is None:
            raise MappingError(spec_path, f"{where}{about}: {e.problem}") from None
        raise
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError) as e:
        raise MappingError(spec_path, f"{where}{about}: {e}") from None


class RuleEngine:
    """Evaluates one family's rules against one checkpoint's CS model tensors."""

    def __init__(self, spec: FamilySpec, variant: ModelVariant, scope: Scope, functions: dict, params_path=None):
        self.spec, self.variant, self.scope = spec, variant, scope
        self.functions = {**functions, **TENSOR_FUNCTIONS}
        self.params_path = params_path

    # -- evaluation helpers ---------------------------------------------------------------------------
    def evaluate(self, text: str, values: dict, rule: TensorRule, key: str, part: str):
        def missing(name: str) -> ConfigError:
            return ConfigError(self.params_path, f"params lack model.{name}, needed by {rule.where}.{part} for CS "
                                                 f"tensor {key}")

        return evaluate_rule(text, self.scope.child(values), self.functions, self.spec.path,
                             f"{rule.where}.{part}", f" on CS tensor {key}", missing)

    def _values(self, captures: dict) -> dict:
        return {**self.variant.vars, **captures}

    def match(self, rules, key: str):
        """(rule, captures, key prefix) of the first rule that fires for ``key``, or None."""
        candidates = [(key, "")]
        if key.startswith("model."):
            candidates.append((key[len("model."):], "model."))
        for name, prefix in candidates:
            for rule in rules:
                caps = rule.cs.match(name)
                if caps is None:
                    continue
                if rule.when is not None and not self.evaluate(rule.when, self._values(caps), rule, key, "when"):
                    continue
                return rule, caps, prefix
        return None

    # -- the two phases -----------------------------------------------------------------------------
    def prepare(self, cs: dict) -> dict:
        """Apply the ``prepare`` rewrites (e.g. muP -> sP folding) to the CS tensors."""
        if not self.spec.prepare:
            return cs
        out = {}
        for key, t in cs.items():
            m = self.match(self.spec.prepare, key)
            if m is not None:
                rule, caps, _ = m
                t = _tensor(self.evaluate(rule.emits[0].op, {**self._values(caps), "x": t}, rule, key, "op"),
                            f"{rule.where}.op result")
            out[key] = t
        return out

    def run(self, cs: dict) -> TensorMapping:
        cs = self.prepare(cs)
        self.functions["has_tensor"] = lambda key: key in cs or "model." + key in cs
        matches, consumed = {}, {}
        for key in cs:
            m = self.match(self.spec.tensors, key)
            if m is None:
                continue
            rule, caps, prefix = m
            inputs = {}
            for name, template in rule.inputs:
                try:
                    other = prefix + fill(template, self._values(caps))
                except PatternError as e:
                    raise MappingError(self.spec.path, f"{rule.where}.with.{name}: {e}") from None
                if other not in cs:
                    raise MappingError(self.spec.path, f"{rule.where}: CS tensor {key} needs {other}, "
                                                       f"which the checkpoint does not have")
                inputs[name] = cs[other]
                consumed[other] = key
            matches[key] = (rule, caps, inputs)

        result = TensorMapping([])
        names: dict[str, str] = {}
        for key, tensor in cs.items():
            if key in consumed:
                continue
            if key not in matches:
                result.unmatched.append(key)
                continue
            rule, caps, inputs = matches[key]
            if rule.drop is not None:
                result.dropped.append((key, rule.drop))
                continue
            for n, emit in enumerate(rule.emits):
                base = {**self._values(caps), **inputs, "x": tensor}
                if emit.when is not None and not self.evaluate(emit.when, base, rule, key, f"emit[{n}].when"):
                    continue
                for combo in self._each(emit, base, rule, key, n):
                    values = {**base, **combo}
                    try:
                        hf_name = fill(emit.hf, {**self._values(caps), **combo})
                    except PatternError as e:
                        raise MappingError(self.spec.path, f"{rule.where}: {e}") from None
                    out = _tensor(self.evaluate(emit.op, values, rule, key, f"emit[{n}].op"),
                                  f"{rule.where} output {hf_name}")
                    if hf_name in names:
                        raise MappingError(self.spec.path, f"{rule.where}: HF tensor {hf_name} produced twice "
                                                           f"(from {names[hf_name]} and {key})")
                    names[hf_name] = key
                    result.tensors.append((hf_name, out))
        return result

    def _each(self, emit, base, rule, key, n):
        if not emit.each:
            return [{}]
        names, lists = [], []
        for var, text in emit.each:
            values = self.evaluate(text, base, rule, key, f"emit[{n}].each.{var}")
            if not isinstance(values, (list, tuple, range)):
                raise MappingError(self.spec.path, f"{rule.where}.emit[{n}].each.{var} must give a list")
            names.append(var)
            lists.append(list(values))
        return [dict(zip(names, combo)) for combo in itertools.product(*lists)]
