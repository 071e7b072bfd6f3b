"""Fused CPU operators for the runtime's decode step, compiled on first use (C++, -O3 -march=native).

Each replaces a run of small PyTorch operators whose dispatch costs more than their arithmetic at
one token (see decode_ops.cpp), or is a kernel PyTorch lacks: ``ternary_gemv``, the ternary linear's
decode path (kernels/linear/ternary.py), ``int4_int8_matmul``, an int4 linear's product on integer dot
products (decode, verification, prefill without AMX: int4_int8_ops.cpp, kernels/linear/int4.py),
``int8_int8_matmul``, the same on 8-bit codes (the int8 LM head's decode, kernels/linear/int8.py),
``int4_dequantize_t``, its bf16 weight rebuilt for a prefill chunk on AMX (int4_ops.cpp), and InfLLM
v2's stages reading the bf16 caches in place and ``verify_attention``, the dense attention of a
speculative round's chain or draft tree over them (infllm_ops.cpp, used by kernels/infllm/cpu.py). One
serves the quantization engine: ``bf16_gram_accumulate``, the Hessian update XᵀX of bf16 activations
with float32 sums (gram_ops.cpp, used by quantkit/stats.py). ``load()`` returns None when no compiler
is available, and the runtime then uses the PyTorch operators, which are also the specification the
tests compare with.

The sources compile as one unit (gram_ops.cpp uses infllm_ops.cpp's AMX set-up), and both the runtime and
the quantization statistics call them, so this package sits among quantkit's leaves: it imports nothing
of quantkit's, and neither side has to import the other to reach it.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)
EXTENSION = "quantkit_decode_ops"
SOURCES = ["decode_ops.cpp", "int4_ops.cpp", "int4_int8_ops.cpp", "infllm_ops.cpp", "gram_ops.cpp"]
FUNCTIONS = ["rms_norm_bf16", "rope_and_store", "decode_attention", "silu_mul", "ternary_gemv", "int4_dequantize_t",
             "int4_int8_matmul", "int8_int8_matmul", "int4_int8_isa",
             "infllm_decode_scores", "infllm_decode_select", "infllm_block_attention", "infllm_isa",
             "verify_attention",
             "bf16_gram_accumulate"]


# Builds for another CPU than this one when set (e.g. haswell: AVX2 without AVX-512 or VNNI, as on many
# desktops), so that tests and benchmarks run the code paths such a CPU gets; "native" by default.
MARCH_OVERRIDE = "QUANTKIT_CPU_MARCH"


def target_march() -> str:
    march = os.environ.get(MARCH_OVERRIDE, "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", march):
        raise ValueError(f"{MARCH_OVERRIDE} must name a -march target such as native or haswell, got {march!r}")
    return march


@functools.cache
def load():
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load_inline

    sources = [Path(__file__).with_name(name).read_text() for name in SOURCES]
    march = target_march()
    name = EXTENSION if march == "native" else f"{EXTENSION}_{march.replace('-', '_')}"
    try:
        # torch takes a lock file in the build directory on every load (it runs ninja each time) and
        # waits forever for one a killed process left. An flock dies with its process: holding it, any
        # torch lock file there is such a leftover (every load comes through here), so it is removed.
        build = Path(_get_build_directory(name, verbose=False))
        with open(build / "quantkit.flock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            return load_inline(name, cpp_sources=sources, functions=FUNCTIONS,
                               extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, headers or ninja: fall back to PyTorch operators
        log.warning("fused CPU decode operators unavailable (%s); using PyTorch operators", error)
        return None
