"""Runtime for quantized artifacts (quantkit.kernels)."""
