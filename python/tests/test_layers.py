"""Layer-by-layer retrieve and store (KVStore.retrieve_layers /
store_layers, LayerOp): each layer bitwise once its wait returned, a store
invisible until its last layer, cancel and misuse as exceptions; and the
tiny Llama prefilled with its layers handed to a layerwise store as they
are computed, then a longer prompt prefilled while its prefix loads layer
by layer, waited for layer by layer: the logits bitwise those of the same
split prefill with the prefix's KV in memory. In-process and through
`ferry serve`."""
import asyncio
import errno

import pytest
import torch

import ferry
from ferry import FerryError
from test_kv import gather, paged_caches, small_layout, store_for
from test_model import BLOCKS, BS, CHUNK, layout_of, prompts
from tiny_llama import TinyLlama

FERRY_ESTATE = -4100


def test_retrieve_layers_paged_bitwise():
    lay = small_layout()
    bs, nb = 4, 40
    src = paged_caches(lay, nb, bs, 11)
    table = [5, 9, 1, 30, 2, 3, 17, 11, 12, 13, 14, 15]
    tokens = torch.arange(2000, 2048)
    with store_for(lay) as s:
        assert s.store(tokens, src, table) == 48
        dst = [torch.zeros_like(c) for c in src]
        other = [20, 21, 22, 23, 0, 4, 6, 7, 8, 10, 16, 18]
        op = s.retrieve_layers(tokens, dst, other)
        assert isinstance(op, ferry.LayerOp) and op.num_layers == 3
        for layer in (2, 0, 1):  # any order
            assert op.wait_layer(layer) == 48
            assert torch.equal(gather(dst, other, 48, bs)[layer], gather(src, table, 48, bs)[layer])
        assert op.wait() == 48
        # a prefix of the engine's own (skip) is never written
        dst2 = [torch.zeros_like(c) for c in src]
        op = s.retrieve_layers(tokens, dst2, other, skip=20)
        for layer in range(3):
            assert op.wait_layer(layer, timeout=10) == 48
        assert op.wait() == 48
        got = gather(dst2, other, 48, bs)
        assert torch.count_nonzero(got[:, :, :20]) == 0
        assert torch.equal(got[:, :, 20:], gather(src, table, 48, bs)[:, :, 20:])


def test_store_layers_visible_after_the_last():
    lay = small_layout()
    bs, nb = 4, 40
    src = paged_caches(lay, nb, bs, 12)
    table = list(range(12))
    tokens = torch.arange(3000, 3048)
    with store_for(lay) as s:
        op = s.store_layers(tokens, src, table)
        for layer in range(3):
            assert s.lookup(tokens) == 0
            op.layer_done(layer)
        assert op.wait() == 48
        assert s.lookup(tokens) == 48
        dst = [torch.zeros_like(c) for c in src]
        assert s.retrieve(tokens, dst, table) == 48
        assert torch.equal(gather(dst, table, 48, bs), gather(src, table, 48, bs))


def test_store_layers_past_its_window():
    """A prompt longer than the store's window (a quarter of L1): the chunks
    past it are staged in the store's own memory and stored after the last
    layer; all of them come back bitwise."""
    lay = small_layout()
    bs, nb = 4, 64
    src = paged_caches(lay, nb, bs, 14)
    n = 6 * CHUNK
    table = list(range(n // bs))
    tokens = torch.arange(5000, 5000 + n)
    with store_for(lay, l1=16 * CHUNK * lay.token_bytes) as s:  # 12 slots: a window of 3
        op = s.store_layers(tokens, src, table)
        for layer in (1, 2, 0):  # any order
            assert s.lookup(tokens) == 0
            op.layer_done(layer)
        assert op.wait() == n
        assert s.lookup(tokens) == n
        dst = [torch.zeros_like(c) for c in src]
        other = table[::-1]
        assert s.retrieve(tokens, dst, other) == n
        assert torch.equal(gather(dst, other, n, bs), gather(src, table, n, bs))


def test_cancel_and_misuse():
    lay = small_layout()
    src = paged_caches(lay, 40, 4, 13)
    table = list(range(12))
    tokens = torch.arange(4000, 4048)
    with store_for(lay) as s:
        op = s.store_layers(tokens, src, table)
        op.layer_done(0)
        with pytest.raises(FerryError) as e:
            op.layer_done(0)  # twice
        assert e.value.code == FERRY_ESTATE
        with pytest.raises(FerryError) as e:
            op.layer_done(3)  # past the last layer
        assert e.value.code == -errno.EINVAL
        with pytest.raises(FerryError):
            op.wait()  # layers missing: an error, not a hang
        with pytest.raises(FerryError):
            op.wait_layer(0)  # not a retrieve
        assert op.cancel() is True
        assert s.lookup(tokens) == 0
        assert s.stats()["tier"]["l1"]["chunks"] == 0
        # freed before its last layer: nothing either
        op = s.store_layers(tokens, src, table)
        op.layer_done(1)
        op.free()
        assert s.lookup(tokens) == 0
        with pytest.raises(FerryError):
            op.layer_done(2)  # freed
        assert s.store(tokens, src, table) == 48
        op = s.retrieve_layers(tokens, [torch.zeros_like(c) for c in src], table)
        with pytest.raises(FerryError) as e:
            op.wait_layer(3)
        assert e.value.code == -errno.EINVAL
        with pytest.raises(FerryError):
            op.layer_done(0)  # not a store
        assert op.wait() == 48


def test_layers_in_asyncio():
    lay = small_layout()
    src = paged_caches(lay, 40, 4, 14)
    table = list(range(12))
    tokens = torch.arange(5000, 5048)
    with store_for(lay) as s:
        assert s.store(tokens, src, table) == 48
        dst = [torch.zeros_like(c) for c in src]

        async def load():
            op = s.retrieve_layers(tokens, dst, table)
            got = [await op.wait_layer_async(layer) for layer in range(3)]
            return got, await op

        assert asyncio.run(load()) == ([48, 48, 48], 48)
        assert torch.equal(gather(dst, table, 48, 4), gather(src, table, 48, 4))


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=1234)


def layerwise_reuse(model, s):
    """Prefill a, handing each layer to a layerwise store as it is computed;
    prefill b over a's prefix loaded layer by layer; bitwise checks."""
    a, b = prompts()
    caches_a = model.new_caches(BLOCKS, BS)
    table_a = list(range(0, 16))
    op = s.store_layers(a[:32], caches_a, table_a)
    model.forward(a, 0, caches_a, table_a, after_kv=op.layer_done)
    assert op.wait() == 32
    hit = s.lookup(b)
    assert hit == 32
    caches_b = model.new_caches(BLOCKS, BS)
    table_b = list(range(63, 47, -1))
    waited = []
    op = s.retrieve_layers(b[:hit], caches_b, table_b)

    def wait(layer):
        assert op.wait_layer(layer) == hit
        waited.append(layer)

    logits = model.forward(b[hit:], hit, caches_b, table_b, before_layer=wait)
    assert op.wait() == hit
    assert waited == list(range(model.layers))
    assert torch.equal(model.kv_of(caches_b, table_b, hit)[:, :, :hit],
                       model.kv_of(caches_a, table_a, hit))
    ref = model.forward(b[hit:], hit, [c.clone() for c in caches_a], table_a)
    assert torch.equal(logits, ref)


def test_model_layerwise_in_process(model):
    with ferry.KVStore("tiny-llama", layout_of(model), l1="4M", chunk_tokens=CHUNK) as s:
        layerwise_reuse(model, s)


def test_model_layerwise_through_server(tmp_path):
    from test_server import Daemon, client
    m = TinyLlama(dim=256, layers=2, heads=4, kv_heads=2, ffn=256, seed=4321,
                  dtype=torch.bfloat16)
    d = Daemon(str(tmp_path)).start()
    try:
        with client(d) as s:
            layerwise_reuse(m, s)
    finally:
        d.stop()
