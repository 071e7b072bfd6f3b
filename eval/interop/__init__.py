"""Interoperability with GPTQModel: load quantkit's GPTQ checkpoints with it, and quantize with it as a peer.

The scripts named gptqmodel_*.py run inside the separate GPTQModel venv (`make interop`); the check_*.py
drivers run in quantkit's own venv and call them through a subprocess.
"""
