"""Settings of a draft-head training run (no torch here: the command line reads the defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from quantkit.run import RunError


@dataclass(frozen=True)
class DraftSettings:
    tokens: int = 262_144
    seq_len: int = 512
    batch_rows: int = 4  # rows per optimizer step
    ttt_steps: int = 7  # draft steps unrolled per position (EAGLE-3's training-time test)
    step_weight: float = 0.8  # loss weight of step j: step_weight ** j
    learning_rate: float = 1e-3
    warmup: float = 0.05
    decay: float = 0.2
    final_lr: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    draft_vocab: int | None = None  # None: a quarter of the target's vocabulary, in multiples of 64
    top_k: int = 32  # the target's distribution kept per position, over the draft vocabulary
    aux_states: str = "cpmcu"
    data: str = "default"
    own_text_after: int = 0  # > 0: rows keep this many tokens of text, the target writes the rest (greedy)
    seed: int = 0
    w4: str | None = None  # QAT the head's linears to W4 g128 (symmetric) and write them in this layout
    eval_interval: int = 25
    eval_rows: int = 8
    checkpoint_interval: int = 25

    def check(self, vocab_size: int) -> None:
        """Every setting that can be wrong, before any work."""
        problems = [f"{name} must be > 0, got {getattr(self, name)}" for name in
                    ("tokens", "seq_len", "batch_rows", "ttt_steps", "learning_rate", "top_k", "eval_interval",
                     "eval_rows", "checkpoint_interval", "grad_clip") if getattr(self, name) <= 0]
        if not 0 < self.step_weight <= 1:
            problems.append(f"step_weight must be in (0, 1], got {self.step_weight}")
        from quantkit.models.eagle3 import AUX_STATES

        if self.aux_states not in AUX_STATES:
            problems.append(f"aux_states must be one of {sorted(AUX_STATES)}, got {self.aux_states!r}")
        if self.draft_vocab is not None and not 0 < self.draft_vocab <= vocab_size:
            problems.append(f"draft_vocab must be in 1..{vocab_size} (the target's vocabulary), got {self.draft_vocab}")
        if self.w4 not in (None, "gptq", "marlin", "cpmcu"):
            problems.append(f"w4 must be gptq, marlin or cpmcu (the layout of the W4 head), got {self.w4!r}")
        if not 0 <= self.own_text_after < self.seq_len:
            problems.append(f"own_text_after must be in 0..{self.seq_len - 1} (below seq_len), "
                            f"got {self.own_text_after}")
        if self.tokens < self.batch_rows * self.seq_len:
            problems.append(f"tokens {self.tokens} is less than one step of {self.batch_rows} x {self.seq_len}")
        if problems:
            raise RunError("; ".join(problems))

    def vocabulary_size(self, vocab_size: int) -> int:
        return self.draft_vocab or min(vocab_size, max(64, round(vocab_size / 4 / 64) * 64))
