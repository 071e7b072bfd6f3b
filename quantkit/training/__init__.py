"""What quantkit's training loops share: the training rows and their order (``data``), the WSD
learning rate (``schedule``), the resumable optimizer checkpoint (``state``) and per-row tensors a
frozen model computes once and caches on disk (``rowcache``), and the grids a forward pass rounds
weights onto while the straight-through gradient trains them (``fake_quant``), and a process's place in a
torchrun job with the collectives data-parallel training needs (``distributed``), and FSDP2 sharding where a
run's state does not fit one device (``sharding``). QAT (``quantkit.qat``) and
draft-head training (``quantkit.draft``) are built on them."""
