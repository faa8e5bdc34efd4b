"""``maskplug plugins`` and ``maskplug backends``: what they list, in both output formats, and the switches."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import maskplug
from maskplug import reset_registry
from maskplug.cli import main
from maskplug.kernels import cpu_numba
from maskplug.plugins import BUILTIN_PLUGINS, get_registry

PLUGIN_KEYS = {"name", "distribution", "version", "hooks", "error"}
PROVIDES_KEYS = {"kernels", "grammar_providers", "schedulers"}
BUILTIN_SCHEDULERS = {"dspark", "goodput", "grammar-aware", "no-spec", "verify-all"}

# A plugin distribution made on the fly: one entry point that registers a kernel
# backend (never available) and a scheduler, and one whose module fails to import.
_MODULE = """
from maskplug import hookimpl
from maskplug.schedulers import get_scheduler


class ListingBackend:
    name = "listing-kernel"
    priority = -50

    def unavailable_reason(self, device):
        return "listing-kernel runs nowhere"

    def apply(self, logits, bitmask, request, position, cu_logits, vocab_size, mask_tail):
        raise AssertionError("never selected")


@hookimpl
def maskplug_register_kernels(register):
    register(ListingBackend())


@hookimpl
def maskplug_register_schedulers(register):
    register("listing-sched", lambda **config: get_scheduler("no-spec"))
"""


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Install (on ``sys.path``) the distribution ``maskplug-listing`` 0.3.1 with two entry points."""
    (tmp_path / "listing_plugin.py").write_text(textwrap.dedent(_MODULE))
    (tmp_path / "listing_broken.py").write_text("raise ImportError('listing-broken cannot load here')\n")
    info = tmp_path / "maskplug_listing-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: maskplug-listing\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text("[maskplug]\nlisting = listing_plugin\nlisting-broken = listing_broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MASKPLUG_LOAD_PLUGINS", raising=False)
    monkeypatch.setenv("MASKPLUG_DISABLE_PLUGINS", "listing-broken")
    reset_registry()
    try:
        yield tmp_path
    finally:
        reset_registry()


def _plugins_json(capsys: pytest.CaptureFixture[str], expect_rc: int = 0) -> dict[str, Any]:
    assert main(["plugins", "--json"]) == expect_rc
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) == {"plugins", "provides", "cpu_kernel"}
    assert obj["cpu_kernel"] == cpu_numba.kernel_name() and obj["cpu_kernel"] in ("numba", "numpy")
    assert set(obj["provides"]) == PROVIDES_KEYS
    for row in obj["plugins"]:
        assert set(row) == PLUGIN_KEYS
    return obj


def test_plugins_json_lists_the_builtins_with_their_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    reset_registry()
    obj = _plugins_json(capsys)
    rows = {r["name"]: r for r in obj["plugins"]}
    for name in BUILTIN_PLUGINS:
        row = rows[name]
        assert row["distribution"] == "maskplug" and row["version"] == maskplug.__version__
        assert row["error"] is None
        assert row["hooks"] and all(h.startswith("maskplug_register_") for h in row["hooks"])
    provides = obj["provides"]
    assert "torch" in provides["kernels"]
    assert BUILTIN_SCHEDULERS <= set(provides["schedulers"])
    reg = get_registry()
    assert provides == {
        "kernels": sorted(reg.kernels),
        "grammar_providers": sorted(reg.grammar_providers),
        "schedulers": sorted(reg.schedulers),
    }
    # Every loaded plugin is listed once, in load order.
    assert [r["name"] for r in obj["plugins"]] == [p.name for p in reg.plugins]


def test_plugins_table_shows_each_plugin_with_its_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    reset_registry()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["plugin", "distribution", "version", "hooks", "status"]
    for p in get_registry().plugins:
        line = next(ln for ln in lines if ln.startswith(p.name + " "))
        assert line.split()[1:3] == [p.distribution, p.version] and line.rstrip().endswith("loaded")
    assert any(ln.startswith("schedulers: ") and "dspark" in ln for ln in lines)
    assert any(ln.startswith("kernels: ") and "torch" in ln for ln in lines)


def test_a_plugin_distribution_is_listed_and_disabling_it_removes_it(
    fake_distribution: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    obj = _plugins_json(capsys)
    rows = {r["name"]: r for r in obj["plugins"]}
    assert rows["listing"]["distribution"] == "maskplug-listing"
    assert rows["listing"]["version"] == "0.3.1"
    assert sorted(rows["listing"]["hooks"]) == ["maskplug_register_kernels", "maskplug_register_schedulers"]
    assert "listing-broken" not in rows  # disabled by the fixture
    assert "listing-kernel" in obj["provides"]["kernels"]
    assert "listing-sched" in obj["provides"]["schedulers"]

    reset_registry()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKPLUG_DISABLE_PLUGINS", "listing,listing-broken")
        off = _plugins_json(capsys)
        names = [r["name"] for r in off["plugins"]]
        assert "listing" not in names and "listing-broken" not in names
        assert "listing-kernel" not in off["provides"]["kernels"]
        assert "listing-sched" not in off["provides"]["schedulers"]
        # Only what that plugin registered went away.
        assert set(off["provides"]["kernels"]) == set(obj["provides"]["kernels"]) - {"listing-kernel"}
        assert set(off["provides"]["schedulers"]) == set(obj["provides"]["schedulers"]) - {"listing-sched"}
        # The backend list follows the registry.
        assert main(["backends", "--device", "cpu", "--json"]) == 0
        assert "listing-kernel" not in json.loads(capsys.readouterr().out)["cpu"]["backends"]


def test_a_plugin_that_fails_to_import_is_shown_and_fails_the_command(
    fake_distribution: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASKPLUG_DISABLE_PLUGINS", "")
    reset_registry()
    with pytest.warns(RuntimeWarning, match="listing-broken"):
        obj = _plugins_json(capsys, expect_rc=1)
    rows = {r["name"]: r for r in obj["plugins"]}
    assert rows["listing-broken"]["distribution"] == "maskplug-listing"
    assert "listing-broken cannot load here" in rows["listing-broken"]["error"]
    assert rows["listing"]["error"] is None
    assert main(["plugins"]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("listing-broken "))
    assert "FAILED: ImportError: listing-broken cannot load here" in line


def test_backends_json_has_every_registered_backend_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.dispatch import resolve_backend

    reset_registry()
    assert main(["backends", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    assert list(obj) == devices
    kernels = set(get_registry().kernels)
    for dev, info in obj.items():
        assert set(info) == {"auto", "backends"}
        assert set(info["backends"]) == kernels
        assert all(why is None or (isinstance(why, str) and why) for why in info["backends"].values())
        assert info["auto"] == resolve_backend("auto", torch.device(dev)).name
        assert info["backends"][info["auto"]] is None  # auto resolves to an available backend
    assert obj["cpu"]["backends"]["torch"] is None


def test_backends_table_matches_the_json(fake_distribution: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["cpu"]
    assert info["backends"]["listing-kernel"] == "listing-kernel runs nowhere"
    assert main(["backends", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"device cpu: auto -> {info['auto']}"
    assert lines[1].split() == ["backend", "status"]
    for name, why in info["backends"].items():
        line = next(ln for ln in lines if ln.startswith(name + " "))
        status = line[len(name) :].strip()
        assert status == ("available" if why is None else f"unavailable: {why}")
