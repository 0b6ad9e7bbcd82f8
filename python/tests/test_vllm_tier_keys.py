"""The keys of ferry's secondary tier under vLLM's TieringOffloadingSpec.

vLLM's offload keys hash the tokens alone: hash_block_tokens chained from
NONE_HASH, which init_none_hash derives from PYTHONHASHSEED when it is set
(vllm-project/vllm 001cabc1be16a59a70d720ed61a13b678c060a18,
vllm/v1/core/kv_cache_utils.py; RequestBlockHashList,
1b5b6e147c3aedb7b4c5badff8253954ae3e1136, vllm/v1/kv_offload/hashing.py),
so the same prompt has the same keys after a restart under another model,
cache dtype or TP rank. A persistent L2 the tier kept across such a change
must answer a miss, never load the other engine's bytes; the same engine
reopened finds its chunks bitwise. vLLM's factory builds the tier with
vllm_config= (0411f953de014cc29c91aa7060d66f603bde6a54,
vllm/v1/kv_offload/tiering/factory.py); older ones pass offloading_spec=,
whose vllm_config the tier reads.
"""
import importlib
import sys
import time
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

import ferry
from ferry.adapters import _vllm_base as base

SLOT = 64 * 1024
KEYS = [bytes([i]) * 32 for i in range(3)]


def config(model="org/model-a", cache_dtype="auto", tp=1, revision=None):
    """The fields of vLLM's VllmConfig the tier reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, dtype="torch.bfloat16",
                                     quantization=None),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector",
                                           kv_connector_extra_config={}))


def make_tier(primary, vllm_config, **extra):
    """SecondaryTierFactory.create_secondary_tier's creation of the tier."""
    conf = {"type": "FerrySecondaryTier", "module_path": "ferry.adapters.vllm", **extra}
    cls = getattr(importlib.import_module(conf.pop("module_path")), conf.pop("type"))
    return cls(vllm_config=vllm_config, primary_kv_view=memoryview(primary),
               tier_type="FerrySecondaryTier", **conf)


def job(jid, keys, slots, promotion):
    return base.TransferJob(job_id=jid, keys=keys, chunk_ids=np.array(slots),
                            is_promotion=promotion, req_context=base.ReqContext(req_id="r"))


def finished(tier):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = list(tier.get_finished_jobs())
        if out:
            return out
        time.sleep(0.001)
    raise AssertionError("no job finished")


def store_then_close(tmp_path, vllm_config, **extra):
    """An engine that cascades three slots to a persistent L2 and stops."""
    primary = np.zeros((6, SLOT), np.uint8)
    primary[:3] = np.random.default_rng(5).integers(0, 256, (3, SLOT), dtype=np.uint8)
    tier = make_tier(primary, vllm_config, l1="1M", l2=f"{tmp_path}:8M", persistent=True,
                     **extra)
    tier.submit_store(job(1, KEYS, [0, 1, 2], False))
    assert [(r.job_id, r.success) for r in finished(tier)] == [(1, True)]
    tier.shutdown()
    return primary[:3].copy()


def reopen_and_load(tmp_path, vllm_config, **extra):
    """An engine restarted on the same L2: its lookups, and a promotion of
    every key into slots 3..5 (zero before); the slots and the job's result."""
    primary = np.zeros((6, SLOT), np.uint8)
    tier = make_tier(primary, vllm_config, l1="1M", l2=f"{tmp_path}:8M", persistent=True,
                     **extra)
    ctx = base.ReqContext(req_id="r")
    looked = [tier.lookup(k, ctx) for k in KEYS]
    tier.submit_load(job(2, KEYS, [3, 4, 5], True))
    tier.drain_jobs()
    (res,) = tier.get_finished_jobs()
    tier.shutdown()
    return looked, res, primary[3:]


class Ranks:
    """vLLM's distributed groups in a process that is one rank."""

    def __init__(self, monkeypatch, tp):
        vllm = ModuleType("vllm")
        dist = ModuleType("vllm.distributed")
        dist.get_tensor_model_parallel_rank = lambda: self.tp
        dist.get_pp_group = lambda: SimpleNamespace(rank_in_group=0)
        vllm.distributed = dist
        monkeypatch.setitem(sys.modules, "vllm", vllm)
        monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
        self.tp = tp


def assert_all_missed(looked, res, slots):
    assert looked == [base.LookupResult.MISS] * 3
    assert res.success is False and list(res.successful_keys or []) == []
    assert not slots.any()          # not one byte of the other engine's written


@pytest.mark.parametrize("first, then", [
    ({"model": "org/model-a"}, {"model": "org/model-b"}),
    ({"revision": "r1"}, {"revision": "r2"}),
    ({"cache_dtype": "fp8_e4m3"}, {"cache_dtype": "fp8_e5m2"}),
], ids=["model", "revision", "cache-dtype"])
def test_another_engine_on_a_persistent_l2_never_loads_its_chunks(tmp_path, first, then):
    want = store_then_close(tmp_path, config(**first))
    assert_all_missed(*reopen_and_load(tmp_path, config(**then)))
    # the first engine, back, still finds its own chunks bitwise
    looked, res, slots = reopen_and_load(tmp_path, config(**first))
    assert looked == [base.LookupResult.HIT] * 3 and res.success is True
    assert np.array_equal(slots, want)


def test_fp8_and_fp8_e4m3_are_one_format(tmp_path):
    want = store_then_close(tmp_path, config(cache_dtype="fp8"))
    looked, res, slots = reopen_and_load(tmp_path, config(cache_dtype="fp8_e4m3"))
    assert res.success is True and np.array_equal(slots, want)


def test_another_tp_rank_never_loads_this_ranks_chunks(monkeypatch, tmp_path):
    ranks = Ranks(monkeypatch, tp=0)
    want = store_then_close(tmp_path, config(tp=2))
    ranks.tp = 1
    assert_all_missed(*reopen_and_load(tmp_path, config(tp=2)))
    # and another TP size, at rank 0
    ranks.tp = 0
    assert_all_missed(*reopen_and_load(tmp_path, config(tp=4)))
    looked, res, slots = reopen_and_load(tmp_path, config(tp=2))
    assert res.success is True and np.array_equal(slots, want)


def test_an_explicit_model_names_the_keys(tmp_path):
    """"model" stands for vLLM's model name: two engines that give the same
    one share chunks whatever their model paths; another one misses."""
    want = store_then_close(tmp_path, config(model="/models/a"), model="team-a")
    looked, res, slots = reopen_and_load(tmp_path, config(model="/mnt/a"), model="team-a")
    assert res.success is True and np.array_equal(slots, want)


def test_without_vllm_config_the_tier_needs_a_model(tmp_path):
    primary = np.zeros((4, SLOT), np.uint8)
    with pytest.raises(ValueError, match="give \"model\""):
        make_tier(primary, None, l1="1M")
    for bad in ("", 7):
        with pytest.raises(ValueError, match="non-empty string"):
            make_tier(primary, config(), l1="1M", model=bad)
    # a vLLM that passes its OffloadingSpec: that spec's vllm_config
    tier = make_tier(primary, None, l1="1M",
                     offloading_spec=SimpleNamespace(vllm_config=config(model="org/x")))
    assert "model=org/x@None" in tier.identity
    tier.shutdown()
    # an explicit model, no vllm_config: chunks under that name and slot size
    # (the store is named by it too: its persistent L2 refuses another name)
    want = store_then_close(tmp_path, None, model="team-a")
    with pytest.raises(ferry.FerryError, match="model team-a here, team-b asked"):
        reopen_and_load(tmp_path, None, model="team-b")
    looked, res, slots = reopen_and_load(tmp_path, None, model="team-a")
    assert res.success is True and np.array_equal(slots, want)


def test_a_registered_store_shared_by_two_models_keeps_them_apart():
    from ferry.adapters import register_store, unregister_store
    from ferry.adapters.vllm import FerrySecondaryTier
    store = ferry.KVStore("shared", FerrySecondaryTier.layout_for(SLOT), l1="1M",
                          chunk_tokens=FerrySecondaryTier.TOKENS)
    register_store("tier-keys", store)
    try:
        a_primary = np.full((2, SLOT), 5, np.uint8)
        a = make_tier(a_primary, config(model="org/a"), **{"ferry.store": "tier-keys"})
        a.submit_store(job(1, KEYS[:2], [0, 1], False))
        assert finished(a)[0].success is True
        b_primary = np.zeros((2, SLOT), np.uint8)
        b = make_tier(b_primary, config(model="org/b"), **{"ferry.store": "tier-keys"})
        ctx = base.ReqContext(req_id="r")
        assert [b.lookup(k, ctx) for k in KEYS[:2]] == [base.LookupResult.MISS] * 2
        b.submit_load(job(2, KEYS[:2], [0, 1], True))
        b.drain_jobs()
        (res,) = b.get_finished_jobs()
        assert res.success is False and not b_primary.any()
        # "model" beside "ferry.store" names the keys, not the store
        c = make_tier(np.zeros((2, SLOT), np.uint8), None,
                      **{"ferry.store": "tier-keys", "model": "org/a"})
        assert c.store is store
        for t in (a, b, c):
            t.shutdown()
    finally:
        unregister_store("tier-keys")
        store.close()


def offloading_config(model="org/model-a", cache_dtype="auto", tp=1, layers=("l0", "l1")):
    """The OffloadingConfig a vLLM whose OffloadingSpec holds no vllm_config
    gives (OffloadingSpec.__init__(config), vllm/v1/kv_offload/base.py at
    vllm-project/vllm 0105e232b7fa; its fields, vllm/v1/kv_offload/config.py
    at 006f89ace7ca; TieringOffloadingSpec passes itself to the factory,
    vllm/v1/kv_offload/tiering/spec.py at 0078e9d2b020). Its scheduler's
    parallel rank is 0 whatever the TP."""
    return SimpleNamespace(config=SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=16, layer_names=tuple(layers)),),
        worker_kv_bytes_per_block=SLOT // max(tp, 1), enable_kv_cache_events=False,
        extra_config={}, engine_id="e",
        model=SimpleNamespace(name=model, dtype=cache_dtype),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1,
                                 dcp_size=1, data_parallel_index=0,
                                 is_parallelism_agnostic=False),
        replicated_layout=False))


@pytest.mark.parametrize("first, then", [
    ({"model": "org/model-a"}, {"model": "org/model-b"}),
    ({"cache_dtype": "fp8_e4m3"}, {"cache_dtype": "fp8_e5m2"}),
    ({"tp": 1}, {"tp": 2}),
    ({"layers": ("l0", "l1")}, {"layers": ("l0", "l1", "draft.l0")}),
], ids=["model", "cache-dtype", "tp", "groups"])
def test_a_vllm_that_gives_an_offloading_config_keys_by_it(tmp_path, first, then):
    """The README's tier entry, no "model", on a vLLM whose OffloadingSpec
    carries an OffloadingConfig and no vllm_config: the tier starts, keys
    its chunks by that config, and another engine's misses."""
    want = store_then_close(tmp_path, None, offloading_spec=offloading_config(**first))
    assert_all_missed(*reopen_and_load(tmp_path, None,
                                       offloading_spec=offloading_config(**then)))
    looked, res, slots = reopen_and_load(tmp_path, None,
                                         offloading_spec=offloading_config(**first))
    assert looked == [base.LookupResult.HIT] * 3 and res.success is True
    assert np.array_equal(slots, want)


def test_an_offloading_configs_fp8_is_fp8_e4m3_and_its_scheduler_rank_is_all():
    primary = np.zeros((2, SLOT), np.uint8)
    a = make_tier(primary, None, l1="1M", offloading_spec=offloading_config(cache_dtype="fp8"))
    b = make_tier(primary, None, l1="1M",
                  offloading_spec=offloading_config(cache_dtype="fp8_e4m3"))
    assert a.identity == b.identity and a.salt(KEYS[0]) == b.salt(KEYS[0])
    c = make_tier(primary, None, l1="1M", offloading_spec=offloading_config(tp=2))
    assert "tpallof2" in c.identity
    for t in (a, b, c):
        t.shutdown()
