"""quantkit: quantization toolkit for MiniCPM4.1-8B. Importing it registers MiniCPM with transformers."""
__version__ = "0.1.0"

from quantkit import models  # noqa: E402,F401  (registers the MiniCPM Auto classes)
