"""The generation runtime (quantkit.kernels): its forward pass against the model it re-plays, the
KV cache, chunked prefill, sampling, stop tokens, streaming text, multi-turn chat, roofline
arithmetic and the CLI."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.device import check_device, require_capability
from quantkit.kernels.attention import make_attention, sparse_config_for
from quantkit.kernels.chat import ChatSession
from quantkit.kernels.generate import TextGenerator, TextStream, load_text_generator
from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.load import load_runtime_model
from quantkit.kernels.model import RuntimeModel
from quantkit.kernels.roofline import HARDWARE, roofline, weight_bytes_per_token
from quantkit.kernels.sampling import Sampler, Sampling
from quantkit.loading import load_model

from helpers import built_cpu_ops

# Float32 runtime against the float32 model: the same operations in another order (fused q/k/v,
# RoPE through roll): differences are float32 rounding, far below 1e-4 on logits of size ~10.
FP32_LOGIT_TOLERANCE = 1e-4


def _runtime(model_dir, dtype=torch.float32, sparse="off", overrides=None):
    model = load_runtime_model(model_dir, dtype)
    return RuntimeModel(model, make_attention(sparse_config_for(sparse, model.config.sparse_attention, overrides)))


@pytest.mark.parametrize("variant", [dict(), dict(tied=True), dict(attention_bias=True, longrope=False),
                                     dict(num_key_value_heads=4)])
def test_forward_equals_the_model_in_prefill_chunks_and_decode(tiny_checkpoint_factory, variant):
    model_dir = tiny_checkpoint_factory(**variant)
    reference = load_model(model_dir)
    tokens = torch.randint(0, reference.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(tokens[None]).logits[0]
    runtime = _runtime(model_dir)
    cache = runtime.new_cache()
    got = torch.cat([runtime.forward(tokens[:17], cache, all_logits=True),      # prefill
                     runtime.forward(tokens[17:30], cache, all_logits=True)]     # a later chunk
                    + [runtime.forward(tokens[i:i + 1], cache, all_logits=True) for i in range(30, 40)])  # decode
    assert cache.length == 40
    assert (got - want).abs().max() < FP32_LOGIT_TOLERANCE


def test_rope_tables_read_what_the_rotary_module_computes():
    """Rows of ``RopeTables`` (made at the first call, doubled as positions pass them, at most the model's
    max_position_embeddings) equal the rotary module's cos and sign-flipped sin; past that length, where
    LongRoPE takes its long factors for every position, they are computed with those."""
    from quantkit.kernels.model import RopeTables
    from quantkit.models.decoder import MiniCPMRotaryEmbedding

    frequencies, limit = 8, 1500  # tables of 1024 rows, then of 1500 (not 2048)
    config = SimpleNamespace(head_dim=2 * frequencies, rope_theta=10000.0, max_position_embeddings=limit,
                             rope_scaling={"short_factor": [1.0 + 0.5 * i for i in range(frequencies)],
                                           "long_factor": [1.0 + 2.0 * i for i in range(frequencies)],
                                           "original_max_position_embeddings": limit})
    rotary = MiniCPMRotaryEmbedding(config)
    tables = RopeTables(rotary)
    for positions, rows in (([0, 1, 2], 1024), ([1023], 1024), ([7, 1024, 1499], limit), ([5, 1500], limit)):
        positions = torch.tensor(positions)
        cos, sin = (t[0] for t in rotary(positions.float(), positions[None]))
        got_cos, got_signed_sin = tables(positions)
        assert torch.equal(got_cos, cos)
        assert torch.equal(got_signed_sin, torch.cat((-sin[:, :frequencies], sin[:, frequencies:]), dim=-1))
        assert len(tables._cos) == rows
    short = tables(torch.tensor([5]))[0]
    assert not torch.equal(short, tables(torch.tensor([5, 1500]))[0][:1])  # the long factors past the limit


def test_greedy_generation_equals_transformers_generate(tiny_checkpoint):
    reference = load_model(tiny_checkpoint)
    prompt = [5, 17, 99, 3, 250, 41]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    generator = TextGenerator(_runtime(tiny_checkpoint), tokenizer=None, stop_tokens=set(), prefill_chunk=4)
    assert list(generator.tokens(prompt, max_new_tokens=24)) == expected


def test_kv_cache_grows_and_crops():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    chunks = [torch.randn(2, n, 4) for n in (200, 100, 1)]  # crosses the initial 256 capacity
    for chunk in chunks:
        for layer in range(2):
            keys, values = cache.append(layer, chunk, -chunk)
        cache.advance(chunk.shape[1])
    everything = torch.cat(chunks, dim=1)
    assert torch.equal(keys, everything) and torch.equal(values, -everything)
    assert cache.nbytes() == 2 * 2 * 2 * 4 * 301 * 4
    cache.crop(250)
    keys, _ = cache.append(0, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert keys.shape[1] == 251 and torch.equal(keys[:, :250], everything[:, :250])
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(400)


def test_sampler_greedy_top_p_and_seed():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    assert Sampler(Sampling())(logits) == 0
    nucleus = Sampler(Sampling(temperature=1.0, top_p=0.85))
    probs = torch.softmax(logits.double(), -1)
    assert probs[:2].sum() < 0.85 <= probs[:3].sum()  # the third token crosses top_p: it is kept
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(nucleus.probabilities(logits)[:3], kept) and nucleus.probabilities(logits)[3:].sum() == 0
    draws = torch.tensor([nucleus(logits) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=5).double() / 4000
    sigma = (kept * (1 - kept) / 4000).sqrt()
    assert frequencies[3:].sum() == 0 and ((frequencies[:3] - kept).abs() < 4.5 * sigma).all()
    again = Sampler(Sampling(temperature=1.0, top_p=0.85))
    assert [again(logits) for _ in range(4000)] == draws.tolist()  # same seed, same draws
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def test_text_stream_pieces_add_up_to_the_decoded_text(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    text = "Hello  world — naïve café 東京 🙂 def f(x):\n    return x ** 2"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push(token) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)  # a split emoji is held back, never shown broken


class _ScriptedRuntime:
    """A runtime whose logits put all mass on a scripted token sequence (for stop-token logic)."""

    config = SimpleNamespace(max_position_embeddings=64)

    def __init__(self, script):
        self.script, self.calls = script, 0
        self.attention = make_attention(None)

    def new_cache(self, compressed_keys=None):
        return KVCache(1, 1, 1, torch.float32)

    def forward(self, tokens, cache, all_logits=False):
        cache.advance(tokens.shape[0])
        logits = torch.full((10,), -1e9)
        logits[self.script[min(self.calls, len(self.script) - 1)]] = 0
        self.calls += 1
        return logits


def test_generation_stops_at_a_stop_token_or_the_length_limit():
    generator = TextGenerator(_ScriptedRuntime([4, 5, 6, 2, 7]), tokenizer=None, stop_tokens={2})
    timings: dict = {}
    assert list(generator.tokens([1, 1], max_new_tokens=10, timings=timings)) == [4, 5, 6]
    assert timings["stop_reason"] == "stop token"
    generator = TextGenerator(_ScriptedRuntime([4, 5, 6, 2, 7]), tokenizer=None, stop_tokens={2})
    assert list(generator.tokens([1], max_new_tokens=2, timings=timings)) == [4, 5]
    assert timings["stop_reason"] == "length"
    with pytest.raises(ValueError, match="empty"):
        list(generator.tokens([], max_new_tokens=2))


def test_chat_keeps_the_cache_between_turns_and_matches_a_fresh_run(tiny_checkpoint):
    generator = load_text_generator(tiny_checkpoint, dtype=torch.float32)
    session = ChatSession(generator)
    first = "".join(session.reply("hello there", max_new_tokens=6))
    kept_after_first = session.cache.length
    second = "".join(session.reply("and again", max_new_tokens=6))
    assert kept_after_first > 0 and session.messages[1]["content"] == first
    # the second turn's answer equals a fresh generator's answer to the whole conversation
    conversation = session.messages[:3]
    fresh = generator.generate(generator.chat_prompt(conversation, enable_thinking=False), max_new_tokens=6)
    assert fresh.text == second


def test_chat_prompt_thinking_switch(default_model):
    generator = load_text_generator(default_model)
    messages = [{"role": "user", "content": "hi"}]
    off = generator.tokenizer.decode(generator.chat_prompt(messages, enable_thinking=False))
    on = generator.tokenizer.decode(generator.chat_prompt(messages, enable_thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_the_tokenizer_process_answers_as_the_tokenizer_here(default_model, tiny_checkpoint, tmp_path):
    """What `generate` and `chat` ask of their tokenizer, answered by the child process they start before
    torch: the same ids, text and turn ends as in this process, and the same one-line errors."""
    from quantkit.chat_template import ChatTemplateError
    from quantkit.errors import CheckpointError
    from quantkit.kernels.tokenizer_process import RuntimeTokenizer, TokenizerProcess

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la tour Eiffel ? 🗼"}]
    for model in (default_model, tiny_checkpoint):
        here, there = RuntimeTokenizer.load(model), TokenizerProcess.start(model)
        assert isinstance(there, TokenizerProcess)
        for thinking in (False, True):
            ids = here.chat_ids(messages, add_generation_prompt=True, enable_thinking=thinking)
            assert there.chat_ids(messages, add_generation_prompt=True, enable_thinking=thinking) == ids
        text = "Ünïcode, spaces  and\nnew lines <|im_end|>"
        assert there.encode(text) == here.encode(text)
        for skip in (False, True):
            assert there.decode(here.encode(text), skip_special_tokens=skip) == here.decode(here.encode(text), skip)
        assert there.end_ids() == here.end_ids() and there.largest_token() == here.largest_token()
    hostile = Path(shutil.copytree(tiny_checkpoint, tmp_path / "hostile"))
    (hostile / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        TokenizerProcess.start(hostile).chat_ids(messages, add_generation_prompt=True)
    (hostile / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="its tokenizer cannot be loaded"):
        TokenizerProcess.start(hostile).encode("hi")


def test_default_model_answers_and_stops(default_model):
    generator = load_text_generator(default_model)
    result = generator.generate(generator.chat_prompt([{"role": "user", "content": "What is the capital of France?"}],
                                                      enable_thinking=False), max_new_tokens=40)
    assert "Paris" in result.text and result.stop_reason == "stop token"


def test_roofline_arithmetic(tiny_checkpoint):
    from quantkit.kernels.infllm import SparseAttentionConfig
    from quantkit.models import MiniCPMConfig

    config = MiniCPMConfig.from_pretrained(tiny_checkpoint)
    model = load_model(tiny_checkpoint)
    expected_weights = 2 * sum(t.numel() for name, t in model.state_dict().items()
                               if name != "model.embed_tokens.weight")
    assert weight_bytes_per_token(tiny_checkpoint) == expected_weights
    per_key = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    dense = roofline(tiny_checkpoint, "rtx4090", 65536, None)
    assert dense.kv_bytes == 2 * 65536 * per_key
    assert math.isclose(dense.decode_tokens_per_second_ceiling, 1008e9 / (expected_weights + 2 * 65536 * per_key))
    sparse = roofline(tiny_checkpoint, "orin", 65536, SparseAttentionConfig())
    # 64 top-k + 32 window blocks of 64 tokens, plus the fine (stride 16) and coarse (stride 64) keys
    assert sparse.kv_bytes == (2 * 96 * 64 + 65536 // 16 + 65536 // 64) * per_key
    assert sparse.attention == "InfLLM v2"
    assert roofline(tiny_checkpoint, "orin", 4096, SparseAttentionConfig()).attention == "dense"
    assert HARDWARE["orin"].memory_bandwidth_gb_s == 204.8
    with pytest.raises(ValueError, match="unknown hardware"):
        roofline(tiny_checkpoint, "h100", 10, None)


def test_roofline_prefill_arithmetic(tiny_checkpoint):
    """The prefill ceiling by hand on the tiny checkpoint (2 layers, hidden 256, MLP 512, 16 query heads of 16,
    1 KV head, vocabulary 384): every linear per token, the LM head once, causal attention."""
    from quantkit.kernels.infllm import SparseAttentionConfig
    from quantkit.models import MiniCPMConfig

    config = MiniCPMConfig.from_pretrained(tiny_checkpoint)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, 256, 512, 16, 1, 16, 384)
    # multiply-accumulates per token and layer: q, o 256x256; k, v 16x256; gate, up, down 512x256
    layer_macs = 2 * 256 * 256 + 2 * 16 * 256 + 3 * 512 * 256
    assert layer_macs == 532_480
    dense = roofline(tiny_checkpoint, "rtx4090", 1024, None)
    assert dense.math == "bf16" and dense.prefill_note is None
    assert dense.prefill_linear_ops == 2 * 2 * layer_macs * 1024 == 2_181_038_080
    # the LM head once (384 x 256), and QK^T + PV over the 1024 * 1025 / 2 keys the causal queries see
    assert dense.prefill_bf16_ops == 2 * (384 * 256 + 2 * 16 * 16 * 2 * (1024 * 1025 // 2)) == 1_074_987_008
    ops = 2_181_038_080 + 1_074_987_008
    assert dense.ops_per_token == ops / 1024
    assert math.isclose(dense.prefill_tokens_per_second_ceiling, 165.2e12 * 1024 / ops)
    assert math.isclose(roofline(tiny_checkpoint, "orin", 1024, None).prefill_tokens_per_second_ceiling,
                        42.5e12 * 1024 / ops)
    # InfLLM v2: each query attends to at most 96 blocks of 64 keys and scores its fine (stride 16) and
    # coarse (stride 64) compressed keys
    sparse = roofline(tiny_checkpoint, "orin", 65536, SparseAttentionConfig())
    full = sum(min(n, 96 * 64) for n in range(1, 65537))
    compressed = sum(n // 16 + n // 64 for n in range(1, 65537))
    assert sparse.prefill_linear_ops == 2 * 2 * layer_macs * 65536
    assert sparse.prefill_bf16_ops == 2 * (384 * 256 + 2 * 16 * 16 * (2 * full + compressed))
    assert math.isclose(sparse.prefill_tokens_per_second_ceiling,
                        42.5e12 * 65536 / (sparse.prefill_linear_ops + sparse.prefill_bf16_ops))
    assert "not a measurement" in dense.note
    peaks = {name: {kind: peak.tera_ops for kind, peak in spec.tensor_peaks.items()} for name, spec in HARDWARE.items()}
    assert peaks == {"rtx4090": {"bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6},
                     "orin": {"int8": 85.0, "bf16": 42.5, "fp16": 42.5}}
    assert all(peak.source for spec in HARDWARE.values() for peak in spec.tensor_peaks.values())


def _compressed_tensors_artifact(source, out, grid):
    """``source`` with every decoder linear stored on compressed-tensors ``grid`` by quantkit's writer (random
    integer codes, or the weights cast to E4M3): the roofline reads only the config and the tensor headers."""
    from safetensors.torch import save_file

    from quantkit.checkpoint import CheckpointReader
    from quantkit.formats.compressed_tensors import CompressedTensors
    from quantkit.fp8 import FP8Tensor
    from quantkit.models.layers import LINEARS, layer_prefix

    from helpers import random_record

    out.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, out / path.name)
    reader = CheckpointReader(source)
    tensors = {name: reader.get(name) for name in reader.names}
    fmt = CompressedTensors()
    for index in range(json.loads((source / "config.json").read_text())["num_hidden_layers"]):
        prefix = layer_prefix(index)
        weights = {linear: tensors.pop(f"{prefix}{linear}.weight") for linear in LINEARS}
        float_grid = getattr(grid, "float_grid", None)
        records = {linear: FP8Tensor.quantize(w.float(), float_grid) if float_grid
                   else random_record(grid, *w.shape, seed=index) for linear, w in weights.items()}
        tensors |= fmt.write_layer(records, prefix)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config(grid)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def w8a8_artifacts(tiny_checkpoint_factory, tmp_path_factory):
    """INT8 W8A8, FP8 W8A8 and W4A16 compressed-tensors artifacts of the bf16 tiny checkpoint."""
    from quantkit.formats.compressed_tensors import CompressedTensorsGrid
    from quantkit.quant import QuantConfig

    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("roofline_w8a8")
    grids = {"int8-w8a8": CompressedTensorsGrid(8, -1, True, scale_dtype=torch.bfloat16, activations="int8-dynamic"),
             "fp8-w8a8": CompressedTensorsGrid(8, -1, True, scale_dtype=torch.bfloat16, weights="fp8",
                                               activations="fp8-dynamic"),
             "w4a16": QuantConfig(4, 128, True, scale_dtype=torch.bfloat16)}
    return source, {name: _compressed_tensors_artifact(source, out / name, grid) for name, grid in grids.items()}


def test_roofline_prefill_takes_the_artifacts_math(w8a8_artifacts):
    """INT8 W8A8 runs its linears at the int8 peak, FP8 W8A8 at the fp8 peak (none on the Orin), weight-only
    formats in bf16; the LM head (left in 16 bits) and attention at the bf16 peak."""
    source, artifacts = w8a8_artifacts
    reference = roofline(source, "rtx4090", 1024, None)
    for name, hardware, want, linear_peak in (("int8-w8a8", "rtx4090", "int8", 660.6e12),
                                              ("int8-w8a8", "orin", "int8", 85.0e12),
                                              ("fp8-w8a8", "rtx4090", "fp8", 330.3e12),
                                              ("w4a16", "orin", "bf16", 42.5e12)):
        got = roofline(artifacts[name], hardware, 1024, None)
        assert got.math == want and got.prefill_note is None
        assert (got.prefill_linear_ops, got.prefill_bf16_ops) == (reference.prefill_linear_ops,
                                                                  reference.prefill_bf16_ops)
        bf16_peak = HARDWARE[hardware].tensor_peaks["bf16"].tera_ops * 1e12
        assert math.isclose(got.prefill_tokens_per_second_ceiling,
                            1024 / (got.prefill_linear_ops / linear_peak + got.prefill_bf16_ops / bf16_peak))
    fp8_on_orin = roofline(artifacts["fp8-w8a8"], "orin", 1024, None)
    assert fp8_on_orin.math == "fp8" and fp8_on_orin.prefill_tokens_per_second_ceiling is None
    assert "no fp8 tensor cores" in fp8_on_orin.prefill_note
    assert fp8_on_orin.decode_tokens_per_second_ceiling > 0  # the decode ceiling stands
    runner = CliRunner()
    result = runner.invoke(main, ["roofline", "--hardware", "orin", "--model", str(artifacts["fp8-w8a8"]),
                                  "--context", "1024", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["results"][0]["math"] == "fp8" and payload["results"][0]["prefill_tokens_per_second_ceiling"] is None
    assert "fp8" not in payload["tensor_peaks"] and payload["tensor_peaks"]["int8"]["tera_ops"] == 85.0
    result = runner.invoke(main, ["roofline", "--hardware", "orin", "--model", str(artifacts["fp8-w8a8"])])
    assert result.exit_code == 0, result.output
    assert all(text in result.output for text in ("prefill tok/s ceiling", "n/a", "no fp8 tensor cores"))


def test_devices_below_ampere_and_missing_cuda_are_refused():
    require_capability((8, 9))
    require_capability((8, 7))
    with pytest.raises(RuntimeError, match="compute capability 7.5.*8.0 or newer"):
        require_capability((7, 5))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            check_device("cuda")


def test_cli_generate_chat_and_roofline(tiny_checkpoint):
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--model", str(tiny_checkpoint), "--prompt", "hello", "--raw",
                                  "--max-new-tokens", "5", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert len(payload["tokens"]) <= 5 and payload["prompt_tokens"] > 0
    result = runner.invoke(main, ["chat", "--model", str(tiny_checkpoint), "--max-new-tokens", "3"],
                           input="hello\n/reset\nagain\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("model> ") == 2
    result = runner.invoke(main, ["roofline", "--hardware", "orin", "--model", str(tiny_checkpoint),
                                  "--context", "1024", "--context", "65536", "--sparse", "on", "--json"])
    assert result.exit_code == 0, result.output
    attention = [r["attention"] for r in json.loads(result.output)["results"]]
    assert attention == ["dense", "InfLLM v2"]
    result = runner.invoke(main, ["generate", "--model", str(tiny_checkpoint), "--prompt", "x",
                                  "--sparse-config", "{bad"])
    assert result.exit_code != 0 and "not valid JSON" in result.output


def test_eval_ppl_through_the_runtime_dense_and_sparse(tiny_checkpoint):
    runner = CliRunner()
    base = ["eval", "ppl", "--model", str(tiny_checkpoint), "--max-tokens", "600", "--window", "512", "--json"]
    reference = json.loads(runner.invoke(main, base).output)["perplexity"]
    dense = json.loads(runner.invoke(main, base + ["--runtime", "--sparse", "off"]).output)["perplexity"]
    result = runner.invoke(main, base + ["--runtime", "--sparse", "on", "--sparse-config",
                                         '{"dense_len": 128, "window_size": 64, "topk": 2}'])
    assert result.exit_code == 0, result.output
    sparse = json.loads(result.output)["perplexity"]
    assert abs(dense / reference - 1) < 0.01  # bf16 runtime vs float32 reference
    assert sparse != dense  # 4 of 8 blocks attended: a different (approximate) model
    refused = runner.invoke(main, base + ["--sparse", "on"])
    assert refused.exit_code != 0 and "need --runtime" in refused.output


def test_fused_cpu_operators_match_their_pytorch_specification():
    import torch.nn.functional as F

    from quantkit.kernels.infllm import causal_attention_of_last_positions
    from quantkit.kernels.model import rotate

    ops = built_cpu_ops()
    g = torch.Generator().manual_seed(0)
    bf16_step = 2**-7  # relative spacing of bf16: one rounding of the same float32 value may differ by it

    x, weight = torch.randn(3, 576, generator=g) * 5, torch.rand(576, generator=g) + 0.5
    want = F.rms_norm(x, (576,), weight=weight, eps=1e-5)
    assert ((ops.rms_norm_bf16(x, weight, 1e-5).float() - want).abs() <= want.abs() * bf16_step + 1e-6).all()

    q_heads, kv_heads, dim, start, tokens = 9, 3, 64, 5, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    cos, sin = torch.randn(2, tokens, dim, generator=g)
    keys, values = torch.zeros(2, kv_heads, 16, dim).bfloat16()
    query = ops.rope_and_store(qkv, cos, sin, keys, values, start, q_heads, kv_heads)
    heads = qkv.view(tokens, -1, dim).transpose(0, 1)
    rotated = rotate(heads[:q_heads + kv_heads], cos, sin, torch.float32)
    assert torch.allclose(query, rotated[:q_heads], atol=1e-5)
    written = keys[:, start:start + tokens].float()
    assert ((written - rotated[q_heads:]).abs() <= rotated[q_heads:].abs() * bf16_step + 1e-6).all()
    assert torch.equal(values[:, start:start + tokens], heads[q_heads + kv_heads:])
    assert keys[:, :start].abs().sum() == 0 and keys[:, start + tokens:].abs().sum() == 0

    cache_k, cache_v = torch.randn(2, kv_heads, 40, dim, generator=g).bfloat16()
    one = torch.randn(q_heads, 1, dim, generator=g)
    got = ops.decode_attention(one, cache_k, cache_v, 33, dim ** -0.5).float()
    want = causal_attention_of_last_positions(one, cache_k[:, :33].float(), cache_v[:, :33].float())
    want = want.transpose(0, 1).reshape(1, -1)
    assert ((got - want).abs() <= want.abs() * bf16_step + 1e-3).all()  # + fast-math exp

    gate_up = torch.randn(2, 2 * 100, generator=g).bfloat16()
    want = (F.silu(gate_up[:, :100].float()) * gate_up[:, 100:].float())
    assert ((ops.silu_mul(gate_up).float() - want).abs() <= want.abs() * bf16_step + 1e-6).all()


def test_fused_and_plain_runtime_paths_agree(tiny_checkpoint):
    reference = load_model(tiny_checkpoint)
    tokens = torch.randint(0, reference.config.vocab_size, (60,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = torch.log_softmax(reference(tokens[None]).logits[0].double(), -1)
    runtime = _runtime(tiny_checkpoint, torch.bfloat16)
    assert runtime._ops is not None
    results = {}
    for fused in (True, False):
        ops, runtime._ops = runtime._ops, runtime._ops if fused else None
        cache = runtime.new_cache()
        logits = [runtime.forward(tokens[:40], cache, all_logits=True)]
        logits += [runtime.forward(tokens[i:i + 1], cache, all_logits=True) for i in range(40, 60)]
        runtime._ops = ops
        got = torch.log_softmax(torch.cat(logits).double(), -1)
        results[fused] = (want.exp() * (want - got)).sum(-1).mean()
    # both are bf16 renderings of the float32 model: small KL, and of the same size
    assert results[True] < 5e-3 and results[False] < 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_equals_sdpa_with_the_boolean_mask(dtype):
    """A verification's attention bias (made once per forward, each KV head's query heads folded into
    rows) gives SDPA's own result bit for bit: causal attention for a verification after a cache, and a
    tree's mask."""
    import torch.nn.functional as F

    from quantkit.kernels.attention import DenseAttention
    from quantkit.kernels.infllm import causal_attention_of_last_positions
    from quantkit.kernels.model import DecoderRunner, VerificationAttention, masked_attention

    g = torch.Generator().manual_seed(0)
    runner = DecoderRunner((9, 3, 16), 1e-5, 1.0, dtype, dtype, DenseAttention())
    cache = KVCache(1, 3, 16, dtype)
    cache.length = 10
    assert runner.verification_mask(None, 1, cache) is None  # one row: the attention's own decode path

    def bias(mask):
        return VerificationAttention(mask, cache.length, (9, 3, 16), dtype).bias

    for length in (4, 13):
        q = torch.randn(9, length, 16, generator=g).to(dtype)
        k, v = torch.randn(2, 3, 10 + length, 16, generator=g).to(dtype)
        got = masked_attention(q, k, v, bias(runner.verification_mask(None, length, cache)))
        assert torch.equal(got, causal_attention_of_last_positions(q, k, v))
        mask = torch.rand(length, 10 + length, generator=g) < 0.5
        mask[:, 0] = True
        got = masked_attention(q, k, v, bias(runner.verification_mask(mask, length, cache)))
        want = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads,dim,cached,tokens", [((9, 3), 64, 517, 4), ((9, 3), 64, 517, 13),
                                                      ((32, 2), 128, 130, 13), ((9, 3), 64, 64, 1)],
                         ids=["default-chain", "default-tree", "8b-tree", "one-row"])
def test_fused_verification_attention_equals_masked_sdpa(heads, dim, cached, tokens):
    """The fused kernel of a speculative round's attention (every cached key, and of the new ones what
    each row's mask allows) against its specification, SDPA with the additive bias, on bf16 caches: the
    default model's head shape (3 query heads a KV head: 12 / 39 rows a problem) and MiniCPM4.1-8B's
    (16: 208 rows), a chain's causal mask and a tree's random lineages, a cache that ends inside a block
    and one that fills its last. bf16 probabilities (as SDPA's bf16 path): within 1 % of the output's
    scale."""
    from quantkit import cpu_ops
    from quantkit.kernels.infllm import cpu as infllm_cpu
    from quantkit.kernels.model import VerificationAttention, masked_attention

    ops = cpu_ops.load()
    assert ops is not None, "the compiled operators must build on every CPU"
    g = torch.Generator().manual_seed(tokens)
    (q_heads, kv_heads), total = heads, cached + tokens
    q = torch.randn(q_heads, tokens, dim, generator=g).bfloat16()
    k, v = torch.randn(2, kv_heads, total, dim, generator=g).bfloat16()
    parents = [-1] + [int(torch.randint(-1, t, (1,), generator=g)) for t in range(1, tokens)]
    new = torch.eye(tokens, dtype=torch.bool)
    for t, parent in enumerate(parents):
        if parent >= 0:
            new[t] |= new[parent]
    for visible in (torch.ones(tokens, tokens, dtype=torch.bool).tril(), new):
        mask = torch.cat([torch.ones(tokens, cached, dtype=torch.bool), visible], dim=1)
        attention = VerificationAttention(mask, cached, (q_heads, kv_heads, dim), torch.bfloat16)
        # The kernel itself, as this CPU's build computes it (AVX-512 or the portable loops) ...
        got = ops.verify_attention(q, k, v, cached, visible, infllm_cpu.DENSE_DECODE_BLOCK, dim ** -0.5).float()
        want = masked_attention(q, k, v, attention.bias).float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max()
        # ... and the runtime's dispatch, which takes the kernel only on the builds that beat SDPA.
        dispatched = attention(q, k, v, 0, None).float()
        if ops.infllm_isa() in infllm_cpu.DENSE_DECODE_ISAS:  # the kernel's float32 sums, handed on in q's dtype
            assert torch.equal(dispatched, got.to(q.dtype).float())
        else:
            assert torch.equal(dispatched, want)


def test_fused_verification_attention_rejects_a_row_that_does_not_see_itself():
    from quantkit import cpu_ops

    ops = cpu_ops.load()
    q = torch.randn(3, 2, 64).bfloat16()
    k = v = torch.randn(1, 10, 64).bfloat16()
    with pytest.raises(RuntimeError, match="token 1 must see itself"):
        ops.verify_attention(q, k, v, 8, torch.tensor([[True, False], [True, False]]), 64, 0.125)


def test_a_build_lock_left_by_a_killed_process_does_not_block_the_next_load():
    """torch takes a lock file on every load of the compiled operators and waits forever for one a
    SIGKILLed process left (quantize loads them too, and the reliability suite kills it): load() clears it."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from quantkit.cpu_ops import EXTENSION

    lock = Path(_get_build_directory(EXTENSION, verbose=False)) / "lock"
    lock.touch()
    done = subprocess.run([sys.executable, "-c", "from quantkit import cpu_ops; assert cpu_ops.load()"],
                          timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()
