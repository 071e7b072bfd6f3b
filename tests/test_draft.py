"""Draft-head training: the unrolled training-time test against the runtime drafter's own chains."""
from __future__ import annotations

import pytest
import torch
from quantkit.kernels.eagle3 import Eagle3Drafter

from quantkit.draft.ttt import ttt_mask, unrolled_steps
from quantkit.models import MiniCPMForCausalLM
from quantkit.models.eagle3 import entering_states, load_head
from quantkit.models.fixtures import write_tiny_eagle3_head


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=8)


@pytest.fixture(scope="module")
def target(target_dir):
    return MiniCPMForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return write_tiny_eagle3_head(tmp_path_factory.mktemp("head") / "head", target_dir, draft_vocab_size=100)


def test_ttt_mask_lets_each_step_see_its_chain():
    mask = ttt_mask(5, 2)
    assert mask.shape == (5, 15)
    # position 4 of step 2: its chain starts at 2 -> step 0 keys 0..2, step 1 key at 3, step 2 key at 4
    assert torch.nonzero(mask[4]).flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert torch.equal(ttt_mask(4, 0), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_unrolled_steps_equal_the_runtime_drafters_chains(target, head_dir):
    """Step j at position p is the chain from p - j as the runtime drafts it, fed the text's tokens."""
    head = load_head(head_dir, target.config)
    length, steps = 8, 3
    ids = torch.randint(0, target.config.vocab_size, (1, length + steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = entering_states(target, ids, head.aux_layers)
        aux = head.aux_from_states(states)[:, :length]
        embeds = head.embed(target.model.embed_tokens, ids[:, 1:length + 1])
        unrolled = unrolled_steps(head, aux, embeds, steps)
    drafter = Eagle3Drafter(head, target.model.embed_tokens)
    with torch.inference_mode():
        for start in range(length - steps + 1):
            drafter.reset()
            drafter.observe(ids[0, :start + 1], {layer: state[0, :start + 1] for layer, state in states.items()},
                            ids[0, 1:start + 2])
            hidden = drafter._last
            torch.testing.assert_close(hidden[0], unrolled[0][0, start], rtol=1e-5, atol=1e-5)
            for step in range(1, steps):
                hidden = drafter._step(hidden, ids[0, start + step + 1:start + step + 2])  # token p + 1
                torch.testing.assert_close(hidden[0], unrolled[step][0, start + step], rtol=1e-5, atol=1e-5)
