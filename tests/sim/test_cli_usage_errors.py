"""Out-of-range and malformed command-line values are usage errors: exit 2, one line naming the option."""

from __future__ import annotations

import pytest
import torch

from maskplug.cli import main

CASES = [
    (["selftest", "--cases", "-1"], "--cases", "-1"),
    (["selftest", "--cases", "0"], "--cases", "0"),
    (["selftest", "--seed", "-3"], "--seed", "-3"),
    (["demo", "--max-batch-tokens", "-5"], "--max-batch-tokens", "-5"),
    (["demo", "--squeeze-every", "-1"], "--squeeze-every", "-1"),
    (["demo", "--seed", "-1"], "--seed", "-1"),
    (["demo", "--seed", str(2**32)], "--seed", str(2**32)),
    (["demo", "--steps", "0"], "--steps", "0"),
    (["demo", "--steps", "ten"], "--steps", "'ten'"),
    (["demo", "--concurrency", "-2"], "--concurrency", "-2"),
    (["demo", "--drafts", "-1"], "--drafts", "-1"),
    (["demo", "--tree-branch", "0"], "--tree-branch", "0"),
    (["demo", "--tree-width", "1.5"], "--tree-width", "'1.5'"),
    (["demo", "--sweep-steps", "-4"], "--sweep-steps", "-4"),
    (["backends", "--device", "bogus"], "--device", "'bogus'"),
    (["backends", "--device", "cuda:x"], "--device", "'cuda:x'"),
]


@pytest.mark.parametrize(("argv", "option", "shown"), CASES)
def test_bad_values_exit_2_with_one_line(
    argv: list[str], option: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"maskplug {argv[0]}: error: argument {option}")
    assert shown in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_backends_for_a_missing_cuda_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_values_in_range_still_parse() -> None:
    from maskplug.cli import build_parser

    args = build_parser().parse_args(["demo", "--seed", "0", "--max-batch-tokens", "0", "--drafts", "0"])
    assert (args.seed, args.max_batch_tokens, args.drafts) == (0, 0, 0)
    args = build_parser().parse_args(["selftest", "--cases", "1", "--seed", str(2**32 - 1)])
    assert (args.cases, args.seed) == (1, 2**32 - 1)
