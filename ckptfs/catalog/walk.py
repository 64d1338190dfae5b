"""Walking a catalog's nesting with each leaf position's flat key (for ``ls``, views, reports).

Leaf positions of ``Checkpoint.root``, visited depth-first, correspond one-to-one and in order to
the keys of ``Checkpoint.leaves`` (both follow the pytree flatten order), so a position's flat key
is known even where cstorch's naming is not the container key (defaultdict) and an alias position
can be told from its target (``Checkpoint.links``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .model import Checkpoint, Container


@dataclass(frozen=True)
class Entry:
    depth: int  # nesting depth (0 = a child of the root)
    name: object  # the container key (dict key, or index for sequences); None for the root itself
    node: object  # Container or Leaf
    flat_key: str | None = None  # leaves only
    link_target: str | None = None  # leaves only: the key this alias points to


def walk(checkpoint: Checkpoint) -> Iterator[Entry]:
    """Every node below the root (containers before their children), leaves with their flat keys."""
    keys = iter(checkpoint.leaves.keys())
    links = checkpoint.links

    def rec(node, depth, name):
        if isinstance(node, Container):
            if depth >= 0:
                yield Entry(depth, name, node)
            names = node.keys if node.keys is not None else range(len(node.children))
            for n, child in zip(names, node.children):
                yield from rec(child, depth + 1, n)
        else:
            k = next(keys, None)
            yield Entry(max(depth, 0), name, node, k, links.get(k))

    yield from rec(checkpoint.root, -1, None)
