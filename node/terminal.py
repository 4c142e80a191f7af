"""Text from peers made safe to print on an operator's terminal.

Node records are self-signed and their strings (``http_url``, ``version``) are free text, and a
relay's answers are whatever it sends; ``intellect-node status`` and ``doctor`` print them. A raw
ESC sequence there (``\\x1b[8m`` hides every line after it, ``\\x1b]0;…`` sets the window title,
OSC 8 makes links) or, through rich, markup such as ``[link=…]`` would let any peer rewrite what
the operator reads.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: object) -> str:
    """``text`` with each character Python does not call printable (C0/C1 controls such as ESC,
    newlines, bidirectional overrides and other format characters) written as its escape (``\\x1b``)."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
