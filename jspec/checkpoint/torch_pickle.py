"""Read plain tensors from a PyTorch `torch.save` file (`pytorch_model.bin`) without torch.

EAGLE's own trainer and older Hugging Face exports ship heads as `pytorch_model.bin`: a zip
archive holding `<name>/data.pkl` (a pickled state dict whose tensors point at storages) and one
raw little-endian file per storage, `<name>/data/<key>`. This reader rebuilds the tensors from
those bytes with NumPy. Only what a state dict of plain tensors needs is allowed through the
unpickler (dicts, tensors rebuilt by `torch._utils._rebuild_tensor_v2`, typed storages); any
other object in the pickle is refused with its name, so a file can never run code here.
The pre-1.6 (non-zip) format is refused: re-save such a file with a current torch.
"""

from __future__ import annotations

import collections
import pickle
import zipfile

import ml_dtypes
import numpy as np

# torch storage class name -> NumPy dtype of its elements
_STORAGE_DTYPES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    """Stands for a torch.<X>Storage class named in the pickle."""

    def __init__(self, name: str):
        self.dtype = np.dtype(_STORAGE_DTYPES[name])


def _rebuild_tensor(storage, offset, size, stride, *_ignored):
    """A NumPy view of `storage` (a flat array) with torch's element offset and strides."""
    if not size:
        return storage[offset].copy()
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return np.ascontiguousarray(view)


def _rebuild_parameter(data, *_ignored):
    return data


class _StateDictUnpickler(pickle.Unpickler):
    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(fh)
        self._archive, self._prefix, self._path = archive, prefix, path
        self._storages: dict[str, np.ndarray] = {}

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise pickle.UnpicklingError(
            f"{self._path}: holds a {module}.{name}, not only plain tensors; jspec reads state dicts of tensors"
        )

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"{self._path}: unsupported storage reference {pid!r}")
        if key not in self._storages:
            raw = self._archive.read(f"{self._prefix}data/{key}")
            self._storages[key] = np.frombuffer(raw, dtype=storage_type.dtype.newbyteorder("<"))
        return self._storages[key]


def load_torch_state_dict(path: str) -> dict[str, np.ndarray]:
    """{name: array} of every tensor in a `torch.save` zip file (nested dicts are flattened
    with dots, as torch's state-dict names are)."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip-format torch file (pre-1.6 torch.save is not read; re-save it)")
    with zipfile.ZipFile(path) as archive:
        pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {len(pkl)}")
        prefix = pkl[0][: -len("data.pkl")]
        if archive.namelist().count(f"{prefix}byteorder") and archive.read(f"{prefix}byteorder") != b"little":
            raise ValueError(f"{path}: big-endian torch file; jspec reads little-endian ones")
        with archive.open(pkl[0]) as fh:
            obj = _StateDictUnpickler(fh, archive, prefix, path).load()
    out: dict[str, np.ndarray] = {}

    def walk(node, name):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(node, np.ndarray):
            out[name] = node
        else:
            raise ValueError(f"{path}: entry {name!r} is a {type(node).__name__}, not a tensor")

    walk(obj, "")
    return out
