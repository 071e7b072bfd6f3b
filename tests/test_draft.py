"""Draft-head training: the unrolled training-time test against the runtime drafter's own chains."""
from __future__ import annotations

import pytest
import torch

from quantkit.draft.ttt import ttt_mask, unrolled_steps
from quantkit.kernels.eagle3 import Eagle3Drafter
from quantkit.models import MiniCPMForCausalLM
from quantkit.models.eagle3 import entering_states
from quantkit.reader import load_head
from quantkit.synthetic import write_tiny_eagle3_head

pytestmark = pytest.mark.usefixtures("private_cache")

@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=8)


@pytest.fixture(scope="module")
def target(target_dir):
    return MiniCPMForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return write_tiny_eagle3_head(tmp_path_factory.mktemp("head") / "head", target_dir, draft_vocab_size=100)


def test_ttt_mask_lets_each_step_see_its_chain():
    mask = ttt_mask(5, 2)
    assert mask.shape == (5, 15)
    # position 4 of step 2: its chain starts at 2 -> step 0 keys 0..2, step 1 key at 3, step 2 key at 4
    assert torch.nonzero(mask[4]).flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert torch.equal(ttt_mask(4, 0), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_unrolled_steps_equal_the_runtime_drafters_chains(target, head_dir):
    """Step j at position p is the chain from p - j as the runtime drafts it, fed the text's tokens."""
    head = load_head(head_dir, target.config)
    length, steps = 8, 3
    ids = torch.randint(0, target.config.vocab_size, (1, length + steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, states = entering_states(target, ids, head.aux_layers)
        aux = head.aux_from_states(states)[:, :length]
        embeds = head.embed(target.model.embed_tokens, ids[:, 1:length + 1])
        unrolled = unrolled_steps(head, aux, embeds, steps)
    drafter = Eagle3Drafter(head, target.model.embed_tokens)
    with torch.inference_mode():
        for start in range(length - steps + 1):
            drafter.crop(0)
            drafter.observe(ids[0, :start + 1], {layer: state[0, :start + 1] for layer, state in states.items()},
                            ids[0, 1:start + 2])
            hidden = drafter._last
            torch.testing.assert_close(hidden[0], unrolled[0][0, start], rtol=1e-5, atol=1e-5)
            for step in range(1, steps):
                hidden = drafter._step(hidden, ids[0, start + step + 1:start + step + 2])  # token p + 1
                torch.testing.assert_close(hidden[0], unrolled[step][0, start + step], rtol=1e-5, atol=1e-5)


def settings(training_text, **changes):
    from quantkit.draft.settings import DraftSettings

    values = dict(tokens=64 * 2 * 60, seq_len=64, batch_rows=2, ttt_steps=3, draft_vocab=128, learning_rate=3e-3,
                  data=str(training_text), eval_rows=2, eval_interval=20, checkpoint_interval=10)
    return DraftSettings(**{**values, **changes})


@pytest.fixture(scope="module")
def trained(target_dir, training_text, tmp_path_factory):
    from quantkit.draft.trainer import train_head

    out = tmp_path_factory.mktemp("trained") / "head"
    return out, train_head(target_dir, out, settings(training_text), progress=False)


def test_training_lowers_the_held_out_loss_and_raises_agreement(trained):
    _, report = trained
    measured = [e for e in report.log if "heldout_loss" in e]
    assert [e["step"] for e in measured] == [0, 20, 40, 60]
    first, last = measured[0], measured[-1]
    assert last["heldout_loss"] < 0.85 * first["heldout_loss"]  # a random target: measured 3.48 -> 2.74
    assert last["heldout_top1_by_step"][0] > first["heldout_top1_by_step"][0]
    assert 0 < report.heldout_coverage <= 1 and report.draft_vocab == 128


def test_the_trained_head_is_official_layout_and_drafts_in_the_runtime(trained, target_dir):
    from quantkit.kernels.generate import load_text_generator

    out, _ = trained
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "draft_train.json",
                                               "draft_report.json"}
    plain = load_text_generator(target_dir, dtype=torch.float32).generate([5, 17, 99, 3], max_new_tokens=16)
    speculative = load_text_generator(target_dir, dtype=torch.float32, draft=out).generate([5, 17, 99, 3],
                                                                                          max_new_tokens=16)
    assert speculative.tokens == plain.tokens and speculative.acceptance["rounds"] > 0


def test_resume_ends_with_the_weights_of_an_uninterrupted_run(trained, target_dir, training_text, tmp_path):
    from quantkit.draft.trainer import train_head

    out = tmp_path / "head"
    partial = train_head(target_dir, out, settings(training_text), progress=False, stop_after_steps=27)
    assert partial.steps == 27 and not out.exists()
    resumed = train_head(target_dir, out, settings(training_text), progress=False, resume=True)
    assert resumed.resumed_from_step == 27  # the last checkpoint: the stop writes one
    assert (out / "model.safetensors").read_bytes() == (trained[0] / "model.safetensors").read_bytes()


def test_greedy_continuation_is_the_targets_argmax_at_every_written_position(target_dir):
    """Rows decoded together through one cache write what a teacher-forced forward calls the argmax (float64:
    no near-tie can flip between the cached and the full computation)."""
    from quantkit.training.own_text import greedy_continuation

    model = MiniCPMForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    rows = greedy_continuation(model, prompts, 24)
    assert rows.shape == (3, 24) and torch.equal(rows[:, :5], prompts)
    with torch.no_grad():
        argmax = model(input_ids=rows, use_cache=False).logits.argmax(-1)
    assert torch.equal(rows[:, 5:], argmax[:, 4:-1])


def test_own_text_rows_keep_their_prompt_and_train_a_head(target_dir, training_text, tmp_path):
    """--own-text-after: every visited row is its text's first tokens and the target's greedy continuation;
    a run on them is the same bytes again when it reads the cached continuations."""
    import json

    from quantkit.draft.trainer import train_head
    from quantkit.tokenizer import load_tokenizer
    from quantkit.training.data import training_data
    from quantkit.training.own_text import greedy_continuation, own_text

    text = training_data(load_tokenizer(target_dir), str(training_text), 64, 0)
    model = MiniCPMForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    written = own_text(model, "tiny", text, 16, [3, 1], tmp_path / "cache", progress=False)
    assert torch.equal(written.rows[[3, 1]], greedy_continuation(model, text.rows[[3, 1], :16], 64))
    assert torch.equal(written.rows[0], text.rows[0]) and not torch.equal(written.rows[1], text.rows[1])
    assert written.fingerprint != text.fingerprint

    changes = dict(tokens=64 * 2 * 10, own_text_after=16, eval_interval=10, checkpoint_interval=10)
    first = train_head(target_dir, tmp_path / "a", settings(training_text, **changes), progress=False)
    again = train_head(target_dir, tmp_path / "b", settings(training_text, **changes), progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first.steps == again.steps == 10
    assert json.loads((tmp_path / "a" / "draft_train.json").read_text())["data"]["own_text_after"] == 16


@pytest.mark.parametrize("changes, message", [
    ({"own_text_after": 64}, "own_text_after must be in 0..63"),
    ({"draft_vocab": 10_000}, "draft_vocab must be in 1..384"),
    ({"tokens": 10}, "less than one step"),
    ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"aux_states": "sglang"}, "aux_states must be one of"),
])
def test_bad_settings_are_refused_before_any_work(target_dir, training_text, tmp_path, changes, message):
    from quantkit.draft.trainer import train_head
    from quantkit.run import RunError

    with pytest.raises(RunError, match=message):
        train_head(target_dir, tmp_path / "head", settings(training_text, **changes), progress=False)
    assert not (tmp_path / "head.partial").exists()


def test_an_existing_output_is_refused(target_dir, training_text, trained):
    from quantkit.atomic import OutputExistsError
    from quantkit.draft.trainer import train_head

    with pytest.raises(OutputExistsError, match="already exists"):
        train_head(target_dir, trained[0], settings(training_text), progress=False)


def test_cli_draft_train(target_dir, training_text, tmp_path):
    import json

    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["draft", "train", "--target", str(target_dir), "--out", str(tmp_path / "h"),
                                       "--tokens", "1024", "--seq-len", "64", "--batch-rows", "2", "--ttt-steps", "2",
                                       "--draft-vocab", "64", "--data", str(training_text), "--no-progress",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["steps"] == 8
    again = CliRunner().invoke(main, ["draft", "train", "--target", str(target_dir), "--out", str(tmp_path / "h")])
    assert again.exit_code == 1 and "already exists" in again.output


CLI_TINY_RUN = ["--tokens", "1024", "--seq-len", "64", "--batch-rows", "2", "--ttt-steps", "2", "--draft-vocab", "64",
                "--no-progress", "--json"]


def test_cli_draft_train_device_cpu_is_the_default_here_byte_for_byte(target_dir, training_text, tmp_path,
                                                                     monkeypatch):
    """Without a GPU, auto is the CPU: --device cpu writes the same head, log and target features as the
    default, each run computing its features afresh in a cache of its own, under the same key."""
    import json

    from click.testing import CliRunner

    from quantkit.cli import main

    caches = {}
    for name, device in (("default", []), ("cpu", ["--device", "cpu"])):
        caches[name] = tmp_path / f"cache-{name}"
        monkeypatch.setenv("QUANTKIT_CACHE", str(caches[name]))
        result = CliRunner().invoke(main, ["draft", "train", "--target", str(target_dir), "--out",
                                           str(tmp_path / name), "--data", str(training_text), *CLI_TINY_RUN, *device])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["device"] == "cpu"
    for file in ("model.safetensors", "config.json", "draft_train.json"):
        assert (tmp_path / "default" / file).read_bytes() == (tmp_path / "cpu" / file).read_bytes(), file
    cached = {name: sorted(p.relative_to(cache) for p in cache.rglob("*.safetensors"))
              for name, cache in caches.items()}
    assert cached["default"] == cached["cpu"] and cached["cpu"]  # the same keys: the device is not part of them
    for path in cached["cpu"]:
        assert (caches["default"] / path).read_bytes() == (caches["cpu"] / path).read_bytes(), path


def test_cli_draft_train_device_cuda_without_a_gpu_is_one_clear_line(target_dir, training_text, tmp_path,
                                                                     monkeypatch):
    from click.testing import CliRunner

    from quantkit.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "h"
    result = CliRunner().invoke(main, ["draft", "train", "--target", str(target_dir), "--out", str(out),
                                       "--data", str(training_text), *CLI_TINY_RUN, "--device", "cuda"])
    assert result.exit_code == 1 and "--device cuda: no CUDA device" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, RuntimeError)
    assert not out.exists() and not (tmp_path / "h.partial").exists()  # refused before any work


def test_a_draft_step_names_its_device_everywhere(target_dir, training_text, tmp_path, monkeypatch):
    """As the engine's audit (tests/test_engine.py): the target features and every training and held-out
    step create their tensors on their data's device, and reach NumPy only through .cpu()."""
    from quantkit.draft import features, trainer

    from helpers import DeviceAudit

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))  # features computed here, not read back
    audit = DeviceAudit()

    def audited(function):
        def run(*args, **kwargs):
            with audit:
                return function(*args, **kwargs)
        return run

    monkeypatch.setattr(trainer, "step_loss", audited(trainer.step_loss))
    monkeypatch.setattr(features, "row_features", audited(features.row_features))
    monkeypatch.setattr(trainer, "row_features", audited(trainer.row_features))
    monkeypatch.setattr(trainer, "features_key", audited(trainer.features_key))
    report = trainer.train_head(target_dir, tmp_path / "h", settings(training_text, tokens=64 * 2 * 2, ttt_steps=2),
                                device="cpu", progress=False)
    assert report.device == "cpu" and report.steps == 2
    assert not audit.found, "\n".join(sorted(audit.found))


def test_realignment_continues_a_head_on_a_quantized_target(trained, target_dir, training_text, tmp_path):
    """--init: the FP target's head trained on for the W4 target keeps its vocabulary and moves on."""
    from safetensors.torch import load_file

    from quantkit.draft.trainer import train_head
    from quantkit.engine import quantize
    from quantkit.run import RunError

    from helpers import small_recipe

    w4 = tmp_path / "w4"
    quantize(target_dir, small_recipe("rtn-w4g128", tmp_path), w4, progress=False)
    out = tmp_path / "realigned"
    report = train_head(w4, out, settings(training_text, tokens=64 * 2 * 10, draft_vocab=None), init=trained[0],
                        progress=False)
    before, after = load_file(trained[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert torch.equal(before["d2t"], after["d2t"]) and report.draft_vocab == 128
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    with pytest.raises(RunError, match="draft vocabulary of 128 tokens, not 64"):
        train_head(w4, tmp_path / "other", settings(training_text, draft_vocab=64), init=trained[0], progress=False)


@pytest.fixture(scope="module")
def packable(tiny_checkpoint_factory, tmp_path_factory):
    """A target whose head's linears every W4 layout can pack (K, N multiples of 128 / 64), and its head."""
    target = tiny_checkpoint_factory(num_hidden_layers=8, num_key_value_heads=4, seed=5)
    return target, write_tiny_eagle3_head(tmp_path_factory.mktemp("packable") / "head", target, draft_vocab_size=128)


def _quantized(packable, tmp_path, recipe, **changes):
    from quantkit.draft.quantize import quantize_head

    from helpers import small_recipe

    target, head = packable
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / recipe
    return out, quantize_head(head, target, small_recipe(recipe, tmp_path, **changes), out, progress=False)


def test_quantized_heads_in_every_layout_decode_to_the_same_weights(packable, tmp_path):
    """GPTQ's solution written as GPTQ, Marlin and CPM.cu: each layout reads back to identical weights, and
    GPTQ's output error is below RTN's on every linear."""
    from safetensors.torch import load_file

    target, _ = packable
    config = MiniCPMForCausalLM.from_pretrained(target).config
    gptq_dir, gptq = _quantized(packable, tmp_path, "gptq-w4g128")
    weights = {}
    for fmt in ("gptq", "marlin", "cpmcu"):
        out = gptq_dir if fmt == "gptq" else _quantized(packable, tmp_path / fmt, "gptq-w4g128", format=fmt)[0]
        weights[fmt] = load_head(out, config).state_dict()
    for name in weights["gptq"]:
        assert torch.equal(weights["marlin"][name], weights["gptq"][name]), name
        assert torch.equal(weights["cpmcu"][name], weights["gptq"][name]), name
    _, rtn = _quantized(packable, tmp_path, "rtn-w4g128")
    for name, error in gptq["relative_output_error"].items():
        assert error < rtn["relative_output_error"][name], name
    cpmcu = load_file(tmp_path / "cpmcu" / "gptq-w4g128" / "model.safetensors")
    assert set(cpmcu) == {"d2t", "fc.qweight", "fc.scales", "lm_head.weight", "norm.weight",
                          "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                          "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.qkv_proj.qweight",
                          "midlayer.self_attn.qkv_proj.scales", "midlayer.self_attn.o_proj.qweight",
                          "midlayer.self_attn.o_proj.scales", "midlayer.mlp.gate_up_proj.qweight",
                          "midlayer.mlp.gate_up_proj.scales", "midlayer.mlp.down_proj.qweight",
                          "midlayer.mlp.down_proj.scales"}  # what CPM.cu's converter makes of an EAGLE-3 head
    assert cpmcu["d2t"].dtype == torch.int32 and cpmcu["lm_head.weight"].dtype == torch.float16


def test_a_quantized_head_drafts_and_keeps_greedy_output(packable, tmp_path):
    from quantkit.kernels.generate import load_text_generator

    target, _ = packable
    out, _ = _quantized(packable, tmp_path, "gptq-w4g128")
    plain = load_text_generator(target, dtype=torch.float32).generate([5, 17, 99, 3], max_new_tokens=12)
    drafted = load_text_generator(target, dtype=torch.float32, draft=out).generate([5, 17, 99, 3], max_new_tokens=12)
    assert drafted.tokens == plain.tokens


def test_head_quantization_refuses_other_formats_and_smoothing(packable, tmp_path):
    from quantkit.models.eagle3 import DraftHeadError

    with pytest.raises(DraftHeadError, match="draft heads are written as gptq, marlin, cpmcu"):
        _quantized(packable, tmp_path, "awq-w4g128")
    with pytest.raises(DraftHeadError, match="smooths or skips prefix tokens"):
        _quantized(packable, tmp_path, "marlin")


def test_w4_qat_of_a_head_writes_a_quantized_head_on_its_grid(packable, training_text, tmp_path):
    """--w4: the head trains through W4 g128 (straight-through) from the FP head and is written quantized
    (here in CPM.cu's layout); its linears read back on a 4-bit grid, and it drafts."""
    from safetensors.torch import load_file

    from quantkit.draft.trainer import train_head
    from quantkit.kernels.generate import load_text_generator

    target, head = packable
    out = tmp_path / "w4"
    train_head(target, out, settings(training_text, tokens=64 * 2 * 6, draft_vocab=None, w4="cpmcu"), init=head,
               progress=False)
    assert "midlayer.self_attn.qkv_proj.qweight" in load_file(out / "model.safetensors")
    config = MiniCPMForCausalLM.from_pretrained(target).config
    trained = load_head(out, config).state_dict()["fc.weight"]
    groups = trained.reshape(-1, 128)
    assert max(len(group.unique()) for group in groups) <= 16  # 4 bits: at most 16 values per group of 128
    plain = load_text_generator(target, dtype=torch.float32).generate([5, 17, 99, 3], max_new_tokens=8)
    drafted = load_text_generator(target, dtype=torch.float32, draft=out).generate([5, 17, 99, 3], max_new_tokens=8)
    assert drafted.tokens == plain.tokens
