"""Training EAGLE-3 draft heads (``quantkit draft train``): ``settings`` (the run's knobs), ``features``
(the target's states and distribution per row, cached once), ``ttt`` (the unrolled training-time
test) and ``trainer`` (the loop). The head itself is ``quantkit.models.eagle3``; the runtime drafts
with it in ``quantkit.kernels.eagle3``."""
