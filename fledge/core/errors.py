"""The one exception fledge raises for bad input: the CLI prints its message as one line and exits 2."""

from __future__ import annotations


class FledgeError(Exception):
    """A problem the user can fix. The CLI prints `fledge: error: <message>` and exits 2.

    Messages name the file (or argument) and the problem in one line.
    """
