"""Chunks named by the caller (an engine's own page keys), from Python, in
process and through a `ferry serve` daemon: stored, found, retrieved
bitwise into other blocks and deleted by name; bad names refused."""
import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError
from test_server import CHUNK, store_per_backend

LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")


@pytest.fixture(scope="module", params=["local", "server"])
def store(request, tmp_path_factory):
    yield from store_per_backend(request, tmp_path_factory, "named")

def keys(n, tag):
    return [f"{i:064x}-{tag}" for i in range(n)]


def test_named_pages_round_trip_into_other_blocks(store):
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(2, 32, CHUNK, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros_like(c) for c in src]
    names = keys(4, "a")
    # one page per block: page i in block 3+i, retrieved into block 20-i
    rc, st = store.store_named(names, src, [3, 4, 5, 6], statuses=True)
    assert (rc, st) == (4, [0, 0, 0, 0])
    assert store.lookup_named(names) == 4
    assert store.lookup_named([names[0], "missing", names[2]]) == 1
    assert store.retrieve_named(names, dst, [20, 19, 18, 17]) == 4
    for c_src, c_dst in zip(src, dst):
        for i in range(4):
            assert torch.equal(c_dst[:, 20 - i].view(torch.int16), c_src[:, 3 + i].view(torch.int16))
    assert store.lookup_named(names, salt="other") == 0
    assert store.lookup_named([n.encode() for n in names]) == 4   # bytes or str alike
    assert store.delete_named(names[:1]) == 1
    assert store.lookup_named(names) == 0


def test_bad_names_are_refused(store):
    src = [torch.zeros(2, 8, CHUNK, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    for bad in (["ok", ""], ["ok", "k" * 1025]):     # empty; past FERRY_KV_NAME_MAX (1024)
        with pytest.raises(FerryError, match="name 1 of 2"):
            store.store_named(bad, src, [0, 1])
    with pytest.raises(TypeError):
        store.lookup_named("one string is not a list of names")
    with pytest.raises(FerryError, match="no names"):
        store.lookup_named([])


def test_lookups_of_one_length_go_packed_with_the_same_answers(store):
    """Names of one length go packed (lookup_named_packed), others as an
    array: the same answers for hits, misses and leading runs."""
    src = [torch.zeros(2, 8, CHUNK, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    names = keys(5, "packed")                      # one length
    assert store.store_named(names[:3], src, [0, 1, 2]) == 3
    packed = "".join(names).encode()
    size = len(names[0])
    assert store.lookup_named_packed(packed, size, 5) == 3
    for n in range(1, 6):
        want = min(n, 3)
        assert store.lookup_named(names[:n]) == want
        assert store.lookup_named_packed(packed, size, n) == want
        assert store.lookup_named(names[:n] + ["other length"]) == want   # the array form
    assert store.lookup_named([names[3]]) == 0
    assert store.lookup_named_packed(packed[3 * size:], size, 1) == 0
    assert store.lookup_named([names[0], names[4], names[1]]) == 1
    assert store.lookup_named([bytearray(names[1].encode())]) == 1
    assert store.lookup_named([names[0]], salt="other") == 0
    assert store.lookup_named_packed(packed, size, 1, salt="other") == 0


def test_bad_packed_names_are_refused(store):
    k = keys(2, "bad")
    packed = "".join(k).encode()
    with pytest.raises(TypeError):
        store.lookup_named_packed("".join(k), len(k[0]), 2)      # str, not bytes
    with pytest.raises(ValueError, match="need"):
        store.lookup_named_packed(packed, len(k[0]), 3)          # past the buffer's end
    with pytest.raises(ValueError):
        store.lookup_named_packed(packed, -1, 1)
    with pytest.raises(FerryError, match="empty"):
        store.lookup_named_packed(packed, 0, 2)
    with pytest.raises(FerryError, match="no names"):
        store.lookup_named_packed(packed, len(k[0]), 0)
    with pytest.raises(FerryError, match="empty or too long"):
        store.lookup_named_packed(b"k" * 2050, 1025, 2)
    with pytest.raises(TypeError, match="name 1 is int"):
        store.lookup_named(["ok", 5])                  # never 5 zero bytes


def test_named_lookups_after_close_raise():
    s = ferry.KVStore("named-closed", LAY, l1="16M", chunk_tokens=CHUNK)
    k = keys(1, "closed")
    assert s.lookup_named(k) == 0
    s.close()
    for call in (lambda: s.lookup_named(k), lambda: s.lookup_named(k + ["x"]),
                 lambda: s.lookup_named_packed(k[0].encode(), len(k[0]), 1)):
        with pytest.raises(FerryError) as e:
            call()
        assert e.value.name == "EBADF"
