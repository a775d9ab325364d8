"""A launched child's output (`jaxpar launch`): its own lines kept whole and apart from the runtime's,
and Gloo's connection notices, which the runtime prints piece by piece from several C++ threads, dropped.
JAX-free: `jaxpar.cli.main` arranges a child's streams before anything else loads."""
from __future__ import annotations

import os
import re
import sys

CHILD = "JAXPAR_LAUNCHED"  # set by `jaxpar launch` in each child's environment (jaxpar/cli/launch.py)


def separate_streams() -> None:
    """In a launched child: Python's standard output on its own descriptor, line-buffered, and the
    process's C++ standard output (Gloo prints its notices there, piece by piece, from several threads)
    sent to standard error, so that no runtime text lands inside one of jaxpar's lines."""
    if os.environ.get(CHILD) != "1":
        return
    own = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(own, "w", buffering=1, encoding=sys.stdout.encoding, errors="replace")


GLOO_NOTICE = re.compile(r"\[Gloo\] Rank \d* is connected to \d* peer ranks\. Expected number of connected "
                         r"peer ranks is : \d*")
GLOO_TEMPLATE = "[Gloo] Rank N is connected to N peer ranks. Expected number of connected peer ranks is : N"
# The pieces the runtime streams a notice in (the numbers between them dropped), in any order, at least one.
GLOO_PIECES = re.compile(r"(?:\s*(?:\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer "
                         r"ranks is :)\s*)+")


def clean_lines(stream):
    """A child's stream's lines, decoded, without Gloo's connection notices (`unglued`)."""
    for raw in stream:
        line = unglued(raw.decode(errors="replace"))
        if line is not None:
            yield line


def unglued(line: str) -> str | None:
    """`line` without Gloo's connection notices (one per process per communicator, each printed as the pieces
    of `GLOO_PIECES` by unsynchronised C++ threads: two may share a line with their pieces shuffled, or one may
    be cut in two); None if nothing else was in it (a line of notice pieces alone is dropped too)."""
    left = line
    while (stripped := GLOO_NOTICE.sub("", left, count=1)) != left:
        left = stripped
    piece = re.sub(r"\d+", "N", left).strip()
    if (len(piece) >= 4 and piece in GLOO_TEMPLATE) or GLOO_PIECES.fullmatch(re.sub(r"\d+", "", left)):
        return None
    return line if left == line else (left if left.strip() else None)
