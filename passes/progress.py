"""A progress bar on stderr for long work, silent when stderr is not a terminal.

Library functions take `progress=None` or a callable `progress(done, total)`; the command makes
one with `progress_bar("quantize")` and closes it when the work is done:

    with progress_bar("quantize") as bar:
        passes.quantize_weights(model, progress=bar)
"""
from __future__ import annotations

import sys
import time
from typing import IO

_WIDTH = 30
_MIN_INTERVAL_S = 0.1  # redraw at most ten times a second: a bar must not slow the work


class ProgressBar:
    """Callable(done, total) drawing `label [#####.....] 42% (21/50)` on one line of `stream`."""

    def __init__(self, label: str, stream: IO[str] | None = None, enabled: bool | None = None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._last_draw = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < _MIN_INTERVAL_S:
            return
        self._last_draw = now
        fraction = min(max(done / total, 0.0), 1.0) if total else 1.0
        filled = int(round(fraction * _WIDTH))
        bar = "#" * filled + "." * (_WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {fraction * 100:3.0f}% ({done}/{total})")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the bar so that the next line of output starts clean."""
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(label: str, stream: IO[str] | None = None, enabled: bool | None = None) -> ProgressBar:
    return ProgressBar(label, stream, enabled)
