"""``maskplug.kernels.sdk``: the pieces every kernel backend shares."""

from __future__ import annotations

import threading

import pytest
import torch

import maskplug
from maskplug.kernels import sdk
from maskplug.kernels.torch_backend import TorchBackend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ninf_bits_are_the_bits_of_minus_infinity(dtype: torch.dtype) -> None:
    ninf = torch.tensor([float("-inf")], dtype=dtype)
    assert sdk.int_view(ninf).item() == sdk.ninf_bits(dtype) == sdk.NINF_BITS[dtype]
    width = 8 * ninf.element_size()
    assert sdk.ninf_bits(dtype, unsigned=True) == sdk.ninf_bits(dtype) + (1 << width)
    assert sdk.INT_VIEW[dtype].itemsize == ninf.element_size()


def test_int_view_shares_storage_and_strides() -> None:
    x = torch.randn(4, 10)[:, 2:7]
    xi = sdk.int_view(x)
    assert xi.dtype == torch.int32 and xi.stride() == x.stride() and xi.data_ptr() == x.data_ptr()
    xi[1, 1] = sdk.ninf_bits(torch.float32)
    assert x[1, 1].item() == float("-inf")


def test_launch_extent_reads_shapes_and_strides_only() -> None:
    logits = torch.zeros(6, 100)[::2]  # 3 rows, row stride 200
    bitmask = torch.zeros(5, 4, dtype=torch.int32)
    assert sdk.launch_extent(logits, bitmask, 97, False) == sdk.Extent(rows=5, width=100, limit=97, row_stride=200)
    assert sdk.launch_extent(logits, bitmask, 97, True) == sdk.Extent(rows=5, width=100, limit=100, row_stride=200)
    # A one-row slice reports its parent's stride; the extent gives the width instead.
    one = torch.zeros(4, 100)[:, :64][1:2]
    assert one.stride(0) == 100
    assert sdk.launch_extent(one, bitmask, 64, False) == sdk.Extent(rows=5, width=64, limit=64, row_stride=64)


@pytest.mark.parametrize(
    ("logit_rows", "mask_rows", "vocab_size", "mask_tail"),
    [(3, 0, 97, False), (0, 5, 97, True), (3, 5, 0, False)],
)
def test_launch_extent_is_none_when_nothing_is_to_mask(
    logit_rows: int, mask_rows: int, vocab_size: int, mask_tail: bool
) -> None:
    logits = torch.zeros(logit_rows, 100)
    bitmask = torch.zeros(mask_rows, 4, dtype=torch.int32)
    assert sdk.launch_extent(logits, bitmask, vocab_size, mask_tail) is None


def test_import_reason_names_the_failure() -> None:
    assert sdk.import_reason("math", "json") is None
    why = sdk.import_reason("math", "maskplug_no_such_module_here")
    assert why is not None and why.startswith("ModuleNotFoundError: ") and "maskplug_no_such_module_here" in why


class _Counting(sdk.BackendBase):
    """A backend that runs on CPU only and counts its probes and launches."""

    name = "counting"
    priority = -1

    def __init__(self) -> None:
        super().__init__()
        self.probes: list[torch.device] = []
        self.launches = 0

    def probe(self, device: torch.device) -> str | None:
        self.probes.append(device)
        return None if device.type == "cpu" else f"runs on CPU only, got {device.type}"

    def launcher(self, device: torch.device) -> sdk.Launcher:
        def launch(*args: object) -> None:
            self.launches += 1

        return launch


def _normalised(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = torch.device(device)
    logits = torch.randn(2, 64, device=dev)
    bitmask = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    rows = torch.arange(2, dtype=torch.int32, device=dev)
    return logits, bitmask, rows, torch.zeros(2, dtype=torch.int32, device=dev), torch.arange(3, dtype=torch.int32)


def test_backend_base_probes_once_per_device_across_threads() -> None:
    be = _Counting()
    assert isinstance(be, sdk.KernelBackend)
    results: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: results.append(be.unavailable_reason(torch.device("cpu")))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [None] * 8
    assert be.unavailable_reason(torch.device("meta")) == "runs on CPU only, got meta"
    assert be.unavailable_reason(torch.device("meta")) == "runs on CPU only, got meta"
    assert [d.type for d in be.probes] == ["cpu", "meta"]


def test_backend_base_apply_refuses_an_unavailable_device_and_writes_nothing() -> None:
    be = _Counting()
    logits, bitmask, req, pos, cu = _normalised("meta")
    with pytest.raises(maskplug.BackendUnavailable, match=r"^backend: 'counting' cannot run on meta: runs on CPU only"):
        be.apply(logits, bitmask, req, pos, cu, 64, True)
    assert be.launches == 0
    be.apply(*_normalised("cpu"), 64, True)
    assert be.launches == 1


def test_torch_backend_uses_the_base() -> None:
    be = TorchBackend()
    assert be.unavailable_reason(torch.device("meta")) == "untested device type 'meta'"
    logits = torch.zeros(1, 32)
    bitmask = torch.full((1, 1), 0b101, dtype=torch.int32)  # tokens 0 and 2 allowed
    zero = torch.zeros(1, dtype=torch.int32)
    be.apply(logits, bitmask, zero, zero, torch.tensor([0, 1], dtype=torch.int32), 32, True)
    want = torch.full((1, 32), float("-inf"))
    want[0, [0, 2]] = 0.0
    assert torch.equal(logits, want)


def test_define_apply_op_runs_the_launcher_and_refuses_other_devices() -> None:
    seen: list[tuple[int, bool]] = []

    def launch(logits: torch.Tensor, *tensors: torch.Tensor | int | bool) -> None:
        *_, vocab_size, mask_tail = tensors
        seen.append((int(vocab_size), bool(mask_tail)))
        logits.fill_(float("-inf"))

    sdk.define_apply_op("maskplug_sdk_test_any", launch)
    sdk.define_apply_op("maskplug_sdk_test_cuda", launch, cuda_only=True)
    logits, bitmask, req, pos, cu = _normalised()
    torch.ops.maskplug_sdk_test_any.apply_bitmask(logits, bitmask, req, pos, cu, 64, False)
    assert seen == [(64, False)] and bool(torch.isneginf(logits).all())
    fresh = torch.randn(2, 64)
    before = fresh.clone()
    with pytest.raises(
        maskplug.BackendUnavailable, match=r"^logits: maskplug_sdk_test_cuda::apply_bitmask runs on CUDA"
    ):
        torch.ops.maskplug_sdk_test_cuda.apply_bitmask(fresh, bitmask, req, pos, cu, 64, True)
    assert len(seen) == 1 and torch.equal(fresh, before)


class _Outside(sdk.BackendBase):
    """A backend written against the seven-argument contract only, as a distribution outside maskplug would be."""

    name = "outside"
    priority = -1

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def probe(self, device: torch.device) -> str | None:
        return None

    def mask(self, logits: torch.Tensor, row: int, vocab_size: int, mask_tail: bool) -> None:
        self.calls.append((vocab_size, mask_tail))
        logits[row, vocab_size:] = float("-inf")

    def launcher(self, device: torch.device) -> sdk.Launcher:
        # Seven named parameters, called positionally, as the contract says.
        return lambda logits, bitmask, request, position, cu_logits, vocab_size, mask_tail: self.mask(
            logits, int(cu_logits[int(request[0])]) + int(position[0]), vocab_size, mask_tail
        )


def test_an_outside_seven_argument_launcher_runs_through_the_base_and_a_custom_op() -> None:
    be = _Outside()
    assert isinstance(be, sdk.KernelBackend)
    logits, bitmask, req, pos, cu = _normalised()
    be.apply(logits, bitmask, req, pos, cu, 60, True)
    assert be.calls == [(60, True)]
    assert bool(torch.isneginf(logits[0, 60:]).all()) and not bool(torch.isneginf(logits[:, :60]).any())
    sdk.define_apply_op("maskplug_sdk_test_outside", be.launcher(torch.device("cpu")))
    fresh = torch.zeros(2, 64)
    torch.ops.maskplug_sdk_test_outside.apply_bitmask(fresh, bitmask, req, pos, cu, 32, False)
    assert be.calls[-1] == (32, False)
    assert bool(torch.isneginf(fresh[0, 32:]).all()) and not bool(torch.isneginf(fresh[1]).any())


def test_launcher_from_hands_the_seven_arguments_on_as_one_record() -> None:
    seen: list[sdk.LaunchArgs] = []

    def run(args: sdk.LaunchArgs) -> None:
        """Record the call."""
        seen.append(args)

    launch = sdk.launcher_from(run)
    assert (launch.__name__, launch.__module__, launch.__doc__) == ("run", __name__, "Record the call.")
    logits, bitmask, req, pos, cu = _normalised()
    launch(logits, bitmask, req, pos, cu, 64, False)
    (got,) = seen
    assert type(got) is sdk.LaunchArgs and got == (logits, bitmask, req, pos, cu, 64, False)
    assert got.logits is logits and got.cu_logits is cu and got.vocab_size == 64 and got.mask_tail is False
    assert sdk.LaunchArgs._fields == (
        "logits",
        "bitmask",
        "request",
        "position",
        "cu_logits",
        "vocab_size",
        "mask_tail",
    )
    with pytest.raises(TypeError):
        launch(logits, bitmask, req, pos, cu, 64)  # type: ignore[call-arg]  # one short: refused, never run
    assert len(seen) == 1


def test_the_torch_launchers_keep_the_seven_argument_form() -> None:
    logits = torch.zeros(1, 32)
    bitmask = torch.full((1, 1), 0b11, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    want = torch.full((1, 32), float("-inf"))
    want[0, :2] = 0.0
    for launch in (TorchBackend().launcher(torch.device("cpu")), TorchBackend._apply_device):
        out = logits.clone()
        launch(out, bitmask, zero, zero, cu, 32, True)
        assert torch.equal(out, want)
    sdk.define_apply_op("maskplug_sdk_test_torch_cpu", TorchBackend().launcher(torch.device("cpu")))
    out = logits.clone()
    torch.ops.maskplug_sdk_test_torch_cpu.apply_bitmask(out, bitmask, zero, zero, cu, 32, True)
    assert torch.equal(out, want)
