"""Tiny random MiniCPM checkpoints for tests, and the MiniCPM4.1-8B shape without weights.

``write_tiny_checkpoint`` writes a complete HF folder (config, weights, generation config, a small
byte-level BPE tokenizer with the MiniCPM4.1 chat template) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load after ``import quantkit``. Same arguments give byte-identical files.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from quantkit.atomic import save_safetensors, write_json, write_text
from quantkit.models import CHAT_TEMPLATE
from quantkit.models.configuration_minicpm import MiniCPMConfig
from quantkit.models.decoder import weight_shapes
from quantkit.models.minicpm import MiniCPMForCausalLM

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 384

# Fixed training text: English, Chinese, digits and ChatML/reasoning markup, so that merges cover
# what the tests and chat template produce.
_TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog while the model thinks about the answer.",
    "Quantization maps each weight to a small grid; GPTQ and AWQ choose that grid with calibration data.",
    "<think>\nLet me think step by step.\n</think>\n\nThe answer is 42.",
    "user\nWhat is 12 + 30? /no_think\nassistant\nIt is 42. /think",
    "量化把权重映射到低比特网格。模型的回答应该保持不变。",
    "0123456789 3.14159 2.71828 1000000 2025-09-05",
) * 4

# MiniCPM4.1-8B 128K LongRoPE factors (OpenBMB README, "Long Context Extension"); the same list
# serves as short_factor and long_factor.
MINICPM41_128K_ROPE_FACTORS = (
    0.9982316082870437, 1.033048153422584, 1.0749920956484724, 1.1255096879436193,
    1.1863348602111476, 1.259543828902579, 1.3476188888731149, 1.4535223827776373,
    1.5807816745852985, 1.7335856049489526, 1.9168922912975785, 2.1365471404135326,
    2.3994084200118646, 2.713475511863602, 3.0880118452194134, 3.533650295140154,
    4.062463396503134, 4.687974098908333, 5.425075306704039, 6.289818967956352,
    7.29902962722721, 8.6357018163639, 10.210822723989212, 12.053807765671676,
    14.193944598909404, 16.65780676784363, 19.463620727694074, 22.628311203524586,
    26.150106147261315, 30.02526691405111, 34.23183327975347, 38.73811934094828,
    43.502489489729555, 48.47627117965394, 53.61139491762471, 58.857366522037935,
    64.16798299215064, 69.51359464319125, 74.86555458220285, 80.21497790341579,
    85.55322183307433, 90.89611806932027, 96.26245306514224, 101.68269304046481,
    107.18619510219668, 112.82253283014026, 118.63764063163615, 119.88866203644656,
    120.9462882391725, 121.837565139014, 122.58663780572562, 123.2147719894291,
    123.74049454862576, 124.17980424685767, 124.54641761955492, 124.85202548028222,
    125.10654406389756, 125.31835105170659, 125.49450117164764, 125.64091910903052,
    125.76256945356558, 125.86360463815589, 125.94749252260765, 126.01712561287873,
)

MINICPM41_SPARSE_CONFIG = {
    "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
    "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192,
}

# Tiny checkpoints: μP constants as in the 8B (scale_emb, scale_depth) but a logit divisor of
# hidden/64 so that it is not 1; LongRoPE over a context 4× the original, so its attention factor
# sqrt(1 + ln 4 / ln 64) ≈ 1.155 is exercised.
TINY_ORIGINAL_CONTEXT = 64
TINY_CONTEXT = 256


def minicpm41_8b_config() -> MiniCPMConfig:
    """MiniCPM4.1-8B's configuration (docs/model.md, "Configuration"), with the 128K LongRoPE factors."""
    return MiniCPMConfig(
        architectures=["MiniCPMForCausalLM"],
        vocab_size=73448,
        hidden_size=4096,
        intermediate_size=16384,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=[2, 73440],
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": list(MINICPM41_128K_ROPE_FACTORS),
            "long_factor": list(MINICPM41_128K_ROPE_FACTORS),
            "original_max_position_embeddings": 65536,
        },
        scale_emb=12,
        scale_depth=1.4,
        dim_model_base=256,
        mup_denominator=32,
        sparse_config=dict(MINICPM41_SPARSE_CONFIG),
        dtype=torch.bfloat16,
    )


def meta_model(config: MiniCPMConfig) -> MiniCPMForCausalLM:
    """The model with every parameter on the meta device: shapes and sizes, no memory, no weights."""
    with torch.device("meta"):
        return MiniCPMForCausalLM(config)


def build_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with MiniCPM's special tokens (<unk>=0, <s>=1, </s>=2) that prepends <s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def _tiny_config(tokenizer: Tokenizer, *, tied, longrope, same_rope_factors, num_hidden_layers, hidden_size,
                 intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size, attention_bias,
                 sparse_config, dtype) -> MiniCPMConfig:
    vocab_size = tokenizer.get_vocab_size() if vocab_size is None else vocab_size
    if vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()}")
    head_dim = head_dim or hidden_size // num_attention_heads
    rope_scaling = None
    if longrope:
        frequencies = head_dim // 2
        rope_scaling = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.5 * i for i in range(frequencies)],
            "long_factor": [1.0 + (0.5 if same_rope_factors else 2.0) * i for i in range(frequencies)],
            "original_max_position_embeddings": TINY_ORIGINAL_CONTEXT,
        }
    return MiniCPMConfig(
        architectures=["MiniCPMForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=TINY_CONTEXT,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=[tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<|im_end|>")],
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        attention_bias=attention_bias,
        scale_emb=12,
        scale_depth=1.4,
        dim_model_base=64,
        sparse_config=sparse_config,
        dtype=dtype,
    )


def _random_tensor(name: str, shape: tuple[int, ...], config: MiniCPMConfig,
                   generator: torch.Generator) -> torch.Tensor:
    """Scaled so activations stay O(1): linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1/scale_emb²), norm
    weights ~ 1 + N(0, 0.1²) (not all ones, so a misplaced norm weight shows), o_proj bias 0."""
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("o_proj.bias"):
        return torch.zeros(shape)
    if name.endswith(".bias"):
        return 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise / config.scale_emb
    return noise / math.sqrt(shape[1])


def _random_weights(config: MiniCPMConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = weight_shapes(config)
    return {name: _random_tensor(name, shapes[name], config, generator).to(dtype) for name in sorted(shapes)}


def _write_support_files(path: Path, config: MiniCPMConfig, tokenizer: Tokenizer) -> None:
    """config.json, generation config and the tokenizer files that go beside the weights."""
    config_dict = config.to_diff_dict()
    config_dict.pop("transformers_version")  # keep the files independent of the installed version
    write_json(path / "config.json", config_dict)
    write_json(
        path / "generation_config.json",
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id},
    )
    write_text(path / "tokenizer.json", tokenizer.to_str(pretty=True))
    write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "<|im_end|>",
            "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config.max_position_embeddings,
        },
    )


def write_sharded_checkpoint(path, config: MiniCPMConfig, *, seed: int = 0, progress: bool = False) -> Path:
    """A random checkpoint of any size (e.g. ``minicpm41_8b_config()``), written one decoder layer per
    shard so that it is never whole in memory; each tensor's generator is seeded from its name."""
    from tqdm.auto import tqdm

    from quantkit.checkpoint import INDEX_FILE

    path = Path(path)
    shapes = weight_shapes(config)
    shards: dict[str, list[str]] = {}
    for name in sorted(shapes):
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(part, []).append(name)
    weight_map = {}
    for number, (part, names) in enumerate(tqdm(sorted(shards.items()), desc="write shards", disable=not progress)):
        file = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            tensors[name] = _random_tensor(name, shapes[name], config, generator).to(config.dtype)
            weight_map[name] = file
        save_safetensors(path / file, tensors, metadata={"format": "pt"})
    write_json(path / INDEX_FILE, {"metadata": {}, "weight_map": weight_map})
    _write_support_files(path, config, build_tiny_tokenizer())
    return path


def write_tiny_checkpoint(
    path,
    *,
    tied: bool = False,
    longrope: bool = True,
    same_rope_factors: bool = False,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_attention_heads: int = 16,
    num_key_value_heads: int = 1,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    attention_bias: bool = False,
    sparse_config: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random MiniCPM checkpoint folder at ``path`` and return it (GQA 16:1 by default).

    ``same_rope_factors``: LongRoPE's long and short factor lists identical, as in the shipped
    MiniCPM4.1 configs (mlx-lm applies the long factors at every length, so only then does it agree
    with MiniCPM's own modeling, which picks between the two)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(
        tokenizer, tied=tied, longrope=longrope, same_rope_factors=same_rope_factors,
        num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, vocab_size=vocab_size,
        attention_bias=attention_bias, sparse_config=sparse_config, dtype=dtype,
    )
    save_safetensors(path / "model.safetensors", _random_weights(config, seed, dtype), metadata={"format": "pt"})
    _write_support_files(path, config, tokenizer)
    return path


def write_tiny_eagle3_head(path, target_dir, *, seed: int = 0, draft_vocab_size: int | None = None,
                           aux_states: str = "cpmcu", dtype: torch.dtype = torch.float32) -> Path:
    """A random EAGLE-3 head for the checkpoint at ``target_dir``, in the official layout (weights scaled
    as ``_random_tensor`` does; the draft vocabulary from random token counts)."""
    from quantkit.models.eagle3 import Eagle3Config, Eagle3Head, draft_vocabulary, save_head

    target = MiniCPMConfig.from_pretrained(target_dir)
    config = Eagle3Config(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size // 2, target_hidden_size=target.hidden_size,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings, aux_states=aux_states)
    head = Eagle3Head(config, target)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.copy_(_random_tensor(name, tuple(parameter.shape), target, generator))
        counts = torch.randint(0, 1000, (target.vocab_size,), generator=generator)
        head.d2t, head.t2d = draft_vocabulary(counts, config.draft_vocab_size)
    return save_head(head.to(dtype), path)
