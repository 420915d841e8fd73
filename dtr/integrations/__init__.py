"""Adapters that run other libraries' training loops under a dtr budget.

Each adapter lives in its own module and imports its library there, so that none of them is a
dependency of dtr: ``import dtr`` never imports this package. Import the one you need, for
example ``from dtr.integrations.huggingface import DTRTrainer`` (needs ``transformers``).
"""
