"""Where jspec writes for a user: $JSPEC_CACHE (or its older name $JSPEC_CACHE_DIR), else ~/.cache/jspec.

Cost tables measured on the fly (the `auto` policy's), `jspec calibrate`'s fits, `jspec
train-head`'s runs, assembled GGUF presets, GGUF files' converted tokenizers (tokenizers/) and the
compilation cache (xla/) go there unless a flag names another place, so a run never writes into the
repository it was started from; the project's own tables and fits under models/ are only read.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE") or os.environ.get("JSPEC_CACHE_DIR") or Path.home() / ".cache" / "jspec")
