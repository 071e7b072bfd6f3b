"""Block reconstruction (quantkit.algorithms.reconstruct): the start reproduced bit for bit, codes on the grid,
the output error never above the start's, determinism, and the engine's use of it (zero iterations = the
solver's artifact, resume, refusals)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.algorithms.gptq import gptq_solve
from quantkit.algorithms.reconstruct import _Rounding, _rounding, reconstruct
from quantkit.artifact import REPORT_FILE
from quantkit.engine import quantize
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TYPES
from quantkit.quant import QuantConfig, QuantizedTensor, rtn_quantize
from quantkit.recipe import RecipeError, load_recipe
from quantkit.synthetic import write_tiny_checkpoint

from helpers import small_recipe

GRIDS = {
    "sym w4 g32": QuantConfig(4, 32, True),
    "asym w2 g32": QuantConfig(2, 32, False, min_zero=1),
    "asym w3 g-1": QuantConfig(3, -1, False),
    "ternary g32": QuantConfig(2, 32, False, ternary=True),
    "mlx affine w2 g32": QuantConfig(2, 32, False, float_bias=True, scale_dtype=torch.bfloat16),
}
SETTINGS = {"iterations": 100, "learning_rate": 0.005, "batch_size": 4, "scale_range": 0.25, "optimizer": "sign-sgd",
            "eval_every": 10, "seed": 0, "fp_input_fraction": 0.0}
LOW_BITS = ("asym w2 g32", "ternary g32")  # where these settings find a better rounding on these weights


def _problem(seed: int = 0, n: int = 48, k: int = 96, tokens: int = 32):
    """Two linears in a row with a nonlinearity between them, correlated inputs, and the exact outputs."""
    gen = torch.Generator().manual_seed(seed)
    weights = {"a": torch.randn(k, k, generator=gen) / k ** 0.5, "b": torch.randn(n, k, generator=gen) / k ** 0.5}
    mixing = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    inputs = torch.randn(12, tokens, k, generator=gen) @ mixing

    def forward(linear_weights, batch):
        return torch.nn.functional.gelu(batch @ linear_weights["a"].T) @ linear_weights["b"].T

    with torch.no_grad():
        targets = forward(weights, inputs)
    return forward, weights, inputs, targets


def _gptq(weights, inputs, config):
    """GPTQ's records of both linears and the weights it rounded (its rounding points)."""
    records, points, x = {}, {}, inputs.reshape(-1, inputs.shape[-1])
    for name in ("a", "b"):
        hessian = 2 * x.T @ x / x.shape[0]
        solution = gptq_solve(weights[name], hessian, config, damp_percent=0.05)
        records[name], points[name] = solution.quantized, solution.rounding_point
        x = torch.nn.functional.gelu(x @ weights[name].T) if name == "a" else x
    return records, points


def _same(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    pairs = [(a.codes, b.codes), (a.scales, b.scales), (a.g_idx, b.g_idx)]
    pairs += [(x, y) for x, y in ((a.zeros, b.zeros), (a.biases, b.biases)) if x is not None or y is not None]
    return all(x is not None and y is not None and torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("grid", GRIDS)
def test_the_start_is_reproduced_bit_for_bit(grid):
    """At zero offsets and the start's scales, the stored record is the solver's: round-to-nearest's from
    the weights, GPTQ's from its rounding points, and GPTQ's from the unquantized weights too (through the
    integer shift: GPTQ's codes are not round-to-nearest's)."""
    _, weights, inputs, _ = _problem()
    config = GRIDS[grid]
    records, points = _gptq(weights, inputs, config)
    assert not torch.equal(records["a"].codes, rtn_quantize(weights["a"], config).codes)
    for point, start in ((weights["a"], rtn_quantize(weights["a"], config)), (points["a"], records["a"]),
                         (weights["a"], records["a"])):
        assert _same(_Rounding(point, start, 0.25).record(), start)
        assert torch.equal(_Rounding(point, start, 0.25).fake().detach(), start.dequantize())


def test_act_order_records_are_reproduced():
    """A non-trivial g_idx (GPTQ's act-order) maps every column to its own group's scale."""
    _, weights, inputs, _ = _problem()
    x = inputs.reshape(-1, inputs.shape[-1])
    solution = gptq_solve(weights["a"], 2 * x.T @ x / x.shape[0], QuantConfig(3, 32, False), desc_act=True)
    start = solution.quantized
    assert not torch.equal(start.g_idx, start.g_idx.sort().values)
    assert _same(_Rounding(solution.rounding_point, start, 0.25).record(), start)


@pytest.mark.parametrize("grid", GRIDS)
def test_error_never_ends_above_the_start_and_codes_stay_on_the_grid(grid):
    forward, weights, inputs, targets = _problem()
    config = GRIDS[grid]
    start, points = _gptq(weights, inputs, config)
    result = reconstruct(forward, points, start, inputs, targets, SETTINGS, eval_batch_size=5, seed=1)
    measured = [error for _, error in result.errors]
    assert len(measured) == 1 + SETTINGS["iterations"] // SETTINGS["eval_every"]
    assert result.error == min(measured) <= result.start_error == measured[0]
    if grid in LOW_BITS:  # on these weights the training finds a better rounding: a tenth less output error
        assert result.error < 0.9 * result.start_error, measured
    for name, record in result.records.items():
        assert record.config == config and record.codes.dtype == torch.uint8 and int(record.codes.max()) <= config.maxq
        assert record.scales.dtype == config.scale_dtype
        ratio = record.scales.float() / start[name].scales.float()
        assert ratio.min() >= 0.75 - 1e-2 and ratio.max() <= 1.25 + 1e-2  # scale_range, up to the stored rounding
        if record.zeros is not None:
            assert torch.equal(record.zeros, start[name].zeros)  # zero points stay fixed
    # the recorded error is the stored records' own
    with torch.no_grad():
        out = forward({n: r.dequantize() for n, r in result.records.items()}, inputs)
    assert float((out - targets).square().mean()) == pytest.approx(result.error, rel=1e-5)


def test_same_seed_same_records_and_zero_iterations_keep_the_start():
    forward, weights, inputs, targets = _problem(seed=3)
    start, points = _gptq(weights, inputs, GRIDS["asym w2 g32"])
    first, second = (reconstruct(forward, points, start, inputs, targets, SETTINGS, eval_batch_size=4, seed=7)
                     for _ in range(2))
    assert all(_same(first.records[n], second.records[n]) for n in start)
    kept = reconstruct(forward, points, start, inputs, targets, {**SETTINGS, "iterations": 0}, eval_batch_size=4,
                       seed=7)
    assert all(kept.records[n] is start[n] for n in start) and kept.best_step == 0


def test_a_start_that_cannot_be_improved_is_kept():
    """With a step so large that every iterate is worse than GPTQ's start, the start is what comes back."""
    forward, weights, inputs, targets = _problem(seed=4)
    start, points = _gptq(weights, inputs, GRIDS["sym w4 g32"])
    wild = {**SETTINGS, "learning_rate": 0.5, "iterations": 4, "eval_every": 1, "scale_range": 0.9}
    result = reconstruct(forward, points, start, inputs, targets, wild, eval_batch_size=4, seed=0)
    assert all(error > result.start_error for _, error in result.errors[1:])
    assert result.best_step == 0 and all(result.records[n] is start[n] for n in start)


def test_fp_inputs_are_fed_to_the_chosen_share_of_sequences_and_never_move_the_order():
    """The share of sequences fed the unquantized model's inputs follows ``fp_input_fraction`` and its own
    random stream: with inputs equal to the quantized model's, any fraction trains exactly as none."""
    forward, weights, inputs, targets = _problem(seed=5)
    start, points = _gptq(weights, inputs, GRIDS["asym w2 g32"])
    fp_inputs = inputs + 10.0  # far from every quantized input: each batch row tells where it came from
    fed: list[bool] = []

    def watched(linear_weights, batch):
        if torch.is_grad_enabled():  # a training step (the measurements run without gradients)
            fed.extend(bool(row.mean() > 5) for row in batch)
        return forward(linear_weights, batch)

    settings = {**SETTINGS, "iterations": 200, "fp_input_fraction": 0.25}
    reconstruct(watched, points, start, inputs, targets, settings, eval_batch_size=4, seed=2, fp_inputs=fp_inputs)
    assert len(fed) == 200 * SETTINGS["batch_size"] and 0.2 < sum(fed) / len(fed) < 0.3
    plain = reconstruct(forward, points, start, inputs, targets, SETTINGS, eval_batch_size=4, seed=2)
    mixed = reconstruct(forward, points, start, inputs, targets, {**SETTINGS, "fp_input_fraction": 0.5},
                        eval_batch_size=4, seed=2, fp_inputs=inputs.clone())
    assert all(_same(plain.records[n], mixed.records[n]) for n in start) and plain.errors == mixed.errors
    with pytest.raises(ValueError, match="unquantized model's inputs"):
        reconstruct(forward, points, start, inputs, targets, settings, eval_batch_size=4, seed=2)


# --- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=2)


def _recipe(tmp_path, **reconstruct):
    base = {"quant": {"bits": 2, "group_size": 32, "sym": False}, "gptq": {"clip_search": False}}
    if reconstruct:
        base["reconstruct"] = {"batch_size": 2, "eval_every": 5, **reconstruct}
    return small_recipe("gptq-w4g128", tmp_path, **base)


def _artifact_bytes(directory: Path, skip=(REPORT_FILE,)) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name not in skip}


def _layer_errors(directory: Path) -> list[dict]:
    return json.loads((directory / "quantkit.json").read_text())["layer_errors"]


def test_zero_iterations_write_the_solvers_artifact(tiny, tmp_path):
    quantize(tiny, _recipe(tmp_path), tmp_path / "gptq", progress=False)
    quantize(tiny, _recipe(tmp_path, iterations=0), tmp_path / "recon0", progress=False)
    manifest = "quantkit.json"  # it records the recipe, which differs
    assert _artifact_bytes(tmp_path / "gptq", (REPORT_FILE, manifest)) == \
        _artifact_bytes(tmp_path / "recon0", (REPORT_FILE, manifest))
    assert all(entry["reconstruction"]["best_step"] == 0 for entry in _layer_errors(tmp_path / "recon0"))


def test_reconstruction_lowers_each_layers_error_and_resumes_to_the_same_bytes(tiny, tmp_path):
    recipe = _recipe(tmp_path, iterations=10)
    straight, resumed = tmp_path / "a", tmp_path / "b"
    quantize(tiny, recipe, straight, progress=False)
    for entry in _layer_errors(straight):
        summary = entry["reconstruction"]
        assert summary["error"] < 0.95 * summary["start_error"], summary
    quantize(tiny, recipe, resumed, progress=False, stop_after_layers=1)
    quantize(tiny, recipe, resumed, progress=False, resume=True)
    assert _artifact_bytes(straight) == _artifact_bytes(resumed)


def test_the_engine_feeds_the_unquantized_models_inputs(tiny, tmp_path):
    """AutoRound's other choice (every step on the unquantized model's inputs) runs through the engine and,
    measured on the quantized model's inputs, still ends no worse than GPTQ's start in any layer."""
    quantize(tiny, _recipe(tmp_path, iterations=10, fp_input_fraction=1.0), tmp_path / "fp", progress=False)
    for entry in _layer_errors(tmp_path / "fp"):
        summary = entry["reconstruction"]
        assert summary["error"] <= summary["start_error"], summary


@pytest.mark.parametrize("type_name", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q5_1"])
def test_gguf_block_types_start_at_their_blocks_and_keep_their_scales(type_name):
    """On a GGUF affine block type the start is the solver's blocks byte for byte, training moves codes only
    (every scale and minimum byte of the blocks stays), and the error never ends above the start's."""
    forward, weights, inputs, targets = _problem(k=256)
    tensor_type = TYPES[type_name]
    start = {name: GGUFTensor.quantize(weight, tensor_type) for name, weight in weights.items()}
    rounding = _rounding(weights["a"], start["a"], 0.25)
    assert torch.equal(rounding.record().data, start["a"].data)
    assert torch.equal(rounding.fake().detach(), start["a"].dequantize())
    result = reconstruct(forward, weights, start, inputs, targets, SETTINGS, eval_batch_size=5, seed=1)
    assert result.error <= result.start_error
    assert result.best_step > 0 and result.error < 0.97 * result.start_error, result.errors
    for name, record in result.records.items():
        codes = tensor_type.codec.codes(record.data.numpy().reshape(-1, tensor_type.block_bytes))
        kept = tensor_type.codec.with_codes(start[name].data.numpy().reshape(-1, tensor_type.block_bytes), codes)
        assert np.array_equal(kept.reshape(record.data.shape), record.data.numpy())  # only the codes moved


def test_gguf_codebook_types_are_refused():
    _, weights, _, _ = _problem(k=256)
    with pytest.raises(ValueError, match="cannot train iq4_nl"):
        _rounding(weights["a"], GGUFTensor.quantize(weights["a"], TYPES["iq4_nl"]), 0.25)


def test_a_gguf_file_type_reconstructs_end_to_end(tiny, tmp_path):
    """gguf-q3_k_m (Q3_K, Q4_K and Q5_K blocks) through the engine: every layer's error falls, and with zero
    iterations the file is the plain GPTQ one."""
    def recipe(iterations):
        return small_recipe("gguf-q3_k_m", tmp_path, reconstruct={"iterations": iterations, "batch_size": 2,
                                                                  "eval_every": 5})

    quantize(tiny, recipe(10), tmp_path / "recon", progress=False)
    for entry in _layer_errors(tmp_path / "recon"):
        assert entry["reconstruction"]["error"] < entry["reconstruction"]["start_error"], entry
    quantize(tiny, small_recipe("gguf-q3_k_m", tmp_path), tmp_path / "gptq", progress=False)
    quantize(tiny, recipe(0), tmp_path / "recon0", progress=False)
    manifest = "quantkit.json"
    assert _artifact_bytes(tmp_path / "gptq", (REPORT_FILE, manifest)) == \
        _artifact_bytes(tmp_path / "recon0", (REPORT_FILE, manifest))


@pytest.mark.parametrize(("recipe", "overrides", "message"), [
    ("gguf-iq3_m", {}, "writes iq3_s, iq4_nl, whose codes stand for codebook or lattice points"),
    ("fp8-w8a8", {}, "16-bit activations|solved on FP8"),
    ("int8-w8a8", {}, "16-bit activations"),
    ("gptq-w4g128", {"reconstruct.batch_size": 200}, "exceeds calibration.n_samples"),
    ("gptq-w4g128", {"reconstruct.iterations": -1}, r"in \[0, 100000\]"),
    ("gptq-w4g128", {"reconstruct.learning_rate": 0}, r"in \(0, 0.5\]"),
    ("gptq-w4g128", {"reconstruct.scale_range": 1.5}, r"in \[0, 1\)"),
    ("gptq-w4g128", {"reconstruct.fp_input_fraction": 1.5}, r"in \[0, 1\]"),
])
def test_bad_settings_and_untrainable_grids_are_refused(recipe, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe, {"reconstruct.iterations": 10, **overrides})
