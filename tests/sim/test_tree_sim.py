"""Tree verification in the simulator: the tree drafter, the tree engine's checks and the demo's tree rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sim_testkit import BrokenPlugin

from maskplug import BudgetError, LayoutError, ScheduledLayout, reset_registry
from maskplug.data import load_tokenizer
from maskplug.grammar import grammar_provider
from maskplug.plugins import get_registry
from maskplug.sim import SimConfig, Workload, default_cost_model
from maskplug.sim.models import TargetModel, draft, structural_tokens
from maskplug.sim.tree_drafter import TreeConfig, draft_trees
from maskplug.sim.tree_engine import TREE_SCHEDULERS, TreeSimulation, is_tree_scheduler
from maskplug.trees import DraftTree, TreeCompaction

V = 1000
FIRST = 3
EOS = 2


def _inputs(n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "rid": np.arange(n, dtype=np.int64) + 100,
        "length": rng.integers(0, 50, n).astype(np.int64),
        "window": rng.integers(FIRST, V, (n, k + 2)).astype(np.int64),
        "skill": rng.uniform(0.3, 0.9, n),
    }


def _trees(n: int, k: int, cfg: TreeConfig, seed: int = 0, on_track: bool = True):  # type: ignore[no-untyped-def]
    x = _inputs(n, k, seed)
    structural = np.zeros(V, dtype=bool)
    structural[FIRST : FIRST + 20] = True
    levels = np.full(n, k, dtype=np.int64)
    d = draft_trees(
        seed, x["rid"], x["length"], x["window"], levels, np.full(n, on_track), x["skill"], structural, FIRST, V, EOS,
        cfg,
    )  # fmt: skip
    return d, x, structural


def test_tree_config_refuses_bad_shapes_naming_the_field() -> None:
    with pytest.raises(LayoutError, match="branch"):
        TreeConfig(branch=0)
    with pytest.raises(LayoutError, match="depth"):
        TreeConfig(depth=-1)
    with pytest.raises(LayoutError, match="width"):
        TreeConfig(width=0)
    with pytest.raises(LayoutError, match="second_chance"):
        TreeConfig(second_chance=1.0)
    assert TreeConfig().levels(4) == 4 and TreeConfig(depth=2).levels(4) == 2


def test_trees_are_level_ordered_with_distinct_siblings_and_bounded_width() -> None:
    cfg = TreeConfig(branch=3, depth=4, width=3)
    d, x, _ = _trees(40, 4, cfg)
    for r in range(40):
        par, tok, dep, conf = d.parents[r], d.tokens[r], d.depth[r], d.conf[r]
        assert par.shape[0] <= 4 * 3
        assert np.all(par < np.arange(par.shape[0]))  # parents before children
        assert np.all(np.diff(dep) >= 0)  # level order
        assert np.all(np.bincount(dep)[1:] <= 3)  # width per level
        assert np.all((conf >= 0) & (conf <= 1))
        assert np.all(dep[par >= 0] == dep[par[par >= 0]] + 1)
        for p in np.unique(par):
            kids = tok[par == p]
            assert np.unique(kids).size == kids.size  # distinct siblings
        # A node follows the reference iff its parent does and its token is the reference token there.
        for j in range(par.shape[0]):
            parent_on = True if par[j] < 0 else bool(d.on_ref[r][par[j]])
            assert d.on_ref[r][j] == (parent_on and tok[j] == x["window"][r, dep[j] - 1])
    # The drafts form a valid tree layout.
    lay = ScheduledLayout(x["rid"], d.num_nodes, np.ones(40, dtype=np.int64))
    tree = DraftTree(lay, d.parents)
    assert np.array_equal(tree.depth, np.concatenate(d.depth))


def test_branch_one_drafts_the_greedy_chain() -> None:
    d, x, structural = _trees(30, 5, TreeConfig(branch=1, depth=5, width=1))
    n = 30
    chain = draft(
        0, x["rid"], x["length"], x["window"], np.full(n, 5), x["skill"], np.zeros(n, dtype=bool), structural, FIRST,
        V, 5,
    )  # fmt: skip
    for r in range(n):
        k = d.tokens[r].shape[0]
        assert np.array_equal(d.parents[r], np.arange(k) - 1)
        # The chain stops only at a stop token; up to there the tokens and confidences are the chain drafter's.
        assert np.array_equal(d.tokens[r], chain.tokens[r, :k])
        assert np.allclose(d.conf[r], chain.conf[r, :k])


def test_confidences_are_calibrated_per_rank() -> None:
    # Depth 1: the root's children; a child is accepted iff it is the reference token.
    n = 3000
    d, _, _ = _trees(n, 1, TreeConfig(branch=3, depth=1, width=3), seed=5)
    conf = np.stack([c for c in d.conf])
    hit = np.stack([o for o in d.on_ref])
    assert np.all(hit.sum(axis=1) <= 1)  # the reference token appears at most once
    for rank in range(3):
        assert abs(hit[:, rank].mean() - conf[:, rank].mean()) < 0.03, rank
    # Off the reference nothing is ever right.
    d_off, _, _ = _trees(50, 3, TreeConfig(branch=2, depth=3, width=2), on_track=False)
    assert not any(o.any() for o in d_off.on_ref)


_WORK: dict[int, Workload] = {}


def _setup(cfg: SimConfig):  # type: ignore[no-untyped-def]
    # One request stream per seed for the whole module (its compiled grammars are shared, as run_demo shares them).
    tok = load_tokenizer(cfg.tokenizer)
    if cfg.seed not in _WORK:
        _WORK[cfg.seed] = Workload(cfg, tok, grammar_provider(cfg.provider, tok.vocab))
    target = TargetModel(cfg.seed, tok.vocab.vocab_size, noise=cfg.noise, margin=cfg.margin)
    return _WORK[cfg.seed], target, structural_tokens(tok.vocab)


def test_tree_runs_pass_every_check_in_every_regime() -> None:
    cfg = SimConfig(steps=12, concurrency=4, tokenizer="spm", squeeze_every=4, max_batch_tokens=48, tempt_rate=0.3)
    work, target, structural = _setup(cfg)
    tree = TreeConfig(branch=2, depth=3, width=3)
    for name in (*TREE_SCHEDULERS, "tree:verify-all"):
        res = TreeSimulation(cfg, name, work, target, default_cost_model(), structural=structural, tree=tree).run()
        assert res.violations == [], (name, res.violations)
        assert res.invalid == 0, (name, res.invalid_samples)
        assert res.scheduler == name and res.steps == 12
        assert res.tokens > 0 and res.accepted > 0
        assert res.admitted == res.valid + res.invalid + res.cut_off + res.in_flight
        assert res.regimes["zero"] >= 3  # every 4th step has room for bonus rows only
        if name != "tree:verify-all":
            assert res.regimes["partial"] > 0
    assert res.tempted_rows > 0


def test_tree_runs_are_deterministic() -> None:
    cfg = SimConfig(steps=6, concurrency=3, tokenizer="spm", seed=4)
    work, target, structural = _setup(cfg)
    runs = [
        TreeSimulation(cfg, "tree:grammar-aware:dspark", work, target, default_cost_model(), structural=structural)
        .run()
        .as_json(False)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_only_tree_schedulers_are_accepted() -> None:
    cfg = SimConfig(steps=1, concurrency=1, tokenizer="spm")
    work, target, _ = _setup(cfg)
    assert is_tree_scheduler("tree:dspark") and not is_tree_scheduler("dspark")
    for bad in ("dspark", "tree:goodput", "tree:"):
        with pytest.raises(BudgetError, match="scheduler"):
            TreeSimulation(cfg, bad, work, target, default_cost_model())


def test_a_broken_kernel_is_caught_on_trees() -> None:
    reset_registry()
    try:
        get_registry().add_plugin(BrokenPlugin(), "broken-for-test")
        cfg = SimConfig(steps=12, concurrency=4, tokenizer="spm", backend="broken-for-test", tempt_rate=0.5)
        work, target, structural = _setup(cfg)
        res = TreeSimulation(cfg, "tree:verify-all", work, target, default_cost_model(), structural=structural).run()
    finally:
        reset_registry()
    assert any("forbids" in v or "not masked exactly" in v for v in res.violations), res.violations


def test_a_live_mapping_that_leaves_rows_in_place_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows left at their scheduled positions mask the wrong logits rows once nodes are dropped.
    monkeypatch.setattr(TreeCompaction, "live_mapping", lambda self, mapping, tree: mapping)
    cfg = SimConfig(steps=8, concurrency=4, tokenizer="spm", tempt_rate=0.5)
    work, target, structural = _setup(cfg)
    res = TreeSimulation(cfg, "tree:dspark", work, target, default_cost_model(), structural=structural).run()
    assert any("live mapping" in v for v in res.violations), res.violations


TREE_SMALL = ["demo", "--steps", "5", "--concurrency", "3", "--tokenizer", "spm", "--no-progress"]


def test_demo_tree_adds_tree_rows_and_stays_byte_identical(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.cli import main

    args = [*TREE_SMALL, "--tree", "--tree-width", "3", "--scheduler", "dspark", "--json", "--no-timing"]
    outs = []
    for _ in range(2):
        assert main(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0].encode() == outs[1].encode()
    obj = json.loads(outs[0])
    assert list(obj["schedulers"]) == ["dspark", *TREE_SCHEDULERS]
    assert obj["config"]["tree"] == {"branch": 2, "depth": 4, "width": 3, "second_chance": 0.5}
    for name in TREE_SCHEDULERS:
        rec = obj["schedulers"][name]
        assert rec["steps"] == 5 and rec["invalid"] == 0 and rec["tokens"] > 0
    # Without --tree the configuration has no tree and no tree rows run.
    assert main([*TREE_SMALL, "--scheduler", "dspark", "--json", "--no-timing"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "tree" not in plain["config"] and list(plain["schedulers"]) == ["dspark"]


def test_demo_tree_table_and_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.cli import main

    assert main([*TREE_SMALL, "--scheduler", "tree:verify-all", "--tree-branch", "3", "--tree-depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "tree:verify-all" in out and "top-3 branching, depth 2" in out and "all passed" in out
    for flag, value in (("--tree-branch", "0"), ("--tree-width", "0"), ("--tree-depth", "-1")):
        assert main([*TREE_SMALL, "--tree", flag, value]) == 2
        assert flag in capsys.readouterr().err
    assert main([*TREE_SMALL, "--scheduler", "tree:goodput"]) == 2
    assert "tree:dspark" in capsys.readouterr().err
