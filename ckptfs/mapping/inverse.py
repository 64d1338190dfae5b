"""A family's tensor rules read the other way: HF tensors -> the CS model tensors the converter writes (HF -> CS).

Each rule's HF name template becomes a pattern (its vars filled in, its captures matching what the CS pattern's
captures match); the first rule whose pattern matches an HF name (and whose ``when`` holds) is that tensor's rule.
A capture the HF name does not carry is found by trying the values its CS pattern allows (``{enc:bert_encoder|bert}``
with ``when: enc == cs_bert``; an index with an ``each`` that names it). The HF tensors of one rule firing are then
pushed back through its ``op`` to the rule's CS tensors (``x`` and its ``with`` inputs):

- renames, ``transpose``, ``transpose_if_2d``, ``permute_rows`` (the direction flipped) and ``mul``/``div``/``add``/
  ``sub`` (the opposite step) invert one to one; ``x if c else y`` inverts the branch ``c`` chose;
- ``slice``/``chunk``/``select`` of ``x`` by several outputs give its pieces, joined back with ``concat``/``stack``;
  ``concat`` of several inputs splits into equal parts, ``stack`` into its items;
- a family transform (``transforms/<family>.py``) inverts through its ``INVERSES`` entry;
- generated tensors (``causal_mask``, ``constant``…) need no CS tensor;
- anything else needs the rule's ``inverse:`` (an expression per CS input over the HF output ``y``).

A drop rule with ``make`` gives a CS tensor the HF model does not hold (a tied copy, the ALiBi slopes buffer, a
headless model's LM head), from the CS tensors made so far (``cs('key')``) or the HF ones (``hf('name')``).
Nothing here reads tensor data.
"""
from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field

from ..errors import CkptfsError, ConfigError, MappingError
from ..tensor.base import VirtualTensor
from ..tensor import ops
from .lang.expr import Scope, parse
from .lang.pattern import KeyPattern, PatternError, alternatives, fields, fill, substitute
from .forward import TENSOR_FUNCTIONS, evaluate_rule
from .lang.spec import FamilySpec, ModelVariant, TensorRule
from .transforms import collect_inverses


#: inverses of the family transforms (``transforms/<family>.py`` ``INVERSES``)
INVERSES = collect_inverses()


class NotInvertible(Exception):
    """An op the rule engine cannot push an HF tensor back through (the rule needs ``inverse:``)."""


@dataclass
class Need:
    """What one HF output says about a CS input: all of it (``full``), rows [start, stop) of ``dim`` (``piece``), or
    item ``start`` of ``dim`` (``item``)."""

    kind: str
    tensor: VirtualTensor
    dim: int = 0
    start: int = 0
    stop: int = 0


@dataclass
class Added:
    key: str
    tensor: VirtualTensor
    why: str  # the rule's ``added`` text


@dataclass
class CSMapping:
    tensors: list  # [(CS key, VirtualTensor)] from HF tensors, in the order of their first HF tensor
    made: list = field(default_factory=list)  # [(CS key, VirtualTensor)] of ``make`` rules without ``added``
    added: list = field(default_factory=list)  # [Added]
    unmatched: list = field(default_factory=list)  # [HF name] no rule takes


def _flip(direction: str) -> str:
    return "hf_to_cs" if direction == "cs_to_hf" else "cs_to_hf"


_OPPOSITE = {"mul": "div", "div": "mul", "add": "sub", "sub": "add"}
# functions whose result depends on no CS tensor: their HF output needs nothing from the CS side
_GENERATED = {"causal_mask", "constant", "position_ids", "alibi_slopes"}


def _mentions(node, names: set) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _combine(key: str, needs: list, where: str) -> VirtualTensor:
    """One CS tensor from what its HF outputs say about it."""
    full = [n for n in needs if n.kind == "full"]
    if full:
        return full[0].tensor
    kinds = {(n.kind, n.dim) for n in needs}
    if len(kinds) != 1:
        raise MappingError(None, f"{where}: CS tensor {key} is cut in different ways by its HF outputs")
    kind, dim = kinds.pop()
    parts = sorted(needs, key=lambda n: n.start)
    if kind == "item":
        if [n.start for n in parts] != list(range(len(parts))):
            raise MappingError(None, f"{where}: CS tensor {key} misses items of dim {dim} (HF has "
                                     f"{[n.start for n in parts]})")
        return ops.Stack([n.tensor for n in parts], dim)
    pos = 0
    for n in parts:
        if n.start != pos:
            raise MappingError(None, f"{where}: CS tensor {key} misses rows [{pos}, {n.start}) of dim {dim}")
        pos = n.stop
    return parts[0].tensor if len(parts) == 1 else ops.Concat([n.tensor for n in parts], dim)


@dataclass
class _Matcher:
    rule: TensorRule
    index: int  # rule number
    emit: int
    pattern: KeyPattern
    missing: tuple  # CS captures the HF name does not carry: ((name, candidate values), ...)


def hf_matchers(spec: FamilySpec, variant: ModelVariant, hf_count: int) -> list:
    """A ``_Matcher`` per (rule, output) of ``spec`` whose HF name can be matched: the template with ``variant``'s
    vars filled in and each capture matching what its CS pattern field matches. A CS capture the HF name lacks gets
    its candidate values: a field's literal alternatives, or (with ``each``) the indices up to ``hf_count``."""
    out = []
    for r, rule in enumerate(spec.tensors):
        if rule.drop is not None:
            continue
        cs_fields = dict(fields(rule.cs.text))
        for n, emit in enumerate(rule.emits):
            each = {k for k, _ in emit.each}
            text, used = emit.hf, set()
            for name, _ in fields(emit.hf):
                used.add(name)
                if name not in cs_fields and name not in each and name in variant.vars:
                    text = substitute(text, {name: str(variant.vars[name])})
            subs = {}
            for name, rx in fields(text):
                if name in cs_fields:
                    subs[name] = "{" + name + "}" if cs_fields[name] is None else "{" + name + ":" + cs_fields[name] + "}"
                else:
                    subs[name] = "{" + name + ":[^.]+}"
            try:
                pattern = KeyPattern.compile(substitute(text, subs))
            except PatternError:
                continue  # a field used twice: not matched the other way
            missing = []
            for name, rx in cs_fields.items():
                if name in used:
                    continue
                cands = list(range(hf_count + 1)) if rx is None else alternatives(rx)
                if cands is None or (rx is None and not emit.each):
                    missing = None
                    break
                missing.append((name, tuple(cands)))
            if missing is not None:
                out.append(_Matcher(rule, r, n, pattern, tuple(missing)))
    return out


def hf_coverage(spec: FamilySpec, variant: ModelVariant, names) -> int:
    """How many of the HF tensor ``names`` some rule of ``spec`` could take for ``variant`` (names only: tells a
    headless model from one with an LM head, a prefix from another)."""
    patterns = [m.pattern for m in hf_matchers(spec, variant, 0)]
    return sum(any(p.match(n) is not None for p in patterns) for n in names)


class InverseEngine:
    """Pushes one model's HF tensors back through one family's rules."""

    def __init__(self, spec: FamilySpec, variant: ModelVariant, scope: Scope, functions: dict):
        self.spec, self.variant, self.scope = spec, variant, scope
        self.functions = {**functions, **TENSOR_FUNCTIONS}
        self.inverses = INVERSES
        self.vars = dict(variant.vars)

    # -- helpers ------------------------------------------------------------------------------------------
    def _evaluate(self, text: str, values: dict, rule: TensorRule, part: str):
        def missing(name: str) -> ConfigError:
            return ConfigError(None, f"the Cerebras params lack model.{name}, needed by {rule.where}.{part}")

        return evaluate_rule(text, self.scope.child(values), self.functions, self.spec.path, f"{rule.where}.{part}",
                             "", missing)

    def _value(self, node, values: dict, rule: TensorRule, part: str):
        return self._evaluate(ast.unparse(node), values, rule, part)

    def _fires(self, m: _Matcher, caps: dict, name: str) -> dict | None:
        """The full capture values (CS captures and ``each`` values) when ``m`` takes HF ``name``, else None."""
        emit = m.rule.emits[m.emit]
        each_names = {k for k, _ in emit.each}
        cs_caps = {k: v for k, v in caps.items() if k not in each_names}
        each = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in caps.items() if k in each_names}
        names = [n for n, _ in m.missing]
        for combo in itertools.product(*(c for _, c in m.missing)):
            values = {**self.vars, **cs_caps, **dict(zip(names, combo))}
            if m.rule.when is not None and not self._evaluate(m.rule.when, values, m.rule, "when"):
                continue
            if emit.when is not None and not self._evaluate(emit.when, {**values, **each}, m.rule,
                                                              f"emit[{m.emit}].when"):
                continue
            ok = True
            for var, text in emit.each:
                if _mentions(parse(text), {"x", *(n for n, _ in m.rule.inputs)}):
                    continue  # sized by the CS tensor itself: any index the HF name has
                items = self._evaluate(text, values, m.rule, f"emit[{m.emit}].each.{var}")
                if each.get(var) not in list(items):
                    ok = False
            if ok:
                return {**cs_caps, **dict(zip(names, combo)), **each}
        return None

    # -- inversion of one op ------------------------------------------------------------------------------
    def _invert(self, node, y: VirtualTensor, values: dict, tensors: set, needs: dict, rule: TensorRule, part: str):
        if isinstance(node, ast.Name):
            if node.id in tensors:
                needs[node.id].append(Need("full", y))
                return
            raise NotInvertible(f"{node.id} is not one of the rule's CS tensors")
        if isinstance(node, ast.IfExp):
            test = self._value(node.test, values, rule, part)
            self._invert(node.body if test else node.orelse, y, values, tensors, needs, rule, part)
            return
        if not isinstance(node, ast.Call):
            raise NotInvertible(f"{ast.unparse(node)} is not a function of the CS tensors")
        fn = node.func.id
        args, kw = list(node.args), {k.arg: k.value for k in node.keywords}
        val = lambda n: self._value(n, values, rule, part)

        def arg(i, name, default=None):
            if len(args) > i:
                return val(args[i])
            return val(kw[name]) if name in kw else default

        if not _mentions(node, tensors):
            if fn in _GENERATED or fn in ("size", "ndim", "dtype"):
                return  # generated from the config: nothing to give back
            raise NotInvertible(f"{fn}(...) uses no CS tensor")
        if fn == "transpose":
            perm = arg(1, "perm")
            perm = list(range(y.ndim))[::-1] if perm is None else [int(p) for p in perm]
            inv = [perm.index(d) for d in range(len(perm))]
            self._invert(args[0], ops.Transpose(y, inv), values, tensors, needs, rule, part)
        elif fn == "transpose_if_2d":
            self._invert(args[0], ops.Transpose(y) if y.ndim == 2 else y, values, tensors, needs, rule, part)
        elif fn == "permute_rows":
            t = ops.PermuteRows(y, arg(1, "heads"), arg(2, "rotary_dim"), _flip(arg(3, "direction", "cs_to_hf")))
            self._invert(args[0], t, values, tensors, needs, rule, part)
        elif fn in _OPPOSITE:
            self._invert(args[0], ops.Affine(y, [(_OPPOSITE[fn], arg(1, "v"))]), values, tensors, needs, rule, part)
        elif fn in ("concat", "stack"):
            dim = int(val(kw["dim"])) if "dim" in kw else 0
            parts = [a for a in args if _mentions(a, tensors)]
            if len(parts) != len(args):
                raise NotInvertible(f"{fn} of CS tensors and other values")
            if fn == "stack":
                for i, a in enumerate(parts):
                    self._invert(a, ops.Select(y, dim, i), values, tensors, needs, rule, part)
                return
            dim = dim % y.ndim
            if y.shape[dim] % len(parts):
                raise NotInvertible(f"concat of {len(parts)} parts: {y.describe()} does not split evenly on dim {dim}")
            size = y.shape[dim] // len(parts)
            for i, a in enumerate(parts):
                self._invert(a, ops.Slice(y, dim, i * size, (i + 1) * size), values, tensors, needs, rule, part)
        elif fn in ("slice", "chunk", "select"):
            src = args[0]
            if not (isinstance(src, ast.Name) and src.id in tensors):
                raise NotInvertible(f"{fn} of an expression (only of a CS tensor itself)")
            if fn == "slice":
                dim = arg(1, "dim")
                start, stop = arg(2, "start"), arg(3, "stop")
                needs[src.id].append(Need("piece", y, int(dim) % y.ndim, int(start), int(stop)))
            elif fn == "chunk":
                dim = int(arg(3, "dim", 0)) % y.ndim
                index = int(arg(2, "index"))
                size = y.shape[dim]
                needs[src.id].append(Need("piece", y, dim, index * size, (index + 1) * size))
            else:
                dim = int(arg(1, "dim"))
                needs[src.id].append(Need("item", y, dim % (y.ndim + 1), int(arg(2, "index"))))
        elif fn in self.inverses:
            tensor_args = [a for a in args if _mentions(a, tensors)]
            others = [val(a) for a in args if not _mentions(a, tensors)]
            if any(_mentions(v, tensors) for v in kw.values()):
                raise NotInvertible(f"{fn}: CS tensors passed by keyword")
            targets = self.inverses[fn](y, *others, **{k: val(v) for k, v in kw.items()})
            if len(targets) != len(tensor_args):
                raise MappingError(None, f"the inverse of {fn} gives {len(targets)} tensors for "
                                         f"{len(tensor_args)} inputs")
            for a, t in zip(tensor_args, targets):
                self._invert(a, t, values, tensors, needs, rule, part)
        else:
            raise NotInvertible(f"{fn} has no inverse")

    # -- the whole model ------------------------------------------------------------------------------------
    def run(self, hf: dict) -> CSMapping:
        produced: dict = {}
        self.functions["has_tensor"] = lambda key: True  # while matching: whatever CS tensor a rule may consult
        firings: dict = {}  # (rule number, captures) -> [(emit number, captures with each values, HF tensor)]
        result = CSMapping([])
        matchers = hf_matchers(self.spec, self.variant, len(hf))
        for name, tensor in hf.items():
            for m in matchers:
                caps = m.pattern.match(name)
                if caps is None:
                    continue
                full = self._fires(m, caps, name)
                if full is None:
                    continue
                each_names = {k for k, _ in m.rule.emits[m.emit].each}
                key = (m.index, tuple(sorted((k, v) for k, v in full.items() if k not in each_names)))
                firings.setdefault(key, []).append((m.emit, full, tensor, name))
                break
            else:
                result.unmatched.append(name)

        for (r, caps), outputs in firings.items():
            rule = self.spec.tensors[r]
            caps = dict(caps)
            values = {**self.vars, **caps}
            try:
                keys = {"x": rule.cs.format(caps)}
                for var, template in rule.inputs:
                    keys[var] = fill(template, values)
            except PatternError as e:
                raise MappingError(self.spec.path, f"{rule.where}: {e}") from None
            needs = {var: [] for var in keys}
            if rule.inverse:
                y = outputs[0][2]
                for var, text in rule.inverse:
                    t = self._evaluate(text, {**values, "y": y}, rule, f"inverse.{var}")
                    if not isinstance(t, VirtualTensor):
                        raise MappingError(self.spec.path, f"{rule.where}.inverse.{var} is not a tensor ({t!r})")
                    needs[var].append(Need("full", t))
            else:
                for n, full, y, name in outputs:
                    emit = rule.emits[n]
                    try:
                        self._invert(parse(emit.op).body, y, {**values, **full}, set(keys), needs, rule,
                                     f"emit[{n}].op")
                    except NotInvertible as e:
                        raise MappingError(self.spec.path, f"{rule.where}: op {emit.op!r} does not invert for HF "
                                                           f"tensor {name} ({e}); give the rule an 'inverse:'") from None
            hf_names = ", ".join(name for *_, name in outputs)
            for var, key in keys.items():
                if not needs[var]:
                    raise MappingError(None, f"CS tensor model.{key} cannot be made: the HF model lacks the other "
                                             f"tensors of {rule.where} (it has {hf_names})")
                try:
                    t = _combine(key, needs[var], rule.where)
                except MappingError as e:
                    raise MappingError(self.spec.path, e.problem) from None
                if key in produced:
                    raise MappingError(self.spec.path, f"{rule.where}: CS tensor model.{key} made twice (also from "
                                                       f"{produced[key][1]})")
                produced[key] = (t, hf_names)
                result.tensors.append((key, t))

        self.functions["has_tensor"] = lambda key: key in produced
        self.functions["cs"] = lambda key: _lookup(produced, key, "CS tensor", lambda v: v[0])
        self.functions["hf"] = lambda name: _lookup(hf, name, "HF tensor", lambda v: v)
        for rule in self.spec.tensors:
            if rule.make is None:
                continue
            names = [n for n, _ in fields(rule.cs.text)]
            for combo in itertools.product(*(alternatives(rx) for _, rx in fields(rule.cs.text))):
                values = {**self.vars, **dict(zip(names, combo))}
                key = rule.cs.format(values)
                if key in produced:
                    continue
                if rule.when is not None and not self._evaluate(rule.when, values, rule, "when"):
                    continue
                try:
                    t = self._evaluate(rule.make, values, rule, "make")
                except _Absent:
                    continue  # made from a tensor this model does not have (a norm without bias)
                if not isinstance(t, VirtualTensor):
                    raise MappingError(self.spec.path, f"{rule.where}.make is not a tensor ({t!r})")
                produced[key] = (t, rule.where)
                if rule.added is None:
                    result.made.append((key, t))
                else:
                    result.added.append(Added(key, t, rule.added))
        return result


class _Absent(CkptfsError):
    """``cs('key')`` / ``hf('name')`` of a tensor the model does not have: the ``make`` rule makes nothing."""

    def __init__(self, what: str):
        super().__init__(None, what)


def _lookup(table: dict, key: str, what: str, get):
    if key not in table:
        raise _Absent(f"{what} {key} is not there")
    return get(table[key])
