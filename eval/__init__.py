"""Evaluation harness (quantkit.eval): accuracy loss against the unquantized model."""
