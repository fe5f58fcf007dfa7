"""Where jspec writes for a user: $JSPEC_CACHE, else ~/.cache/jspec.

Cost tables measured on the fly (the `auto` policy's), `jspec calibrate`'s fits and `jspec
train-head`'s runs go there unless a flag names another place, so a run never writes into the
repository it was started from; the project's own tables and fits under models/ are only read.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE") or Path.home() / ".cache" / "jspec")
