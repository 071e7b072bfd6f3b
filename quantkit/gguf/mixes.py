"""Which GGUF type each tensor gets for a requested file type: llama.cpp's choices, in one table.

For the float types every matrix takes the type (``convert_hf_to_gguf.py --outtype``). For the
block types the choices are ``llama-quantize``'s (``llama_tensor_get_type``): the output matrix
(or the tied embedding that serves as it) gets Q6_K, or Q8_0 in a Q8_0 file or when its rows are
not whole 256-blocks; a K-quant that does not fit a tensor's rows falls back as llama.cpp's
does. Vectors (norms, rope factors) always stay F32.
"""
from __future__ import annotations

from gguf import LlamaFileType

from quantkit.gguf.types import TYPES, TensorType

FILE_TYPES: dict[str, LlamaFileType] = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q6_k": LlamaFileType.MOSTLY_Q6_K,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q4_1": LlamaFileType.MOSTLY_Q4_1,
}
FLOAT_FILE_TYPES = ("f32", "f16", "bf16")
# llama-quantize's replacement for a K-quant whose 256-block does not divide a tensor's rows
K_QUANT_FALLBACK = {"q6_k": "q8_0"}


def _fitting(type_name: str, name: str, k: int) -> TensorType:
    if not TYPES[type_name].fits(k) and type_name in K_QUANT_FALLBACK:
        type_name = K_QUANT_FALLBACK[type_name]
    if not TYPES[type_name].fits(k):
        raise ValueError(f"{name}: rows of {k} weights are not whole {type_name.upper()} blocks "
                         f"of {TYPES[type_name].block_size}")
    return TYPES[type_name]


def choose_type(file_type: str, name: str, shape: tuple[int, ...], tied_embeddings: bool) -> TensorType:
    """The type of GGUF tensor ``name`` (numpy shape ``shape``) in a ``file_type`` file."""
    if len(shape) == 1:
        return TYPES["f32"]
    if file_type in FLOAT_FILE_TYPES:
        return TYPES[file_type]
    is_output = name == "output.weight" or (tied_embeddings and name == "token_embd.weight")
    if is_output:
        return _fitting("q8_0" if file_type == "q8_0" else "q6_k", name, shape[-1])
    return _fitting(file_type, name, shape[-1])
