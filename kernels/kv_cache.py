"""Key/value cache of one sequence: per layer, head-major K and V buffers that grow by doubling.

Head-major ([Hkv, capacity, d]) keeps each head's keys contiguous, so attention reads a prefix view
without copying and InfLLM v2 gathers 64-token blocks as row copies. Sparse attention also keeps, per
layer, the compressed keys it scores blocks with, and with ``use_nope`` the pre-RoPE keys they are
pooled from; they live here too so that cropping the sequence (speculative decoding, a new turn that
rewrites the tail) drops them with the keys.
"""
from __future__ import annotations

import torch

INITIAL_CAPACITY = 256


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", compressed_keys=None, pre_rope_keys: bool = False):
        """``compressed_keys``: a factory for a layer's compressed-key cache (sparse attention), or None.
        ``pre_rope_keys``: also keep every key before RoPE (InfLLM v2 with use_nope scores with them)."""
        self.length = 0
        self._shape = (num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._pre_rope: list[torch.Tensor | None] | None = [None] * num_layers if pre_rope_keys else None
        self.compressed = [compressed_keys() if compressed_keys else None for _ in range(num_layers)]

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               pre_rope_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys/values [Hkv, T, d] at positions length..length+T-1 and return
        views of every key and value so far. Call ``advance(T)`` once all layers have appended.
        A cache made with ``pre_rope_keys`` needs them too (read back with ``pre_rope_keys``)."""
        if (pre_rope_keys is None) != (self._pre_rope is None):
            raise ValueError("pass pre_rope_keys exactly when the cache was made to keep them")
        new_length = self.length + keys.shape[1]
        key_buffer, value_buffer = self.buffers(layer, new_length)
        key_buffer[:, self.length:new_length] = keys
        value_buffer[:, self.length:new_length] = values
        if pre_rope_keys is not None:
            self._pre_rope[layer][:, self.length:new_length] = pre_rope_keys
        return key_buffer[:, :new_length], value_buffer[:, :new_length]

    def pre_rope_keys(self, layer: int, end: int) -> torch.Tensor:
        """The layer's pre-RoPE keys of positions 0..end-1 [Hkv, end, d] (a view)."""
        if self._pre_rope is None:
            raise ValueError("this cache keeps no pre-RoPE keys (made without pre_rope_keys=True)")
        return self._pre_rope[layer][:, :end]

    def buffers(self, layer: int, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's whole key and value buffers [Hkv, capacity, d], grown to hold ``needed`` positions
        (for writers that fill positions length.. themselves)."""
        buffer = self._keys[layer]
        if buffer is None or needed > buffer.shape[1]:
            self._grow(layer, needed)
        return self._keys[layer], self._values[layer]

    def _grow(self, layer: int, needed: int) -> None:
        old_keys = self._keys[layer]
        capacity = max(INITIAL_CAPACITY, needed, 2 * (0 if old_keys is None else old_keys.shape[1]))
        heads, dim = self._shape
        for store in (self._keys, self._values, self._pre_rope):
            if store is None:
                continue
            old, store[layer] = store[layer], torch.empty(heads, capacity, dim, dtype=self._dtype, device=self._device)
            if old is not None:
                store[layer][:, :self.length] = old[:, :self.length]

    @property
    def device(self) -> torch.device | str:
        return self._device

    def advance(self, count: int) -> None:
        self.length += count

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on, with the compressed keys pooled from any of them
        (every speculative round that rejects a draft does this)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        for compressed in self.compressed:
            if compressed is not None:
                compressed.crop(length)
        self.length = length

    @torch.inference_mode()  # the buffers are inference tensors (the runtime's forward made them)
    def keep(self, start: int, slots: list[int]) -> None:
        """Keep positions ``0..start-1`` and then the entries at ``slots`` (ascending, each >= start), moved
        to ``start, start+1, ...``; forget the rest (the accepted path of a verified draft tree)."""
        if any(b <= a for a, b in zip(slots, slots[1:])) or (slots and (slots[0] < start or slots[-1] >= self.length)):
            raise ValueError(f"slots {slots} must ascend within {start}..{self.length - 1}")
        index = torch.tensor(slots, dtype=torch.long, device=self._device)
        for store in (self._keys, self._values, self._pre_rope):
            for buffer in store or ():
                if buffer is not None:
                    buffer[:, start:start + len(slots)] = buffer[:, index]
        self.crop(start + len(slots))

    def nbytes(self) -> int:
        """Bytes of keys and values held for the current length (what a decode step reads densely)."""
        heads, dim = self._shape
        return 2 * len(self._keys) * heads * dim * self.length * self._dtype.itemsize
