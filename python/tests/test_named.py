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
