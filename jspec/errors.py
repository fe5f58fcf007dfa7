"""User-facing errors that are not about a checkpoint, a prompt or a drafter (those have their own
classes: jspec.checkpoint.errors, jspec.decode.PromptError, jspec.speculative.drafters.base.DrafterError).

The command line prints any of them as one line, `jspec: error: ...`, with exit code 2.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A bad command-line argument or combination of arguments; the message names the fix."""
