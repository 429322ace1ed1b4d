"""loom's exception hierarchy for the communication layer.

User mistakes (a bad count, a wrong dtype) are ``ValueError``/``TypeError`` subclasses so that callers can catch
them the ordinary way; transport failures get :class:`CommError`, chained ``from`` the MPI exception.
"""

from __future__ import annotations

__all__ = ["CommError", "CollectiveMismatchError", "CommTimeoutError"]


class CommError(RuntimeError):
    """A failure of the transport underneath loom (an MPI error, a dead peer)."""


class CollectiveMismatchError(ValueError):
    """Ranks disagree about a collective (shape, dtype, counts, op); raised on every rank in check mode."""


class CommTimeoutError(CommError):
    """A wait ran past its deadline (``Request.wait(timeout=...)`` or the ``LOOM_TIMEOUT`` watchdog)."""
