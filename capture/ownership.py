"""One call at a time: a runner's ownership, which no interrupt can leave stuck."""

from __future__ import annotations

import contextlib
import sys
import threading
from types import FrameType, TracebackType

__all__ = ["Ownership"]


def _on_stack(frame: FrameType, thread: int) -> bool:
    """Whether `frame` is still running in `thread` (on that thread's current stack)."""
    top = sys._getframe() if thread == threading.get_ident() else (
        sys._current_frames().get(thread))
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class Ownership:
    """``with ownership(what):`` owns an object for one call; a second call meanwhile (another
    thread, or the call re-entered) raises RuntimeError.

    A call claims the object by appending itself (its thread and calling frame) to a list, an
    atomic step; the first claim still running owns it. A call interrupted anywhere (Ctrl-C
    between any two lines, even before its release) leaves a claim whose frame no longer
    runs, which the next call drops: nothing is ever stuck, and no lock is held across lines.

    Parameters
    ----------
    name : str
        The owned object's name, for the error.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._claims: list[tuple[int, FrameType]] = []

    def __call__(self, what: str) -> _Held:
        return _Held(self, what)

    def take(self, what: str, caller: FrameType) -> tuple[int, FrameType]:
        """Claim for `caller` (RuntimeError, and no claim left, if another call owns it)."""
        mine = (threading.get_ident(), caller)
        self._claims.append(mine)
        for claim in list(self._claims):
            if claim is mine:
                return mine
            if _on_stack(claim[1], claim[0]):
                self.release(mine)
                raise RuntimeError(
                    f"{self.name}.{what}: the {self.name} is already running in another "
                    "thread (or re-entered); it is driven by one thread, one call at a time")
            self.release(claim)  # an interrupted call's
        raise AssertionError("unreachable: a claim is in the list it was appended to")

    def release(self, claim: tuple[int, FrameType]) -> None:
        with contextlib.suppress(ValueError):  # dropped already
            self._claims.remove(claim)


class _Held:
    __slots__ = ("claim", "ownership", "what")

    def __init__(self, ownership: Ownership, what: str) -> None:
        self.ownership, self.what, self.claim = ownership, what, None

    def __enter__(self) -> None:
        self.claim = self.ownership.take(self.what, sys._getframe(1))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.ownership.release(self.claim)
