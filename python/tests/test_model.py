"""ferry checked on a real model computation: a prompt's KV is stored, a
longer prompt sharing its prefix retrieves the cached blocks and prefills
only the rest. The retrieved KV is bitwise the KV the prefix produced and
the logits are bitwise those of the same split prefill with the prefix's
KV kept in memory (and close to a full recompute, whose other query shape
may sum in another order): in-process, and across a close and reopen of
a store with a persistent L2."""
import pytest
import torch

import ferry
from tiny_llama import TinyLlama

CHUNK, BS, BLOCKS = 16, 4, 64


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=1234)


def prompts():
    g = torch.Generator().manual_seed(99)
    a = torch.randint(0, 512, (40,), generator=g)
    b = torch.cat([a[:36], torch.randint(0, 512, (28,), generator=g)])  # 64 tokens
    return a, b


def layout_of(model):
    return ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype=model.dtype)


def prefill_and_store(model, store):
    a, _ = prompts()
    caches = model.new_caches(BLOCKS, BS)
    table_a = list(range(0, 16))
    model.forward(a, 0, caches, table_a)
    assert store.store(a, caches, table_a) == 32  # two whole chunks of the 40 tokens
    return caches, table_a


def check_reuse(model, store, caches_a, table_a):
    a, b = prompts()
    hit = store.lookup(b)
    assert hit == 32
    # retrieve the prefix into other blocks of a fresh cache
    caches_b = model.new_caches(BLOCKS, BS)
    table_b = list(range(63, 47, -1))
    assert store.retrieve(b[:hit], caches_b, table_b) == hit
    assert torch.equal(model.kv_of(caches_b, table_b, hit), model.kv_of(caches_a, table_a, hit))
    logits = model.forward(b[hit:], hit, caches_b, table_b)
    # the same split prefill with the prefix's KV kept in memory
    ref_caches = [c.clone() for c in caches_a]
    ref = model.forward(b[hit:], hit, ref_caches, table_a)
    assert torch.equal(logits, ref)
    # a full recompute sums in other shapes: equal within float tolerance
    full = model.forward(b, 0, model.new_caches(BLOCKS, BS), list(range(16)))
    torch.testing.assert_close(logits, full[hit:], rtol=1e-4, atol=1e-5)
    assert not torch.equal(logits, model.forward(b[hit:], hit, model.new_caches(BLOCKS, BS),
                                                 table_b)), "the prefix's KV must matter"


def test_prefix_reuse_in_process(model):
    with ferry.KVStore("tiny-llama", layout_of(model), l1="4M", chunk_tokens=CHUNK) as s:
        caches_a, table_a = prefill_and_store(model, s)
        check_reuse(model, s, caches_a, table_a)


def test_prefix_reuse_across_reopen_with_persistent_l2(model, tmp_path):
    kw = dict(l1="4M", l2=f"{tmp_path}/l2:8M", chunk_tokens=CHUNK, persistent=True,
              l2_direct=False)
    with ferry.KVStore("tiny-llama", layout_of(model), **kw) as s:
        caches_a, table_a = prefill_and_store(model, s)
        assert s.sync() == 2
    with ferry.KVStore("tiny-llama", layout_of(model), **kw) as s:
        assert s.lookup_tiers(prompts()[1])[1][:2] == ["l2", "l2"]
        check_reuse(model, s, caches_a, table_a)


def test_other_model_or_salt_never_reuses(model):
    with ferry.KVStore("tiny-llama", layout_of(model), l1="4M", chunk_tokens=CHUNK) as s:
        a, b = prompts()
        caches = model.new_caches(BLOCKS, BS)
        model.forward(a, 0, caches, list(range(16)))
        s.store(a, caches, list(range(16)), salt=b"user-1")
        assert s.lookup(b, salt=b"user-1") == 32
        assert s.lookup(b, salt=b"user-2") == 0
    with ferry.KVStore("other-model", layout_of(model), l1="4M", chunk_tokens=CHUNK) as s:
        assert s.lookup(b) == 0
