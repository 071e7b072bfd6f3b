"""The programs that read quantkit's outputs, as a model card shows them (``Format.consumers``; a GGUF
file's is ``LLAMA_CPP``). Which program reads which format: docs/formats.md, "Which consumer reads what"."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Consumer:
    """How one program runs a published repository: a code block, and why it looks as it does."""

    title: str
    language: str
    # str.format fields: repo, ref, remote (Python keyword), remote_flag (CLI), kv_cache_flag (CLI: an FP8 KV
    # cache whose scales the artifact states), register, local, file_type
    command: str
    note: str = ""
    library: str | None = None  # the Hub's library_name of a repository this program reads first
    # it reads config.json through transformers' AutoConfig, which knows model_type minicpm only from the
    # code config.json's auto_map names (quantkit/models/remote_code.py): no auto_map, no run
    needs_auto_map: bool = False


TRANSFORMERS = Consumer(
    "transformers", "python",
    '{register}from transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
    'tokenizer = AutoTokenizer.from_pretrained("{repo}"{remote})\n'
    'model = AutoModelForCausalLM.from_pretrained("{repo}", device_map="auto"{remote})',
    "transformers loads GPTQ and AWQ checkpoints through GPTQModel: `pip install gptqmodel optimum`.",
    library="transformers")
VLLM = Consumer("vLLM", "bash", "vllm serve {repo}{remote_flag}{kv_cache_flag}",
                "vLLM takes the method from `quantization_config` (GPTQ runs on its Marlin kernels).",
                needs_auto_map=True)
SGLANG = Consumer("SGLang", "bash", "python -m sglang.launch_server --model-path {repo}{remote_flag}{kv_cache_flag}")
CPMCU = Consumer(
    "CPM.cu", "bash",
    'hf download {repo} --local-dir {local}\npython -m cpmcu.cli --model-path {local} --prompt-text "Hello"',
    "CPM.cu treats a model as quantized only when its folder's name says so (`marlin`, `gptq`, ...).")
QUANTKIT = Consumer("quantkit's runtime", "bash", 'quantkit generate --model {ref} --prompt "Hello"\n'
                                                  'quantkit chat --model {ref}')
LLAMA_CPP = Consumer("llama.cpp", "bash", "llama-cli -hf {repo}:{file_type}\nllama-server -hf {repo}:{file_type}")
MLX_LM = Consumer("mlx-lm", "bash", 'pip install "mlx-lm>=0.32"\nmlx_lm.generate --model {repo} --prompt "Hello"',
                  "mlx-lm reads `config.json`'s `quantization` (group size, bits) and the packed uint32 "
                  "weights with their scales and biases; Apple silicon, or `mlx[cpu]` on Linux.", library="mlx")
# An artifact stored unquantized (a fake-quantized QAT checkpoint, a converted GGUF file): what reads a
# MiniCPM checkpoint reads it, with no quantization backend.
UNQUANTIZED = (replace(TRANSFORMERS, note=""), replace(VLLM, note=""), QUANTKIT)
