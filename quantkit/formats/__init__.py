"""Checkpoint formats: each converts ``quantkit.quant.QuantizedTensor`` records to tensors/bytes and back."""
