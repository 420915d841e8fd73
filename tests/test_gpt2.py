"""A real outside model: Hugging Face GPT-2 built from a small config (no download), one
training step with dropout on, under a budget that forces evictions."""

import copy

import pytest
import torch

import dtr

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, 256, (4, 64))
    return model, ids


def _step(model, ids, budget="eager"):
    torch.manual_seed(7)
    if budget == "eager":
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), None
    with dtr.budget(budget) as engine:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        loss = dtr.materialize(loss)
    return loss, engine.stats()


def test_gpt2_training_step_matches_eager(gpt2):
    model, ids = gpt2
    eager = copy.deepcopy(model)
    eager_loss, _ = _step(eager, ids)
    _, stats = _step(copy.deepcopy(model), ids, None)
    for fraction in (0.5,):
        m = copy.deepcopy(model)
        loss, stats_b = _step(m, ids, int(stats.peak_resident_bytes * fraction))
        assert stats_b.evictions > 0 and stats_b.rematerializations > 0
        assert torch.equal(loss, eager_loss)
        for (name, p), q in zip(m.named_parameters(), eager.parameters()):
            assert type(p.grad) is torch.Tensor, name
            assert torch.equal(p.grad, q.grad), name
    # Tied weights (wte / lm_head) stayed tied.
    assert m.lm_head.weight is m.transformer.wte.weight
