"""``tfpar compare``'s progress: a bar on a terminal, whole lines in a log, never on the line of an error or a verdict.

On a terminal the bar is ``tqdm``'s, redrawn in place with ``\\r`` and cleared when it
closes (``leave=False``), so what is printed next (an error, the verdict table) starts a
line of its own. A log file or a pipe has no place to redraw: ``\\r`` redraws would pile up
on one line and the next message would be glued to them. There each run is announced on
a line of its own (``case: run 2/4: torch.ddp@float32``) and nothing is ever left
unterminated.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["run_bar", "LineProgress"]


class LineProgress:
    """The bar's interface (``set_postfix_str``, ``update``, ``close``, ``total``) as one line per run."""

    def __init__(self, total: int, desc: str, stream: TextIO) -> None:
        self.total, self.desc, self.n, self._stream, self.disable = total, desc, 0, stream, False
        self._started = 0  # runs announced (two may run at once: a TensorFlow and a torch one)

    def set_postfix_str(self, text: str) -> None:
        if not self.disable:
            self._started += 1
            print(f"{self.desc}: run {self._started}/{self.total}: {text}", file=self._stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.disable = True


def run_bar(total: int, desc: str, stream: TextIO | None = None) -> Any:
    """A progress display for ``total`` runs on ``stream`` (default stderr): ``tqdm`` on a terminal, else lines."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="run", leave=False, file=stream)
    return LineProgress(total, desc, stream)
