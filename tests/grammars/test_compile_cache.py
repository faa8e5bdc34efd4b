"""The compile cache is bounded: the least recently used grammar goes first, and nothing else changes."""

from __future__ import annotations

from typing import Any

import pytest
from maskplug_llguidance import LLGuidanceProvider

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec
from maskplug.grammar.sdk import DEFAULT_CACHE_ENTRIES, CompileCache
from maskplug.grammar.vocabs import mistral_sentencepiece


def _counting() -> tuple[list[str], Any]:
    calls: list[str] = []

    def compile_fn(spec: GrammarSpec) -> object:
        calls.append(str(spec.source))
        return object()

    return calls, compile_fn


def test_the_least_recently_used_grammar_is_dropped_first() -> None:
    cache = CompileCache(max_entries=2)
    calls, fn = _counting()
    a, b, c = (GrammarSpec("regex", x) for x in "abc")
    ga = cache.get_or_compile(a, fn)
    cache.get_or_compile(b, fn)
    assert cache.get_or_compile(a, fn) is ga  # a is now the most recently used
    cache.get_or_compile(c, fn)  # drops b
    assert len(cache) == 2 and a in cache and c in cache and b not in cache
    assert cache.evicted == 1 and calls == ["a", "b", "c"]
    cache.get_or_compile(b, fn)  # compiled again, dropping a (least recently used now)
    assert calls == ["a", "b", "c", "b"] and a not in cache and cache.evicted == 2
    assert (cache.hits, cache.misses) == (1, 4)


def test_get_looks_up_without_compiling() -> None:
    """``get`` answers a cached spec as a hit (made the most recently used) and anything else with ``None``."""
    cache = CompileCache(max_entries=2)
    calls, fn = _counting()
    a, b, c = (GrammarSpec("regex", x) for x in "abc")
    assert cache.get(a) is None and calls == [] and (cache.hits, cache.misses) == (0, 0)
    ga = cache.get_or_compile(a, fn)
    cache.get_or_compile(b, fn)
    assert cache.get(GrammarSpec("regex", "a")) is ga and (cache.hits, cache.misses) == (1, 2)
    cache.get_or_compile(c, fn)  # drops b: a was used more recently
    assert a in cache and b not in cache and cache.get(b) is None and calls == ["a", "b", "c"]


def test_no_bound_keeps_everything() -> None:
    cache = CompileCache(max_entries=None)
    _, fn = _counting()
    for i in range(DEFAULT_CACHE_ENTRIES + 5):
        cache.get_or_compile(GrammarSpec("regex", f"x{i}"), fn)
    assert len(cache) == DEFAULT_CACHE_ENTRIES + 5 and cache.evicted == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_bounds_are_refused_by_name(bad: Any) -> None:
    with pytest.raises(GrammarError, match="max_entries"):
        CompileCache(max_entries=bad)


def test_a_provider_keeps_the_default_number_and_a_dropped_grammar_keeps_working() -> None:
    v = mistral_sentencepiece()
    p = LLGuidanceProvider(v, compile_limit_s=None)
    assert p.cache.max_entries == DEFAULT_CACHE_ENTRIES
    p.cache.max_entries = 1
    first = p.compile(GrammarSpec("regex", "ab"))
    m = first.matcher()
    p.compile(GrammarSpec("regex", "cd"))  # drops the first grammar from the cache
    assert GrammarSpec("regex", "ab") not in p.cache
    # A matcher of the dropped grammar still works to the end.
    assert all(m.accept(t) for t in v.encode("ab")) and m.accept(v.eos_ids[0])
    again = p.compile(GrammarSpec("regex", "ab"))
    assert again is not first and p.cache.evicted == 2
