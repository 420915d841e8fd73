"""Helpers for testing code that uses dtr, and dtr itself: a model zoo (``zoo.build``) and
an eager-vs-dtr step runner (``step.run_step``, ``step.assert_same``)."""
