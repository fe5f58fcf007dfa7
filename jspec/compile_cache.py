"""JAX's persistent compilation cache, on by default: a program compiled once on a host is loaded,
not compiled, by every later process (the CLI, `generate()`, `jspec bench`, training).

Where it lives, first match wins:
  1. an explicit path (`--compile-cache DIR`, or `use_compile_cache(DIR)`);
  2. $JSPEC_COMPILE_CACHE;
  3. $JAX_COMPILATION_CACHE_DIR (JAX's own setting);
  4. `user_cache.user_cache_dir()` / "xla": ~/.cache/jspec/xla unless $JSPEC_CACHE moves it.
"off" (or "0", "none", "") in 1 or 2 turns the cache off.

Every program is kept, however fast it compiled (JAX's default keeps only those of a second or
more): a generation starts with dozens of small programs (prompt packing, the tree-size timing,
the sampler's setup) whose compiles add up to seconds, and a cache read costs less than any of them.
On a GPU, XLA's autotuning results are kept there too, so a cached program skips the autotuner.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from .user_cache import user_cache_dir

ENV = "JSPEC_COMPILE_CACHE"
OFF = ("off", "0", "none", "")

_decided = False  # whether enable_default_compile_cache has run in this process


def compile_cache_dir(path: str | None = None) -> str | None:
    """The directory the cache should use for an explicit `path` (None: the environment's
    choice, then the default), as an absolute path; None when it is turned off."""
    for choice in (path, os.environ.get(ENV), os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        if choice is not None:
            break
    else:
        choice = str(user_cache_dir() / "xla")
    if choice.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(choice))


def use_compile_cache(path: str | None = None) -> str | None:
    """Keep every program compiled from now on in `compile_cache_dir(path)`, or turn the cache off
    when that is None. Returns the directory used (None: off)."""
    global _decided
    _decided = True
    directory = compile_cache_dir(path)
    if directory is None:
        if jax.config.jax_compilation_cache_dir:  # also when $JAX_COMPILATION_CACHE_DIR set it
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return None
    if jax.config.jax_compilation_cache_dir == directory and jax.config.jax_persistent_cache_min_compile_time_secs == 0:
        return directory
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: reads cost less
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # a process that compiled before reads the new directory from now on
    return directory


def enable_default_compile_cache() -> str | None:
    """The library's default (`generate()`, the bench harness): the first call in a process turns
    the cache on as `use_compile_cache()` would, unless the process already chose, through this
    module or JAX's own `jax_compilation_cache_dir` (which is then left exactly as it is); later
    calls change nothing. Returns the directory in use (None: off)."""
    if _decided or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir or None
    return use_compile_cache()


def add_compile_cache_arg(parser) -> None:
    parser.add_argument(
        "--compile-cache", default=None, metavar="DIR|off",
        help=f"persistent compilation cache: a second run on this host loads its programs instead of compiling "
             f"them (default ${ENV}, else $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jspec/xla; 'off' turns it off)")
