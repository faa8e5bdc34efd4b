"""Draw strings that match a (simple) regular expression, deterministically.

The simulator needs a reference document for every request: for regex requests
and for JSON-schema strings with a ``pattern``. The patterns used there are
plain: literals, escapes, character classes with ranges, groups with
alternation, and the quantifiers ``? * + {m} {m,} {m,n}``. Anything else raises
:class:`maskplug.GrammarError` naming the pattern, so a schema the sampler cannot
serve is refused instead of producing an invalid reference.
"""

from __future__ import annotations

import string

import numpy as np

from ..errors import GrammarError

__all__ = ["sample_regex"]

_CLASS_ESCAPES = {
    "d": string.digits,
    "w": string.ascii_letters + string.digits + "_",
    "s": " ",
}
# Unbounded quantifiers stay short: a reference document is meant to be typical.
_OPEN_MAX = 6

Node = tuple  # ("lit", chars) | ("alt", [seq, ...]); a seq is a list of (node, lo, hi)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def fail(self, why: str) -> GrammarError:
        return GrammarError(f"pattern: expected a simple regex, got {self.p!r} ({why} at offset {self.i})")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.fail("unexpected end")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse_alt(self) -> Node:
        branches = [self.parse_seq()]
        while self.peek() == "|":
            self.take()
            branches.append(self.parse_seq())
        return ("alt", branches)

    def parse_seq(self) -> list[tuple[Node, int, int]]:
        seq: list[tuple[Node, int, int]] = []
        while (c := self.peek()) is not None and c not in "|)":
            atom = self.parse_atom()
            if atom is None:
                continue
            lo, hi = self.parse_quant()
            seq.append((atom, lo, hi))
        return seq

    def parse_atom(self) -> Node | None:
        c = self.take()
        if c in "^$":
            return None  # anchors: the whole string is matched anyway
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            node = self.parse_alt()
            if self.take() != ")":
                raise self.fail("unbalanced group")
            return node
        if c == "[":
            return ("lit", self.parse_class())
        if c == ".":
            return ("lit", string.ascii_letters + string.digits)
        if c == "\\":
            e = self.take()
            if e in _CLASS_ESCAPES:
                return ("lit", _CLASS_ESCAPES[e])
            return ("lit", e)
        if c in "*+?{":
            raise self.fail("quantifier without an atom")
        return ("lit", c)

    def parse_class(self) -> str:
        chars: list[str] = []
        if self.peek() == "^":
            raise self.fail("negated classes are not supported")
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                e = self.take()
                chars.extend(_CLASS_ESCAPES.get(e, e))
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.take()
                end = self.take()
                if ord(end) < ord(c):
                    raise self.fail("reversed range")
                chars.extend(chr(x) for x in range(ord(c), ord(end) + 1))
            else:
                chars.append(c)
        return "".join(dict.fromkeys(chars))

    def parse_quant(self) -> tuple[int, int]:
        c = self.peek()
        if c == "?":
            self.take()
            return 0, 1
        if c == "*":
            self.take()
            return 0, _OPEN_MAX
        if c == "+":
            self.take()
            return 1, _OPEN_MAX
        if c == "{":
            self.take()
            body = ""
            while self.peek() != "}":
                body += self.take()
            self.take()
            try:
                if "," in body:
                    a, b = body.split(",", 1)
                    lo = int(a)
                    hi = int(b) if b.strip() else lo + _OPEN_MAX
                else:
                    lo = hi = int(body)
            except ValueError as exc:
                raise self.fail(f"bad repetition {{{body}}}") from exc
            return lo, hi
        return 1, 1


def _emit(node: Node, rng: np.random.Generator, out: list[str]) -> None:
    kind, payload = node
    if kind == "lit":
        out.append(payload[int(rng.integers(len(payload)))])
        return
    branch = payload[int(rng.integers(len(payload)))]
    for atom, lo, hi in branch:
        for _ in range(int(rng.integers(lo, hi + 1))):
            _emit(atom, rng, out)


def sample_regex(pattern: str, rng: np.random.Generator, *, max_len: int | None = None) -> str:
    """One string that fully matches ``pattern``, drawn with ``rng``.

    ``max_len`` retries (a few times) until the string is short enough.
    """
    parser = _Parser(pattern)
    tree = parser.parse_alt()
    if parser.i != len(pattern):
        raise parser.fail("trailing text")
    for _ in range(16):
        out: list[str] = []
        _emit(tree, rng, out)
        s = "".join(out)
        if max_len is None or len(s) <= max_len:
            return s
    return s
