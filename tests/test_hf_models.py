"""Real outside models: Hugging Face GPT-2, BERT, Llama and ViT, each built from a tiny config
(no download), one training step with dropout on where the config has it, under a budget of
half the step's peak. Loss and every gradient must be bit for bit eager's, and tied weights
(GPT-2's and BERT's embeddings and output layer) stay tied."""

import copy

import pytest
import torch

import dtr

from conftest import DEVICE

transformers = pytest.importorskip("transformers")


def _gpt2(attn):
    config = transformers.GPT2Config(
        attn_implementation=attn,
        vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (4, 64))
    return model, dict(input_ids=ids, labels=ids)


def _bert(attn):
    config = transformers.BertConfig(
        attn_implementation=attn,
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 256, (4, 48))
    labels = ids.clone()
    labels[:, ::3] = -100  # positions that do not count, as a masked-LM collator would leave them
    return model, dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def _llama(attn):
    config = transformers.LlamaConfig(
        attn_implementation=attn,
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (4, 48))
    return model, dict(input_ids=ids, labels=ids)


def _vit(attn):
    config = transformers.ViTConfig(
        attn_implementation=attn,
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    model = transformers.ViTForImageClassification(config)
    # 32x32 images in 4x4 patches: 64 patches plus the class token.
    return model, dict(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.randint(0, 10, (4,)))


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "vit": _vit}
# "sdpa" (the default) runs attention, its dropout included, as one fused op; "eager" spells it
# out as matmul, softmax, dropout, matmul: different ops for the engine to record and replay.
ATTENTION = ("sdpa", "eager")


@pytest.fixture(
    scope="module",
    params=[(name, attn) for name in sorted(MODELS) for attn in ATTENTION],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def model_and_batch(request):
    name, attn = request.param
    torch.manual_seed(0)
    model, batch = MODELS[name](attn)
    model.train()
    return model.to(DEVICE), {k: v.to(DEVICE) for k, v in batch.items()}


def _step(model, batch, budget="eager"):
    # The same seed before each run, so dropout draws the same masks eagerly and under dtr.
    torch.manual_seed(7)
    if budget == "eager":
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), None
    with dtr.budget(budget) as engine:
        loss = model(**batch).loss
        loss.backward()
        loss = dtr.materialize(loss)
    return loss, engine.stats()


def test_training_step_matches_eager(model_and_batch):
    model, batch = model_and_batch
    eager = copy.deepcopy(model)
    eager_loss, _ = _step(eager, batch)
    _, stats = _step(copy.deepcopy(model), batch, None)
    m = copy.deepcopy(model)
    loss, stats_b = _step(m, batch, int(stats.peak_resident_bytes * 0.5))
    assert stats_b.evictions > 0 and stats_b.rematerializations > 0
    assert torch.equal(loss, eager_loss)
    for (name, p), q in zip(m.named_parameters(), eager.parameters()):
        assert type(p.grad) is torch.Tensor, name
        assert torch.equal(p.grad, q.grad), name
    assert _tied(m) == _tied(model)


def _tied(model) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight
