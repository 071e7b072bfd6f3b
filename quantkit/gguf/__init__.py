"""GGUF export for llama.cpp: the tensor-type registry (``types``), one module per block family
(``legacy``: Q8_0/Q4_0/Q4_1), and the MiniCPM writer (``export``)."""
