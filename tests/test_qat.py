"""Quantization-aware training (quantkit.qat) on tiny random MiniCPMs: the quantizer, the loop, resumption,
bad input, and what it writes."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.atomic import OutputExistsError, staging_dir
from quantkit.engine import quantize
from quantkit.eval.ppl import perplexity
from quantkit.qat import run_qat
from quantkit.qat.trainer import CHECKPOINT_DIR, train
from quantkit.qat.write import FAKE_QUANT_MANIFEST, write_outputs
from quantkit.quant import QuantConfig
from quantkit.reader import ArtifactReader
from quantkit.recipe import RecipeError, load_recipe
from quantkit.run import Run, RunError
from quantkit.training import state
from quantkit.training.distill import distillation_loss
from quantkit.training.fake_quant import grid_weight, quantized_record, straight_through
from quantkit.training.schedule import wsd_learning_rate

STEP_TOKENS = 128  # two rows of 64 tokens a step


pytestmark = pytest.mark.usefixtures("private_cache")

@pytest.fixture(scope="module")
def model(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(hidden_size=256, intermediate_size=512)


def overrides(training_text, **settings) -> dict:
    """The tests' small QAT settings (64-token rows, two a step, the tiny training text, the full learning rate
    whatever the start: the tiny random model's ternary start is already close to it), updated by ``settings``."""
    return {"qat.seq_len": 64, "qat.batch_tokens": STEP_TOKENS, "qat.eval_interval": 5, "qat.eval_tokens": 128,
            "qat.checkpoint_interval": 5, "qat.data": str(training_text), "qat.learning_rate": 1e-3,
            "qat.top_k": 8, "qat.full_rate_excess": 0.0, **settings}


def recipe(training_text, name="qat-ternary-g32", **settings):
    return load_recipe(name, overrides(training_text, **settings))


@pytest.mark.parametrize("config", [QuantConfig(2, 32, False, True), QuantConfig(2, 256, False, True),
                                    QuantConfig(2, -1, False, True), QuantConfig(4, 128, True)],
                         ids=["ternary-g32", "ternary-g256", "ternary-per-row", "int4-g128"])
@pytest.mark.parametrize("in_features", [512, 1728])  # 1728 = 13.5 groups of 128: the EAGLE-3 fc of hidden 576
def test_the_training_grid_is_rtns_grid_bit_for_bit(config, in_features):
    weight = torch.randn(96, in_features, generator=torch.Generator().manual_seed(1)) * 0.02
    assert torch.equal(grid_weight(weight, config), quantized_record(weight, config).dequantize())


def test_straight_through_gradient_reaches_the_latent_weight_unchanged():
    latent = torch.randn(8, 64, requires_grad=True)
    on_grid = grid_weight(latent, QuantConfig(2, 32, False, True))
    x = torch.randn(5, 64)
    upstream = torch.randn(5, 8)
    (torch.nn.functional.linear(x, straight_through(latent, on_grid)) * upstream).sum().backward()
    assert torch.equal(latent.grad, upstream.T @ x)  # d/dW of sum(upstream * x Wᵀ), as if W were unquantized


def test_wsd_schedule_warms_holds_and_decays():
    rates = [wsd_learning_rate(step, 100, 1.0, warmup=0.1, decay=0.2, final=0.1) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == 1.0
    assert set(rates[10:80]) == {1.0}
    assert rates[-1] == pytest.approx(0.1) and all(a > b for a, b in zip(rates[80:], rates[81:]))


def test_topk_distillation_with_every_token_is_the_full_kl():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 7, 50, generator=generator), torch.randn(3, 7, 50, generator=generator)
    values, ids = teacher.topk(50, dim=-1)
    full = torch.nn.functional.kl_div(torch.log_softmax(student / 2, -1), torch.log_softmax(teacher / 2, -1),
                                      log_target=True, reduction="none").sum(-1).mean() * 4
    assert distillation_loss(student, ids, values, 2.0).item() == pytest.approx(full.item(), rel=1e-5)


def test_zero_steps_write_exactly_rtn_ternary_g32(model, training_text, tmp_path):
    rtn = tmp_path / "rtn"
    quantize(model, load_recipe("rtn-ternary-g32", {"calibration.n_samples": 2, "calibration.seq_len": 32}), rtn,
             progress=False)
    settings = recipe(training_text, **{"qat.distill_weight": 0.0})
    trained = train(model, settings, tmp_path / "qat", perplexity=perplexity, tokens=STEP_TOKENS, stop_after_steps=0,
                    progress=False)
    write_outputs(trained, model, settings)
    ours, theirs = ArtifactReader(tmp_path / "qat"), ArtifactReader(rtn)
    assert ours.format.name == theirs.format.name == "ternary"
    for index in range(ours.num_layers):
        mine, reference = ours.layer(index), theirs.layer(index)
        assert mine[1].keys() == reference[1].keys()
        for name, record in reference[1].items():
            assert torch.equal(mine[1][name].codes, record.codes) and torch.equal(mine[1][name].scales, record.scales)
        assert all(torch.equal(mine[0][name], tensor) for name, tensor in reference[0].items())


@pytest.fixture(scope="module")
def uninterrupted(model, training_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("qat-run") / "out"
    report = run_qat(model, recipe(training_text), out, tokens=12 * STEP_TOKENS, perplexity=perplexity, progress=False)
    return out, report


def test_loss_falls_within_a_dozen_steps(uninterrupted):
    out, report = uninterrupted
    losses = [entry["loss"] for entry in report.log if "loss" in entry]
    perplexities = [entry["heldout_ppl"] for entry in report.log if "heldout_ppl" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3
    assert perplexities[-1] < perplexities[0]
    assert json.loads((out / "qat_log.json").read_text()) == report.log
    assert (out / "qat_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / CHECKPOINT_DIR).exists() and not staging_dir(out).exists()


def test_resumed_run_ends_with_the_uninterrupted_weights(model, training_text, uninterrupted, tmp_path):
    out = tmp_path / "out"
    settings = recipe(training_text)
    train(model, settings, out, tokens=12 * STEP_TOKENS, stop_after_steps=7, perplexity=perplexity, progress=False)
    assert state.record(staging_dir(out) / CHECKPOINT_DIR)["step"] == 7  # the checkpoint at the stop
    report = run_qat(model, settings, out, tokens=12 * STEP_TOKENS, resume=True, perplexity=perplexity, progress=False)
    assert report.resumed_from_step == 7
    reference, resumed = uninterrupted[0], out
    for shard in sorted(p.name for p in reference.glob("*.safetensors")):
        a, b = load_file(reference / shard), load_file(resumed / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard


def test_interrupted_checkpoint_write_keeps_the_previous_one(model, training_text, tmp_path, monkeypatch):
    out = tmp_path / "out"
    settings = recipe(training_text, **{"qat.checkpoint_interval": 2, "qat.distill_weight": 0.0})
    train(model, settings, out, tokens=6 * STEP_TOKENS, stop_after_steps=2, perplexity=perplexity, progress=False)
    checkpoint = staging_dir(out) / CHECKPOINT_DIR
    before = {path.relative_to(checkpoint): path.read_bytes() for path in checkpoint.rglob("*") if path.is_file()}
    assert sorted(map(str, before)) == ["checkpoint.json", "step-00000002/shard-00001-model-00001-of-00001.safetensors"]

    def dies_mid_write(state_dict, storage_writer, **kwargs):
        folder = Path(storage_writer.path)
        folder.mkdir(parents=True)
        (folder / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(state.dcp, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        train(model, settings, out, tokens=6 * STEP_TOKENS, resume=True, perplexity=perplexity, progress=False)
    for name, data in before.items():
        assert (checkpoint / name).read_bytes() == data, name
    monkeypatch.undo()  # the next run continues from step 2, and writes over the half-written step 4
    report = run_qat(model, settings, out, tokens=6 * STEP_TOKENS, resume=True, perplexity=perplexity, progress=False)
    assert report.resumed_from_step == 2 and report.steps == 6


def test_non_finite_loss_stops_with_a_clear_message_and_keeps_the_checkpoint(model, training_text, tmp_path,
                                                                             monkeypatch):
    out = tmp_path / "out"
    settings = recipe(training_text, **{"qat.checkpoint_interval": 1, "qat.distill_weight": 0.0, "qat.keep": "last"})
    real, calls = torch.nn.functional.cross_entropy, []

    def nan_from_step_four(*args, **kwargs):  # two micro-batches a step
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) > 6 else loss

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", nan_from_step_four)
    with pytest.raises(RunError, match=r"not finite .* at step 4; the last good checkpoint \(step 3\)"):
        train(model, settings, out, tokens=8 * STEP_TOKENS, perplexity=perplexity, progress=False)
    assert state.record(staging_dir(out) / CHECKPOINT_DIR)["step"] == 3


def test_int4_grid_trains_with_the_same_trainer(model, training_text, tmp_path):
    settings = recipe(training_text, **{"quant.bits": 4, "quant.group_size": 128, "quant.sym": True,
                                        "quant.ternary": False, "format": "gptq"})
    report = run_qat(model, settings, tmp_path / "int4", tokens=3 * STEP_TOKENS, perplexity=perplexity, progress=False)
    records = ArtifactReader(tmp_path / "int4").layer(0)[1]
    assert report.steps == 3 and all(r.config == QuantConfig(4, 128, True) for r in records.values())


def test_fake_quant_checkpoint_loads_in_transformers_as_the_artifact(model, training_text, uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit.loading import load_model

    out = tmp_path / "fake"
    run_qat(model, recipe(training_text), out, perplexity=perplexity, tokens=12 * STEP_TOKENS, fake_quant=True,
            progress=False)
    assert not (out / "quantkit.json").exists() and (out / FAKE_QUANT_MANIFEST).is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    packed = load_model(uninterrupted[0])
    ids = torch.arange(5, 60)[None]
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, packed(ids).logits)


@pytest.mark.parametrize("settings, message", [
    ({"quant.group_size": 256}, "does not divide K = 384"),
    ({"qat.learning_rate": 0.0}, "must be > 0"),
    ({"qat.warmup": 0.5}, "must be 1"),
    ({"qat.batch_tokens": 100}, "multiple of"),
    ({"qat.distill_weight": True}, "must be float"),
])
def test_bad_input_is_refused_before_any_work(tiny_checkpoint_factory, training_text, tmp_path, settings, message):
    narrow = tiny_checkpoint_factory(hidden_size=256, intermediate_size=384)
    with pytest.raises((RunError, RecipeError, ValueError), match=message):
        train(narrow, recipe(training_text, **settings), tmp_path / "out", perplexity=perplexity, progress=False)
    assert not staging_dir(tmp_path / "out").exists()


def test_empty_data_and_existing_output_are_refused(model, training_text, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no text"):
        train(model, recipe(training_text, **{"qat.data": str(empty)}), tmp_path / "out", perplexity=perplexity,
              progress=False)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        train(model, recipe(training_text), tmp_path / "taken", perplexity=perplexity, progress=False)
    assert not staging_dir(tmp_path / "out").exists()


@pytest.mark.parametrize("name, settings", [
    ("gptq-ternary-g32", {}),
    ("block-recon-ternary-g32",
     {"reconstruct.iterations": 4, "reconstruct.batch_size": 2, "reconstruct.eval_every": 2}),
])
def test_qat_from_a_post_training_ternary_artifact_starts_exactly_at_its_weights(model, training_text, tmp_path,
                                                                                name, settings):
    gptq = tmp_path / "gptq"
    quantize(model, load_recipe(name, {"calibration.n_samples": 4, "calibration.seq_len": 32, **settings}), gptq,
             progress=False)
    settings = recipe(training_text, **{"qat.distill_weight": 0.0})
    trained = train(model, settings, tmp_path / "qat", tokens=STEP_TOKENS, init=gptq, stop_after_steps=0,
                    perplexity=perplexity, progress=False)
    write_outputs(trained, model, settings, init=str(gptq))
    ours, theirs = ArtifactReader(tmp_path / "qat"), ArtifactReader(gptq)
    for index in range(ours.num_layers):
        for name, record in theirs.layer(index)[1].items():
            assert torch.equal(ours.layer(index)[1][name].dequantize(), record.dequantize()), name


def _artifact_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def test_a_run_that_only_gets_worse_writes_its_start(model, training_text, tmp_path):
    """qat.keep best: at a rate that wrecks the tiny model's near-lossless ternary start, the held-out KL
    never falls below the start's, and what is written is the start bit for bit (the zero-step artifact);
    qat.keep last writes the wrecked weights."""
    wrecking = {"qat.learning_rate": 0.05, "qat.warmup": 0.0, "qat.stable": 1.0, "qat.decay": 0.0,
                "qat.distill_weight": 1.0}
    start = tmp_path / "start"
    settings = recipe(training_text, **wrecking)
    write_outputs(train(model, settings, start, perplexity=perplexity, tokens=STEP_TOKENS, stop_after_steps=0,
                        progress=False), model, settings)
    best = run_qat(model, settings, tmp_path / "best", tokens=10 * STEP_TOKENS, perplexity=perplexity, progress=False)
    losses = [entry["heldout_kl"] for entry in best.log if "heldout_kl" in entry]
    assert len(losses) == 3 and min(losses[1:]) > losses[0]  # every measurement after the start is worse
    assert best.kept_step == 0 and best.kept_heldout_ppl == best.log[0]["heldout_ppl"]
    ours, theirs = _artifact_tensors(tmp_path / "best"), _artifact_tensors(start)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    last = run_qat(model, recipe(training_text, **wrecking, **{"qat.keep": "last"}), tmp_path / "last",
                   tokens=10 * STEP_TOKENS, perplexity=perplexity, progress=False)
    assert last.kept_step == 10
    assert any(not torch.equal(tensor, theirs[k]) for k, tensor in _artifact_tensors(tmp_path / "last").items())


def test_a_start_close_to_the_fp_model_takes_smaller_steps(model, training_text, tmp_path):
    """qat.full_rate_excess: the peak rate is scaled by sqrt(KL / full_rate_excess), KL the start's held-out KL
    to the FP model; the tiny model's ternary start is close to it."""
    settings = recipe(training_text, **{"qat.full_rate_excess": 1.0, "qat.warmup": 0.0, "qat.stable": 1.0,
                                        "qat.decay": 0.0})
    report = run_qat(model, settings, tmp_path / "out", tokens=2 * STEP_TOKENS, perplexity=perplexity,
                     progress=False)
    start = report.log[0]
    assert 0 < start["heldout_kl"] < 0.25 and start["rate_factor"] == pytest.approx(start["heldout_kl"] ** 0.5)
    assert [entry["lr"] for entry in report.log[1:]] == [pytest.approx(1e-3 * start["rate_factor"])] * 2
    full = run_qat(model, recipe(training_text), tmp_path / "full", tokens=STEP_TOKENS, perplexity=perplexity,
                   progress=False)
    assert full.log[0]["rate_factor"] == 1.0 and "heldout_kl" in full.log[0]  # qat.full_rate_excess 0


def test_overrides_read_as_a_user_types_them(training_text):
    """`--set` values arrive as YAML 1.1 reads them: `0` is an int and `1e-3` a string."""
    settings = recipe(training_text, **{"qat.learning_rate": "1e-3", "qat.distill_weight": 0})["qat"]
    assert settings["learning_rate"] == 0.001 and settings["distill_weight"] == 0.0


def test_teacher_cache_grows_with_a_longer_run(tmp_path, monkeypatch):
    """A longer run reuses a shorter one's chunks, recomputing its last one if that held fewer rows."""
    from types import SimpleNamespace

    from quantkit.qat import teacher as teacher_module
    from quantkit.training import rowcache

    monkeypatch.setattr(rowcache, "CHUNK_ROWS", 4)
    rows = torch.randint(0, 50, (12, 6), generator=torch.Generator().manual_seed(0))
    calls = []

    def fake_teacher(ids):
        calls.append(ids)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(ids, 50).float().cumsum(-1))

    order = [5, 2, 9, 0, 7, 11, 3, 1, 4, 6, 8, 10]
    short = teacher_module.build_cache(fake_teacher, rows, order[:6], 3, tmp_path, progress=False)
    assert len(calls) == 6 and short.batch(order[:6])["ids"].shape[0] == 6
    long = teacher_module.build_cache(fake_teacher, rows, order[:10], 3, tmp_path, progress=False)
    assert len(calls) == 6 + 4 + 2  # the first chunk reused, the 2-row one redone with 4 rows, one new
    for row in order[:10]:
        assert torch.equal(long.batch([row])["ids"][0], fake_teacher(rows[row][None]).logits[0].topk(3).indices)
    across_chunks = [4, 5, 0, 1]  # rows from the third, first and second chunk, read from disk in this order
    assert torch.equal(long.batch(across_chunks)["ids"], torch.cat([long.batch([row])["ids"] for row in across_chunks]))


def test_resume_continues_from_a_checkpoint_and_starts_over_without_one(tmp_path):
    """A run killed before its first checkpoint leaves a staging folder with none: --resume starts it over
    (as `quantize --resume` does before its first layer), instead of refusing what a user cannot fix."""
    out, staging, inputs = tmp_path / "out", staging_dir(tmp_path / "out"), {"model": "m", "tokens": 1}
    progress = state.progress_file(CHECKPOINT_DIR)
    assert Run(out, resume=True).begin(inputs, progress) is False  # nothing there
    with pytest.raises(RunError, match="interrupted run: pass --resume"):
        Run(out, resume=False)
    assert Run(out, resume=True).begin(inputs, progress) is False  # killed early
    (staging / CHECKPOINT_DIR / "step-00000001").mkdir(parents=True)
    assert Run(out, resume=True).begin(inputs, progress) is False  # killed before the first record: starts over
    assert not (staging / CHECKPOINT_DIR).exists()
    (staging / CHECKPOINT_DIR).mkdir()
    (staging / progress).write_text("{}")
    assert Run(out, resume=True).begin(inputs, progress) is True
    with pytest.raises(RunError, match="started with a different model or tokens"):
        Run(out, resume=True).begin({**inputs, "tokens": 2}, progress)
    out.mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        Run(out, resume=True)
