"""Loading a params YAML that may be hostile: bounded in size, in nesting and in what its aliases expand to.

YAML aliases (``&a`` / ``*a``) let a 1 KB document stand for 10^8 leaves (an "alias bomb"): PyYAML builds it
cheaply as shared objects, but everything that walks the result (the config mapping, deep copies, the upgraded
``cs/<stem>.yaml``) pays for every expanded leaf. So the document is first *composed* (a graph of nodes, aliases
shared), the size it expands to is counted over that graph (each node counted once per reference, computed
bottom-up in time linear in the graph), and only a document under the bounds is constructed — with the safe
loader, so no tag can build anything but plain data.

Bounds: the file's size (``MAX_BYTES``), and the expanded node count: at most ``MAX_EXPANDED`` nodes, or twice the
composed node count for a (large) document that barely uses aliases — so a document without aliases is never
refused for its own size beyond ``MAX_BYTES``. Failures are ``ConfigError(path, one line)``.
"""
from __future__ import annotations

import os
import stat as stat_mod
from pathlib import Path

import yaml

from ..errors import ConfigError
from ..storage.local import open_if_regular

#: largest params file read (Model Zoo params are a few KB)
MAX_BYTES = 16 << 20
#: most nodes a document may expand to through aliases
MAX_EXPANDED = 200_000

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _expanded_size(root) -> tuple[int, int]:
    """(nodes once each, nodes counted once per reference) of a composed node graph; ``ValueError`` on a cycle."""
    size: dict = {}
    on_path: set = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            continue
        if key in size:
            continue
        if key in on_path:
            raise ValueError("a YAML alias refers to a node that contains it (a recursive document)")
        on_path.add(key)
        stack.append((node, True))
        for k in _children(node):
            if id(k) in on_path:
                raise ValueError("a YAML alias refers to a node that contains it (a recursive document)")
            if id(k) not in size:
                stack.append((k, False))
    return len(size), size[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def load_params_yaml(path) -> object:
    """The YAML document at ``path`` as plain data; ``ConfigError`` for a missing, non-regular, oversized,
    unparsable or alias-bomb file."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(path, "params YAML not found") from None
    except OSError as e:
        raise ConfigError(path, f"cannot read params YAML: {e.strerror or e}") from None
    if not stat_mod.S_ISREG(st.st_mode):
        raise ConfigError(path, "params YAML is not a regular file")
    if st.st_size > MAX_BYTES:
        raise ConfigError(path, f"params YAML is {st.st_size} bytes, more than the {MAX_BYTES} a params file may have")
    try:
        blob = open_if_regular(path)  # a FIFO swapped in since the stat is not waited on
        if blob is None:
            raise ConfigError(path, "params YAML is not a regular file")
        try:
            text = blob.read(0, MAX_BYTES + 1).decode("utf-8", "replace")
        finally:
            blob.close()
    except OSError as e:
        raise ConfigError(path, f"cannot read params YAML: {e.strerror or e}") from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            composed, expanded = _expanded_size(node)
        except ValueError as e:
            raise ConfigError(path, f"params YAML refused: {e}") from None
        if expanded > max(MAX_EXPANDED, 2 * composed):
            raise ConfigError(path, f"params YAML refused: its aliases expand {composed} nodes to {expanded} "
                                    f"(more than {MAX_EXPANDED}; a YAML alias bomb?)")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(path, f"cannot parse params YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()
