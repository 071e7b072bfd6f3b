"""Quantization-aware training (`quantkit qat`): BitCPM4's ternary QAT, and any other grid; and, with
``qat.trains: scales``, distilled scales and biases over fixed codes (mlx-lm's DWQ, `quantkit qat dwq`).

- ``fake_quant``: the grid in the forward pass, the straight-through gradient in the backward, and the
  table of what trains (``TRAINS``);
- ``data``: training rows from the calibration sources, a fresh order each epoch;
- ``teacher``: the FP model's top-k logits, cached once, and the distillation loss;
- ``schedule``: the warmup-stable-decay learning rate;
- ``state``: the resumable checkpoint;
- ``trainer``: the loop; ``write``: the artifact, fake-quantized checkpoint, log and curve.
"""


def run_qat(model_dir, recipe, out_dir, *, perplexity, tokens=None, init=None, resume=False, fake_quant=False,
            device="cpu", shard_state="auto", progress=True):
    """Train, then write the result to ``out_dir``; returns the run's ``QATReport``. ``perplexity`` is
    ``quantkit.eval.ppl.perplexity``, passed in by the entry points (a pipeline does not import scoring).
    Under torchrun every rank trains and rank 0 alone writes and returns the report (None on the others)."""
    from pathlib import Path

    from quantkit.qat.trainer import train
    from quantkit.qat.write import write_outputs

    trained = train(model_dir, recipe, out_dir, perplexity=perplexity, tokens=tokens, init=init, resume=resume,
                    device=device, shard_state=shard_state, progress=progress)
    if trained is None:  # a rank of a torchrun job other than 0
        return None
    write_outputs(trained, Path(model_dir), recipe, fake_quant=fake_quant, init=None if init is None else str(init))
    return trained.report
