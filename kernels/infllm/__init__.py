"""InfLLM v2 trainable sparse attention of MiniCPM4/4.1 (reference minicpm4.md §2).

Three implementations of one algorithm: ``reference`` (readable PyTorch, the specification),
``cpu`` (fast CPU path) and the Triton kernels ``triton_stage1`` (scoring with the group reduction)
and ``triton_attention`` (block-sparse attention); tests tie the last two to the first. ``sparse_attention`` is the entry point for prefill and decode.
"""
from quantkit.kernels.infllm.attention import dense_attention, sparse_attention
from quantkit.kernels.infllm.cache import CompressedKeyCache
from quantkit.kernels.infllm.config import SparseAttentionConfig
from quantkit.kernels.infllm.reference import sparse_attention_reference

__all__ = ["CompressedKeyCache", "SparseAttentionConfig", "dense_attention", "sparse_attention",
           "sparse_attention_reference"]
