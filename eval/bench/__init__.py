"""The benchmarks (``python -m quantkit.eval.bench.<name>``; the ``make bench-*`` targets run them).

Each is a script of its own; what they share (timing, the machine description, the report) lives in
``common`` and nowhere else: no benchmark imports another.
"""
