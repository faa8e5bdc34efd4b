"""What a grammar request is made of: the spec kinds, :class:`GrammarSpec` and :class:`Vocab`.

Plain value types with no engine behind them; every provider and the core
share them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import GrammarError

__all__ = [
    "ANNOTATIONS",
    "DEFAULT_MAX_WHITESPACE",
    "SPEC_KINDS",
    "UNSUPPORTED",
    "WHITESPACE",
    "Encoder",
    "GrammarSpec",
    "Vocab",
    "schema_keywords",
    "strict_keys_schema",
]

#: A tokenizer's encoder: text to model token ids (no special tokens added).
Encoder = Callable[[str], Sequence[int]]

SPEC_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice")


#: ``GrammarSpec.whitespace`` values.
WHITESPACE = ("flexible", "compact")
#: ``GrammarSpec.unsupported`` values.
UNSUPPORTED = ("ignore", "refuse")

#: ``GrammarSpec.max_whitespace`` default: the most whitespace characters in a row between JSON items.
#: ``json.dumps(..., indent=2)`` of the deepest valid instance of the JSONSchemaBench sample
#: (1,278 instances) needs 19 (a newline and 18 spaces: 9 levels); 24 leaves room for two more
#: levels or ``\r\n`` line ends, while a runaway stops after 24 characters.
DEFAULT_MAX_WHITESPACE = 24


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match, and how strictly.

    ``kind`` is one of :data:`SPEC_KINDS`. ``source`` is the schema (a JSON
    string or a dict) for ``json_schema``, ignored for ``json_object``, the
    pattern for ``regex``, the grammar text for ``ebnf``/``lark``, and a list
    of strings for ``choice``.

    Options (keyword only; the same meaning for every provider, which maps
    them to its engine or raises :class:`GrammarError` naming the option it
    cannot honour; see ``docs`` of each provider distribution):

    * ``whitespace``: ``"flexible"`` (default, as the engines default: any
      JSON whitespace between JSON items) or ``"compact"`` (none: ``,`` and
      ``:`` with nothing around them). JSON kinds only.
    * ``strict_keys``: True (default, xgrammar's and vLLM's default) makes an
      object allow only the keys its schema *names* for it: ``properties``,
      ``required`` and ``patternProperties`` of the object's schema, its
      ``allOf`` members and ``$ref`` targets, and in an ``anyOf``/``oneOf``
      branch that branch's own (see :func:`strict_keys_schema`), as if each
      said ``"additionalProperties": false`` over all of them; a required
      key listed in another branch or a ``$ref``'d base stays allowed, so no
      schema is made unsatisfiable. An object schema that names no key (a
      bare ``{"type": "object"}``, ``json_object``) stays open: any keys, as
      in xgrammar's strict mode; ``"properties": {}`` allows none. An
      explicit ``additionalProperties`` (or ``unevaluatedProperties``) other
      than false keeps that object open. False keeps the JSON Schema meaning
      (unlisted keys allowed).
    * ``max_whitespace``: the most whitespace characters (space, tab,
      ``\n``, ``\r``) in a row between JSON items under
      ``whitespace="flexible"``; an int ``>= 0`` or None (no bound, the
      engines' own flexible whitespace). Default
      :data:`DEFAULT_MAX_WHITESPACE` (24): a model that keeps emitting
      whitespace (vLLM #55313: 250k spaces) is stopped after 24, and
      pretty-printed JSON still fits (``json.dumps(indent=2)`` of the
      deepest JSONSchemaBench sample instance needs 19: a newline and 9
      levels of indentation). ``whitespace="compact"`` allows none, so the
      bound has nothing to limit there; ``0`` with ``"flexible"`` allows no
      whitespace either. JSON kinds only. Part of :meth:`key`.
    * ``unsupported``: what to do with schema keywords the engine does not
      enforce: ``"ignore"`` (default: compile without them and report each in
      the compiled grammar's ``warnings``) or ``"refuse"`` (raise
      :class:`GrammarError` naming them).
    * ``compile_limit_s``: seconds this compile may take (default: the
      provider's ``compile_limit_s``; ``math.inf``: no limit). Not part of
      :meth:`key`.

    How the options map to each engine (and what vLLM passes by default)::

        option        xgrammar                 llguidance                      outlines-core
        whitespace    any_whitespace=True      whitespace_flexible=True        whitespace_pattern of every
         flexible     (vLLM: the same)         (vLLM: the same)                JSON blank (vLLM: its own [ ]?)
        whitespace    any_whitespace=False,    whitespace_flexible=False,      whitespace_pattern=""
         compact      separators (",", ":")    separators "," and ":"
        strict_keys   strict_mode=True         strict_keys_schema(schema):     what it always does
         True         (vLLM: the same)         closed to the names of each     (only listed keys)
                                               object (vLLM: additionalProperties
                                               false with guidance_disable_
                                               additional_properties)
        strict_keys   strict_mode=False        the schema as it is             GrammarError naming
         False                                 (vLLM's default for guidance)   strict_keys (open objects)
        max_whitespace max_whitespace_cnt=N    whitespace_pattern              whitespace_pattern
         N (flexible) (vLLM: no bound)         [\x20\x0a\x0d\x09]{0,N}        [\x20\x0a\x0d\x09]{0,N}; None:
                                               (vLLM: no bound)                ...*; N = 0: no whitespace
        unsupported   compiles; its C++        lenient=True; its warnings      maskplug's keyword check,
         ignore       warnings captured        in ``warnings``                 in ``warnings``
        unsupported   GrammarError naming      lenient=False: GrammarError     GrammarError naming
         refuse       unsupported + warnings   naming unsupported              unsupported + keywords

    Known gaps: xgrammar leaves some keywords out without a warning (for
    example ``uniqueItems``), so ``warnings`` lists only what the engine says.
    Under ``strict_keys=True`` xgrammar closes an object with ``required``
    but no ``properties`` to no key at all, ignores a parent's
    ``properties`` beside ``anyOf`` and reads ``allOf`` of several members as
    any value. outlines-core gets ``allOf`` members, ``$ref``'d bases and a
    parent's keys folded into one object per branch first (its own regex
    builder writes ``allOf`` members one after another); compositions that
    cannot be folded, ``patternProperties``, an ``additionalProperties``
    schema and an object with ``required`` but no ``properties`` (left
    open) are read its own way.
    """

    kind: str
    source: Any = None
    whitespace: str = field(default="flexible", kw_only=True)
    strict_keys: bool = field(default=True, kw_only=True)
    unsupported: str = field(default="ignore", kw_only=True)
    max_whitespace: int | None = field(default=DEFAULT_MAX_WHITESPACE, kw_only=True)
    compile_limit_s: float | None = field(default=None, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise GrammarError(f"kind: expected one of {SPEC_KINDS}, got {self.kind!r}")
        if self.whitespace not in WHITESPACE:
            raise GrammarError(f"whitespace: expected one of {WHITESPACE}, got {self.whitespace!r}")
        if not isinstance(self.strict_keys, bool):
            raise GrammarError(f"strict_keys: expected a bool, got {self.strict_keys!r}")
        if self.unsupported not in UNSUPPORTED:
            raise GrammarError(f"unsupported: expected one of {UNSUPPORTED}, got {self.unsupported!r}")
        mw = self.max_whitespace
        if mw is not None and (isinstance(mw, bool) or not isinstance(mw, int) or mw < 0):
            raise GrammarError(f"max_whitespace: expected an int >= 0 or None, got {mw!r}")
        lim = self.compile_limit_s
        if lim is not None and (
            isinstance(lim, bool) or not isinstance(lim, (int, float)) or math.isnan(lim) or lim <= 0
        ):
            raise GrammarError(f"compile_limit_s: expected a number of seconds > 0 or None, got {lim!r}")
        if self.kind == "json_schema" and isinstance(self.source, (dict, list, tuple, str)):
            src = self.source
            depth = _text_nesting_depth(src) if isinstance(src, str) else _nesting_depth(src, MAX_SCHEMA_DEPTH)
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(
                    f"source: expected a JSON schema nested at most {MAX_SCHEMA_DEPTH} levels deep, "
                    f"got more than {MAX_SCHEMA_DEPTH}"
                )

    @property
    def options(self) -> dict[str, Any]:
        """The options that shape the grammar (``compile_limit_s`` is not one)."""
        return {
            "whitespace": self.whitespace,
            "strict_keys": self.strict_keys,
            "unsupported": self.unsupported,
            "max_whitespace": self.max_whitespace,
        }

    def key(self) -> str:
        """A canonical string for caching (dict schemas are serialised with sorted keys; options that differ from
        the defaults are appended)."""
        src = self.source
        if isinstance(src, (dict, list, tuple)):
            src = json.dumps(src, sort_keys=True, separators=(",", ":"))
        extra = [f"{k}={v}" for k, v in self.options.items() if v != _DEFAULTS[k]]
        return f"{self.kind}:{src}" + ("" if not extra else "\x00" + ",".join(extra))


_DEFAULTS: dict[str, Any] = {
    "whitespace": "flexible",
    "strict_keys": True,
    "unsupported": "ignore",
    "max_whitespace": DEFAULT_MAX_WHITESPACE,
}

#: Keywords that only annotate a schema (no constraint to enforce).
ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "id",
        "$comment",
        "title",
        "description",
        "examples",
        "example",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$anchor",
        "markdownDescription",
        "x-guidance",
    }
)
# Keywords whose value maps names to subschemas; the names are not keywords.
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords whose value is data, not a schema.
_DATA = frozenset({"enum", "const", "default", "examples", "example", "required", "dependentRequired"})


def schema_keywords(schema: Any) -> set[str]:
    """Every constraint keyword used anywhere in a JSON schema (annotations left out).

    Subschemas are found under every keyword except data (``enum``,
    ``const``, ``required``, ...); the names under ``properties``, ``$defs``
    and the like are names, not keywords.
    """
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            if not k.startswith("x-") and k not in ANNOTATIONS:
                found.add(k)
            if k in _DATA or k in ANNOTATIONS:
                continue
            if k in _NAMED and isinstance(v, dict):
                for sub in v.values():
                    walk(sub)
            elif isinstance(v, (dict, list)):
                walk(v)

    walk(schema)
    return found


def _token_ids(ids: Any, name: str) -> tuple[int, ...]:
    """Token ids as ints, refusing what is not a whole number (floats, strings, bools) by ``name``."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise GrammarError(f"{name}: expected an iterable of int token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise GrammarError(f"{name}[{i}]: expected an int token id, got {t!r}")
        out.append(int(t))
    return tuple(out)


#: How deeply a JSON schema may nest (objects and arrays); deeper ones are refused before any engine sees them.
MAX_SCHEMA_DEPTH = 256


def _nesting_depth(obj: Any, limit: int) -> int:
    """The nesting depth of dicts and lists in ``obj``, counted iteratively; stops once past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in children)
    return deepest


def _text_nesting_depth(text: str) -> int:
    """The deepest ``{``/``[`` nesting of JSON text (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


class Vocab:
    """A model's vocabulary, as decoded bytes per token id.

    Args:
        tokens: ``tokens[i]`` is the byte string token ``i`` decodes to
            (special tokens: their literal text, they are never allowed by a
            grammar except as stop tokens).
        eos_ids: the stop tokens.
        special_ids: token ids that are control tokens (never grammar text).
        vocab_size: the model's padded logits width (``>= len(tokens)``); it
            fixes the mask width ``ceil(vocab_size / 32)``.
        encoder: the tokenizer's own encoder, text to model ids (no special
            tokens added), where one exists: the loaders attach tiktoken's,
            Hugging Face ``tokenizers``' or SentencePiece's. Providers use it
            to tokenise text a grammar forces the way the model spells it.
            A bare byte table has none (:attr:`has_encoder` is False and the
            ``repr`` says so); providers then fall back on their own
            tokenisation over the bytes.
        encoder_name: what the encoder is (shown in the ``repr`` and part of
            the :attr:`fingerprint`); default: the encoder's ``name``
            attribute or its type name.
    """

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_ids: Iterable[int],
        special_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        encoder: Encoder | None = None,
        encoder_name: str | None = None,
    ) -> None:
        if encoder is not None and not callable(encoder):
            raise GrammarError(f"encoder: expected a callable str -> token ids, got {type(encoder).__name__}")
        if encoder_name is not None and encoder is None:
            raise GrammarError("encoder_name: expected no name without an encoder, got a name and encoder=None")
        toks = list(tokens)
        for i, t in enumerate(toks):
            if not isinstance(t, (bytes, bytearray)):
                raise GrammarError(f"tokens[{i}]: expected bytes, got {type(t).__name__}")
        self.tokens: list[bytes] = [bytes(t) for t in toks]
        self.eos_ids: tuple[int, ...] = _token_ids(eos_ids, "eos_ids")
        if not self.eos_ids:
            raise GrammarError("eos_ids: expected at least one stop token, got none")
        self.special_ids: frozenset[int] = frozenset(_token_ids(special_ids, "special_ids")) | frozenset(self.eos_ids)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not hasattr(vocab_size, "__index__")):
            raise GrammarError(f"vocab_size: expected an int, got {vocab_size!r}")
        size = len(self.tokens) if vocab_size is None else int(vocab_size)
        if size < len(self.tokens):
            raise GrammarError(f"vocab_size: expected >= len(tokens) = {len(self.tokens)}, got {size}")
        self.vocab_size: int = size
        for name, ids in (("eos_ids", self.eos_ids), ("special_ids", self.special_ids)):
            bad = [i for i in ids if not 0 <= i < len(self.tokens)]
            if bad:
                raise GrammarError(f"{name}: expected ids in [0, {len(self.tokens)}), got {bad[:5]}")
        self._encoder: Encoder | None = encoder
        self._encoder_name: str | None = None
        if encoder is not None:
            self._encoder_name = encoder_name or str(getattr(encoder, "name", None) or type(encoder).__name__)
        self._fingerprint: str | None = None

    @property
    def has_encoder(self) -> bool:
        """Whether the tokenizer's own encoder is attached (False for a bare byte table)."""
        return self._encoder is not None

    @property
    def encoder(self) -> Encoder | None:
        """The tokenizer's encoder (text to model ids), or None for a bare byte table."""
        return self._encoder

    @property
    def encoder_name(self) -> str | None:
        """What the encoder is (``"tiktoken:..."``, ``"tokenizers:..."``, ``"sentencepiece:..."``), or None."""
        return self._encoder_name

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's token ids, by the tokenizer's own encoder (no special tokens added).

        Raises :class:`GrammarError` when the vocabulary has no encoder, when
        ``text`` is not a str, or when the encoder answers ids outside the
        vocabulary.
        """
        if not isinstance(text, str):
            raise GrammarError(f"text: expected a str, got {type(text).__name__}")
        if self._encoder is None:
            raise GrammarError(
                "vocab: this vocabulary is a bare byte table with no encoder; "
                "load it from its tokenizer files (Vocab.from_tokenizer_json, from_tiktoken, from_sentencepiece) "
                "or pass encoder=..."
            )
        ids = [int(i) for i in self._encoder(text)]
        n = len(self.tokens)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise GrammarError(f"encoder: expected ids in [0, {n}), got {bad[:5]} for {text[:40]!r}")
        return ids

    def with_encoder(self, encoder: Encoder | None, encoder_name: str | None = None) -> Vocab:
        """The same tokens, stop and special ids and size with ``encoder`` attached (None: a bare byte table)."""
        out = Vocab.__new__(Vocab)
        out.tokens = self.tokens
        out.eos_ids = self.eos_ids
        out.special_ids = self.special_ids
        out.vocab_size = self.vocab_size
        if encoder is not None and not callable(encoder):
            raise GrammarError(f"encoder: expected a callable str -> token ids, got {type(encoder).__name__}")
        out._encoder = encoder
        out._encoder_name = None
        if encoder is not None:
            out._encoder_name = encoder_name or str(getattr(encoder, "name", None) or type(encoder).__name__)
        out._fingerprint = None
        return out

    @property
    def mask_words(self) -> int:
        """Words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    @property
    def fingerprint(self) -> str:
        """A digest of the tokens, stop and special ids and size (cache key)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for t in self.tokens:
                h.update(len(t).to_bytes(4, "little"))
                h.update(t)
            h.update(repr((self.eos_ids, sorted(self.special_ids), self.vocab_size)).encode())
            if self._encoder_name is not None:
                # Providers tokenise forced text with the encoder: it is part of what they compile for.
                h.update(b"encoder:" + self._encoder_name.encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of ``rows`` rows, all tokens allowed."""
        return torch.full((rows, self.mask_words), -1, dtype=torch.int32)

    @classmethod
    def from_tokenizer_json(
        cls,
        path: Any,
        *,
        eos_tokens: Sequence[str] | None = None,
        vocab_size: int | None = None,
    ) -> Vocab:
        """Load a Hugging Face ``tokenizer.json`` (see :func:`maskplug.grammar.vocabs.load_tokenizer_json`)."""
        from .vocabs import load_tokenizer_json

        return load_tokenizer_json(path, eos_tokens=eos_tokens, vocab_size=vocab_size)

    @classmethod
    def from_tiktoken(
        cls,
        ranks: Any,
        special_tokens: Any = (),
        *,
        num_special_tokens: int | None = None,
        vocab_size: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ) -> Vocab:
        """Build from tiktoken-format ranks (see :func:`maskplug.grammar.vocabs.load_tiktoken`)."""
        from .vocabs import load_tiktoken

        return load_tiktoken(
            ranks, special_tokens, num_special_tokens=num_special_tokens, vocab_size=vocab_size, eos_ids=eos_ids
        )

    @classmethod
    def from_sentencepiece(cls, path: Any, *, vocab_size: int | None = None) -> Vocab:
        """Load a SentencePiece ``.model`` file (see :func:`maskplug.grammar.vocabs.load_sentencepiece`)."""
        from .vocabs import load_sentencepiece

        return load_sentencepiece(path, vocab_size=vocab_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        enc = f"encoder={self._encoder_name!r}" if self._encoder_name is not None else "no encoder (byte table only)"
        return f"Vocab({len(self.tokens)} tokens, eos={list(self.eos_ids)}, vocab_size={self.vocab_size}, {enc})"


# -- strict keys --------------------------------------------------------------------------------------------------
# Keywords whose subschemas apply to the same instance as the schema holding them (one object "position").
_SAME_INSTANCE_LISTS = ("allOf", "anyOf", "oneOf")
_SAME_INSTANCE_ONE = ("if", "then", "else")
# Keywords that make an object schema say something about keys (so strict keys may close it).
_OBJECT_KEYWORDS = frozenset(
    {"properties", "patternProperties", "required", "dependentRequired", "dependentSchemas", "minProperties"}
)
# Keywords whose value is data or names, never a subschema.
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "example", "required", "dependentRequired", "type"})
# The names and patterns an object is closed to.
_Names = tuple[tuple[str, ...], tuple[str, ...]]
# Where specialised copies of $ref targets go in the root schema.
_CLOSED_DEF = "maskplug_closed_"


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or ``#/a/b``) names in ``root``; raises KeyError when it names none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise KeyError(ref)
    from urllib.parse import unquote

    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node[part]
        elif isinstance(node, list) and part.isdigit():
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def _nested_ids(root: dict[str, Any]) -> bool:
    """Whether a subschema below ``root`` declares an ``$id`` (or draft-04 ``id``) of its own."""
    todo: list[Any] = [root]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if node is not root and (isinstance(node.get("$id"), str) or isinstance(node.get("id"), str)):
                return True
            for k, v in node.items():
                if k in _NAMED and isinstance(v, dict):
                    todo.extend(v.values())
                elif k not in _NOT_SCHEMAS and k not in ANNOTATIONS:
                    todo.append(v)
    return False


class _Closer:
    """The rewrite behind :func:`strict_keys_schema` for one root schema."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.defs: dict[str, Any] = {}
        self.memo: dict[tuple[str, Any], str] = {}
        defs = root.get("$defs")
        taken: dict[str, Any] = defs if isinstance(defs, dict) else {}
        self.prefix = _CLOSED_DEF
        while any(str(k).startswith(self.prefix) for k in taken):
            self.prefix = "_" + self.prefix
        # A nested $id starts a resource whose refs resolve against it, not the root: such
        # schemas keep their refs as they are (maskplug resolves only pointers into the root).
        self.follow_refs = not _nested_ids(root)

    def resolve(self, ref: str) -> Any:
        """The local target of ``ref``; KeyError when maskplug does not resolve it."""
        if not self.follow_refs:
            raise KeyError(ref)
        return _pointer(self.root, ref)

    def group(self, node: Any) -> tuple[tuple[str, ...], tuple[str, ...], bool, bool]:
        """Names, patterns, whether some member keeps unnamed keys open, whether some member lists keys.

        The members are ``node`` and, recursively, the subschemas of its
        ``allOf``/``anyOf``/``oneOf``/``if``/``then``/``else``/``dependentSchemas``
        and the local targets of its ``$ref``. A ``$ref`` maskplug cannot
        resolve counts as open (its keys are unknown).
        """
        # dicts, not sets: names are added to members in the order the schema names them
        names: dict[str, None] = {}
        patterns: dict[str, None] = {}
        is_open = lists = False
        seen: set[int] = set()
        todo = [node]
        while todo:
            m = todo.pop()
            if not isinstance(m, dict) or id(m) in seen:
                continue
            seen.add(id(m))
            props = m.get("properties")
            if isinstance(props, dict):
                names.update(dict.fromkeys(str(k) for k in props))
                lists = True
            pats = m.get("patternProperties")
            if isinstance(pats, dict):
                patterns.update(dict.fromkeys(str(k) for k in pats))
                lists = True
            req = m.get("required")
            if isinstance(req, list):
                names.update(dict.fromkeys(str(k) for k in req))
            dep = m.get("dependentRequired")
            if isinstance(dep, dict):
                for k, v in dep.items():
                    names[str(k)] = None
                    if isinstance(v, list):
                        names.update(dict.fromkeys(str(x) for x in v))
            for kw in ("additionalProperties", "unevaluatedProperties"):
                if kw in m and m[kw] is not False:
                    is_open = True
            for kw in _SAME_INSTANCE_LISTS:
                if isinstance(m.get(kw), list):
                    todo.extend(m[kw])
            for kw in _SAME_INSTANCE_ONE:
                if kw in m:
                    todo.append(m[kw])
            ds = m.get("dependentSchemas")
            if isinstance(ds, dict):
                names.update(dict.fromkeys(str(k) for k in ds))
                todo.extend(ds.values())
            ref = m.get("$ref")
            if isinstance(ref, str):
                try:
                    todo.append(self.resolve(ref))
                except (KeyError, IndexError, TypeError):
                    is_open = True
        return tuple(names), tuple(patterns), is_open, lists

    def position(self, node: Any) -> Any:
        """``node`` rewritten as the whole schema of one instance value."""
        if not isinstance(node, dict):
            return node
        names, patterns, is_open, lists = self.group(node)
        close = not is_open and (lists or bool(names) or bool(patterns))
        return self.member(node, ((), ()) if close else None)

    def closing(self, ctx: _Names, node: Any, drop: tuple[str, ...] = ()) -> _Names:
        """``ctx`` with the names and patterns of ``node``'s group (``node`` without its keys ``drop``)."""
        if drop and isinstance(node, dict):
            node = {k: v for k, v in node.items() if k not in drop}
        names, patterns, _, _ = self.group(node)
        return (tuple(dict.fromkeys(ctx[0] + names)), tuple(dict.fromkeys(ctx[1] + patterns)))

    def member(self, node: Any, ctx: _Names | None) -> Any:
        """``node`` rewritten as one member of a closed position (``ctx``: the names allowed from outside it).

        ``node`` itself, its ``allOf`` members, ``$ref`` targets and
        ``dependentSchemas`` are closed to ``ctx`` plus every name of
        ``node``'s group; a branch of its ``anyOf``/``oneOf`` (or its
        ``then``/``else``) to ``ctx`` plus the names of ``node`` without
        that keyword plus the branch's own: a key named only in another
        branch is refused (as xgrammar's strict mode closes each branch),
        while every key the mandatory part names stays allowed in each
        branch. ``ctx`` None: not closed.
        """
        if not isinstance(node, dict):
            return node
        whole = None if ctx is None else self.closing(ctx, node)
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k in _NOT_SCHEMAS or k in ANNOTATIONS:
                out[k] = v
            elif k == "allOf" and isinstance(v, list):
                out[k] = [self.member(x, whole) for x in v]
            elif k in _SAME_INSTANCE_LISTS and isinstance(v, list):
                fixed = None if ctx is None else self.closing(ctx, node, (k,))
                out[k] = [self.member(x, fixed) for x in v]
            elif k in ("then", "else"):
                fixed = None if ctx is None else self.closing(ctx, node, ("then", "else"))
                out[k] = self.member(v, fixed)
            elif k in ("if", "not"):
                # Conditions: closing inside them would make them fail more often, which loosens
                # what follows (the else branch, the negation). Their names still count (group).
                out[k] = v
            elif k == "dependentSchemas" and isinstance(v, dict):
                out[k] = {n: self.member(x, whole) for n, x in v.items()}
            elif k == "$ref" and isinstance(v, str):
                out[k] = self.ref(v, whole)
            elif k in ("$defs", "definitions"):
                out[k] = v  # the originals stay for refs maskplug does not rewrite
            elif k in _NAMED and isinstance(v, dict):
                out[k] = {n: self.position(x) for n, x in v.items()}
            elif isinstance(v, dict):
                out[k] = self.position(v)
            elif isinstance(v, list):
                out[k] = [self.position(x) for x in v]
            else:
                out[k] = v
        if whole is not None and self.objectish(node) and "additionalProperties" not in node:
            names, patterns = whole
            if names:
                props = dict(out.get("properties") or {})
                for n in names:
                    props.setdefault(n, {})
                out["properties"] = props
            if patterns:
                pats = dict(out.get("patternProperties") or {})
                for p in patterns:
                    pats.setdefault(p, {})
                out["patternProperties"] = pats
            out["additionalProperties"] = False
        return out

    @staticmethod
    def objectish(node: dict[str, Any]) -> bool:
        t = node.get("type")
        return bool(_OBJECT_KEYWORDS & node.keys()) or t == "object" or (isinstance(t, list) and "object" in t)

    def ref(self, ref: str, ctx: _Names | None) -> str:
        """A ``$ref`` to ``ref``'s target rewritten as a member closed to ``ctx`` (one copy per target and ctx)."""
        try:
            target = self.resolve(ref)
        except (KeyError, IndexError, TypeError):
            return ref
        if target is self.root and isinstance(target, dict):
            # The copy must not be a resource of its own (an id would re-base the refs inside it).
            target = {k: v for k, v in target.items() if k not in ("$id", "id", "$schema", "$defs", "definitions")}
        key = (ref, ctx)
        name = self.memo.get(key)
        if name is None:
            name = f"{self.prefix}{len(self.memo)}"
            self.memo[key] = name  # before the body: recursive schemas end here
            self.defs[name] = self.member(target, ctx)
        return f"#/$defs/{name}"


def strict_keys_schema(schema: Any) -> Any:
    """``schema`` with every object closed to the keys the schema names for it (``strict_keys=True``).

    For each place an instance value is validated, the keys *named* for that
    object are gathered from the schema there and every schema applying to
    the same value: the members of ``allOf``/``anyOf``/``oneOf``,
    ``if``/``then``/``else`` and ``dependentSchemas``, and local ``$ref``
    targets, recursively. Names come from ``properties``, ``required``,
    ``dependentRequired`` and ``dependentSchemas``; patterns from
    ``patternProperties``. Every member that speaks of objects then gets
    ``{}`` for the names and patterns it lacks and
    ``"additionalProperties": false``: the schema itself, its ``allOf``
    members and ``$ref`` targets allow every name of the place; a branch of
    an ``anyOf``/``oneOf`` (or a ``then``/``else``) allows the names of the
    rest of the place and its own, so a key only another branch names is
    refused (as xgrammar's strict mode closes each branch). A required key
    listed in another branch or a ``$ref``'d base stays allowed, so closing
    makes no schema unsatisfiable. ``if`` and ``not`` are copied unchanged
    (closing inside a condition would loosen what it guards).

    Left open: a place that names nothing (a bare ``{"type": "object"}``:
    any keys, as xgrammar's strict mode leaves it; ``"properties": {}`` does
    close), and a place where some member says ``additionalProperties`` or
    ``unevaluatedProperties`` other than false, or has a ``$ref`` maskplug
    does not resolve (only JSON pointers into the root are followed, and none
    in a schema with a nested ``$id``). ``$ref`` targets are copied into
    ``$defs`` once per target and set of names (one target may be closed
    differently for different referrers; recursive schemas end at the copy
    already made). ``schema`` is not changed.
    """
    if not isinstance(schema, dict):
        return schema
    closer = _Closer(schema)
    out = closer.position(schema)
    if closer.defs:
        defs = dict(out.get("$defs") or {}) if isinstance(out.get("$defs"), dict) else {}
        defs.update(closer.defs)
        out["$defs"] = defs
    return out
