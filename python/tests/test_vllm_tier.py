"""ferry as a secondary tier of vLLM's OffloadingConnector.

The interface is SecondaryTierManager of vllm-project/vllm
cda0f3248538da3cc96b3760fe4cfaa7d3d652b9 (vllm/v1/kv_offload/tiering/
base.py: TransferJob, JobResult, lookup, submit_store, submit_load,
get_finished_jobs, drain_jobs); the tier is loaded the way
TieringOffloadingSpec loads an out-of-tree one: its "secondary_tiers" entry
names the class in "type" and its module in "module_path", and the tier is
built with offloading_spec=, primary_kv_view=, tier_type= and the entry's
other keys. vLLM is not installed: the primary (vLLM's CPU tier) is a NumPy
array of slots viewed through a memoryview, as the tiering manager passes it.
"""
import time
import importlib
from types import SimpleNamespace

import numpy as np
import pytest

import ferry
from ferry.adapters import _vllm_base as base

SLOT = 64 * 1024
# the OffloadingSpec the tier is built with: its vllm_config (the fields the
# tier reads; test_vllm_tier_keys.py for what they change)
SPEC = SimpleNamespace(vllm_config=SimpleNamespace(
    model_config=SimpleNamespace(model="org/model", revision=None, dtype="torch.bfloat16"),
    cache_config=SimpleNamespace(cache_dtype="auto", block_size=16)))


def make_tier(primary, **extra):
    """TieringOffloadingSpec.get_manager's creation of one out-of-tree tier."""
    conf = {"type": "FerrySecondaryTier", "module_path": "ferry.adapters.vllm", **extra}
    conf = dict(conf)
    cls = getattr(importlib.import_module(conf.pop("module_path")), conf.pop("type"))
    assert issubclass(cls, base.SecondaryTierManager)
    return cls(offloading_spec=SPEC, primary_kv_view=memoryview(primary),
               tier_type="FerrySecondaryTier", **conf)


def poll(tier, n):
    out = []
    deadline = time.monotonic() + 30    # (a deadline: a busy host stretches the jobs)
    while time.monotonic() < deadline:
        out += list(tier.get_finished_jobs())
        if len(out) >= n:
            return out
        time.sleep(0.001)
    raise AssertionError(f"only {out} of {n} jobs finished")


def job(jid, keys, slots, promotion):
    return base.TransferJob(job_id=jid, keys=keys, chunk_ids=np.array(slots),
                            is_promotion=promotion, req_context=base.ReqContext(req_id="r"))


def test_cascade_then_promotion_is_bitwise(tmp_path):
    rng = np.random.default_rng(3)
    primary = np.zeros((8, SLOT), np.uint8)
    primary[:3] = rng.integers(0, 256, (3, SLOT), dtype=np.uint8)
    tier = make_tier(primary, l1="1M", l2=f"{tmp_path}:8M")
    keys = [bytes([i]) * 36 for i in range(3)]
    ctx = base.ReqContext(req_id="r")
    assert [tier.lookup(k, ctx) for k in keys] == [base.LookupResult.MISS] * 3
    tier.submit_store(job(1, keys, [0, 1, 2], False))       # returns at once
    # until the job is reported, a lookup of its keys says to come back
    assert tier.lookup(keys[0], ctx) == base.LookupResult.RETRY
    assert tier.has_pending_work()
    res = poll(tier, 1)
    assert [(r.job_id, r.success) for r in res] == [(1, True)]
    assert [tier.lookup(k, ctx) for k in keys] == [base.LookupResult.HIT] * 3
    ev = list(tier.take_events())
    assert len(ev) == 1 and ev[0].keys == keys and ev[0].removed is False
    tier.submit_load(job(2, keys[::-1], [5, 6, 7], True))
    res = poll(tier, 1)
    assert [(r.job_id, r.success, r.successful_keys) for r in res] == [(2, True, None)]
    assert np.array_equal(primary[5:8], primary[2::-1])
    tier.shutdown()


def test_a_promotion_of_a_lost_chunk_is_reported_failed():
    primary = np.zeros((4, SLOT), np.uint8)
    primary[0] = 7
    primary[1] = 9
    tier = make_tier(primary, l1="1M")
    k0, k1 = b"a" * 36, b"b" * 36
    tier.submit_store(job(1, [k0, k1], [0, 1], False))
    poll(tier, 1)
    tier.store.delete([0] * tier.TOKENS, salt=tier.salt(k1))   # evicted meanwhile
    primary[3] = 0
    tier.submit_load(job(2, [k0, k1], [2, 3], True))
    tier.drain_jobs()
    (res,) = tier.get_finished_jobs()
    assert res.success is False and list(res.successful_keys) == [k0]
    assert np.all(primary[2] == 7) and np.all(primary[3] == 0)   # nothing of k1 written
    tier.shutdown()


def test_bad_settings_are_refused():
    primary = np.zeros((2, SLOT), np.uint8)
    with pytest.raises(ValueError, match="l1"):
        make_tier(primary)
    with pytest.raises(RuntimeError, match="no store registered"):
        make_tier(primary, **{"ferry.store": "nowhere"})
    with pytest.raises(ValueError, match="token runs"):
        make_tier(np.zeros((2, 100), np.uint8), l1="1M")


def test_an_unknown_setting_is_refused_naming_it(tmp_path):
    """A misspelt setting switched nothing, with a warning in the scheduler's
    log: "persistant": True kept no L2 across a restart. It is refused when
    vLLM builds the tier, naming it, as the connector refuses its own; so is
    a store setting beside "ferry.store" (the registered store's are its
    own). The keys of the entry vLLM's factory reads ("type", "module_path",
    "backpressure", "tier_name": some versions pass them on) and null
    settings are taken."""
    primary = np.zeros((2, SLOT), np.uint8)
    for bad in ({"persistant": True}, {"L1": "1M"}, {"ferry.l1": "1M"}, {"chunk_tokens": 16}):
        with pytest.raises(ValueError) as e:
            make_tier(primary, l1="1M", **bad)
        assert repr(next(iter(bad))) in str(e.value) and "persistent" in str(e.value)
    from ferry.adapters import register_store, unregister_store
    from ferry.adapters.vllm import FerrySecondaryTier
    store = ferry.KVStore("tier", FerrySecondaryTier.layout_for(SLOT), l1="1M",
                          chunk_tokens=FerrySecondaryTier.TOKENS)
    register_store("tier-test", store)
    try:
        with pytest.raises(ValueError, match="give no l1, l2"):
            make_tier(primary, **{"ferry.store": "tier-test", "l1": "1M", "l2": "/x:1M"})
        tier = make_tier(primary, **{"ferry.store": "tier-test", "l1": None})
        assert tier.store is store
        tier.shutdown()
    finally:
        unregister_store("tier-test")
        store.close()
    # (a vLLM whose factory pops "type" alone passes "module_path" on)
    tier = FerrySecondaryTier(offloading_spec=SPEC, primary_kv_view=memoryview(primary),
                              tier_type="FerrySecondaryTier", l1="1M", l2=None, model=None,
                              backpressure={"type": "ema"}, tier_name="ferry",
                              module_path="ferry.adapters.vllm", persistent="no")
    tier.shutdown()
