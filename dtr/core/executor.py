"""The seam between the engine and a driver: what the runtime asks of whoever runs the ops."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Tuple

from dtr.core.storage import OpRecord

__all__ = ["Executor"]


class Executor(Protocol):
    """What a driver gives the runtime so that it can recompute storages.

    ``views_alias_data``: True when a view's value shares memory with its storage, so that an
    in-place write to the storage is visible through the views' existing values (torch);
    the runtime then keeps those values across the write instead of re-deriving them.
    """

    views_alias_data: bool

    def replay(self, record: OpRecord) -> Tuple[Sequence[Any], float]:
        """Run ``record`` again on the values of ``record.inputs`` (all defined).

        Returns the output values, aligned with ``record.outputs``, and the cost of the replay
        in seconds (measured or estimated).
        """

    def forget(self, record: OpRecord) -> None:
        """``record`` will never be replayed again; drop what its payload holds."""

    # Swapping (only with a host tier; core/host_tier.py):

    def swap_out(self, value: Any) -> Any:
        """Start copying a storage (its root ``value``) to the host; returns a handle."""

    def swap_done(self, handle: Any) -> bool:
        """Whether the copy out has finished, so that the storage's memory is free."""

    def swap_wait(self, handle: Any) -> None:
        """Block until the copy out has finished."""

    def swap_in(self, handle: Any) -> Tuple[Any, float]:
        """The root value back from the host, and the seconds the caller waited for it."""

    def prefetch(self, handle: Any) -> Tuple[Any, Any]:
        """Start bringing the root value back from the host without waiting: the value, which
        must not be read before ``arrive(pending)``, and ``pending``."""

    def arrive(self, pending: Any) -> None:
        """Make the value of a prefetch readable (its copy has landed before any later read)."""
