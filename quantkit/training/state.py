"""A resumable training checkpoint: trainable weights, AdamW's moments and the loop's position, in one
safetensors file written atomically (an interrupted write leaves the previous checkpoint whole).

Nothing else carries state: the learning rate is a function of the step, the data order a function
of the position, and no operation draws random numbers, so these restore the run exactly. Whether a
run may continue from it is the run's lifecycle's to say (``quantkit.run``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit import atomic


def save(path: Path, parameters: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
         loop: dict) -> None:
    tensors = {}
    for name, param in parameters.items():
        tensors[f"param/{name}"] = param.detach().cpu()
        state = optimizer.state.get(param)
        if state:
            tensors[f"exp_avg/{name}"] = state["exp_avg"].cpu()
            tensors[f"exp_avg_sq/{name}"] = state["exp_avg_sq"].cpu()
            tensors[f"step/{name}"] = state["step"].reshape(1).cpu()
    atomic.save_safetensors(path, tensors, metadata={"loop": json.dumps(loop, sort_keys=True)})


def load(path: Path, parameters: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    """Restore weights and optimizer state in place; return the loop's position."""
    with safe_open(str(path), framework="pt") as f:
        loop = json.loads(f.metadata()["loop"])
        stored = set(f.keys())
        with torch.no_grad():
            for name, param in parameters.items():
                param.copy_(f.get_tensor(f"param/{name}"))
                if f"exp_avg/{name}" in stored:
                    optimizer.state[param] = {"step": f.get_tensor(f"step/{name}").reshape(()),
                                              "exp_avg": f.get_tensor(f"exp_avg/{name}").to(param.device),
                                              "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{name}").to(param.device)}
    return loop
