"""The comparison half of the GPTQModel interop check (quantkit's venv; GPTQModel itself is not needed)."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from quantkit.eval.interop.check_gptqmodel import (
    LogitCheck,
    RecordedLogits,
    Tolerance,
    WeightCheck,
    compare_logits,
    compare_weights,
    failures,
    run_gptqmodel,
)


def two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 4, bias=False))


LINEARS = {"0.weight", "1.weight"}


def test_weights_decoded_identically_pass():
    model = two_linears()
    decoded = {name: w.to(torch.float16) for name, w in model.state_dict().items()}
    assert compare_weights(model, decoded, LINEARS) == WeightCheck(linears=2, mismatched_linears=[], max_abs_diff=0.0)


def test_one_ulp_off_is_a_mismatch():
    model = two_linears()
    decoded = {name: w.to(torch.float16) for name, w in model.state_dict().items()}
    original = decoded["1.weight"][2, 3].clone()
    decoded["1.weight"][2, 3] = torch.nextafter(original, torch.tensor(math.inf, dtype=torch.float16))
    check = compare_weights(model, decoded, LINEARS)
    assert check.mismatched_linears == ["1.weight"]
    assert check.max_abs_diff == (decoded["1.weight"][2, 3].float() - original.float()).item()


def test_decoding_other_linears_or_shapes_is_refused():
    model = two_linears()
    decoded = {name: w.to(torch.float16) for name, w in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"packs 3: extra \[\], missing \['2.weight'\]"):
        compare_weights(model, decoded, LINEARS | {"2.weight"})
    decoded["0.weight"] = decoded["0.weight"].T
    with pytest.raises(ValueError, match=r"0.weight: GPTQModel shape \(16, 8\)"):
        compare_weights(model, decoded, LINEARS)


def test_identical_logits_give_zero_divergence():
    ids = torch.tensor([5, 1, 3, 2])
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    check = compare_logits(logits, logits.clone(), ids)
    assert (check.tokens, check.max_abs_logit_diff, check.mean_kl, check.top1_agreement) == (3, 0.0, 0.0, 1.0)


def test_kl_of_a_known_pair():
    # p = (1/2, 1/2) against q = (3/4, 1/4): KL(p||q) = ln(4/3) / 2 at each of the 2 scored positions.
    ids = torch.tensor([0, 1, 0])
    reference = torch.zeros(3, 2)
    logits = torch.tensor([[math.log(3.0), 0.0]] * 3)
    check = compare_logits(reference, logits, ids)
    assert check.tokens == 2
    assert check.mean_kl == pytest.approx(math.log(4 / 3) / 2, rel=1e-7)  # ln 3 held in float32
    assert check.max_abs_logit_diff == pytest.approx(math.log(3.0), rel=1e-6)


def test_recorded_logits_refuse_another_sequence():
    recorded = RecordedLogits(torch.tensor([1, 2, 3]), torch.zeros(3, 5))
    assert recorded(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 5)
    with pytest.raises(ValueError, match="other than the recorded"):
        recorded(torch.tensor([[1, 2, 4]]))


def logit_check(max_abs: float, kl: float, top1: float) -> LogitCheck:
    return LogitCheck(tokens=10, max_abs_logit_diff=max_abs, mean_kl=kl, max_kl=kl, top1_agreement=top1,
                      perplexity=20.0, reference_perplexity=20.0)


FLOOR = logit_check(1.0, 1e-3, 0.95)
TOLERANCE = Tolerance(max_abs_logit_ratio=2.0, mean_kl_ratio=2.0, top1_drop=0.03)
EXACT = WeightCheck(linears=2, mismatched_linears=[], max_abs_diff=0.0)


def test_failures_within_and_beyond_the_floor():
    assert failures(EXACT, logit_check(2.0, 2e-3, 0.92), FLOOR, TOLERANCE) == []
    problems = failures(EXACT, logit_check(2.5, 3e-3, 0.91), FLOOR, TOLERANCE)
    assert [p.split()[0] for p in problems] == ["max", "mean", "top-1"]


def test_nan_logits_and_mismatched_weights_fail():
    problems = failures(WeightCheck(2, ["1.weight"], 0.5), logit_check(math.nan, math.nan, 0.0), FLOOR, TOLERANCE)
    assert len(problems) == 4
    assert problems[0].startswith("1 linears decode differently")


def test_missing_interop_venv_is_named(tmp_path: Path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(FileNotFoundError, match="make interop"):
        run_gptqmodel(missing, tmp_path, tmp_path / "out.safetensors", "bfloat16", "gptq_torch")
