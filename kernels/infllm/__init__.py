"""InfLLM v2 trainable sparse attention of MiniCPM4/4.1 (docs/model.md, "InfLLM v2").

Three implementations of one algorithm: ``reference`` (readable PyTorch, the specification),
``cpu`` (fast CPU path) and the Triton kernels ``triton_stage1`` (scoring with the group reduction)
and ``triton_attention`` (block-sparse attention); tests tie the last two to the first.
``sparse_attention`` is the entry point for prefill and decode, ``sparse_tree_attention`` (``tree``)
for a draft tree's verification.
"""
from quantkit.kernels.infllm.attention import sparse_attention
from quantkit.kernels.infllm.cache import CompressedKeyCache
from quantkit.kernels.infllm.cpu import causal_attention_of_last_positions
from quantkit.kernels.infllm.reference import sparse_attention_reference
from quantkit.kernels.infllm.tree import sparse_tree_attention
from quantkit.models.sparse_attention import SparseAttentionConfig

__all__ = ["CompressedKeyCache", "SparseAttentionConfig", "causal_attention_of_last_positions", "sparse_attention",
           "sparse_attention_reference", "sparse_tree_attention"]
