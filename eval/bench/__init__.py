"""The benchmarks (``python -m quantkit.eval.bench.<name>``; the ``make bench-*`` targets run them).

Each is a script of its own; what they share (timing, the machine description, the report) lives in
``common``. A benchmark that measures what another already measures imports that one's functions rather
than copying them (bench_8b runs bench_runtime's contenders on bench_gguf_speed's 8B-shaped checkpoint).
"""
