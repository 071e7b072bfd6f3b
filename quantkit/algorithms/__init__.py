"""Quantization algorithms, one module each, behind one interface (``quantkit.algorithms.base.Algorithm``).

An algorithm maps a linear's weight, the statistics of its calibration inputs, the target grid and
the recipe's values to a record, and says what the recipe checks and the artifact records of its
settings. A module whose code reads recipe settings declares their section beside that code
(``SETTINGS``); ``quantkit.recipe`` assembles the schema from ``SECTIONS``. Adding an algorithm is a
module plus an entry in ``ALGORITHMS`` (whose order is the recipe schema's list of choices).
"""
from __future__ import annotations

from quantkit.algorithms import gptq, reconstruct, smooth
from quantkit.algorithms.awq import AWQ
from quantkit.algorithms.base import Algorithm
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.rtn import RTN

ALGORITHMS: dict[str, Algorithm] = {algorithm.name: algorithm for algorithm in (RTN(), AWQ(), GPTQ())}
# The recipe sections of the algorithms' code, in recipe order: GPTQ's solver (stated by every recipe,
# whatever its algorithm, so fingerprints stay put), the smoothing the engine runs before any algorithm, and
# the block reconstruction it may run after one (only in recipes that state it)
SECTIONS = {"gptq": gptq.SETTINGS, "smooth": smooth.SETTINGS, "reconstruct": reconstruct.SETTINGS}

__all__ = ["ALGORITHMS", "Algorithm", "SECTIONS"]
