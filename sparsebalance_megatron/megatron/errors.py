"""The adapter's launch error, in a leaf module every adapter module may import.

``LaunchError`` is raised by the launch checks, the resume-state reader, the hybrid stack spec and
the replay set-up alike; it lives here, importing nothing of the package, so that none of them has
to import another's module (with its own imports) to raise it, and no import circle forms around
it. ``launch/checks.py`` re-exports it for the callers that import it from there.
Must not import anything from the package, megatron or torch.distributed.
"""

from __future__ import annotations


class LaunchError(ValueError):
    """A launch setting that cannot work; raised before any model or process group is built."""
