"""Key patterns of the mapping YAML: literal key text with named captures.

``transformer_decoder.layers.{i}.norm1.{p:weight|bias}``: ``{name}`` captures a decimal index (layer
``{i}``, expert ``{e}``), ``{name:regex}`` captures what the regex matches; everything else is literal
(dots included). The same text with values filled in (``KeyPattern.format``) names a key, so one string
serves both to match an input key and to build an output key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::((?:[^{}]|\{\d*,?\d*\})*))?\}")


class PatternError(ValueError):
    """A malformed pattern or template (the spec loader turns it into a MappingError with the YAML path)."""


@dataclass(frozen=True)
class KeyPattern:
    text: str
    regex: re.Pattern = field(compare=False)
    names: tuple = ()
    index_names: frozenset = frozenset()  # captures written {name} (decimal, given as int)

    @classmethod
    def compile(cls, text: str) -> "KeyPattern":
        if not isinstance(text, str) or not text:
            raise PatternError(f"pattern must be a non-empty string, got {text!r}")
        out, names, index, pos = [], [], set(), 0
        for m in _FIELD.finditer(text):
            out.append(re.escape(text[pos:m.start()]))
            name, rx = m.group(1), m.group(2)
            if name in names:
                raise PatternError(f"pattern {text!r} captures {{{name}}} twice")
            names.append(name)
            if rx is None:
                rx = r"\d+"
                index.add(name)
            try:
                inner = re.compile(rx)
            except re.error as e:
                raise PatternError(f"pattern {text!r}: bad regex for {{{name}}}: {e}") from None
            if inner.groups:
                raise PatternError(f"pattern {text!r}: regex for {{{name}}} must not contain groups; use (?:...)")
            out.append(f"(?P<{name}>{rx})")
            pos = m.end()
        rest = text[pos:]
        if "{" in rest or "}" in rest:
            raise PatternError(f"pattern {text!r} has an unbalanced brace")
        out.append(re.escape(rest))
        return cls(text, re.compile("".join(out)), tuple(names), frozenset(index))

    def match(self, key: str) -> dict | None:
        """The captures when ``key`` matches the whole pattern (index captures as int), else None."""
        m = self.regex.fullmatch(key)
        if m is None:
            return None
        return {k: int(v) if k in self.index_names else v for k, v in m.groupdict().items()}

    def format(self, values: dict) -> str:
        """The pattern with every ``{name}`` / ``{name:regex}`` replaced by ``values[name]``."""
        return fill(self.text, values)


def fields(text: str) -> list:
    """``[(name, regex or None)]`` of a pattern's fields, in order (None: a decimal index ``{name}``)."""
    return [(m.group(1), m.group(2)) for m in _FIELD.finditer(text)]


def alternatives(regex: str) -> list | None:
    """The strings a field regex that is a plain alternation of literals matches (``weight|bias``, ``\\.embed|``),
    in order, a ``.`` taken as the dot of a key name; None when the regex is anything else."""
    out = []
    for alt in regex.split("|"):
        if re.search(r"[()\[\]*+?{}^$]|\\[A-Za-z0-9]", re.sub(r"\\[^A-Za-z0-9]", "", alt)):
            return None
        out.append(re.sub(r"\\(.)", r"\1", alt))
    return out


def substitute(text: str, subs: dict) -> str:
    """``text`` with each field named in ``subs`` replaced by ``subs[name]`` (other fields kept as written)."""
    return _FIELD.sub(lambda m: subs.get(m.group(1), m.group(0)), text)


def template_names(text: str) -> list:
    """The ``{name}`` fields of a template (for validation)."""
    return [m.group(1) for m in _FIELD.finditer(text)]


def fill(text: str, values: dict) -> str:
    """Fill a template's ``{name}`` fields from ``values``; a missing value raises PatternError."""
    def sub(m):
        name = m.group(1)
        if name not in values:
            raise PatternError(f"template {text!r} needs a value for {{{name}}}")
        return str(values[name])
    return _FIELD.sub(sub, text)
