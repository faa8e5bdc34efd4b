"""What the vLLM 0.32 and 0.33 structured-output replacements share.

The two releases differ in the mask-row layout only (ragged rows in 0.32,
fixed blocks in 0.33), so each release module (:mod:`maskplug_vllm.worker`
and :mod:`maskplug_vllm.scheduler` for 0.32, :mod:`maskplug_vllm.v0_33`)
says how its rows are counted, filled and mapped, and leaves the rest to
this module:

* :func:`apply_rows`: the scheduler's numpy bitmask moved to the logits'
  device and applied through a row mapping (both workers of both releases);
* :func:`make_apply_compacted`: the replacement of ``StructuredOutputsWorker.apply_grammar_bitmask``
  around the release's rows of one step;
* :func:`make_grammar_init`: the wrapper of ``StructuredOutputManager.grammar_init``
  that installs :class:`~maskplug_vllm.backend.MaskplugBackend`;
* :func:`make_grammar_bitmask`: the wrapper of ``StructuredOutputManager.grammar_bitmask``
  that binds the step's grammars, keeps vLLM's own loop for the steps
  maskplug's producer does not cover, sizes the bitmask, fills it and fails
  the requests whose grammars failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from maskplug import DraftMasks, apply_grammar_bitmask
from maskplug.engines.sdk import wraps
from maskplug.grammar.sdk import check_bitmask

from .backend import MaskplugBackend, bind_grammars, fail_requests, provider_for
from .host import StepRows

__all__ = [
    "CompactedRows",
    "FewResult",
    "FewRows",
    "FillRows",
    "RowsNeeded",
    "apply_rows",
    "bitmask_to",
    "checked_buffer",
    "make_apply_compacted",
    "make_grammar_bitmask",
    "make_grammar_init",
]

RowsNeeded = Callable[[Sequence[str], Mapping[str, Sequence[int]], int], int]
"""``(grammar_req_ids, spec_tokens, stride) -> rows the step needs``; ``stride`` is ``num_speculative_tokens + 1``."""

FillRows = Callable[[torch.Tensor, list[Any], list[str], dict[str, list[int]], int], tuple[int, DraftMasks]]
"""``(bitmask, grammars, grammar_req_ids, spec_tokens, stride) -> (rows written, draft masks)``."""

FewRows = Callable[[Any, Mapping[str, Any], list[str], dict[str, list[int]], bool], "FewResult | None"]
"""``(manager, requests, grammar_req_ids, spec_tokens, find_forced) -> (rows written, draft masks, grammars, rows
as numpy)``, or ``None`` for a step the release's general path must produce; with ``find_forced`` false the draft
masks' ``forced`` may be all False (see :func:`maskplug.engines.sdk.fill_windows_serially`)."""

FewResult = tuple[int, DraftMasks, list[Any], np.ndarray]

CompactedRows = Callable[[Any, Any, list[str], np.ndarray], StepRows]
"""``(worker, input_batch, grammar_req_ids, grammar_bitmask) -> the step's rows`` (checked against the bitmask)."""

ApplyCompacted = Callable[[Any, torch.Tensor, Any, list[str], np.ndarray], None]

#: The manager's mask-row buffer once checked: the tensor, its version counter when checked, its rows,
#: its words per row and its numpy view.
_buffer: tuple[torch.Tensor, int, int, int, np.ndarray] | None = None


def _known(bitmask: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int, np.ndarray] | None:
    """The checked record of ``bitmask`` when it is that buffer, unchanged in place since."""
    b = _buffer
    if b is not None and b[0] is bitmask and bitmask._version == b[1]:
        return b
    return None


def checked_buffer(bitmask: torch.Tensor, vocab: Any) -> tuple[int, np.ndarray] | None:
    """The rows and numpy view of the manager's buffer when it suits ``vocab``'s rows, else ``None``.

    The buffer must pass :func:`~maskplug.grammar.sdk.check_bitmask` for
    ``vocab`` (a contiguous CPU int32 tensor exactly ``vocab.mask_words``
    wide). vLLM's manager keeps one buffer for the engine's life, so the
    check and the view are made once per buffer and then found by identity
    and torch's version counter, which every in-place operation moves
    (``resize_``, ``set_``, ``as_strided_``, ``fill_``, ...; not the
    producer's own writes through the view or xgrammar's): between forward
    passes each tensor attribute read or numpy view costs several
    microseconds. Nothing in vLLM swaps the buffer's memory by assigning
    ``.data``, the one change the counter does not see.
    """
    global _buffer
    b = _buffer
    # _known's test, written out: this runs every step.
    if b is not None and b[0] is bitmask and bitmask._version == b[1] and b[3] == vocab.mask_words:
        return b[2], b[4]
    try:
        check_bitmask(bitmask, 0, vocab)
    except Exception:
        _buffer = None
        return None
    view = bitmask.numpy()
    _buffer = (bitmask, bitmask._version, int(bitmask.shape[0]), int(vocab.mask_words), view)
    return _buffer[2], view


def _numpy_rows(bitmask: torch.Tensor, total: int) -> np.ndarray:
    """The first ``total`` rows of the manager's buffer as numpy (through the checked buffer's view when it is that)."""
    b = _known(bitmask)
    return (bitmask.numpy() if b is None else b[4])[:total]


def bitmask_to(device: torch.device, bitmask: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor | np.ndarray:
    """The scheduler's numpy bitmask ready for :func:`maskplug.apply_grammar_bitmask` on ``device``.

    On the CPU, the contiguous int32 numpy array itself (the apply masks from
    numpy there: a tensor around it would only be turned back into an
    array); elsewhere an int32 tensor on ``device``, copied asynchronously on
    CUDA. ``out``, a device buffer at least as tall and exactly as wide,
    receives the copy when given (the worker's own bitmask buffer);
    otherwise a new device tensor does.
    """
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    if device.type == "cpu":
        return words
    host = torch.from_numpy(words).pin_memory()
    if out is not None and out.shape[0] >= host.shape[0] and out.shape[1] == host.shape[1]:
        return out[: host.shape[0]].copy_(host, non_blocking=True)
    return host.to(device, non_blocking=True)


def apply_rows(
    logits: torch.Tensor, bitmask_np: np.ndarray, mapping: Any, cu: Any, out: torch.Tensor | None = None
) -> None:
    """Mask ``logits`` in place with the scheduler's rows through ``mapping`` (rows past the mask masked as tail).

    ``cu`` are the live logits-row offsets per request (host or device);
    ``out`` is the device buffer for the bitmask copy (see :func:`bitmask_to`).
    """
    bitmask = bitmask_to(logits.device, bitmask_np, out)
    # vLLM sizes both from the model's vocabulary; take the common part so a
    # narrower mask never reads past its words (the rest is masked as tail).
    vocab_size = int(min(logits.shape[1], 32 * bitmask.shape[1]))
    apply_grammar_bitmask(logits, bitmask, mapping, cu, vocab_size=vocab_size, tail="mask")


def make_apply_compacted(step_rows_of: CompactedRows) -> ApplyCompacted:
    """A drop-in for ``StructuredOutputsWorker.apply_grammar_bitmask(self, logits, input_batch, ids, bitmask)``.

    ``step_rows_of`` maps the bitmask's rows in the release's layout, from
    the drafts as scheduled. The device ``cu_num_logits`` (compacted by
    adaptive verification) only decides which rows are live: it is read on
    the device, never copied back, so every budget regime is handled and the
    host never waits. The bitmask goes to the device through the worker's own
    buffer when it has one.
    """

    def apply_compacted(
        worker: Any, logits: torch.Tensor, input_batch: Any, grammar_req_ids: list[str], grammar_bitmask: np.ndarray
    ) -> None:
        if not grammar_req_ids:
            return
        rows = step_rows_of(worker, input_batch, grammar_req_ids, grammar_bitmask)
        cu = input_batch.cu_num_logits[: rows.num_batch + 1]
        apply_rows(logits, grammar_bitmask, rows.mapping, cu, getattr(worker, "grammar_bitmask", None))

    apply_compacted.__doc__ = make_apply_compacted.__doc__
    return apply_compacted


def make_grammar_init(
    orig: Callable[..., Any], *, record_backend_name: bool, ready_when_compiled: bool = False
) -> Callable[..., Any]:
    """Wrap ``StructuredOutputManager.grammar_init`` so the engine's backend is maskplug's.

    With ``record_backend_name`` the wrapper also sets the manager's
    ``backend_name`` to the backend vLLM resolved, as vLLM 0.33 does when it
    creates the backend itself (its one-backend-per-engine check reads it).

    With ``ready_when_compiled`` a request whose grammar was compiled before
    (the same spec and stop set, in the provider's cache) gets its grammar
    at once (:meth:`~maskplug_vllm.backend.MaskplugBackend.compiled_grammar`)
    where vLLM would hand the compile to its thread pool: the request can be
    scheduled in the same step. Through the pool even a cached grammar is
    ready only once that thread gets the GIL from the engine loop, which
    spins on steps that schedule nothing meanwhile (about 5 ms per request
    at one request in flight, ``benchmarks/RESULTS.md``). Everything else,
    and a grammar not compiled yet, goes vLLM's way.
    """

    @wraps(orig)
    def grammar_init(self: Any, request: Any) -> None:
        sor = request.structured_output_request
        if sor is not None and self.backend is None:
            structured = request.sampling_params.structured_outputs
            vllm_backend = structured._backend
            self.backend = MaskplugBackend(
                self.vllm_config,
                tokenizer=self.tokenizer,
                vocab_size=self.vllm_config.model_config.get_vocab_size(),
                provider_name=provider_for(vllm_backend, was_auto=structured._backend_was_auto),
            )
            if record_backend_name:
                self.backend_name = vllm_backend
        if ready_when_compiled and sor is not None and isinstance(self.backend, MaskplugBackend):
            grammar = _compiled_grammar(self.backend, request)
            if grammar is not None:
                sor.grammar = grammar
                return
        orig(self, request)

    return grammar_init


def _compiled_grammar(backend: MaskplugBackend, request: Any) -> Any:
    """The request's grammar from ``backend``'s compile cache, or ``None`` (not compiled yet, or not readable here).

    What vLLM's own compile task passes (the request's spec key and stop
    ids); any failure leaves the request to vLLM's task, which reports it.
    """
    try:
        request_type, grammar_spec = request.structured_output_request.structured_output_key
        params = request.sampling_params
        stop = params.all_stop_token_ids if params is not None else None
        return backend.compiled_grammar(request_type, grammar_spec, stop_token_ids=stop)
    except Exception:
        return None


def make_grammar_bitmask(
    orig: Callable[..., Any],
    *,
    rows: RowsNeeded,
    fill: FillRows,
    record: str | None = None,
    few: FewRows | None = None,
    few_below: int = 0,
    wanted: str | None = None,
) -> Callable[..., Any]:
    """Wrap ``StructuredOutputManager.grammar_bitmask`` so rows come from :func:`maskplug.fill_draft_masks`.

    ``rows`` says how many bitmask rows the step needs and ``fill`` writes
    them (the release's layout); a manager buffer too small for the step is
    replaced by one for a full batch of full windows (``max_num_seqs ×
    stride`` rows, or the step's need if more). ``record``, when given, names the manager
    attribute that gets the step's ``(grammar_req_ids, DraftMasks)``, or
    ``None`` when vLLM's own loop produced the rows. ``few``, when given,
    serves a step of fewer than ``few_below`` grammar requests first
    (binding the grammars, checking the buffer and the drafts itself, on
    the manager's buffer as it is); where it returns ``None`` the step goes
    the general way. ``wanted``, when given, names the manager attribute
    that says whether anyone reads the step's draft masks (read on every
    step, false when absent): when not, ``record`` gets ``None`` and
    ``few`` looks in the rows only for one that allows nothing (not for
    the single-token ones a budget reads).
    """

    @wraps(orig)
    def grammar_bitmask(
        self: Any,
        requests: dict[str, Any],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> Any:
        backend = self.backend
        if not structured_output_request_ids or not isinstance(backend, MaskplugBackend):
            if record is not None:
                setattr(self, record, None)
            return orig(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        ids = list(structured_output_request_ids)
        # A reasoning parser that gates the grammar inside the window (and the
        # masked reasoning-end tokens that come with it), and diffusion models
        # (no bonus row), stay on vLLM's own loop over the same grammars.
        own_loop = (self.reasoner_cls is not None and not self.enable_in_reasoning) or (
            self.vllm_config.model_config.is_diffusion
        )
        keep = record is not None and (wanted is None or getattr(self, wanted, False))
        if few is not None and not own_loop and len(ids) < few_below:
            # At a few requests each Python call between forward passes counts: one pass binds,
            # checks and walks (the usual step at low concurrency).
            done = few(self, requests, ids, scheduled_spec_decode_tokens, keep)
            if done is not None:
                total, dm, grammars, view = done
                if dm.failed:
                    fail_requests(grammars, ids, dm.failed)
                if record is not None:
                    setattr(self, record, (ids, dm) if keep else None)
                return view[:total]
        if record is not None:
            setattr(self, record, None)  # until this step's rows are made
        # Each grammar learns its request (its id and stop_reason when it fails), also for vLLM's own loop.
        grammars = bind_grammars(requests, ids)
        if own_loop:
            return orig(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        stride = int(self.vllm_config.num_speculative_tokens) + 1
        need = rows(ids, scheduled_spec_decode_tokens, stride)
        buf = self._grammar_bitmask
        b = _known(buf)
        # The checked buffer's row count is known: no shape read on the usual step.
        have = b[2] if b is not None else (-1 if buf is None else int(buf.shape[0]))
        if have < need:
            max_rows = self.vllm_config.scheduler_config.max_num_seqs * stride
            self._grammar_bitmask = backend.allocate_token_bitmask(max(max_rows, need))
        total, dm = fill(self._grammar_bitmask, grammars, ids, scheduled_spec_decode_tokens, stride)
        if dm.failed:
            # Only those requests fail: stop-only rows now, FinishReason.ERROR when their tokens come back.
            fail_requests(grammars, ids, dm.failed)
        if keep and record is not None:
            setattr(self, record, (ids, dm))
        # numpy, like vLLM: it serialises far faster than a tensor on the way to the workers.
        return _numpy_rows(self._grammar_bitmask, total)

    return grammar_bitmask
