"""Nurseries that raise the error their tasks raised, not a group of one.

Since trio 0.25 a nursery wraps every error of its body or its tasks in an
``ExceptionGroup``, even a single one.  The layers above catch the project's
errors by type (``except AiturboError``): a wrapped error slips past them, so
a mount error reached the user as "the daemon exited before mounting" and a
failed upload was neither retried nor marked broken.  Every nursery of the
package is opened here, and its group is reduced to the one error it stands
for wherever that is well defined (``one_error``); anything else (several
unrelated errors, a bug beside an outage) propagates as the group it is.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ._errors import AiturboError, TransientBackendError


def one_error(group: BaseExceptionGroup) -> BaseException:
    """The one error ``group`` stands for, or ``group`` itself.

    A group of one leaf is that leaf.  A group of project errors only (an
    outage fails every part upload in flight at once) is its first permanent
    error, else its first transient one: a permanent failure must not be
    retried as if it were transient.  Any other mix is returned as it is.
    """
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(reversed(exc.exceptions))
        else:
            leaves.append(exc)
    if len(leaves) == 1:
        return leaves[0]
    if not leaves or not all(isinstance(e, AiturboError) for e in leaves):
        return group
    permanent = [e for e in leaves if not isinstance(e, TransientBackendError)]
    return (permanent or leaves)[0]


@asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """``trio.open_nursery()`` whose failure is ``one_error`` of its group."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        one = one_error(group)
        if one is group:
            raise
        raise one from None
