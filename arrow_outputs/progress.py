"""Progress bars for long work (the demo, `convert`): tqdm when it is installed, else a small
one of our own on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "progress_bar"]


class Progress:
    """A one-line bar on a text stream: redrawn in place on a terminal (at most every
    ``interval`` seconds, 0.1 by default), a new line every 5 seconds in a log.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> bar = Progress(4, "steps", file=out, interval=0)
    >>> bar.update(2, tokens=7)
    >>> bar.close()
    >>> out.getvalue().splitlines()[-1].split("|")[0]
    'steps  50%'
    """

    def __init__(
        self, total: int, desc: str, *, file: TextIO | None = None, interval: float | None = None
    ) -> None:
        self.total = max(total, 1)
        self.desc = desc
        self.n = 0
        self.file = file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self._tty = bool(isatty and isatty())
        self.interval = interval if interval is not None else (0.1 if self._tty else 5.0)
        self._start = time.perf_counter()
        self._last = -float("inf")
        self._postfix = ""

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        if postfix:
            self._postfix = " ".join(f"{k}={v}" for k, v in postfix.items())
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.n / self.total, 1.0)
        width = 24
        filled = int(frac * width)
        rate = self.n / max(now - self._start, 1e-9)
        bar = "#" * filled + "-" * (width - filled)
        line = (
            f"{self.desc} {frac:4.0%}|{bar}| {self.n}/{self.total} [{rate:.1f}/s] {self._postfix}"
        )
        # A terminal redraws its one line (and clears what a longer one left); a log appends.
        self.file.write(f"\r{line}\x1b[K" if self._tty else f"{line}\n")
        self.file.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        if self._tty:
            self.file.write("\n")
        self.file.flush()


class _Tqdm:
    """tqdm behind :class:`Progress`'s interface."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int = 1, **postfix: Any) -> None:
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class _Silent:
    def update(self, n: int = 1, **postfix: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> Any:
    """A bar with ``update(n, **postfix)`` and ``close()``: tqdm's if importable, else
    :class:`Progress`; a silent one when not ``enabled``."""
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return Progress(total, desc)
    return _Tqdm(tqdm(total=total, desc=desc, file=sys.stderr))
