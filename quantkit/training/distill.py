"""Distillation onto a teacher's cached top-k logits (QAT's student, a draft head's predictions)."""
from __future__ import annotations

import torch
from torch import Tensor


def distillation_loss(student_logits: Tensor, teacher_ids: Tensor, teacher_logits: Tensor, temperature: float,
                      mask: Tensor | None = None, kept: Tensor | None = None) -> Tensor:
    """Mean over positions (those ``mask`` keeps) of T² · KL(teacher ‖ student), the teacher renormalised
    over its top-k ids. ``kept``, with a mask: the number of positions the mean is over, when they are more
    than these (a data-parallel rank's share of a step: its positions' sum over the step's count).

    ``student_logits`` [..., V]; ``teacher_ids``/``teacher_logits`` [..., k]; ``mask`` [...] bool."""
    teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_ids)
    per_position = (teacher.exp() * (teacher - student)).sum(-1)
    if mask is not None:
        return temperature**2 * (per_position * mask).sum() / (mask.sum() if kept is None else kept).clamp(min=1)
    return temperature**2 * per_position.mean()
