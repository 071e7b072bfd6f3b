"""quantkit's version, a leaf every layer may import (the package's ``__init__`` is the public API,
which only the entry points import)."""
__version__ = "0.1.0"
