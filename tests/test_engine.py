"""The layer-wise engine on tiny random MiniCPM checkpoints: artifacts, determinism, resume, bad input."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.artifact import REPORT_FILE
from quantkit.atomic import OutputExistsError, staging_dir
from quantkit.checkpoint import CheckpointError
from quantkit.engine import quantize
from quantkit.loading import load_model
from quantkit.models import MiniCPMConfig
from quantkit.models.layers import LINEARS
from quantkit.recipe import RecipeError, load_recipe
from quantkit.run import RunError
from quantkit.synthetic import write_tiny_checkpoint

from helpers import DeviceAudit

RECIPE = """\
name: tiny-rtn
description: RTN on a tiny checkpoint
algorithm: rtn
quant: {bits: 4, group_size: 128, sym: true}
calibration: {n_samples: 4, seq_len: 64, batch_size: 3}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=3)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "tiny-rtn.yaml"
    path.write_text(RECIPE)
    return load_recipe(path)


def _artifact_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != REPORT_FILE}


def test_artifact_is_complete_and_loads(tiny, recipe, tmp_path):
    out = tmp_path / "q"
    report = quantize(tiny, recipe, out, progress=False)
    assert len(report.layers) == 3 and not staging_dir(out).exists()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 4 and config["quantization_config"]["quant_method"] == "gptq"
    assert (out / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.2.mlp.down_proj.qweight" in index["weight_map"]
    # RTN W4 on Gaussian weights: every linear loses some, none loses most of its output energy.
    for layer in report.layers:
        assert set(layer.errors) == set(LINEARS)
        assert all(1e-4 < e < 0.05 for e in layer.errors.values()), layer.errors

    model, reference = load_model(out), load_model(tiny)
    for name, w in reference.state_dict().items():
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            q = model.state_dict()[name]
            assert not torch.equal(q, w)
            assert (q - w).abs().max() < w.abs().max() / 7  # within half a 4-bit step of the group max
    ids = torch.arange(1, 40)[None]
    assert torch.isfinite(model(ids).logits).all()


def test_same_inputs_give_identical_bytes_and_resume_matches(tiny, recipe, tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    quantize(tiny, recipe, straight, progress=False)
    partial = quantize(tiny, recipe, resumed, progress=False, stop_after_layers=1)
    assert len(partial.layers) == 1 and staging_dir(resumed).is_dir() and not resumed.exists()
    with pytest.raises(RunError, match="--resume"):
        quantize(tiny, recipe, resumed, progress=False)
    report = quantize(tiny, recipe, resumed, progress=False, resume=True)
    assert report.resumed_from_layer == 1 and [r.index for r in report.layers] == [1, 2]
    assert _artifact_bytes(straight) == _artifact_bytes(resumed)


def test_resume_refuses_a_different_recipe(tiny, recipe, tmp_path):
    out = tmp_path / "q"
    quantize(tiny, recipe, out, progress=False, stop_after_layers=1)
    other = tmp_path / "other.yaml"
    other.write_text(RECIPE.replace("bits: 4", "bits: 8"))
    with pytest.raises(RunError, match="different model, recipe"):
        quantize(tiny, load_recipe(other), out, progress=False, resume=True)


def test_existing_output_directory_is_refused(tiny, recipe, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="already exists"):
        quantize(tiny, recipe, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"


def test_unknown_recipe_key_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(RECIPE.replace("sym: true", "sym: true, grup_size: 64"))
    with pytest.raises(RecipeError, match=r"bad\.yaml.*quant\.grup_size"):
        load_recipe(path)
    path.write_text(RECIPE.replace("bits: 4", "bits: 5"))
    with pytest.raises(RecipeError, match=r"quant\.bits.*5"):
        load_recipe(path)


def test_prefix_linears_default_to_all_and_keep_shared_inputs_together(tmp_path):
    path = tmp_path / "scoped.yaml"
    path.write_text(RECIPE)
    assert load_recipe(path)["prefix_linears"] == list(LINEARS)
    path.write_text(RECIPE + "prefix_linears: [mlp.gate_proj, mlp.up_proj, mlp.down_proj]\n")
    assert load_recipe(path)["prefix_linears"] == ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for bad in ("[self_attn.q_proj]", "[mlp.down_proj, mlp.down_proj]", "[mlp.dwn_proj]", "mlp.down_proj"):
        path.write_text(RECIPE + f"prefix_linears: {bad}\n")
        with pytest.raises(RecipeError, match=r"scoped\.yaml.*prefix_linears"):
            load_recipe(path)


def _broken_copy(tiny: Path, tmp_path: Path, edit) -> Path:
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in tiny.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(broken / "model.safetensors"))
    return broken


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t["model.layers.2.self_attn.k_proj.weight"].view(-1).__setitem__(7, float("nan")), "NaN"),
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight",
                             t["model.layers.0.mlp.down_proj.weight"][:, :-8].contiguous()), "has shape"),
])
def test_bad_checkpoints_fail_before_writing(tiny, recipe, tmp_path, edit, message):
    broken = _broken_copy(tiny, tmp_path, edit)
    out = tmp_path / "q"
    with pytest.raises(RunError, match=message):
        quantize(broken, recipe, out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_corrupt_safetensors_is_a_clear_error(tiny, recipe, tmp_path):
    broken = _broken_copy(tiny, tmp_path, lambda t: None)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "q"
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        quantize(broken, recipe, out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_sharded_checkpoint_reads_like_a_single_file(tmp_path):
    from quantkit.checkpoint import CheckpointReader
    from quantkit.synthetic import write_sharded_checkpoint

    config = MiniCPMConfig.from_pretrained(write_tiny_checkpoint(tmp_path / "one", num_hidden_layers=2))
    sharded = write_sharded_checkpoint(tmp_path / "sharded", config, seed=1)
    reader = CheckpointReader(sharded)
    assert len(reader.files()) == 3  # one shard per layer plus the rest
    assert reader.shape("model.layers.1.mlp.down_proj.weight") == (256, 512)
    model = load_model(sharded)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reader.get(name)), name
    assert write_sharded_checkpoint(tmp_path / "again", config, seed=1) and all(
        (tmp_path / "again" / p.name).read_bytes() == p.read_bytes() for p in sharded.iterdir())


def test_reused_attention_and_o_proj_give_the_same_statistics_and_outputs(tiny):
    from quantkit.activations import Activations
    from quantkit.checkpoint import CheckpointReader
    from quantkit.engine import LayerRunner, _build_layer, _layer_tensors
    from quantkit.models import MiniCPMRotaryEmbedding
    from quantkit.models.layers import DOWN, GATE, O_PROJ

    config = MiniCPMConfig.from_pretrained(tiny)
    layer = _build_layer(config, 1, _layer_tensors(CheckpointReader(tiny), 1), torch.bfloat16, torch.device("cpu"))
    hidden = torch.randn(5, 24, config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    position_embeddings = MiniCPMRotaryEmbedding(config)(hidden, torch.arange(24)[None])
    memory = Activations(torch.device("cpu"))
    recomputing, reusing = (LayerRunner(layer, position_embeddings, batch_size=2, activations=memory) for _ in range(2))
    reusing.fix_attention(hidden)
    assert reusing.mixed.shape == (5, 24, layer.self_attn.o_proj.in_features)

    def same_statistics(names):
        for name in names:
            expected = recomputing.input_stats(hidden, (name,), skip_prefix={name: 4})[name]
            got = reusing.input_stats(hidden, (name,), skip_prefix={name: 4})[name]
            assert torch.equal(got.hessian, expected.hessian) and torch.equal(got.abs_mean, expected.abs_mean)

    same_statistics((O_PROJ, GATE, DOWN))
    assert torch.equal(reusing.forward(hidden), recomputing.forward(hidden))
    reusing.fix_attended(hidden)  # o_proj final: the MLP's passes start after it
    assert reusing.mixed is None and reusing.attended.shape == hidden.shape
    same_statistics((GATE, DOWN))
    assert torch.equal(reusing.forward(hidden), recomputing.forward(hidden))
    reusing.fix_gated(hidden)  # gate/up final: down_proj's statistics and the output start from its input
    assert reusing.gated.shape == (5, 24, layer.mlp.down_proj.in_features)
    same_statistics((DOWN,))
    attended = reusing.attended
    output = reusing.forward(hidden)
    assert torch.equal(output, recomputing.forward(hidden))
    assert output.data_ptr() == attended.data_ptr() and reusing.gated is None  # written over the stream


@pytest.fixture(scope="module")
def one_layer(tiny_checkpoint_factory) -> Path:
    """Every format can pack it (as conftest's marlin_legal), one layer: the audit slows every torch call."""
    return tiny_checkpoint_factory(num_hidden_layers=1, num_key_value_heads=4, seed=5)


# One recipe per code path: GPTQ on the integer grid and the GPTQ packing; smoothing, the prefix cut and
# Marlin's packing; the clip search, the float bias and MLX's packing; GGUF blocks; RTN; ternary.
@pytest.mark.parametrize("recipe_name", ["gptq-w4g128", "marlin", "mlx-s-gptq-w4g64", "gguf-q4_k_m",
                                         "rtn-w4g128", "gptq-ternary-g32"])
def test_a_layers_work_names_its_device_everywhere(one_layer, recipe_name, tmp_path, monkeypatch):
    """--device cuda cannot run here, so this proves the property it needs: within a layer's work
    (statistics, smoothing, every algorithm and grid, packing) every tensor is created on the device of
    the data it works on, and nothing reaches NumPy except through .cpu()."""
    from quantkit import engine

    audit, run = DeviceAudit(), engine._LayerJob.run

    def audited(self, *args, **kwargs):
        with audit:
            return run(self, *args, **kwargs)

    monkeypatch.setattr(engine._LayerJob, "run", audited)
    recipe = load_recipe(recipe_name, {"calibration.n_samples": 4, "calibration.seq_len": 32, "smooth.grid": 2})
    report = quantize(one_layer, recipe, tmp_path / "out", progress=False, device="cpu")
    assert report.device == "cpu" and len(report.layers) == 1
    assert not audit.found, "\n".join(sorted(audit.found))


def test_device_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused(tiny, recipe, tmp_path, monkeypatch):
    from quantkit.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        quantize(tiny, recipe, tmp_path / "out", progress=False, device="cuda")
    assert not (tmp_path / "out").exists()


def test_calibration_that_cannot_fit_is_refused_up_front_with_estimate_and_limit(tiny, recipe, tmp_path,
                                                                                monkeypatch):
    import quantkit.memory
    from quantkit.engine import calibration_memory

    config = MiniCPMConfig.from_pretrained(tiny)
    parts = calibration_memory(config, 4, 64, torch.float32)
    # the input, the residual stream after attention (then the output) and down_proj's input, float32
    assert parts["activations"] == 4 * 64 * (2 * config.hidden_size + config.intermediate_size) * 4
    monkeypatch.setattr(quantkit.memory, "available_bytes", lambda: (2**20, "a test's limit"))
    with pytest.raises(RunError, match=r"calibration does not fit: 4 x 64 tokens .* need about [\d.]+ GiB on cpu "
                                          r"\(activations .*a test's limit leaves 0.00 GiB"):
        quantize(tiny, recipe, tmp_path / "out", progress=False, device="cpu")
    assert not (tmp_path / "out").exists() and not staging_dir(tmp_path / "out").exists()


def _spill_counter(monkeypatch) -> list:
    """Records each tensor the run maps from a spill file."""
    from quantkit.activations import Activations

    spilled, empty = [], Activations.empty

    def counted(self, shape, dtype):
        if self.spilled:
            spilled.append(shape)
        return empty(self, shape, dtype)

    monkeypatch.setattr(Activations, "empty", counted)
    return spilled


@pytest.fixture(scope="module")
def two_layers(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory(num_hidden_layers=2, num_key_value_heads=4, seed=7)


def test_activations_spilled_to_disk_give_identical_bytes_and_leave_no_file(two_layers, tmp_path, monkeypatch):
    """Smoothing, the prefix cut, GPTQ and uneven batches (4 rows in batches of 3) through mapped files."""
    recipe = load_recipe("s-p-gptq-w4g128", {"calibration.n_samples": 4, "calibration.seq_len": 32,
                                             "calibration.batch_size": 3, "smooth.grid": 2, "format": "marlin"})
    in_memory = quantize(two_layers, recipe, tmp_path / "memory", progress=False, activations="memory")
    spilled = _spill_counter(monkeypatch)
    on_disk = quantize(two_layers, recipe, tmp_path / "disk", progress=False, activations="disk")
    # the first layer's input, then each layer's o_proj input, residual stream after attention (which the
    # output overwrites) and down_proj's input
    assert (in_memory.activations, on_disk.activations, len(spilled)) == ("memory", "disk", 1 + 3 * 2)
    assert _artifact_bytes(tmp_path / "memory") == _artifact_bytes(tmp_path / "disk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "memory"]  # no spill file left


def test_auto_spills_activations_that_do_not_fit_in_memory(tiny, recipe, tmp_path, monkeypatch):
    import quantkit.memory
    from quantkit.engine import MEMORY_MARGIN, calibration_memory
    from quantkit.stats import compute_dtype

    big = load_recipe(recipe.source, {"calibration.n_samples": 64, "calibration.seq_len": 64,
                                      "calibration.batch_size": 4})
    parts = calibration_memory(MiniCPMConfig.from_pretrained(tiny), 64, 64, compute_dtype(big["compute_dtype"]))
    spilled_need = MEMORY_MARGIN * (sum(parts.values()) - parts["activations"] * (1 - 4 / 64))
    limit = int(spilled_need) + 1
    assert limit < MEMORY_MARGIN * sum(parts.values())  # in memory, the run would not fit the limit
    monkeypatch.setattr(quantkit.memory, "available_bytes", lambda: (limit, "a test's limit"))
    spilled = _spill_counter(monkeypatch)
    report = quantize(tiny, big, tmp_path / "out", progress=False, device="cpu")
    assert report.activations == "disk" and len(spilled) == 1 + 3 * 3
    with pytest.raises(RunError, match=r"calibration does not fit: .* on cpu \(activations [\d.]+ GiB"):
        quantize(tiny, big, tmp_path / "refused", progress=False, device="cpu", activations="memory")
    monkeypatch.setattr(quantkit.memory, "available_bytes", lambda: (limit // 2, "a test's limit"))
    with pytest.raises(RunError, match=r"on cpu \(activations \(one batch; the rest on disk\) [\d.]+ GiB"):
        quantize(tiny, big, tmp_path / "refused", progress=False, device="cpu")


def test_a_spill_that_does_not_fit_the_disk_is_refused_up_front(tiny, recipe, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**20, 2**20, 1024))
    with pytest.raises(RunError, match=r"calibration does not fit: the activations of 4 x 64 tokens \([\d.]+ GiB\) "
                                          r"fit neither in memory nor on the disk of .* \(0.00 GiB free\)"):
        quantize(tiny, recipe, tmp_path / "out", progress=False, device="cpu", activations="disk")
    assert not (tmp_path / "out").exists() and not staging_dir(tmp_path / "out").exists()
