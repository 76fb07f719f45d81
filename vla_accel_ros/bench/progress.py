"""One progress bar for every long command: tqdm on stderr, also when stderr is not a terminal
(a CI log then gets a line every few seconds instead of a redraw every tenth of a second);
stdout keeps only the results."""

from __future__ import annotations

import sys


def progress_bar(total: int | None, desc: str, unit: str = "step", enabled: bool = True):
    """A tqdm bar on stderr (a context manager; ``update(n)``, ``set_postfix_str``)."""
    from tqdm import tqdm  # noqa: PLC0415 - loaded on use

    tty = sys.stderr.isatty()
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=tty,
        mininterval=0.1 if tty else 5.0, ascii=not tty,
    )  # fmt: skip
