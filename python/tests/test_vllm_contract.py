"""ferry's vLLM connector against the contract of vLLM's KVConnectorBase_V1
as vllm-project/vllm states it at commit
003df2961dd8830c317a61f9745ccd557da9fa06
(vllm/distributed/kv_transfer/kv_connector/v1/base.py): SupportsHMA and
request_finished_all_groups, requires_piecewise_for_cudagraph,
get_required_kvcache_layout, load-async through get_finished,
get_block_ids_with_load_errors, take_events, stats, reset_cache.

vLLM is not installed here: the engine's side is replayed by stand-ins with
upstream's signatures (ferry.adapters._vllm_base; the scheduler's and
worker's calls as in test_adapter_vllm.py). What the stand-in scheduler does
with reported blocks follows Scheduler._handle_invalid_blocks
(vllm/v1/core/sched/scheduler.py): under kv_load_failure_policy
"recompute" the request's computed tokens are cut back to the first failed
block, which vLLM then computes itself; under "fail" the request ends with an
error. Layers are the tiny Llama's (tiny_llama.py).
"""
from types import SimpleNamespace

import time
import pytest
import torch

from ferry.adapters import register_store
from ferry.adapters import _vllm_base as base
from ferry.adapters.vllm import FerryConnector, FerryConnectorStats
from test_adapter_vllm import (BLOCKS, BS, CHUNK, NAME, Engine, Request, connector_class,
                               layer_names, prompts, serve_a, vllm_config)

Role = base.KVConnectorRole


class KVCacheBlocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks: get_block_ids() gives
    every group's block ids."""

    def __init__(self, *groups):
        self._ids = tuple(list(g) for g in groups)

    def get_block_ids(self, allow_none=False):
        return self._ids


def empty_output(**kw):
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, finished_req_ids=set(),
                         preempted_req_ids=set(),
                         scheduled_cached_reqs=SimpleNamespace(
                             req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[]))
    so.__dict__.update(kw)
    return so


def test_the_cuda_graph_flag_follows_the_layerwise_form():
    assert FerryConnector.requires_piecewise_for_cudagraph({"ferry.layerwise": True}) is True
    assert FerryConnector.requires_piecewise_for_cudagraph({"ferry.layerwise": "true"}) is True
    assert FerryConnector.requires_piecewise_for_cudagraph({}) is False
    assert FerryConnector.requires_piecewise_for_cudagraph({"ferry.layerwise": False}) is False


def test_a_layout_is_asked_for_only_when_configured():
    assert FerryConnector.get_required_kvcache_layout(vllm_config({})) is None
    assert FerryConnector.get_required_kvcache_layout(
        vllm_config({"ferry.kv_cache_layout": "hnd"})) == "HND"
    with pytest.raises(ValueError, match="NHD or HND"):
        FerryConnector.get_required_kvcache_layout(vllm_config({"ferry.kv_cache_layout": "X"}))


def test_connector_declares_hma_and_best_effort_delivery(store):
    assert issubclass(FerryConnector, base.SupportsHMA)
    register_store(NAME, store)
    c = FerryConnector(vllm_config({"ferry.store": NAME}), Role.SCHEDULER, None)
    assert c.requires_kv_delivery is False
    r = Request("x", range(40))
    c.get_num_new_matched_tokens(r, 0)
    assert c.request_finished_all_groups(r, ([1, 2], [3, 4])) == (False, None)


def test_an_async_load_is_reported_through_get_finished(model, store):
    """get_num_new_matched_tokens answers (n, True); vLLM allocates the blocks
    (update_state_after_alloc with every block of the request), parks the
    request in WAITING_FOR_REMOTE_KVS and keeps stepping; the worker starts
    the load and returns; get_finished's second set names the request once
    the load is over; vLLM allocates again with num_external_tokens 0."""
    eng = Engine(model, store)
    kv_a = serve_a(eng)
    eng.close()
    register_store(NAME, store)
    cfg = vllm_config({"ferry.store": NAME, "ferry.async_load": True})
    cls = connector_class(cfg)
    worker, sched = cls(cfg, Role.WORKER, None), cls(cfg, Role.SCHEDULER, None)
    caches = model.new_caches(BLOCKS, BS)
    worker.register_kv_caches(dict(zip(layer_names(model), caches)))
    _, b = prompts()
    rb = Request("b", b)
    assert sched.get_num_new_matched_tokens(rb, 0) == (32, True)
    blocks = list(range(20, 36))
    sched.update_state_after_alloc(rb, KVCacheBlocks(blocks), 32)
    meta = sched.build_connector_meta(empty_output())   # b is not scheduled this step
    assert [(s.req_id, s.is_async, s.need) for s in meta.loads] == [("b", True, 32)]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    recving = set()
    deadline = time.monotonic() + 30     # (a deadline, not a count of polls: a
    while time.monotonic() < deadline:   # busy CI host stretches the load)
        sending, got = worker.get_finished(set())
        assert sending is None
        recving |= got or set()
        if recving:
            break
        time.sleep(0.001)
    worker.clear_connector_metadata()
    assert recving == {"b"}
    assert worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(model.kv_of(caches, blocks, 32), kv_a)
    sched.update_state_after_alloc(rb, KVCacheBlocks(blocks), 0)   # after the load
    # the load of b was deferred, so vLLM keeps its blocks until get_finished names it
    assert sched.request_finished(rb, blocks) == (True, None)
    assert worker.get_finished({"b"}) == ({"b"}, None)
    assert worker.get_kv_connector_stats().data["async_loads"] == 1
    worker.shutdown()
    sched.shutdown()


def fail_second_chunk(eng, rb, a_blocks):
    """Admit b (32 tokens from ferry), then lose its second chunk before the
    load, as an eviction or a chunk failing its checksum would."""
    assert eng.admit(rb) == 32
    a, b = prompts()
    eng.sched.store.unpin(b[:32])
    eng.sched.store.delete(b[:32])
    # the first chunk back, from a's freed (not yet reused) blocks
    assert eng.sched.store.store(a[:16], eng.caches, a_blocks) == 16


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_error_is_recomputed_or_fails_never_used(model, store, policy):
    eng = Engine(model, store)
    a_blocks = eng.free[:10]
    serve_a(eng)
    eng.sched._failure_policy = eng.worker._failure_policy = policy
    _, b = prompts()
    rb = Request("b", b)
    fail_second_chunk(eng, rb, a_blocks)
    eng.load_only(rb)
    bad = eng.errors
    assert bad == set(eng.blocks["b"][4:8])       # the second chunk's blocks
    if policy == "fail":
        eng.finish(rb)                            # the request ends with an error
        eng.close()
        return
    # Scheduler._handle_invalid_blocks: computed tokens cut to the first failed block
    first = min(eng.blocks["b"].index(x) for x in bad) * BS
    assert first == 16
    got = model.forward(b[first:], first, eng.caches, eng.blocks["b"])
    # the same request computed with no ferry at all
    ref = model.new_caches(BLOCKS, BS)
    table = list(range(16))
    a, _ = prompts()
    model.forward(a, 0, ref, table)               # what stored b's first chunk
    want = model.forward(b[first:], first, ref, table)
    assert torch.equal(got, want)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 64), model.kv_of(ref, table, 64))
    eng.finish(rb)
    eng.close()


def test_async_saves_hold_the_blocks_until_stored(model, store):
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.async_save": True})
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    w = eng.worker
    meta = eng.step_new(ra)
    assert [len(s.tokens) for s in meta.saves] == [32]
    assert eng.sched.request_finished(ra, eng.blocks["a"]) == (True, None)
    sending = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sending, _ = w.get_finished({"a"})
        if sending:
            break
        time.sleep(0.001)
    assert sending == {"a"}
    assert store.lookup(a) == 32
    eng.close()


def test_events_stats_prometheus_and_reset(model, store):
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.kv_events": True})
    serve_a(eng)
    ev = list(eng.sched.take_events())
    assert [type(e).__name__ for e in ev] == ["BlockStored"]
    assert len(ev[0].block_hashes) == 2 and ev[0].block_size == CHUNK
    assert list(eng.sched.take_events()) == []
    a, _ = prompts()
    store.delete(a[:32])
    eng.admit(Request("c", a))                    # the lookup finds them gone
    ev = list(eng.sched.take_events())
    assert [type(e).__name__ for e in ev] == ["BlockRemoved"]
    assert len(ev[0].block_hashes) == 2
    stats = eng.worker.get_kv_connector_stats()
    assert isinstance(stats, FerryConnectorStats)
    assert stats.data["saves"] == 1 and stats.data["save_tokens"] == 32
    assert eng.worker.get_kv_connector_stats() is None          # reset by the call
    again = FerryConnector.build_kv_connector_stats(stats.data)
    assert again.aggregate(stats).reduce()["save_tokens"] == 64

    class Counter:
        __name__ = "Counter"
        made = {}

        def __init__(self, name, documentation, labelnames):
            self.name, self.values = name, {}
            Counter.made[name] = self

        def labels(self, *vals):
            metric = self

            class Child:
                def inc(self, v):
                    metric.values[vals] = metric.values.get(vals, 0) + v
            return Child()

    class Gauge(Counter):
        pass

    class Histogram(Counter):
        pass

    prom = FerryConnector.build_prom_metrics(
        vllm_config({}), {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(stats.data, 0)
    assert Counter.made["vllm:ferry_save_tokens"].values == {("tiny", "0"): 32}
    assert eng.sched.reset_cache() is True
    assert store.lookup(a) == 0
    assert [type(e).__name__ for e in eng.sched.take_events()] == ["AllBlocksCleared"]
    eng.finish(Request("c", a))
    eng.close()


def test_a_lora_requests_events_name_its_adapter(model, store):
    """vLLM's BlockStored carries the adapter a block's KV was computed
    with: lora_name (what a KV-aware router keys a LoRA's blocks by) and
    the deprecated lora_id (vllm-project/vllm
    0181ea3173e53eea8cf04a86891488e3dc89bb34, vllm/distributed/kv_events.py),
    filled from request.lora_request.name and .adapter_id (lora_name and
    lora_int_id of LoRARequest) by vLLM's own block pool
    (c59cb7941357443da7c5eef75cfa8697d683d228, vllm/v1/core/block_pool.py,
    BlockPool.cache_full_blocks). Before, ferry's events said None for
    both, so a router took an adapter's stored chunks for the base
    model's."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.kv_events": True})
    a, _ = prompts()
    r = Request("lora", a)
    r.lora_request = SimpleNamespace(lora_name="alpha", lora_int_id=7, lora_path="/a")
    eng.admit(r)
    eng.step_new(r)
    ev = list(eng.sched.take_events())
    assert [type(e).__name__ for e in ev] == ["BlockStored"]
    assert (ev[0].lora_name, ev[0].lora_id) == ("alpha", 7)
    eng.finish(r)
    base = Request("base", a)
    eng.admit(base)
    eng.step_new(base)
    ev = list(eng.sched.take_events())
    assert [(e.lora_name, e.lora_id) for e in ev] == [(None, None)]
    eng.finish(base)
    eng.close()
