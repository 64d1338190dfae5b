"""Pytree specs: what torch's own ``treespec_dumps`` writes is rebuilt into the very same nesting."""
from __future__ import annotations

import collections
import json

import pytest
import torch.utils._pytree as pytree
from hypothesis import given, settings, strategies as st

from ckptfs.catalog.model import ValueLeaf
from ckptfs.catalog.materialize import node_to_python
from ckptfs.catalog.pytree import SpecError, build_tree, leaf_keys, parse_treespec

_keys = st.one_of(st.text(min_size=1, max_size=4), st.integers(-3, 50))


def _containers(children):
    return st.one_of(
        st.dictionaries(_keys, children, max_size=4),
        st.dictionaries(_keys, children, max_size=4).map(collections.OrderedDict),
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=3).map(
            lambda d: collections.defaultdict(list, d)),
        st.lists(children, max_size=3).map(collections.deque),
    )


_trees = st.recursive(st.integers(), _containers, max_leaves=25)


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple, collections.deque)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@settings(max_examples=150, deadline=None)
@given(_trees)
def test_rebuilds_what_torch_flattened(obj):
    leaves, spec = pytree.tree_flatten(obj)
    node = parse_treespec(pytree.treespec_dumps(spec))
    assert node.num_leaves() == len(leaves)
    tree = build_tree(node, iter([ValueLeaf(str(i), v) for i, v in enumerate(leaves)]))
    _same(node_to_python(tree), obj)


def test_key_naming_follows_cstorch():
    obj = {"model": collections.OrderedDict([("0.weight", 1)]), "state": {0: {"step": 2}, True: 3, 1.5: 4},
           "groups": [{"betas": (5, 6)}], "empty": {}, "none_list": []}
    _, spec = pytree.tree_flatten(obj)
    keys = [k for k, _ in leaf_keys(parse_treespec(pytree.treespec_dumps(spec)))]
    assert keys == ["model.0.weight", "state.0.step", "state.True", "state.1.5", "groups.0.betas.0", "groups.0.betas.1"]


def test_defaultdict_naming_quirk_and_limit():
    _, spec = pytree.tree_flatten(collections.defaultdict(list, {"a": 1, "b": 2}))
    node = parse_treespec(pytree.treespec_dumps(spec))
    assert [k for k, _ in leaf_keys(node)] == ["<class 'list'>", "['a', 'b']"]
    _, spec = pytree.tree_flatten(collections.defaultdict(list, {"a": 1, "b": 2, "c": 3}))
    with pytest.raises(SpecError, match="only the first 2"):
        leaf_keys(parse_treespec(pytree.treespec_dumps(spec)))


def test_set_and_namedtuple_nodes():
    leaf = {"type": None, "context": None, "children_spec": []}
    text = json.dumps([1, {"type": "builtins.dict", "context": json.dumps(["s", "n"]), "children_spec": [
        {"type": "builtins.set", "context": "null", "children_spec": [leaf, leaf]},
        {"type": "collections.namedtuple", "context": "NestedObject", "children_spec": [leaf, leaf]}]}])
    node = parse_treespec(text)
    assert [k for k, _ in leaf_keys(node)] == ["s.0", "s.1", "n.0", "n.1"]
    out = node_to_python(build_tree(node, iter([ValueLeaf("x", v) for v in (1, 2, 3, 4)])))
    assert out["s"] == {1, 2} and type(out["s"]) is set
    assert tuple(out["n"]) == (3, 4) and type(out["n"]).__name__ == "NestedObject"


@pytest.mark.parametrize("text,match", [
    ("not json", "not valid JSON"),
    (json.dumps([2, {}]), "protocol"),
    (json.dumps([1, {"type": "my.Thing", "context": None, "children_spec": []}]), "unsupported container"),
    (json.dumps([1, {"type": "builtins.dict", "context": "[\"a\"]", "children_spec": []}]), "one key per child"),
])
def test_malformed_specs(text, match):
    with pytest.raises(SpecError, match=match):
        parse_treespec(text)
