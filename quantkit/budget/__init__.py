"""The best model that fits: bits per tensor chosen to minimise the estimated loss under a size budget.

A plan has three parts, one module each:

- ``target``: what the user asks for (``--target-size 80MB``, ``--target-bpw 3.6``), parsed and checked;
- ``sensitivity``: for every decoder linear and every type the format may give it, the increase in the
  model's output KL that type's rounding error causes, estimated from one pass over calibration rows
  (the linear's input second moments H and the Fisher information of its outputs);
- ``allocate``: the choice of one type per tensor that minimises the summed estimate under the byte budget
  (a Lagrangian relaxation, then a greedy fill of what is left).

``plan`` puts them together for a recipe's format; ``quantkit plan`` prints the result and ``quantkit quantize
--target-size`` hands it to the recipe's solver as per-tensor types (docs/budget.md).
"""
