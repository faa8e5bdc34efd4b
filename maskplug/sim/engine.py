"""The simulated engine loop: continuous batching through maskplug's real code, checked every step.

One :class:`Simulation` serves a request stream with one budget scheduler.
Each step it does what a speculative-decoding engine with structured outputs
does, calling maskplug for every part that maskplug owns:

1. admit new requests into free slots (their first step is a prefill chunk);
2. draft up to ``K`` tokens per decoding request (:mod:`.models`);
3. fill the grammar requests' mask rows for the scheduled drafts
   (:func:`maskplug.fill_draft_masks`, real grammar provider);
4. choose the verify budget (the scheduler, on two-step-old confidences from
   :class:`maskplug.confidence.ConfidenceHistory`) and allocate it on the live
   confidences (:func:`maskplug.allocate`, or
   :func:`maskplug.schedulers.allocate_step` for schedulers that read the
   draft masks, those whose ``uses_grammar`` is true);
5. compact (:func:`maskplug.compact`, :func:`maskplug.active_cu_logits`),
   build the target's logits for the live rows only and apply the masks
   (:func:`maskplug.apply_grammar_bitmask` with the mapping from the
   *scheduled* layout);
6. verify, greedy or by rejection sampling, on the masked compacted logits;
7. commit the emitted tokens (:func:`maskplug.commit`), retire finished
   requests and validate their outputs.

With ``SimConfig.overlap``, stage 3 runs while the accelerator would run
its forward pass, for schedulers that choose the budget without the draft
masks (``uses_grammar`` false): the budget is chosen, the forward pass is
launched (it is stood in for by the cost model's time for the step, during
which the host thread is free, as while an accelerator computes), the rows
are started as a job (``fill_draft_masks(..., wait=False)``) and collected
before sampling. Each step records the simulated forward time, the mask
production time and the step's time from the forward pass's launch to the
masks being ready: measured with overlap, and without it as production +
forward (schedulers that read the masks always take that path).

Each stage is one method of :class:`Simulation` (``_admit``, ``_draft``,
``_fill_masks``, ``_choose_budget``, ``_masked_logits``, ``_verify``,
``_commit`` and ``_retire``), passing small records (``_Batch``, ``_Masks``,
``_Budget``, ``_Rows``) from one to the next. A step's budget regime is
:func:`maskplug.compaction.regime_of`'s: a step without drafts is ``"full"``.

Every step is checked: the layout invariants (mapping length, capacity a
per-request prefix summing to the budget, device offsets against the host
compaction, allocation against :mod:`maskplug.reference`), that every
emitted token is allowed by its mask row and accepted by its matcher, and,
on a few rows per step, that masking wrote ``-inf`` exactly at the
disallowed tokens and changed nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .. import reference
from ..budget import CostModel, allocate
from ..compaction import Compaction, active_cu_logits, compact, regime_of
from ..confidence import ConfidenceHistory
from ..data import Tokenizer
from ..dispatch import apply_grammar_bitmask
from ..draftmasks import DraftMasks
from ..errors import GrammarError
from ..grammar import GrammarProvider, commit, fill_draft_masks
from ..layout import GrammarRows, RowMapping, ScheduledLayout
from ..plugins import get_registry
from ..schedulers import StepOutcome, StepView, allocate_step, get_scheduler
from .models import Drafts, Streams, TargetModel, draft, hash64, structural_tokens, uniform
from .workload import RequestSpec, WorkloadMix, load_schemas, make_request

__all__ = [
    "DEFAULT_SCHEDULERS",
    "RunResult",
    "SimConfig",
    "Simulation",
    "Workload",
    "default_cost_model",
    "make_scheduler",
]

I64 = npt.NDArray[np.int64]

#: The schedulers ``maskplug demo`` compares, in table order. ``grammar-aware:X`` wraps ``X``.
DEFAULT_SCHEDULERS = ("no-spec", "verify-all", "dspark", "grammar-aware:dspark", "goodput")


def default_cost_model() -> CostModel:
    """The simulated GPU: flat verify cost up to 64 tokens, then about 0.11 ms per token.

    Shaped like a mid-size target on one accelerator: a forward pass costs
    the same until the batch fills the compute units, then grows linearly.
    The drafter costs a little per request.
    """
    return CostModel.from_curves(
        draft_curve=[(1, 1.0), (16, 1.3), (64, 2.2), (256, 5.5)],
        verify_curve=[(1, 9.0), (64, 9.5), (128, 16.0), (256, 30.0), (512, 58.0), (1024, 114.0)],
        max_reqs=4096,
        max_tokens=1 << 16,
    )


#: Requests failing one after another before the run stops (every grammar failing would never fill a slot).
_MAX_FAILED_IN_A_ROW = 1000


def make_scheduler(spec: str) -> Any:
    """A scheduler from a spec: a registered name, or ``grammar-aware:INNER`` (:func:`maskplug.get_scheduler`)."""
    return get_scheduler(spec)


@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a run (the seed included); see ``maskplug demo --help``.

    Attributes:
        steps: engine steps per scheduler.
        concurrency: request slots (continuous batching keeps them full).
        drafts: ``K``, drafts per decoding request and step.
        tokenizer: ``"tekken"`` (131,072 tokens) or ``"spm"`` (32,000).
        provider: grammar provider name (default ``"auto"``: each grammar compiled by the
            provider best suited to it). A grammar that does not compile (a
            compile stopped at its limit included) fails that request alone:
            it is counted in ``RunResult.failed`` and listed in
            ``Workload.failures``; the run goes on.
        backend: kernel backend name or ``"auto"``.
        seed: the seed of the request stream, drafter and target.
        noise: scale of the target's logit noise.
        margin: the target's preference for the reference token, in logits.
        tempt_rate: how often a grammar row's raw logits prefer a forbidden token.
        max_batch_tokens: the engine's tokens-per-step limit (prefill chunks
            plus decode tokens plus verified drafts); ``None`` for no limit.
        squeeze_every: every ``N``-th step the engine has room for bonus
            rows only (budget 0 forced through ``max_logits``); 0 = never.
        check_rows: rows per step whose masking is checked column by column.
        mix: request kinds.
        schema_dir: the folder of JSON schemas (default :func:`maskplug.data.schema_dir`).
        overlap: produce the mask rows during the simulated forward pass
            (which then takes real time: the cost model's, per step).
    """

    steps: int = 60
    concurrency: int = 16
    drafts: int = 4
    tokenizer: str = "tekken"
    provider: str = "auto"
    backend: str = "auto"
    seed: int = 0
    noise: float = 2.0
    margin: float = 30.0
    tempt_rate: float = 0.1
    max_batch_tokens: int | None = 192
    squeeze_every: int = 0
    check_rows: int = 2
    mix: WorkloadMix = field(default_factory=WorkloadMix)
    schema_dir: str | None = None
    overlap: bool = False

    def as_json(self) -> dict[str, Any]:
        """The configuration as plain JSON values."""
        return {
            "steps": self.steps,
            "concurrency": self.concurrency,
            "drafts": self.drafts,
            "tokenizer": self.tokenizer,
            "provider": self.provider,
            "backend": self.backend,
            "noise": self.noise,
            "margin": self.margin,
            "tempt_rate": self.tempt_rate,
            "max_batch_tokens": self.max_batch_tokens,
            "squeeze_every": self.squeeze_every,
            "mix": {"json": self.mix.json, "regex": self.mix.regex, "free": self.mix.free},
        }


@dataclass
class _Prepared:
    spec: RequestSpec
    ref: I64  # reference tokens followed by the stop token
    compiled: Any  # CompiledGrammar or None
    max_tokens: int
    error: str | None = None  # why the request failed (its grammar did not compile); None when it runs


class Workload:
    """The request stream of one seed: specs, tokenised references, compiled grammars (shared by all runs)."""

    def __init__(self, config: SimConfig, tokenizer: Tokenizer, provider: GrammarProvider | None) -> None:
        self.config = config
        self.tok = tokenizer
        self.provider = provider
        self.schemas = load_schemas(config.schema_dir)
        self._cache: dict[int, _Prepared] = {}
        self._by_bytes: dict[bytes, list[int]] | None = None
        self._longest = 0
        #: Requests that failed (request index -> (request name, the grammar error)), in the order reached.
        self.failures: dict[int, tuple[str, str]] = {}
        # One compile per grammar: a spec that failed fails every request that asks for it.
        self._failed_specs: dict[str, str] = {}

    def _guided(self, text: str, matcher: Any) -> list[int] | None:
        """Tokenise ``text`` greedily (longest token first) among the tokens the grammar allows.

        Where several ids spell the same bytes (a piece and its byte-fallback
        token), the first the grammar allows is taken: a provider holding
        forced text to the tokenizer's own spelling allows only one of them.
        """
        if self._by_bytes is None:
            vocab = self.tok.vocab
            self._by_bytes = {}
            for i, t in enumerate(vocab.tokens):
                if t and i not in vocab.special_ids:
                    self._by_bytes.setdefault(t, []).append(i)
            self._longest = max(len(t) for t in self._by_bytes)
        raw = text.encode("utf-8")
        bm = self.tok.vocab.new_bitmask(1)
        ids: list[int] = []
        pos = 0
        while pos < len(raw):
            matcher.fill(bm, 0)
            words = bm[0].numpy()
            for n in range(min(self._longest, len(raw) - pos), 0, -1):
                tid = next(
                    (i for i in self._by_bytes.get(raw[pos : pos + n], ()) if (int(words[i >> 5]) >> (i & 31)) & 1),
                    None,
                )
                if tid is not None and matcher.accept(tid):
                    ids.append(tid)
                    pos += n
                    break
            else:
                return None
        eos = self.tok.eos
        return [*ids, eos] if matcher.accept(eos) else None

    def get(self, index: int) -> _Prepared:
        """Request ``index``: the reference is the first serialisation its grammar accepts."""
        got = self._cache.get(index)
        if got is not None:
            return got
        spec, texts = make_request(self.config.seed, index, self.schemas, self.config.mix)
        eos = self.tok.eos
        compiled = None
        ids: list[int] | None = None
        if spec.grammar is not None:
            if self.provider is None:
                raise GrammarError("provider: expected a grammar provider for grammar requests, got none")
            key = spec.grammar.key()
            error = self._failed_specs.get(key)
            if error is None:
                try:
                    compiled = self.provider.compile(spec.grammar)
                except GrammarError as exc:  # that request's error, as a serving engine reports it
                    error = self._failed_specs[key] = str(exc)
            if error is not None:
                failed = _Prepared(spec, np.zeros(0, dtype=np.int64), None, 0, error)
                self._cache[index] = failed
                self.failures[index] = (spec.name, error)
                return failed
            assert compiled is not None  # compiled above, or the request failed
            for text in texts:
                cand = [*self.tok.encode(text), eos]
                if compiled.matcher().validate(cand) == len(cand):
                    ids = cand
                    break
            if ids is None:
                # Some providers accept only certain tokenisations of forced text
                # (llguidance keeps it canonical): let the grammar pick the split.
                ids = self._guided(texts[0], compiled.matcher())
            if ids is None:
                raise GrammarError(
                    f"workload: no serialisation of request {index}'s {spec.name} reference is accepted by "
                    f"{self.config.provider}: {texts[0][:80]!r}"
                )
        else:
            ids = [*self.tok.encode(spec.text), eos]
        ref = np.asarray(ids, dtype=np.int64)
        n = int(ref.shape[0])
        max_tokens = max(2, int(n * 0.6)) if spec.short_limit else n + 4
        prep = _Prepared(spec, ref, compiled, max_tokens)
        self._cache[index] = prep
        return prep


@dataclass
class _Active:
    prep: _Prepared
    slot: int
    matcher: Any
    output: list[int] = field(default_factory=list)
    on_track: bool = True
    prefilled: bool = False


@dataclass
class RunResult:
    """What one scheduler's run produced (all counts are exact; times are host measurements)."""

    scheduler: str
    steps: int = 0
    tokens: int = 0
    decode_steps_tokens: int = 0
    verified: int = 0
    accepted: int = 0
    verify_events: int = 0
    regimes: dict[str, int] = field(default_factory=lambda: {"full": 0, "partial": 0, "zero": 0})
    #: steps at budget 0 although drafts were scheduled (the budget trimmed them all)
    zero_trimmed: int = 0
    #: tokens of the outputs that finished (valid, invalid or cut off)
    finished_tokens: int = 0
    sim_ms: float = 0.0
    valid: int = 0
    invalid: int = 0
    cut_off: int = 0
    admitted: int = 0
    #: requests that failed alone (their grammar did not compile); never admitted
    failed: int = 0
    in_flight: int = 0
    violations: list[str] = field(default_factory=list)
    invalid_samples: list[str] = field(default_factory=list)
    host_s: float = 0.0
    apply_s: float = 0.0
    budgets: list[int] = field(default_factory=list)
    max_budgets: list[int] = field(default_factory=list)
    tempted_rows: int = 0
    #: the cost model's forward time (verify + draft), summed over steps
    forward_ms: float = 0.0
    #: mask production time (host), summed over steps
    mask_ms: float = 0.0
    #: step time from mask production's start to masks ready, without overlap (production + forward)
    serial_ms: float = 0.0
    #: the same, measured with mask production overlapping the forward pass (equal to serial_ms without overlap)
    overlap_ms: float = 0.0
    #: max(forward, mask production) per step, summed: what overlap can reach at best
    bound_ms: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Emitted tokens per engine step (all requests together)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def accepted_length(self) -> float:
        """Mean tokens emitted per decoding request per step: accepted drafts + 1."""
        return 1.0 + self.accepted / self.verify_events if self.verify_events else 0.0

    @property
    def goodput(self) -> float:
        """Emitted tokens per simulated second under the cost model."""
        return self.tokens / (self.sim_ms / 1000.0) if self.sim_ms > 0 else 0.0

    def as_json(self, timing: bool) -> dict[str, Any]:
        """The ``--json`` record of ``docs/design.md`` §9; ``host_us_per_step`` is ``None`` unless ``timing``."""
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_step": round(self.tokens_per_step, 6),
            "accepted_length": round(self.accepted_length, 6),
            "regimes": dict(self.regimes),
            "goodput_tok_s": round(self.goodput, 3),
            "valid": self.valid,
            "invalid": self.invalid,
            "cut_off": self.cut_off,
            "host_us_per_step": round(1e6 * self.host_s / self.steps, 1) if timing and self.steps else None,
            # Present only when some request failed, so the record of a run without failures keeps its fields.
            **({"failed": self.failed} if self.failed else {}),
        }


@dataclass
class _Requests:
    """The running requests' state at the start of a step, one entry per request (batch order)."""

    rid: I64
    slots: I64
    length: I64
    prefill: npt.NDArray[np.bool_]
    on_track: npt.NDArray[np.bool_]
    #: the request's token limit
    limit: I64
    prompt: I64
    skill: npt.NDArray[np.float64]
    sampled: npt.NDArray[np.bool_]
    has_g: npt.NDArray[np.bool_]
    #: ``window[r, j]``: the reference token ``j`` places past request ``r``'s output
    window: I64


@dataclass
class _Step(_Requests):
    """One step's running requests and scheduled layout: what chain and tree steps both carry."""

    t: int
    act: list[_Active]
    num_drafts: I64
    num_non_draft: I64
    layout: ScheduledLayout
    #: maskplug's host time in this step so far
    host_s: float = field(default=0.0, kw_only=True)
    #: mask production and, with overlap, the time from the forward pass's launch to the masks ready (seconds)
    mask_s: float = field(default=0.0, kw_only=True)
    ready_s: float | None = field(default=None, kw_only=True)


@dataclass
class _Batch(_Step):
    """One chain step's running requests (stage 2): their state, the scheduled layout and the drafts."""

    drafts: Drafts
    #: ``live_cols[r, j]``: draft ``j`` of request ``r`` is scheduled
    live_cols: npt.NDArray[np.bool_]


@dataclass
class _Masks:
    """Stage 3: the grammar requests (batch rows ``g_idx``), their mask rows and the row mapping."""

    g_idx: I64
    num_rows: int
    bitmask: torch.Tensor
    dm: DraftMasks | None
    mapping: RowMapping


@dataclass
class _Budget:
    """Stage 4: the scheduler's view and budget, the live allocation and the compaction."""

    view: StepView
    b: int
    live: torch.Tensor
    cap: I64
    cu: torch.Tensor
    cu_np: I64
    comp: Compaction
    regime: str


@dataclass
class _Rows:
    """Stage 5: the masked logits of the live rows and where each row comes from."""

    logits: torch.Tensor
    row_req: I64
    row_pos: I64
    out_pos: I64
    #: grammar index of each batch row (−1 for unconstrained requests)
    g_of: I64
    #: first mask row of each grammar request
    g_start: I64
    bm_np: npt.NDArray[np.int32]
    apply_s: float


def _bits(bitmask_np: npt.NDArray[np.int32], rows: I64, tokens: I64) -> npt.NDArray[np.bool_]:
    """Independent bit test: is ``tokens[i]`` allowed by mask row ``rows[i]``?"""
    words = bitmask_np[rows, tokens >> 5].astype(np.int64) & 0xFFFFFFFF
    return ((words >> (tokens & 31)) & 1).astype(bool)


def _row_allowed(bitmask_row: npt.NDArray[np.int32], vocab_size: int) -> npt.NDArray[np.bool_]:
    """The allowed-token vector of one mask row (little-endian bit order, ``docs/design.md`` §2)."""
    bits = np.unpackbits(bitmask_row.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


class Simulation:
    """One scheduler serving the workload for ``config.steps`` steps.

    Args:
        config: the run's configuration.
        scheduler: a scheduler spec (see :func:`make_scheduler`).
        workload: the shared request stream.
        target: the shared synthetic target model.
        cost: the cost model for budgets and simulated time.
        on_step: called after every step with ``(step, result)`` (progress).
    """

    def __init__(
        self,
        config: SimConfig,
        scheduler: str,
        workload: Workload,
        target: TargetModel,
        cost: CostModel,
        on_step: Callable[[int, RunResult], None] | None = None,
        structural: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        self.cfg = config
        self.name = scheduler
        self.sched = make_scheduler(scheduler)
        self.spec_off = scheduler == "no-spec"
        # Schedulers that read the draft masks get an allocation that respects them.
        self.grammar_aware = bool(getattr(self.sched, "uses_grammar", False))
        self.work = workload
        self.target = target
        self.cost = cost
        self.on_step = on_step
        vocab = workload.tok.vocab
        self.vocab = vocab
        self.V = vocab.vocab_size
        self.eos = workload.tok.eos
        self.first_token = max(vocab.special_ids) + 1
        self.structural = structural if structural is not None else structural_tokens(vocab)
        self.K = 0 if self.spec_off else int(config.drafts)
        self.hist = ConfidenceHistory(config.concurrency, max(self.K, 1))
        self.active: list[_Active] = []
        self.free_slots = list(range(config.concurrency))[::-1]
        self.next_index = 0
        self.result = RunResult(scheduler)
        self.registry = get_registry()

    # ------------------------------------------------------------------ helpers
    def _fail(self, step: int, what: str) -> None:
        res = self.result
        if len(res.violations) < 50:
            res.violations.append(f"step {step}: {what}")
        else:
            res.violations.append("...")  # keep counting without growing the report

    def _admit(self) -> None:
        new_slots = []
        failed_in_a_row = 0
        while len(self.active) < self.cfg.concurrency:
            prep = self.work.get(self.next_index)
            self.next_index += 1
            if prep.error is not None:
                # The request fails alone (its error is in the workload's failures); the next one takes the slot.
                self.result.failed += 1
                failed_in_a_row += 1
                if failed_in_a_row >= _MAX_FAILED_IN_A_ROW:
                    raise GrammarError(f"workload: {failed_in_a_row} requests in a row failed; the last: {prep.error}")
                continue
            failed_in_a_row = 0
            slot = self.free_slots.pop()
            matcher = prep.compiled.matcher() if prep.compiled is not None else None
            self.active.append(_Active(prep, slot, matcher))
            new_slots.append(slot)
            self.result.admitted += 1
        if new_slots:
            self.hist.reset(new_slots)

    def _finish(self, req: _Active, stopped: bool) -> str:
        """Classify a finished output: ``valid``, ``invalid`` or ``cut_off``."""
        if not stopped:
            return "cut_off"
        spec = req.prep.spec
        body = req.output[:-1]
        raw = self.work.tok.decode(body)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "invalid"
        if spec.kind == "json":
            import jsonschema

            try:
                jsonschema.validate(json.loads(text), spec.schema or {})
            except (ValueError, jsonschema.ValidationError):
                return "invalid"
            return "valid"
        if spec.kind == "regex":
            import regex

            return "valid" if regex.fullmatch(spec.pattern or "", text) is not None else "invalid"
        return "valid"

    def _requests(self, width: int) -> _Requests:
        """The running requests' state and each one's reference window ``width`` tokens wide."""
        act = self.active
        n = len(act)
        length = np.fromiter((len(a.output) for a in act), dtype=np.int64, count=n)
        window = np.empty((n, width), dtype=np.int64)
        for r, a in enumerate(act):
            ref = a.prep.ref
            idx = np.minimum(length[r] + np.arange(width), ref.shape[0] - 1)
            window[r] = ref[idx]
        return _Requests(
            rid=np.fromiter((a.prep.spec.index for a in act), dtype=np.int64, count=n),
            slots=np.fromiter((a.slot for a in act), dtype=np.int64, count=n),
            length=length,
            prefill=np.fromiter((not a.prefilled for a in act), dtype=bool, count=n),
            on_track=np.fromiter((a.on_track for a in act), dtype=bool, count=n),
            limit=np.fromiter((a.prep.max_tokens for a in act), dtype=np.int64, count=n),
            prompt=np.fromiter((a.prep.spec.prompt_len for a in act), dtype=np.int64, count=n),
            skill=np.fromiter((a.prep.spec.skill for a in act), dtype=np.float64, count=n),
            sampled=np.fromiter((a.prep.spec.sampled for a in act), dtype=bool, count=n),
            has_g=np.fromiter((a.matcher is not None for a in act), dtype=bool, count=n),
            window=window,
        )

    def _token_room(self, t: int, num_non_draft: I64) -> int | None:
        """Draft tokens the engine's token limit leaves room for in step ``t`` (``None``: no limit)."""
        cfg = self.cfg
        room = None
        if cfg.max_batch_tokens is not None:
            room = max(0, int(cfg.max_batch_tokens) - int(num_non_draft.sum()))
        if cfg.squeeze_every and t % cfg.squeeze_every == cfg.squeeze_every - 1:
            room = 0
        return room

    def _apply_checked(
        self,
        t: int,
        stream: int,
        logits: torch.Tensor,
        mrow: I64,
        bm_np: npt.NDArray[np.int32],
        apply: Callable[[], None],
    ) -> float:
        """Run ``apply`` (the masking), timed, and check a few masked rows column by column.

        ``mrow[i]`` is the mask row of logits row ``i`` (-1: unmasked); up to
        ``check_rows`` of the masked rows are drawn from the seeded ``stream``.
        Returns the seconds ``apply`` took.
        """
        cfg, V = self.cfg, self.V
        # Keep a few masked rows' raw values to check the kernel column by column.
        check = np.nonzero(mrow >= 0)[0]
        if check.size > cfg.check_rows:
            pick = hash64(cfg.seed, stream, t, np.arange(cfg.check_rows)) % np.uint64(check.size)
            check = check[pick.astype(np.int64)]
        before = logits[torch.from_numpy(check)].clone() if check.size else None
        a0 = time.perf_counter()
        apply()
        apply_s = time.perf_counter() - a0
        if before is not None:
            after = logits[torch.from_numpy(check)]
            for i, row in enumerate(check.tolist()):
                allowed_row = torch.from_numpy(_row_allowed(bm_np[mrow[row]], V))
                if not torch.equal(torch.where(allowed_row, before[i], float("-inf")), after[i]):
                    self._fail(t, f"logits row {row} not masked exactly by mask row {int(mrow[row])}")
        return apply_s

    def _emit(
        self, batch: _Step, a: _Active, toks: list[int], mask_rows: I64 | None, bm_np: npt.NDArray[np.int32]
    ) -> tuple[bool, bool]:
        """Emit ``toks`` for request ``a``: check them against their mask rows, commit them, extend the output.

        ``mask_rows[i]`` is the mask row that allowed ``toks[i]`` (grammar
        requests). Returns ``(finished, stopped)``: the request ended, on its
        stop token or at its token limit.
        """
        t = batch.t
        if a.matcher is not None and mask_rows is not None:
            if not np.all(_bits(bm_np, mask_rows, np.asarray(toks, dtype=np.int64))):
                self._fail(t, f"request {a.prep.spec.index} emitted a token its mask row forbids: {toks}")
            c0 = time.perf_counter()
            took = commit(a.matcher, toks)
            batch.host_s += time.perf_counter() - c0
            if took != len(toks):
                self._fail(t, f"request {a.prep.spec.index}: the grammar took {took} of emitted {toks}")
        start = len(a.output)
        if a.on_track:
            seg = a.prep.ref[start : start + len(toks)]
            a.on_track = seg.shape[0] == len(toks) and bool(np.array_equal(seg, toks))
        a.output.extend(toks)
        a.prefilled = True
        stopped = bool(toks) and toks[-1] == self.eos
        finished = stopped or len(a.output) >= a.prep.max_tokens
        if finished and a.matcher is not None and stopped and not a.matcher.is_terminated():
            self._fail(t, f"request {a.prep.spec.index} stopped but its matcher is not terminated")
        return finished, stopped

    # -------------------------------------------------------------------- stages
    def _tempting_tokens(
        self, bm_np: npt.NDArray[np.int32], mrow: I64, eligible: npt.NDArray[np.bool_], rids: I64, out_pos: I64
    ) -> I64:
        """Per logits row, a token the target is tempted by that its mask row forbids (-1: none).

        A row is tempted (seeded per request and position) when it has a mask
        row, ``eligible`` holds and the draw falls under ``tempt_rate``; the
        token is the first of four seeded candidates the mask disallows.
        """
        cfg, V = self.cfg, self.V
        tempt = np.full(mrow.shape[0], -1, dtype=np.int64)
        want = (mrow >= 0) & eligible & (uniform(cfg.seed, Streams.TEMPT, rids, out_pos) < cfg.tempt_rate)
        if np.any(want):
            w = np.nonzero(want)[0]
            cand = self.first_token + (
                hash64(cfg.seed, Streams.TEMPT_TOKEN, rids[w][:, None], out_pos[w][:, None], np.arange(4)[None, :])
                % np.uint64(V - self.first_token)
            ).astype(np.int64)
            allowed = _bits(bm_np, np.repeat(mrow[w], 4).reshape(-1, 4), cand)
            first_bad = np.argmax(~allowed, axis=1)
            ok = ~allowed[np.arange(w.size), first_bad]
            tempt[w[ok]] = cand[ok, first_bad[ok]]
            self.result.tempted_rows += int(ok.sum())
        return tempt

    def step(self, t: int) -> None:
        """Run engine step ``t``: the seven stages of the module docstring, each checked."""
        self._admit()
        batch = self._draft(t)
        if self.cfg.overlap and not self.grammar_aware:
            masks, budget = self._overlapped(batch)
        else:
            masks = self._fill_masks(batch)
            budget = self._choose_budget(batch, masks)
        self._check_layouts(batch, masks, budget)
        rows = self._masked_logits(batch, masks, budget)
        n_acc, final_tok = self._verify(batch, masks, budget, rows)
        emitted, finished = self._commit(batch, budget, rows, n_acc, final_tok)
        self._retire(batch, finished)
        self._account(batch, masks, budget, rows, n_acc, emitted, len(finished))

    def _draft(self, t: int) -> _Batch:
        """Stage 2: the running requests' state, the scheduled layout and up to ``K`` drafts each."""
        cfg, K = self.cfg, self.K
        q = self._requests(K + 2)
        rid, length, prefill, limit, window = q.rid, q.length, q.prefill, q.limit, q.window
        num_drafts = np.where(prefill, 0, np.clip(np.minimum(K, limit - length - 1), 0, None)).astype(np.int64)
        num_non_draft = np.where(prefill, q.prompt, 1).astype(np.int64)
        layout = ScheduledLayout(rid, num_drafts, num_non_draft)
        d = draft(
            cfg.seed,
            rid,
            length,
            window,
            num_drafts,
            q.skill,
            q.sampled,
            self.structural,
            self.first_token,
            self.V,
            max(K, 1),
        )
        live_cols = np.arange(d.tokens.shape[1])[None, :] < num_drafts[:, None]
        return _Batch(
            **vars(q), t=t, act=self.active, num_drafts=num_drafts, num_non_draft=num_non_draft, layout=layout,
            drafts=d, live_cols=live_cols,
        )  # fmt: skip

    def _fill_masks(self, batch: _Batch) -> _Masks:
        """Stage 3: the grammar requests' mask rows for the scheduled drafts (:func:`maskplug.fill_draft_masks`)."""
        h0 = time.perf_counter()
        g_idx = np.nonzero(batch.has_g)[0]
        rows = GrammarRows(batch.rid[g_idx])
        num_rows = rows.num_rows(batch.layout)
        bitmask = self.vocab.new_bitmask(num_rows)
        flat_drafts = batch.drafts.tokens[batch.live_cols]  # batch order, Σ num_drafts entries
        dm = fill_draft_masks([batch.act[g].matcher for g in g_idx], flat_drafts, bitmask, rows, batch.layout)
        mapping = rows.mapping(batch.layout)
        spent = time.perf_counter() - h0
        batch.host_s += spent
        batch.mask_s = spent
        return _Masks(g_idx, num_rows, bitmask, dm, mapping)

    def _forward_ms(self, batch: _Step, b: int) -> float:
        """The cost model's time for the step's forward passes: verify, plus the drafter when drafts were made."""
        ms = float(self.cost.verify_ms(int(batch.num_non_draft.sum()) + b))
        if batch.layout.total_drafts:
            ms += float(self.cost.draft_ms(int((~batch.prefill).sum())))
        return ms

    def _overlapped(self, batch: _Batch) -> tuple[_Masks, _Budget]:
        """Stages 4 then 3: the budget (without the masks), the forward pass launched, the rows as a job meanwhile."""
        budget = self._choose_budget(batch, None)
        # The accelerator's forward pass starts now and ends at its simulated time; the host thread
        # prepares and starts the rows' job, then only waits (a late wake-up is not the accelerator's).
        forward_s = self._forward_ms(batch, budget.b) / 1e3
        f0 = time.perf_counter()
        g_idx = np.nonzero(batch.has_g)[0]
        rows = GrammarRows(batch.rid[g_idx])
        num_rows = rows.num_rows(batch.layout)
        bitmask = self.vocab.new_bitmask(num_rows)
        flat_drafts = batch.drafts.tokens[batch.live_cols]
        c0 = time.perf_counter()
        job = fill_draft_masks(
            [batch.act[g].matcher for g in g_idx], flat_drafts, bitmask, rows, batch.layout, wait=False
        )
        c1 = time.perf_counter()
        time.sleep(max(0.0, f0 + forward_s - c1))
        h1 = time.perf_counter()
        dm = job.result()
        mapping = rows.mapping(batch.layout)
        batch.host_s += (c1 - f0) + (time.perf_counter() - h1)
        batch.mask_s = (c0 - f0) + (job.elapsed() or 0.0)
        batch.ready_s = max(forward_s, (job.finished_at() or h1) - f0)
        return _Masks(g_idx, num_rows, bitmask, dm, mapping), budget

    def _choose_budget(self, batch: _Batch, masks: _Masks | None) -> _Budget:
        """Stage 4: the scheduler's budget on stale confidences, its allocation on live ones, the compaction.

        ``masks`` is None when the rows are still being produced (schedulers that do not read them).
        """
        K, t, n = self.K, batch.t, len(batch.act)
        h0 = time.perf_counter()
        stale = self.hist.stale(batch.slots)[:, : max(K, 1)]
        room = self._token_room(t, batch.num_non_draft)
        max_logits = None if room is None else n * batch.layout.num_bonus + room
        view = StepView(
            batch.layout,
            self.cost,
            confidences=stale,
            grammar=masks.dm if masks is not None and masks.g_idx.size else None,
            max_logits=max_logits,
        )
        decision = self.sched.budget(view)
        b = int(decision.budget)
        live = torch.from_numpy(batch.drafts.conf.astype(np.float32))
        if self.grammar_aware:
            capacity = allocate_step(view, live, b)
        else:
            capacity = allocate(live, batch.num_drafts, b)
        cu = active_cu_logits(capacity, batch.layout.num_bonus)
        comp = compact(batch.layout, b)
        batch.host_s += time.perf_counter() - h0
        cap = capacity.numpy().astype(np.int64)
        cu_np = cu.numpy().astype(np.int64)
        return _Budget(view, b, live, cap, cu, cu_np, comp, regime_of(batch.layout, b))

    def _check_layouts(self, batch: _Batch, masks: _Masks, budget: _Budget) -> None:
        """The layout invariants of stages 3–4, against :mod:`maskplug.reference` where it has an answer."""
        t, b, cap, cu_np, comp = batch.t, budget.b, budget.cap, budget.cu_np, budget.comp
        num_drafts, num_bonus = batch.num_drafts, batch.layout.num_bonus
        dm = masks.dm
        if not 0 <= b <= budget.view.cap:
            self._fail(t, f"budget {b} outside [0, {budget.view.cap}]")
        if len(masks.mapping) != masks.num_rows or masks.bitmask.shape[0] != masks.num_rows:
            self._fail(
                t,
                f"mapping has {len(masks.mapping)} rows, bitmask {masks.bitmask.shape[0]}, producer {masks.num_rows}",
            )
        if int(cap.sum()) != b or np.any(cap < 0) or np.any(cap > num_drafts):
            self._fail(t, f"capacity {cap.tolist()} does not split budget {b} within {num_drafts.tolist()}")
        if not self.grammar_aware:
            ref_cap = reference.allocate(budget.live.numpy(), num_drafts, b)
            if list(ref_cap) != cap.tolist():
                self._fail(t, f"allocate {cap.tolist()} differs from the reference {list(ref_cap)}")
        elif dm is not None and masks.g_idx.size and np.any(cap[dm.request] > dm.acceptable):
            self._fail(t, "grammar-aware allocation admitted drafts the grammar rejects")
        expect_cu = np.concatenate([[0], np.cumsum(cap + num_bonus)])
        if not np.array_equal(cu_np, expect_cu):
            self._fail(t, f"active cu_logits {cu_np.tolist()} != cumsum(capacity + bonus) {expect_cu.tolist()}")
        if comp.num_tokens != int(batch.num_non_draft.sum()) + b:
            self._fail(t, f"compaction keeps {comp.num_tokens} tokens, expected {int(batch.num_non_draft.sum()) + b}")
        if comp.exact and not np.array_equal(comp.cu_logits, cu_np):
            self._fail(t, f"exact host cu_logits {comp.cu_logits.tolist()} != device {cu_np.tolist()}")
        ref_regime = reference.compact(batch.layout, b).regime
        if comp.regime != budget.regime or ref_regime != budget.regime:
            self._fail(
                t,
                f"compaction regime {comp.regime!r}, regime_of {budget.regime!r}, reference {ref_regime!r} differ",
            )

    def _masked_logits(self, batch: _Batch, masks: _Masks, budget: _Budget) -> _Rows:
        """Stage 5: the target's logits for the live (compacted) rows only, masked by the mapped grammar rows."""
        cfg, V, t, n = self.cfg, self.V, batch.t, len(batch.act)
        cap, cu_np, rid, g_idx = budget.cap, budget.cu_np, batch.rid, masks.g_idx
        d, width = batch.drafts, batch.window.shape[1]
        R = int(cu_np[-1])
        row_req = np.repeat(np.arange(n), cap + 1)
        row_pos = np.arange(R) - cu_np[row_req]
        k_all = d.tokens.shape[1]
        match = (d.tokens == batch.window[:, :k_all]) & batch.live_cols
        lead = np.cumprod(match, axis=1).sum(axis=1)  # drafts that follow the reference
        prefix_ok = batch.on_track[row_req] & (row_pos <= lead[row_req])
        pos_c = np.minimum(row_pos, width - 1)
        preferred = np.where(prefix_ok, batch.window[row_req, pos_c], self.eos)
        # Grammar row of each live logits row (−1 for unconstrained requests).
        g_of = np.full(n, -1, dtype=np.int64)
        g_of[g_idx] = np.arange(g_idx.size)
        g_start = np.zeros(g_idx.size + 1, dtype=np.int64)
        np.cumsum(batch.num_drafts[g_idx] + batch.layout.num_bonus, out=g_start[1:])
        mrow = np.where(g_of[row_req] >= 0, g_start[np.maximum(g_of[row_req], 0)] + row_pos, -1)
        bm_np = masks.bitmask.numpy()
        out_pos = batch.length[row_req] + row_pos
        tempt = self._tempting_tokens(bm_np, mrow, prefix_ok, rid[row_req], out_pos)
        logits = self.target.logits(rid[row_req], out_pos, preferred, tempt)

        def apply() -> None:
            if masks.num_rows:
                apply_grammar_bitmask(
                    logits, masks.bitmask, masks.mapping, budget.cu, vocab_size=V, backend=cfg.backend
                )

        apply_s = self._apply_checked(t, 99, logits, mrow, bm_np, apply)
        return _Rows(logits, row_req, row_pos, out_pos, g_of, g_start, bm_np, apply_s)

    def _verify(self, batch: _Batch, masks: _Masks, budget: _Budget, rows: _Rows) -> tuple[I64, I64]:
        """Stage 6: greedy or rejection-sampling verification on the masked, compacted logits.

        Returns the accepted drafts per request and the token each request
        emits after them (the target's correction or bonus token).
        """
        cfg, V, t = self.cfg, self.V, batch.t
        d, cap, rid, sampled = batch.drafts, budget.cap, batch.rid, batch.sampled
        logits, row_req, row_pos = rows.logits, rows.row_req, rows.row_pos
        n, R, k_all = len(batch.act), int(budget.cu_np[-1]), d.tokens.shape[1]
        tgt = logits.argmax(dim=1).numpy().astype(np.int64)
        draft_row = row_pos < cap[row_req]  # rows whose draft is being verified
        dr = np.nonzero(draft_row)[0]
        dtok = d.tokens[row_req[dr], row_pos[dr]]
        acc_row = np.zeros(R, dtype=bool)
        greedy_dr = ~sampled[row_req[dr]]
        acc_row[dr[greedy_dr]] = dtok[greedy_dr] == tgt[dr[greedy_dr]]
        sdr = dr[~greedy_dr]
        if sdr.size:
            sel = torch.from_numpy(sdr)
            lse = torch.logsumexp(logits[sel], dim=1).double()
            st = dtok[~greedy_dr]
            p_d = torch.exp(logits[sel, torch.from_numpy(st)].double() - lse).numpy()
            conc = d.conc[row_req[sdr]]
            belief = d.belief[row_req[sdr], row_pos[sdr]]
            q_d = (1.0 - conc) / V + conc * (st == belief)
            u = uniform(cfg.seed, Streams.ACCEPT, rid[row_req[sdr]], rows.out_pos[sdr])
            acc_row[sdr] = u * q_d < p_d
        # Nothing is accepted after an accepted stop token: the output ends there.
        after_eos = np.zeros_like(d.tokens, dtype=bool)
        if k_all > 1:
            after_eos[:, 1:] = np.cumsum(d.tokens[:, :-1] == self.eos, axis=1) > 0
        acc_row[dr] &= ~after_eos[row_req[dr], row_pos[dr]]
        ok_mat = np.zeros((n, max(k_all, 1) + 1), dtype=bool)
        ok_mat[row_req[dr], row_pos[dr]] = acc_row[dr]
        n_acc = np.minimum(np.cumprod(ok_mat, axis=1).sum(axis=1), cap)
        # A draft the grammar rejects can never be accepted (its row forbids it),
        # so the accepted prefix never passes the grammar's acceptable count.
        acceptable = batch.num_drafts.copy()
        if masks.g_idx.size and masks.dm is not None:
            acceptable[masks.dm.request] = masks.dm.acceptable
        beyond = n_acc > acceptable
        if np.any(beyond):
            br = int(np.argmax(beyond))
            self._fail(
                t,
                f"verification accepted {int(n_acc[br])} drafts of request {int(rid[br])} "
                f"({d.tokens[br, : batch.num_drafts[br]].tolist()}) but its grammar accepts {int(acceptable[br])}",
            )
            n_acc = np.minimum(n_acc, acceptable)
        final_row = budget.cu_np[:-1] + n_acc
        final_tok = tgt[final_row].copy()
        s_req = np.nonzero(sampled)[0]
        if s_req.size:
            rows_s = torch.from_numpy(final_row[s_req])
            probs = torch.softmax(logits[rows_s].double(), dim=1)
            rejected = n_acc[s_req] < cap[s_req]
            if np.any(rejected):
                rj = np.nonzero(rejected)[0]
                conc_t = torch.from_numpy(d.conc[s_req[rj]])[:, None]
                resid = probs[rj] - (1.0 - conc_t) / V
                bel = torch.from_numpy(d.belief[s_req[rj], n_acc[s_req[rj]]])
                resid[torch.arange(rj.size), bel] -= conc_t[:, 0]
                resid = resid.clamp_min(0.0)
                good = resid.sum(dim=1) > 0
                probs[torch.from_numpy(rj[good.numpy()])] = resid[good]
            cdf = torch.cumsum(probs, dim=1)
            u_s = uniform(cfg.seed, Streams.SAMPLE, rid[s_req], batch.length[s_req] + n_acc[s_req])
            target_mass = torch.from_numpy(u_s)[:, None] * cdf[:, -1:]
            pick = torch.searchsorted(cdf, target_mass, right=True)[:, 0].clamp_max(V - 1)
            final_tok[s_req] = pick.numpy()
        return n_acc, final_tok

    def _commit(
        self, batch: _Batch, budget: _Budget, rows: _Rows, n_acc: I64, final_tok: I64
    ) -> tuple[int, list[tuple[int, bool]]]:
        """Stage 7a: emit, check against the mask rows, commit to the matchers, tell the scheduler.

        Returns the tokens emitted and the finished requests as ``(batch row, stopped)``.
        """
        d = batch.drafts
        finished: list[tuple[int, bool]] = []
        emitted_total = 0
        for r, a in enumerate(batch.act):
            toks = [int(x) for x in d.tokens[r, : n_acc[r]]] + [int(final_tok[r])]
            if self.eos in toks:
                toks = toks[: toks.index(self.eos) + 1]
            toks = toks[: max(0, a.prep.max_tokens - len(a.output))]
            mask_rows = rows.g_start[rows.g_of[r]] + np.arange(len(toks)) if a.matcher is not None else None
            done, stopped = self._emit(batch, a, toks, mask_rows, rows.bm_np)
            emitted_total += len(toks)
            if done:
                finished.append((r, stopped))

        decode = ~batch.prefill
        rid, cap = batch.rid, budget.cap
        o0 = time.perf_counter()
        fin_ids = rid[[r for r, _ in finished]] if finished else np.zeros(0, dtype=np.int64)
        self.sched.observe(
            StepOutcome(req_ids=rid[decode], verified=cap[decode], accepted=n_acc[decode], finished=fin_ids)
        )
        self.hist.record(batch.slots, budget.live if self.K else torch.zeros(len(batch.act), 1))
        batch.host_s += time.perf_counter() - o0
        return emitted_total, finished

    def _retire(self, batch: _Step, finished: list[tuple[int, bool]]) -> None:
        """Stage 7b: validate the finished outputs and free their slots."""
        res = self.result
        for r, stopped in finished:
            a = batch.act[r]
            verdict = self._finish(a, stopped)
            res.finished_tokens += len(a.output)
            if verdict == "valid":
                res.valid += 1
            elif verdict == "cut_off":
                res.cut_off += 1
            else:
                res.invalid += 1
                if len(res.invalid_samples) < 5:
                    res.invalid_samples.append(f"{a.prep.spec.name}: {self.work.tok.decode(a.output)[:200]!r}")
            self.free_slots.append(a.slot)
        done = {r for r, _ in finished}
        self.active = [a for r, a in enumerate(batch.act) if r not in done]

    def _account(
        self,
        batch: _Batch,
        masks: _Masks,
        budget: _Budget,
        rows: _Rows,
        n_acc: I64,
        emitted: int,
        finished: int,
    ) -> None:
        """Simulated time, counters and the ``step_end`` hook."""
        decode = ~batch.prefill
        self._record(
            batch,
            budget.b,
            budget.regime,
            int(budget.view.cap),
            accepted=int(n_acc[decode].sum()),
            emitted=emitted,
            finished=finished,
            grammar_requests=int(masks.g_idx.size),
            mask_rows=masks.num_rows,
            logits_rows=int(budget.cu_np[-1]),
            apply_s=rows.apply_s,
        )

    def _record(
        self,
        batch: _Step,
        b: int,
        regime: str,
        cap_max: int,
        *,
        accepted: int,
        emitted: int,
        finished: int,
        grammar_requests: int,
        mask_rows: int,
        logits_rows: int,
        apply_s: float,
    ) -> None:
        """Add one step to the result (simulated time, counters) and tell the ``step_end`` hook."""
        res, total = self.result, batch.layout.total_drafts
        decode = ~batch.prefill
        step_ms = self._forward_ms(batch, b)
        res.steps += 1
        res.tokens += emitted
        res.sim_ms += step_ms
        serial = 1e3 * batch.mask_s + step_ms
        res.forward_ms += step_ms
        res.mask_ms += 1e3 * batch.mask_s
        res.serial_ms += serial
        res.overlap_ms += serial if batch.ready_s is None else 1e3 * batch.ready_s
        res.bound_ms += max(step_ms, 1e3 * batch.mask_s)
        res.regimes[regime] += 1
        res.zero_trimmed += int(b == 0 and total > 0)
        res.verified += b
        res.accepted += accepted
        res.verify_events += int(decode.sum())
        res.host_s += batch.host_s
        res.apply_s += apply_s
        res.budgets.append(b)
        res.max_budgets.append(cap_max)
        self.registry.step_end(
            {
                "step": batch.t,
                "scheduler": self.name,
                "num_requests": len(batch.act),
                "num_grammar_requests": grammar_requests,
                "scheduled_drafts": total,
                "budget": b,
                "regime": regime,
                "mask_rows": mask_rows,
                "logits_rows": logits_rows,
                "emitted": emitted,
                "finished": finished,
                "sim_ms": step_ms,
                "host_us": batch.host_s * 1e6,
                "apply_us": apply_s * 1e6,
            }
        )

    def run(self) -> RunResult:
        """Run ``config.steps`` steps; the result also counts requests still in flight."""
        for t in range(self.cfg.steps):
            self.step(t)
            if self.on_step is not None:
                self.on_step(t, self.result)
        self.result.in_flight = len(self.active)
        return self.result
