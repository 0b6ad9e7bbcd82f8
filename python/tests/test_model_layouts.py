"""The tiny decoder with its paged cache in each layout an engine uses:
vLLM's NHD and HND (the permuted view vLLM passes), FlashInfer's
[blocks][2][...], packed K|V and one cross-layer tensor. A prompt is
prefilled in one layout and stored; a longer prompt sharing its prefix
retrieves it into every other layout at other block ids and prefills the
rest: KV and logits are bitwise those of the same split prefill with the
prefix kept in memory, and blocks outside the table stay untouched."""
import pytest
import torch

import ferry
from test_model import BLOCKS, BS, CHUNK, layout_of, prompts
from tiny_llama import TinyLlama

KINDS = ["NHD", "HND", "FlashInfer", "packed", "cross-layer"]


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=4321)


def caches_in(model, kind):
    """(what the engine hands ferry, the decoder's [2, blocks, bs, heads, hd] views)."""
    L, H, D = model.layers, model.kv_heads, model.head_dim
    z = dict(dtype=model.dtype)
    if kind == "NHD":
        t = [torch.zeros(2, BLOCKS, BS, H, D, **z) for _ in range(L)]
        return t, t
    if kind == "HND":
        t = [torch.zeros(2, BLOCKS, H, BS, D, **z).permute(0, 1, 3, 2, 4) for _ in range(L)]
        return t, t
    if kind == "FlashInfer":
        t = [torch.zeros(BLOCKS, 2, BS, H, D, **z) for _ in range(L)]
        return t, [x.permute(1, 0, 2, 3, 4) for x in t]
    if kind == "packed":
        t = [torch.zeros(BLOCKS, H, BS, 2 * D, **z) for _ in range(L)]
        return t, [x.view(BLOCKS, H, BS, 2, D).permute(3, 0, 2, 1, 4) for x in t]
    t = torch.zeros(BLOCKS, L, 2, BS, H, D, **z)
    return t, [t[:, i].permute(1, 0, 2, 3, 4) for i in range(L)]


@pytest.mark.parametrize("src", KINDS)
def test_prefill_from_a_prefix_stored_in_another_layout(model, src):
    a, b = prompts()
    with ferry.KVStore("tiny", layout_of(model), l1="8M", chunk_tokens=CHUNK) as store:
        raw_a, views_a = caches_in(model, src)
        table_a = list(range(16))
        model.forward(a, 0, views_a, table_a)
        assert store.store(a, raw_a, table_a) == 32
        ref = model.forward(b[32:], 32, [v.clone() for v in views_a], table_a)
        for dst in KINDS:
            raw_b, views_b = caches_in(model, dst)
            table_b = list(range(63, 47, -1))
            assert store.retrieve(b[:32], raw_b, table_b) == 32
            assert torch.equal(model.kv_of(views_b, table_b, 32),
                               model.kv_of(views_a, table_a, 32)), (src, dst)
            untouched = [blk for blk in range(BLOCKS) if blk not in table_b[:8]]
            for v in views_b:
                assert not v[:, untouched].any(), f"{dst}: a block outside the table was written"
            logits = model.forward(b[32:], 32, views_b, table_b)
            assert torch.equal(logits, ref), (src, dst)
