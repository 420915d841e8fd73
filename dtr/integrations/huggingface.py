"""``DTRTrainer``: Hugging Face ``transformers.Trainer`` under a dtr memory budget.

Replace ``Trainer`` with ``DTRTrainer`` and give it a budget; nothing else changes::

    from dtr.integrations.huggingface import DTRTrainer

    trainer = DTRTrainer(model=model, args=args, train_dataset=ds, dtr_budget="4 GiB")
    trainer.train()
    print(trainer.dtr_engine.stats())

Each call of ``Trainer.training_step`` (forward and backward of one micro-batch) runs inside
one block of a single ``dtr.Engine``; what Trainer does between micro-batches (gradient
clipping, ``optimizer.step()``, the scheduler, ``zero_grad``, logging, evaluation, saving)
runs outside it, eagerly, on plain tensors, as without dtr. Parameters, optimizer state and
gradients already accumulated are constants of each block: never evicted, not charged.

- Losses and gradients are those ``Trainer`` computes, bit for bit, given the same seeds
  (``tests/test_hf_trainer.py`` checks logged losses and final parameters).
- Tested with single-process training on one device. ``DataParallel`` (several GPUs in one
  process) runs the replicas' forward passes on threads of its own, which the block, entered
  on Trainer's thread, does not see; DeepSpeed, FSDP and multi-process DDP are untested.
- ``torch_compile=True`` is refused: dtr runs on eager PyTorch (see the README's limitations).

``transformers`` is imported here only; dtr does not depend on it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch

import dtr

try:
    import transformers
except ImportError as e:  # the integration is optional; say what to install
    raise ImportError(
        "dtr.integrations.huggingface needs the transformers package: pip install transformers"
    ) from e

__all__ = ["DTRTrainer"]

Budget = Union[int, str, None, dtr.Engine]


class DTRTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose forward and backward passes run under a dtr budget.

    Takes every argument ``Trainer`` takes, plus two keyword-only ones.

    Args:
        dtr_budget: the memory budget of each micro-batch's forward and backward pass: bytes
            (int), a string such as ``"800MB"`` or ``"1.5 GiB"``, or ``None`` (track the peak,
            never evict: a way to measure a step before choosing a budget); or an existing
            ``dtr.Engine``, used as it is (its statistics then add up with its other uses).
            Required, so that a forgotten budget does not silently train untracked.
        dtr_options: keyword options for ``dtr.budget`` (``heuristic``, ``cost``, ``trace``,
            ``plan``, ``swap``, ``host_limit``, ``bandwidth``, ``total``, ``max_recompute``).
            Not allowed together with an engine, which already has its options.
        *args, **kwargs: passed to ``transformers.Trainer``.

    Attributes:
        dtr_engine: the ``dtr.Engine`` every training step runs in. Its ``budget`` can be
            changed between steps (from a ``TrainerCallback``, say) and ``stats()`` totals
            every step so far.

    Raises:
        ValueError: a budget ``dtr.budget`` does not accept, ``dtr_options`` given with an
            engine, or ``args.torch_compile`` set.
        TypeError: an option ``dtr.budget`` does not know.

    Example::

        import transformers
        import dtr
        from dtr.integrations.huggingface import DTRTrainer

        # Measure one micro-batch's peak first, then train under half of it.
        with dtr.budget(None) as probe:
            model(**batch).loss.backward()
        model.zero_grad()
        trainer = DTRTrainer(
            model=model,
            args=transformers.TrainingArguments(output_dir="out", max_steps=100),
            train_dataset=train_dataset,
            dtr_budget=probe.stats().peak_resident_bytes // 2,
        )
        trainer.train()
        print(trainer.dtr_engine.stats().rematerializations)
    """

    def __init__(
        self,
        *args: Any,
        dtr_budget: Budget,
        dtr_options: Optional[Mapping[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        # Build the engine before Trainer's own set-up, so that a bad budget or option fails
        # at once rather than after Trainer has set up the model, the accelerator and callbacks.
        if isinstance(dtr_budget, dtr.Engine):
            if dtr_options:
                raise ValueError(
                    "DTRTrainer: dtr_options apply when dtr_budget is a limit; an Engine "
                    "already has its options"
                )
            engine = dtr_budget
        else:
            engine = dtr.budget(dtr_budget, **dict(dtr_options or {}))
        self.dtr_engine: dtr.Engine = engine
        super().__init__(*args, **kwargs)
        if getattr(self.args, "torch_compile", False):
            # A compiled model runs fused kernels the engine cannot record op by op, so it could
            # neither evict nor replay inside them; fail here, not in the first step.
            raise ValueError("DTRTrainer: torch_compile=True does not mix with dtr; turn it off")

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Trainer.training_step`` (forward and backward of one micro-batch) in a dtr block.

        Takes the arguments the installed ``transformers`` passes (they changed across
        versions: ``num_items_in_batch`` was added in 4.46) and returns the detached loss as a
        plain tensor, which Trainer adds to its running loss after the block.
        """
        with self.dtr_engine:
            loss = super().training_step(*args, **kwargs)
            # Inside the block, so that the engine hands the tensor over rather than keeping a
            # wrapper alive; Trainer's running loss must stay a plain tensor across steps.
            return dtr.materialize(loss)
