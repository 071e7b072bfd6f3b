"""Task evaluation that runs offline: HumanEval (code, in a sandbox), GSM-style math, and
multiple-choice log-likelihood tasks; the registry is ``quantkit.eval.tasks.registry.TASKS``."""
