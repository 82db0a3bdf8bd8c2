"""Errors of the resource layer (standard library only).

::

    ResourceError              base; ``str(e)`` is one line for an operator
     +-- InvalidDocument       a document fails validation: names the document and field path
     +-- UnknownKind           a kind name tabby does not know
     +-- NotFound              get/delete of a resource that does not exist
     +-- Conflict              a resourceVersion that does not match, a name or CIDR in use,
     |                         a change that is not allowed (a pool's cidr), or the store kept
     |                         changing under an apply
     +-- NotOwned              a resource another owner keeps: one mirrored from Kubernetes
                               changed with tabbyctl, or one an operator made changed by the
                               controllers (``resources.mirror``)
"""

from __future__ import annotations


class ResourceError(Exception):
    """Base of the resource layer's own errors."""


class InvalidDocument(ResourceError):
    """``label: path: message`` (``label`` is ``Kind/name`` or ``document N``)."""

    def __init__(self, label: str, problems: list[tuple[str, str]]) -> None:
        self.label = label
        self.problems = problems  # (field path, message); path "" = the whole document
        text = "; ".join(f"{p}: {m}" if p else m for p, m in problems)
        super().__init__(f"{label}: {text}")

    @property
    def path(self) -> str:
        """The first problem's field path."""
        return self.problems[0][0] if self.problems else ""


class UnknownKind(ResourceError):
    pass


class NotFound(ResourceError):
    pass


class Conflict(ResourceError):
    pass


class NotOwned(ResourceError):
    pass
