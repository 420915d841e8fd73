"""``DTRTrainer``: Hugging Face's Trainer loop (gradient accumulation, clipping, a linear LR
schedule, AdamW) under half a micro-batch's peak gives the losses and parameters plain
``Trainer`` gives, bit for bit."""

import copy

import pytest
import torch

import dtr

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer refuses to run without it
from dtr.integrations.huggingface import DTRTrainer  # noqa: E402  (needs transformers)

BATCH = 4
SEQ = 48


@pytest.fixture(scope="module")
def setup():
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (16, SEQ))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    # One micro-batch's unlimited peak, on a copy, so the model the runs start from is untouched.
    probe = copy.deepcopy(model).train()
    with dtr.budget(None) as engine:
        probe(input_ids=ids[:BATCH], labels=ids[:BATCH]).loss.backward()
    return model, dataset, engine.stats().peak_resident_bytes


def _train(setup, tmp_path, trainer_class, **extra):
    model, dataset, _ = setup
    model = copy.deepcopy(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=42,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, **extra)
    trainer.train()
    return trainer


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _assert_same_run(a, b, setup_model):
    assert len(_logged(a, "loss")) == 3
    assert _logged(a, "loss") == _logged(b, "loss")
    assert _logged(a, "grad_norm") == _logged(b, "grad_norm")
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert type(p) is type(q), name
        assert torch.equal(p, q), name
    assert not torch.equal(a.model.lm_head.weight, setup_model.lm_head.weight)  # it did train


@pytest.fixture(scope="module")
def plain(setup, tmp_path_factory):
    return _train(setup, tmp_path_factory.mktemp("plain"), transformers.Trainer)


def test_plain_trainer_is_deterministic(setup, plain, tmp_path):
    # The premise of the comparison below: two plain runs agree bit for bit.
    _assert_same_run(_train(setup, tmp_path, transformers.Trainer), plain, setup[0])


def test_dtr_trainer_matches_trainer(setup, plain, tmp_path):
    _, _, peak = setup
    under = _train(setup, tmp_path, DTRTrainer, dtr_budget=int(0.5 * peak))
    _assert_same_run(under, plain, setup[0])
    stats = under.dtr_engine.stats()
    assert stats.evictions > 0 and stats.rematerializations > 0
    # Peak within budget plus one op's outputs (the engine enforces it after each op).
    assert stats.peak_resident_bytes < 0.75 * peak
    for name, p in under.model.named_parameters():
        assert type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor, name


def test_dtr_trainer_takes_an_engine_and_options(setup, tmp_path):
    model, _, peak = setup
    model = copy.deepcopy(model)
    engine = dtr.budget(int(0.5 * peak), cost="estimate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert DTRTrainer(model=model, args=args, dtr_budget=engine).dtr_engine is engine
    trainer = DTRTrainer(model=model, args=args, dtr_budget="1 MiB", dtr_options={"heuristic": "lru"})
    assert trainer.dtr_engine.budget == 2**20
    with pytest.raises(ValueError, match="dtr_options"):
        DTRTrainer(model=model, args=args, dtr_budget=engine, dtr_options={"cost": "auto"})
    with pytest.raises(TypeError, match="unknown option"):
        DTRTrainer(model=model, args=args, dtr_budget=None, dtr_options={"budgett": 1})
    with pytest.raises(ValueError):
        DTRTrainer(model=model, args=args, dtr_budget="lots")
    compiled = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, torch_compile=True
    )
    with pytest.raises(ValueError, match="torch_compile"):
        DTRTrainer(model=model, args=compiled, dtr_budget=None)
