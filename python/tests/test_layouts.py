"""Every paged KV layout an engine hands ferry, read and written in place by
strides: vLLM's NHD and HND (the permuted view vLLM passes), FlashInfer's
[blocks][2][...], packed K|V [blocks][heads][bs][2*hd], MLA, and one
cross-layer tensor for every layer. A prefix stored from each layout is
retrieved into every other at other block ids, bitwise, with the blocks
outside the table untouched: in process and through a `ferry serve` daemon.
"""
import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError
from test_server import CHUNK, store_per_backend

L, H, D, NB, BS = 2, 2, 64, 24, 4      # the daemon's tiny preset: 2 layers, 2 heads of 64
NTOK = 3 * CHUNK
LAY = ferry.Layout(num_layers=L, num_heads=H, head_dim=D, dtype="bf16")


def make(kind, seed):
    """(caches as the engine passes them, function (layer, kv, block) -> [BS, H, D] view)."""
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)
    if kind == "NHD":
        caches = [rnd(2, NB, BS, H, D) for _ in range(L)]
        return caches, lambda l, k, b: caches[l][k, b]
    if kind == "HND":   # allocated [2, NB, H, BS, D], passed as the [2, NB, BS, H, D] view
        raw = [rnd(2, NB, H, BS, D) for _ in range(L)]
        caches = [r.permute(0, 1, 3, 2, 4) for r in raw]
        return caches, lambda l, k, b: caches[l][k, b]
    if kind == "FlashInfer":
        caches = [rnd(NB, 2, BS, H, D) for _ in range(L)]
        return caches, lambda l, k, b: caches[l][b, k]
    if kind == "packed":   # [NB, H, BS, 2*D]: K in the first half of the last axis
        caches = [rnd(NB, H, BS, 2 * D) for _ in range(L)]
        return caches, lambda l, k, b: caches[l][b, :, :, k * D:(k + 1) * D].permute(1, 0, 2)
    if kind == "dict":
        caches = {f"model.layers.{i}.self_attn.attn": rnd(2, NB, BS, H, D) for i in range(L)}
        vals = list(caches.values())
        return caches, lambda l, k, b: vals[l][k, b]
    if kind == "cross-layer":
        t = rnd(NB, L, 2, BS, H, D)
        return t, lambda l, k, b: t[b, l, k]
    raise AssertionError(kind)


KINDS = ["NHD", "HND", "FlashInfer", "packed", "dict", "cross-layer"]
FOUND = {"dict": "NHD"}


@pytest.fixture(scope="module", params=["local", "server"])
def store(request, tmp_path_factory):
    yield from store_per_backend(request, tmp_path_factory, "layouts")

def blocks(seed):
    return list(np.random.default_rng(seed).permutation(NB)[:NTOK // BS])


def test_from_kv_caches_names_the_layout():
    for kind in KINDS:
        caches, _ = make(kind, 1)
        lay = ferry.Layout.from_kv_caches(caches)
        assert lay == LAY, kind
        assert lay.cache_layout == FOUND.get(kind, kind)
    mla = [torch.zeros(NB, BS, 576, dtype=torch.bfloat16) for _ in range(3)]
    lay = ferry.Layout.from_kv_caches(mla)
    assert (lay.kv, lay.num_heads, lay.head_dim, lay.cache_layout) == (1, 1, 576, "MLA")
    with pytest.raises(ValueError, match="cannot read a layout"):
        ferry.Layout.from_kv_caches([torch.zeros(3, 3, dtype=torch.bfloat16)])
    two = [torch.zeros(2, 2, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(ValueError, match="cache_layout="):
        ferry.Layout.from_kv_caches(two)       # 2 blocks: whose [2][2]?
    assert ferry.Layout.from_kv_caches(two, cache_layout="FlashInfer").cache_layout == \
        "FlashInfer"


@pytest.mark.parametrize("src_kind", KINDS)
def test_every_layout_pair_round_trips_bitwise(store, src_kind):
    toks = np.arange(NTOK, dtype=np.int32) * 7 + 1000 * KINDS.index(src_kind)
    src, sview = make(src_kind, 10)
    stab = blocks(3)
    assert store.store(toks, src, stab) == NTOK
    for dst_kind in KINDS:
        dst, dview = make(dst_kind, 20)
        before = [dview(l, k, b).clone() for l in range(L) for k in range(2) for b in range(NB)]
        dtab = blocks(5 + KINDS.index(dst_kind))
        assert store.retrieve(toks, dst, dtab) == NTOK
        i = 0
        for l in range(L):
            for k in range(2):
                for b in range(NB):
                    got = dview(l, k, b)
                    if b in dtab:
                        want = sview(l, k, stab[dtab.index(b)])
                        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                            (src_kind, dst_kind, l, k, b)
                    else:
                        assert torch.equal(got.view(torch.int16), before[i].view(torch.int16)), \
                            f"{dst_kind}: block {b} outside the table was written"
                    i += 1


def test_layouts_ferry_cannot_read_are_refused(store):
    toks = np.arange(CHUNK, dtype=np.int32) + 77777
    nhd, _ = make("NHD", 1)
    fi, _ = make("FlashInfer", 1)
    with pytest.raises(ValueError, match="every layer must have one layout"):
        store.store(toks, [nhd[0], fi[1]], [0, 1, 2, 3])
    gapped = [torch.zeros(2, NB, BS, H, 2 * D, dtype=torch.bfloat16)[..., ::2] for _ in range(L)]
    with pytest.raises(ValueError, match="head_dim axis is not contiguous"):
        store.store(toks, gapped, [0, 1, 2, 3])
    with pytest.raises(FerryError, match="block id 24 at position 3|outside"):
        store.store(toks, nhd, [0, 1, 2, NB])
    with pytest.raises(ValueError, match="paged K/V cache is"):
        store.store(toks, [torch.zeros(NB, 3, BS, H, D, dtype=torch.bfloat16)] * L, [0, 1, 2, 3])
    assert store.lookup(toks) == 0
