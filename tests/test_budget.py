"""Size budgets: the budget as users write it, the allocation against an exhaustive search, the sensitivity
estimate against measured KL, and a planned gguf-* artifact whose file meets the budget and runs in llama.cpp."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from quantkit.budget.allocate import Option, allocate, hull, reachable
from quantkit.budget.target import BudgetError, budget_from_options, parse_size


@pytest.mark.parametrize("text, size", [("4.5GB", 4_500_000_000), ("800MiB", 800 * 2**20), ("1024", 1024),
                                        ("0.5 gib", 2**29), ("12kb", 12_000)])
def test_sizes_parse_in_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4.5 gigs", "GB", "-3GB", "0MB", ""])
def test_a_size_that_does_not_parse_is_refused(text):
    with pytest.raises(BudgetError, match="size"):
        parse_size(text)


def test_one_budget_at_a_time():
    with pytest.raises(BudgetError, match="not both"):
        budget_from_options("1GB", 4.0)
    with pytest.raises(BudgetError, match="more than 0"):
        budget_from_options(None, -1.0)
    assert budget_from_options(None, None) is None


def test_hull_drops_dominated_and_concave_options():
    options = [Option("a", 10, 5.0), Option("b", 20, 6.0), Option("c", 20, 3.0), Option("d", 30, 2.9),
               Option("e", 40, 0.0)]
    # b loses more than a for more bytes; d lies above the line from c to e
    assert [o.name for o in hull(options)] == ["a", "c", "e"]


def _brute_force(options, budget):
    names = sorted(options)
    best = None
    for combo in itertools.product(*(options[n] for n in names)):
        if sum(o.bytes for o in combo) <= budget:
            loss = sum(o.loss for o in combo)
            best = loss if best is None else min(best, loss)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_within_one_upgrade_of_the_exhaustive_optimum(seed):
    """On random instances the allocation fits the budget, and its loss exceeds the exhaustive optimum by
    less than the largest single upgrade's saving (the Lagrangian bound); it is exact in most of them."""
    rng = np.random.default_rng(seed)
    options = {}
    for index in range(5):
        sizes = np.sort(rng.choice(np.arange(10, 200), 4, replace=False))
        losses = np.sort(rng.uniform(0, 1, 4))[::-1] * rng.uniform(0.1, 10)
        options[f"t{index}"] = [Option(f"o{j}", int(s), float(v)) for j, (s, v) in enumerate(zip(sizes, losses))]
    low, high = reachable(options)
    budget = int(rng.integers(low, high + 1))
    chosen = allocate(options, budget)
    assert sum(o.bytes for o in chosen.values()) <= budget
    best = _brute_force(options, budget)
    largest_step = max(a.loss - b.loss for opts in options.values() for a in opts for b in opts)
    assert sum(o.loss for o in chosen.values()) <= best + largest_step + 1e-12


def test_allocation_below_the_smallest_choice_is_refused():
    options = {"t": [Option("small", 10, 1.0), Option("big", 20, 0.0)]}
    with pytest.raises(BudgetError, match="smallest choice takes 10"):
        allocate(options, 9)
    assert allocate(options, 10)["t"].name == "small" and allocate(options, 25)["t"].name == "big"


def test_estimate_ranks_tensors_and_types_as_measured_kl(marlin_legal):
    """½ Σ Gᵢᵢ (ΔW H ΔWᵀ)ᵢᵢ against the KL each rounding alone causes on the same rows: measured, Spearman
    rank correlation over (linear, type) pairs 0.97 and every estimate within 2× of its measurement."""
    from quantkit.budget.formats import rounding
    from quantkit.budget.sensitivity import collect, estimated_kl
    from quantkit.gguf.types import TYPES
    from quantkit.loading import load_model

    model = load_model(marlin_legal).eval()
    ids = torch.randint(5, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    stats = collect(model, ids, seed=0)
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits.double(), -1)
    estimates, measured = [], []
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj",
                 "model.layers.1.mlp.up_proj"):
        module = model.get_submodule(name)
        original = module.weight.data.clone()
        for type_name in ("q8_0", "q5_k", "q4_0", "q3_k", "q2_k"):
            round_trip = rounding(TYPES[type_name])
            estimates.append(estimated_kl(original, [stats[name]], round_trip))
            module.weight.data = torch.from_numpy(round_trip(original.numpy(), stats[name].importance))
            with torch.no_grad():
                log_q = torch.log_softmax(model(ids).logits.double(), -1)
            measured.append(float((reference.exp() * (reference - log_q)).sum(-1).mean()))
            module.weight.data = original
    ranks = [np.argsort(np.argsort(values)) for values in (estimates, measured)]
    assert np.corrcoef(*ranks)[0, 1] > 0.9, (estimates, measured)
    ratios = np.array(estimates) / np.array(measured)
    assert (ratios > 0.5).all() and (ratios < 2).all(), ratios


def test_embedding_and_output_estimates_rank_as_measured_kl(marlin_legal):
    """The output matrix as one more linear and the input embedding as a linear over one-hot tokens
    (H = each token's share of the text): against the KL each unweighted rounding alone causes on the rows
    it was estimated on, every estimate within 25 % (measured: 2–9 %) and the types in the measured order."""
    from quantkit.budget.formats import rounding
    from quantkit.budget.sensitivity import EMBEDDING, OUTPUT, collect, estimated_kl
    from quantkit.gguf.types import TYPES
    from quantkit.loading import load_model

    model = load_model(marlin_legal).eval()
    ids = torch.randint(5, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    stats = collect(model, ids, seed=0)
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits.double(), -1)
    for name in (OUTPUT, EMBEDDING):
        module = model.get_submodule(name)
        original = module.weight.data.clone()
        estimates, measured = [], []
        for type_name in ("q8_0", "q5_0", "q4_0", "iq4_nl", "q2_k"):
            round_trip = rounding(TYPES[type_name], weighted=False)
            estimates.append(estimated_kl(original, [stats[name]], round_trip))
            module.weight.data = torch.from_numpy(round_trip(original.numpy(), None))
            with torch.no_grad():
                log_q = torch.log_softmax(model(ids).logits.double(), -1)
            measured.append(float((reference.exp() * (reference - log_q)).sum(-1).mean()))
            module.weight.data = original
        ratios = np.array(estimates) / np.array(measured)
        assert (ratios > 0.8).all() and (ratios < 1.25).all(), (name, ratios)
        assert np.argsort(estimates).tolist() == np.argsort(measured).tolist(), (name, estimates, measured)


def test_token_frequency_gives_unseen_tokens_the_mass_of_tokens_seen_once():
    from quantkit.budget.sensitivity import token_frequency

    frequency = token_frequency(torch.tensor([6, 1, 1, 0, 0, 0, 2, 0]))  # 10 tokens, 2 seen once, 4 ids unseen
    assert frequency.sum().item() == pytest.approx(1)
    assert frequency[3].item() == pytest.approx(0.2 / 4)  # n₁ / n = 0.2 over the 4 unseen ids
    assert frequency[0].item() == pytest.approx(0.6 * 0.8)
    assert torch.equal(token_frequency(torch.tensor([3, 1])), torch.tensor([0.75, 0.25], dtype=torch.float64))


@pytest.mark.llamacpp
def test_planned_artifact_meets_its_budget_and_runs_in_llama_cpp(marlin_legal, tmp_path, private_cache):
    """`quantkit quantize --target-size`: the file `export gguf` writes is exactly the size the plan
    predicts and within the budget, each linear has the plan's type (copied from the solver's blocks),
    the manifest records the plan, llama.cpp's logits equal quantkit's, and a second plan reuses the cached
    estimates."""
    from click.testing import CliRunner
    from test_gguf_export import _kl_top1, _llama_logits, _model

    from quantkit.cli import main
    from quantkit.gguf.export import export_gguf, exported_weights, file_bytes
    from quantkit.gguf.reader import open_gguf

    from helpers import small_recipe

    recipe = small_recipe("gguf-q4_k_m", tmp_path)
    full, _ = file_bytes(marlin_legal, "q4_k_m")
    budget = int(full * 0.8)
    out = tmp_path / "planned"
    result = CliRunner().invoke(main, ["quantize", "--recipe", recipe.source, "--model", str(marlin_legal), "--out",
                                       str(out), "--target-size", str(budget), "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["budget"]
    manifest = json.loads((out / "quantkit.json").read_text())
    assert manifest["budget"] == plan
    types = {name: entry["type"] for name, entry in plan["tensors"].items()}
    assert len(set(types.values())) > 1 and types != {n: e["mix"] for n, e in plan["tensors"].items()}

    report = export_gguf(out, tmp_path / "planned.gguf", "q4_k_m", progress=False)
    assert report.file_bytes == plan["file_bytes"] == file_bytes(marlin_legal, "q4_k_m", types)[0]
    assert report.file_bytes <= budget
    linears = [name for name in types if name.startswith("blk.")]
    assert report.exact_tensors == len(linears) and len(types) == len(linears) + 2  # + token_embd, output
    stored = {t.name: t.tensor_type.name.lower() for t in open_gguf(tmp_path / "planned.gguf").tensors}
    assert all(stored[name] == type_name for name, type_name in types.items())
    ids = list(range(5, 105))
    with torch.no_grad():
        ours = _model(out, exported_weights(out, "q4_k_m"))(torch.tensor([ids])).logits[0].double().numpy()
    kl, top1 = _kl_top1(ours, _llama_logits(tmp_path / "planned.gguf", ids))
    assert kl < 1e-4 and top1 >= 0.9, (kl, top1)

    again = CliRunner().invoke(main, ["plan", "--recipe", recipe.source, "--model", str(marlin_legal),
                                      "--target-size", str(budget), "--no-progress", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["tensors"] == plan["tensors"]

    shown = CliRunner().invoke(main, ["inspect", str(out), "--plot", str(tmp_path / "layers.png")])
    assert shown.exit_code == 0, shown.output
    assert "budget_matrix_bpw" in shown.output and "ffn_down" in shown.output
    assert all(type_name in shown.output for type_name in set(types.values()))
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planned_mlx_artifact_meets_its_budget_and_runs_in_mlx_lm(tiny_checkpoint_factory, tmp_path, private_cache):
    """`quantkit quantize --recipe mlx-s-gptq-w4g64 --target-size`: the weight files mlx-lm reads are at most the
    plan's predicted bytes (the safetensors headers bounded from above: within 1 % of the written), which are at
    most the budget; every module is stored on the plan's grid, as the config mlx-lm reads says; and mlx-lm
    computes quantkit's logits."""
    import mlx.core as mx
    from click.testing import CliRunner
    from mlx_lm.utils import load_model as mlx_load

    from quantkit.cli import main
    from quantkit.loading import load_model

    from helpers import small_recipe

    checkpoint = tiny_checkpoint_factory(same_rope_factors=True, seed=3)
    recipe = small_recipe("mlx-s-gptq-w4g64", tmp_path, smooth={"grid": 2})

    def run(*args):
        result = CliRunner().invoke(main, [*args, "--recipe", recipe.source, "--model", str(checkpoint),
                                           "--no-progress", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    uniform = run("plan", "--target-bpw", "15")["mix"]["file_bytes"]  # what the recipe alone writes
    budget = int(uniform * 0.85)
    out = tmp_path / "planned"
    plan = run("quantize", "--out", str(out), "--target-size", str(budget))["budget"]
    written = sum(path.stat().st_size for path in out.glob("model*.safetensors"))
    assert written <= plan["file_bytes"] <= budget and plan["file_bytes"] - written < 0.01 * written
    grids = {name: entry["type"] for name, entry in plan["tensors"].items()}
    # 0.85 of W4 g64's 4.5 bits per weight is below every 4-bit grid: some modules must get fewer bits
    assert any(grid.startswith(("2-bit", "3-bit")) for grid in grids.values()), grids
    stored = json.loads((out / "config.json").read_text())["quantization"]
    for module, grid in grids.items():
        entry = stored.get(module, {"group_size": stored["group_size"], "bits": stored["bits"], "mode": "affine"})
        if grid == "unquantized":
            assert entry is False, module
        else:
            bits, group = grid.split("-bit g")
            assert entry == {"group_size": int(group), "bits": int(bits), "mode": "affine"}, module

    ids = [1, 50, 60, 70, 80, 90, 100, 11, 12, 200]
    with torch.no_grad():
        expected = load_model(out)(torch.tensor([ids])).logits[0].double().numpy()
    logits = np.array(mlx_load(out)[0](mx.array([ids]))[0].astype(mx.float32)).astype(np.float64)
    assert np.abs(logits - expected).max() <= 1e-4

    shown = CliRunner().invoke(main, ["inspect", str(out), "--plot", str(tmp_path / "layers.png")])
    assert shown.exit_code == 0, shown.output
    assert "budget lm_head" in shown.output and "down_proj" in shown.output
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--target-size", "1KB"], "out of reach"),
    (["--target-bpw", "17"], "out of reach"),
    (["--target-size", "3 parsecs"], "cannot read size"),
])
def test_unreachable_or_unreadable_budget_is_refused_before_any_work(marlin_legal, tmp_path, private_cache, args,
                                                                     message):
    from click.testing import CliRunner

    from quantkit.cli import main

    from helpers import small_recipe

    recipe = small_recipe("gguf-q4_k_m", tmp_path)
    result = CliRunner().invoke(main, ["quantize", "--recipe", recipe.source, "--model", str(marlin_legal), "--out",
                                       str(tmp_path / "out"), "--no-progress", *args])
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_budget_needs_a_format_that_mixes_types(marlin_legal, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["plan", "--recipe", "gptq-w4g128", "--model", str(marlin_legal),
                                       "--target-bpw", "4", "--no-progress"])
    assert result.exit_code == 1 and "gguf-*" in result.output and "mlx-*" in result.output, result.output


def test_an_mlx_budget_refuses_a_tied_checkpoint_before_any_work(tiny_checkpoint_factory, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    tied = tiny_checkpoint_factory(same_rope_factors=True, tied=True)
    result = CliRunner().invoke(main, ["quantize", "--recipe", "mlx-s-gptq-w4g64", "--model", str(tied), "--out",
                                       str(tmp_path / "out"), "--target-bpw", "4", "--no-progress"])
    assert result.exit_code == 1 and "ties its LM head" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_tensor_types_need_a_gguf_format_and_known_names(tmp_path):
    from quantkit.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="needs a gguf-\\* format"):
        load_recipe("gptq-w4g128", {"gguf.tensor_types": {"blk.0.ffn_down.weight": "q6_k"}})
    with pytest.raises(RecipeError, match="gguf.tensor_types"):
        load_recipe("gguf-q4_k_m", {"gguf.tensor_types": {"blk.0.ffn_down.weight": "tq2_0"}})
    with pytest.raises(RecipeError, match="gguf.tensor_types"):
        load_recipe("gguf-q4_k_m", {"gguf.tensor_types": {"blk.0.attn_norm.weight": "q6_k"}})
    with pytest.raises(RecipeError, match="gguf.tensor_types"):  # rounded without importance by the export
        load_recipe("gguf-q4_k_m", {"gguf.tensor_types": {"output.weight": "iq2_xs"}})
    overrides = {"blk.0.ffn_down.weight": "q6_k", "token_embd.weight": "iq4_nl", "output.weight": "q5_0"}
    assert load_recipe("gguf-q4_k_m", {"gguf.tensor_types": overrides})["gguf"] == {"tensor_types": overrides}
