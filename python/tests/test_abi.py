"""Every ctypes structure the package passes to libferry has the C compiler's layout."""
import ctypes
import json
import subprocess

from conftest import abi_dump_path

from ferry import _abi as A


def _c_layouts():
    out = subprocess.run([abi_dump_path()], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_every_struct_matches_the_c_layout():
    c = _c_layouts()
    assert set(A.STRUCTS) <= set(c), f"abi_dump does not print {set(A.STRUCTS) - set(c)}"
    for name, cls in A.STRUCTS.items():
        want = c[name]
        assert ctypes.sizeof(cls) == want["size"], f"sizeof({name})"
        py_fields = [f for f, _ in cls._fields_]
        assert py_fields == list(want["fields"]), f"{name}: fields differ in name or order"
        for f in py_fields:
            off, size = want["fields"][f]
            desc = getattr(cls, f)
            assert (desc.offset, desc.size) == (off, size), f"{name}.{f}"


def test_sized_structs_carry_their_size():
    for name, cls in A.STRUCTS.items():
        if cls._fields_[0][0] == "size":
            assert cls().size == ctypes.sizeof(cls), name
