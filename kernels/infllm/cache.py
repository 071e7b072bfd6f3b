"""Compressed-key cache for decode (docs/model.md, "InfLLM v2"; the official ``InfLLMv2CacheLayer``).

One per layer and sequence. It holds the fine (kernel 32, stride 16) and coarse (128, 64) mean-pooled
keys and grows them as the sequence grows: an update pools only the windows that the new keys
complete, never the history again. The official cache keeps a buffer of the 16..31 leftover keys
for this; here the caller passes the whole key sequence it already stores (its KV cache), and the
cache reads the few keys each new window needs from it.
"""
from __future__ import annotations

import torch

from quantkit.kernels.infllm.reference import compress_keys, num_windows
from quantkit.models.sparse_attention import SparseAttentionConfig


class _Rows:
    """Compressed keys [Hkv, n, d] in the keys' dtype, stored as the first n rows of a [Hkv, capacity, d]
    buffer, with amortised O(1) appends (capacity doubles). Rows of d contiguous elements are what the
    fused decode kernel reads in place (quantkit/cpu_ops/infllm_ops.cpp)."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        heads, count, dim = rows.shape
        needed = self.length + count
        if self._buffer is None or needed > self._buffer.shape[1]:
            capacity = max(needed, 2 * (0 if self._buffer is None else self._buffer.shape[1]))
            grown = rows.new_empty((heads, capacity, dim))
            if self.length:
                grown[:, : self.length] = self._buffer[:, : self.length]
            self._buffer = grown
        self._buffer[:, self.length: needed] = rows
        self.length = needed

    def view(self) -> torch.Tensor:
        return self._buffer[:, : self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class CompressedKeyCache:
    """Fine and coarse compressed keys of one layer's sequence, extended as keys arrive.

    Stored as the official cache stores them: pooled in float32, held in the keys' dtype (bf16 in the
    runtime, half the bytes a decode step's stage 1 reads).
    """

    def __init__(self, config: SparseAttentionConfig):
        self.config = config
        self.num_keys = 0
        self._heads_dim: tuple[int, int] | None = None
        self._fine = _Rows()
        self._coarse = _Rows()
        self._windows = ((self._fine, config.kernel_size, config.kernel_stride),
                         (self._coarse, config.coarse_kernel_size, config.coarse_kernel_stride))

    def update(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys [Hkv, S, d]: every scoring key of the sequence so far (post-RoPE, or pre-RoPE with
        use_nope), of which the first ``num_keys`` were seen by earlier calls and must be unchanged.
        Pools the windows completed since then; returns (fine [Hkv, n1, d], coarse [Hkv, n2, d])."""
        if keys.dim() != 3:
            raise ValueError(f"keys must be [Hkv, S, d], got {tuple(keys.shape)}")
        num_keys = keys.shape[1]
        if num_keys < self.num_keys:
            raise ValueError(f"the cache has seen {self.num_keys} keys but was given {num_keys}: "
                             "a sequence only grows (use a new cache for a new sequence)")
        heads_dim = (keys.shape[0], keys.shape[2])
        if self._heads_dim not in (None, heads_dim):
            raise ValueError(f"keys have (heads, dim) {heads_dim}, the cache {self._heads_dim}")
        self._heads_dim = heads_dim
        for columns, size, stride in self._windows:
            done, total = columns.length, num_windows(num_keys, size, stride)
            # Windows done..total-1 span keys [stride*done, stride*(total-1) + size); none: an empty
            # append that still fixes the head count and dim on the first call.
            span = keys[:, stride * done: stride * (total - 1) + size] if total > done else keys[:, :0]
            columns.append(compress_keys(span, size, stride))
        self.num_keys = num_keys
        return self._fine.view(), self._coarse.view()

    def crop(self, num_keys: int) -> None:
        """Forget the keys from ``num_keys`` on (a rejected draft): the windows pooled entirely from the
        kept keys stay valid, the rest are pooled again from the new keys by the next ``update``."""
        for columns, size, stride in self._windows:
            columns.truncate(num_windows(num_keys, size, stride))
        self.num_keys = min(self.num_keys, num_keys)
