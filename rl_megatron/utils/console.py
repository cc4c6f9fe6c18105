"""One line to stderr in one write, so that lines from ranks sharing a console stay whole."""

from __future__ import annotations

import sys


def print_line(text: str, stream=None) -> None:
    """Write `text` and its newline with a single `write`.

    `print` writes the text and the newline separately; under PYTHONUNBUFFERED (stderr
    then has no buffer) each is its own system call, and two ranks refusing at once on one
    console interleave as "error: …error: …" followed by two newlines. One write of a short
    line to a pipe or terminal is atomic (POSIX: up to PIPE_BUF bytes).
    """
    stream = sys.stderr if stream is None else stream
    stream.write(f"{text}\n")
    stream.flush()
