"""Python frames, read in one place: the live call stack, a traceback's frames, and a formatted stack's text.

Every other module asks its question of frames here (where a warning should point, whether a compile runs
inside an eager checkpoint, which modules are running, which frame of a traceback traced a call, which user
line a node came from) instead of walking ``f_back`` or parsing ``File "..."`` lines itself. Imports nothing
of sacpass and nothing beyond the standard library.
"""
from __future__ import annotations

import os
import re
import sys
from types import CodeType, FrameType, TracebackType
from typing import Any, Callable, Iterator, NamedTuple

__all__ = ["Frame", "site", "stack_frames", "innermost_frame", "first_outside", "running", "locals_of",
           "traceback_locals"]


# ------------------------------------------------------------------------------------ the live stack
def _outward(frame: FrameType | None) -> Iterator[FrameType]:
    """``frame`` and each frame that called it, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def first_outside(inside: Callable[[str], bool], skip: int = 0) -> tuple[int, FrameType] | None:
    """The innermost frame, from ``skip`` frames above the caller outward, whose file (an absolute path)
    ``inside`` refuses, with its distance from the caller (0: the caller); None when every frame is inside."""
    for depth, frame in enumerate(_outward(sys._getframe(skip + 1)), start=skip):
        if not inside(os.path.abspath(frame.f_code.co_filename)):
            return depth, frame
    return None


def running(file: str, names: tuple[str, ...]) -> bool:
    """Whether a frame of the caller's stack runs a function named in ``names`` defined in ``file``."""
    return any(f.f_code.co_filename == file and f.f_code.co_name in names for f in _outward(sys._getframe(1)))


def locals_of(runs: Callable[[CodeType], bool], name: str) -> list[Any]:
    """The local ``name`` of every frame of the caller's stack whose code ``runs`` accepts, outermost first (a
    frame without that local gives None)."""
    return [f.f_locals.get(name) for f in _outward(sys._getframe(1)) if runs(f.f_code)][::-1]


def traceback_locals(tb: TracebackType | None) -> list[dict[str, Any]]:
    """The locals of each frame of a traceback, outermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame.f_locals)
        tb = tb.tb_next
    return out


# ------------------------------------------------------------------------------- a formatted stack
_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')


def site(file: str, line: int | str) -> str:
    """``file.py:line``: a source position as messages and reports print it."""
    return f"{file.rsplit('/', 1)[-1]}:{line}"


class Frame(NamedTuple):
    """One frame of a formatted stack (``File "...", line N, in f`` and the source line under it)."""

    file: str
    line: int
    func: str
    code: str = ""  # the source line printed under it ('' when the text has none)

    @property
    def site(self) -> str:
        return site(self.file, self.line)


def stack_frames(text: str | None) -> list[Frame]:
    """The frames of a formatted stack (a node's ``stack_trace``, a traceback's text), outermost first."""
    out: list[Frame] = []
    for line in (text or "").splitlines():
        m = _FILE_LINE.match(line)
        if m:
            out.append(Frame(m["file"], int(m["line"]), (m["func"] or "").strip()))
            continue
        code = line.strip()
        if out and not out[-1].code and code and not set(code) <= set("^~ "):  # skip the ^^^ markers
            out[-1] = out[-1]._replace(code=code)
    return out


def innermost_frame(text: str | None) -> Frame | None:
    """The innermost frame of a formatted stack (the user's line a node came from), or None."""
    frames = stack_frames(text)
    return frames[-1] if frames else None
