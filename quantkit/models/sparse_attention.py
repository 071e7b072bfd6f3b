"""InfLLM v2 settings: MiniCPM4/4.1's ``sparse_config`` (docs/model.md, "InfLLM v2").

Missing keys take MiniCPM4.1-8B's values, as the official modeling code reads each key with
``sparse_config.get(key, default)``; unknown keys and values the algorithm cannot honour are errors
(the official code would silently ignore a misspelt key and run dense or with the default).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# Stage 1's LSE approximation uses a second, coarser set of compressed keys: kernel and stride ×4
# (CompressK(kernel_size*4, kernel_stride*4); docs/model.md, "InfLLM v2").
COARSE_FACTOR = 4


@dataclass(frozen=True)
class SparseAttentionConfig:
    """InfLLM v2 settings (``sparse_config`` in MiniCPM4/4.1 config.json); defaults are MiniCPM4.1-8B's."""

    kernel_size: int = 32      # tokens per compressed key (mean pooling window)
    kernel_stride: int = 16    # step between compressed keys
    init_blocks: int = 1       # leading blocks every token attends to (attention sink)
    block_size: int = 64       # selection granularity in tokens
    window_size: int = 2048    # local window, in tokens (window_size // block_size blocks)
    topk: int = 64             # blocks chosen by score, on top of the local window's
    use_nope: bool = False     # score blocks with pre-RoPE queries and keys
    dense_len: int = 8192      # below this many keys attention is dense; -1: always sparse

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"sparse_config.{f.name} must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sparse_config.{f.name} must be an integer, got {value!r}")
        for name in ("kernel_size", "kernel_stride", "block_size", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"sparse_config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("init_blocks", "window_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"sparse_config.{name} must be >= 0, got {getattr(self, name)}")
        if self.topk <= self.init_blocks:
            raise ValueError(f"sparse_config.topk ({self.topk}) must exceed init_blocks ({self.init_blocks}): the "
                             "initial blocks, the local window and the query's own block must fit in the budget")
        if self.dense_len < -1:
            raise ValueError(f"sparse_config.dense_len must be -1 (always sparse) or >= 0, got {self.dense_len}")
        # Block scores max-pool kernel scores with window block_size/kernel_stride + 1 and padding 1
        # (infllmv2_cuda_impl's max_pooling_1d): exactly the kernels that overlap a block only when
        # the stride divides the block and a kernel spans two strides.
        if self.block_size % self.kernel_stride:
            raise ValueError(f"sparse_config.block_size ({self.block_size}) must be a multiple of "
                             f"kernel_stride ({self.kernel_stride})")
        if self.kernel_size != 2 * self.kernel_stride:
            raise ValueError(f"sparse_config.kernel_size ({self.kernel_size}) must be 2 x kernel_stride "
                             f"({self.kernel_stride}): block max-pooling assumes kernels overlap by half")

    @classmethod
    def from_dict(cls, raw: dict) -> "SparseAttentionConfig":
        expected = {f.name for f in fields(cls)}
        unknown = raw.keys() - expected
        if unknown:
            raise ValueError(f"sparse_config: unknown keys {sorted(unknown)}; expected a subset of {sorted(expected)}")
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def local_blocks(self) -> int:
        """Blocks of the local window before the query's own block (2048 // 64 = 32)."""
        return self.window_size // self.block_size

    @property
    def selected_blocks(self) -> int:
        """Top-k budget per token: topk + local_blocks (64 + 32 = 96), capped by the block count."""
        return self.topk + self.local_blocks

    @property
    def pool_stride(self) -> int:
        """Compressed keys per block (64 / 16 = 4): the max-pooling stride."""
        return self.block_size // self.kernel_stride

    @property
    def coarse_kernel_size(self) -> int:
        return self.kernel_size * COARSE_FACTOR

    @property
    def coarse_kernel_stride(self) -> int:
        return self.kernel_stride * COARSE_FACTOR

    def is_dense(self, num_keys: int) -> bool:
        """HF's switch: ``kv_seq_len < dense_len`` runs ordinary causal attention."""
        return self.dense_len != -1 and num_keys < self.dense_len
