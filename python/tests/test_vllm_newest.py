"""ferry's vLLM connector driven as vllm-project/vllm
00f4240ee6458263d76cf51ca7901ce1350bb4d1 drives a KV connector (newer than
003df2961dd8830c317a61f9745ccd557da9fa06, which test_vllm_contract.py
follows). What that commit changed for a connector, from its sources:

- vllm/distributed/kv_transfer/kv_connector/v1/base.py: the worker reports
  finished transfers through get_transfer_results(finished_req_ids), one
  KVConnectorTransferResults (finished_sending, finished_recving,
  failed_recving; a failed receive is in finished_recving too); new
  defaults finish_forward, reset_capture_state, get_mem_pool_context,
  bind_kv_cache_manager, has_pending_block_frees,
  register_finished_partial_tail, can_load_/consume_prefix_replay_checkpoint,
  supports_divergent_local_hybrid_hits; prefer_cross_layer_blocks and
  register_cross_layers_kv_cache are gone; KVConnectorStats gains to_dict
  (metrics.py), which Scheduler.make_stats now calls.
- vllm/v1/worker/kv_connector_model_runner_mixin.py,
  _get_kv_connector_output: bind_connector_metadata; start_load_kv before
  the forward only when scheduler_output.has_sync_kv_loads, otherwise after
  it (async loads' submission off the critical path); wait_for_save (also
  on steps without a forward, metadata still bound);
  get_transfer_results(finished_req_ids); get_block_ids_with_load_errors;
  get_kv_connector_stats; get_kv_connector_kv_cache_events;
  build_connector_worker_meta; clear_connector_metadata. The model runner
  calls handle_preemptions(metadata) before binding it.
- vllm/v1/core/sched/scheduler.py: schedule() sets has_sync_kv_loads only
  for a request admitted this step with external tokens and no async load;
  when allocate_slots fails and connector.has_pending_block_frees() is
  True it stops instead of preempting; update_from_output: with more than
  one KV cache group, reported invalid_block_ids raise RuntimeError
  (_handle_invalid_blocks: "Connectors must report failed requests via
  KVConnectorTransferResults.failed_recving"); _handle_failed_recving sets
  a failed async load's request back to 0 computed tokens (policy
  "recompute") or fails it; _update_from_kv_xfer_finished calls
  update_connector_output, then frees a finished request's blocks on its
  finished_recving and asserts every finished_sending request is still
  known; the scheduler-side get_kv_connector_stats() is aggregated each
  step and make_stats sends stats.to_dict().

vLLM is not installed: the stand-ins below replay those calls, in that
order, around the tiny Llama.
"""
import time
from types import SimpleNamespace

import pytest
import torch

import ferry
from ferry.adapters import register_store, unregister_store
from ferry.adapters import _vllm_base as base
from ferry.adapters.vllm import FerryConnector, FerryConnectorMetadata, FerryConnectorStats
from test_adapter_vllm import (BLOCKS, BS, CHUNK, NAME, Engine, Request, connector_class,
                               layer_names, prompts, serve_a, vllm_config)
from test_vllm_contract import KVCacheBlocks, empty_output
from test_vllm_hybrid import L0, L1, SlidingWindowSpec, W, kv_cache_config, step
from tiny_llama import TinyLlama

Role = base.KVConnectorRole
FWD = SimpleNamespace(attn_metadata={}, no_compile_layers={})
WAITING_FOR_REMOTE_KVS, FINISHED = "WAITING_FOR_REMOTE_KVS", "FINISHED"


def worker_step(w, so, forward=None, calls=None):
    """GPUModelRunner (handle_preemptions) and
    KVConnectorModelRunnerMixin._get_kv_connector_output around one step;
    forward None: kv_connector_no_forward. Returns the KVConnectorOutput."""
    calls = calls if calls is not None else []
    w.handle_preemptions(so.kv_connector_metadata)
    w.bind_connector_metadata(so.kv_connector_metadata)
    if so.has_sync_kv_loads:
        calls.append("start_load_kv")
        w.start_load_kv(FWD)
    if forward is not None:
        calls.append("forward")
        forward()
    if not so.has_sync_kv_loads:
        calls.append("start_load_kv")
        w.start_load_kv(FWD)
    w.wait_for_save()
    res = w.get_transfer_results(so.finished_req_ids)
    assert isinstance(res, base.KVConnectorTransferResults)
    out = SimpleNamespace(finished_sending=res.finished_sending,
                          finished_recving=res.finished_recving,
                          failed_recving=res.failed_recving,
                          invalid_block_ids=w.get_block_ids_with_load_errors(),
                          kv_connector_stats=w.get_kv_connector_stats(),
                          kv_cache_events=w.get_kv_connector_kv_cache_events(),
                          kv_connector_worker_meta=w.build_connector_worker_meta())
    w.clear_connector_metadata()
    return out


class Sched:
    """The connector's part of Scheduler.update_from_output at 00f4240e, for
    requests tracked by status; policy "recompute"."""

    def __init__(self, conn, groups=1):
        self.c, self.groups = conn, groups
        self.requests = {}              # req id -> Request (with .status)
        self.finished_recving = set()
        self.failed_recving = set()

    def update_from_output(self, out):
        if out.invalid_block_ids and self.groups > 1:
            raise RuntimeError("block-level load failures with several KV cache groups")
        for rid in out.failed_recving:              # _handle_failed_recving
            req = self.requests.get(rid)
            if req is not None and req.status == WAITING_FOR_REMOTE_KVS:
                req.num_computed_tokens = 0
                self.failed_recving.add(rid)
        self.c.update_connector_output(out)         # _update_from_kv_xfer_finished
        for rid in out.finished_recving:
            assert rid in self.requests
            if self.requests[rid].status == WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
            else:
                assert self.requests[rid].status == FINISHED
                del self.requests[rid]
        for rid in out.finished_sending:
            assert rid in self.requests, f"{rid} reported finished twice"
            del self.requests[rid]
        stats = self.c.get_kv_connector_stats()
        assert stats is None or stats.is_empty() is False


def poll(w, finished, until, timeout=30):
    """Steps without a forward until `until(outputs)`; every output."""
    outs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # an empty step's metadata, as build_connector_meta returns it
        outs.append(worker_step(w, empty_output(kv_connector_metadata=FerryConnectorMetadata(),
                                                has_sync_kv_loads=False,
                                                finished_req_ids=set(finished)),
                                None))
        finished = ()
        if until(outs):
            break
        time.sleep(0.001)
    return outs


@pytest.mark.skipif(base.VLLM, reason="vLLM's own base class is installed")
def test_the_stand_in_base_has_the_newest_surface():
    B = base.KVConnectorBase_V1
    for name in ("get_transfer_results", "finish_forward", "reset_capture_state",
                 "get_mem_pool_context", "set_host_xfer_buffer_ops", "bind_kv_cache_manager",
                 "bind_gpu_block_pool", "has_pending_block_frees", "has_pending_push_work",
                 "register_finished_partial_tail", "can_load_prefix_replay_checkpoint",
                 "consume_prefix_replay_checkpoint", "set_xfer_handshake_metadata_pp_aware",
                 "on_new_request", "update_connector_output", "build_connector_worker_meta"):
        assert callable(getattr(B, name)), name
    assert not hasattr(B, "register_cross_layers_kv_cache")
    assert not hasattr(B, "prefer_cross_layer_blocks")
    assert set(B.__abstractmethods__) == {
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"}
    r = base.KVConnectorTransferResults()
    assert (r.finished_sending, r.finished_recving, r.failed_recving,
            r.prefix_replay_checkpoints) == (set(), set(), set(), {})
    # ferry keeps the cross-layer pair for the engines that still call it
    assert callable(FerryConnector.register_cross_layers_kv_cache)


def test_the_connectors_answers_to_the_new_scheduler_hooks(store):
    register_store(NAME, store)
    c = FerryConnector(vllm_config({"ferry.store": NAME}), Role.SCHEDULER, None)
    assert c.supports_divergent_local_hybrid_hits is False   # no recurrent state restored
    assert c.has_pending_block_frees() is False
    assert c.register_finished_partial_tail(Request("x", range(8)), ([1, 2],),
                                            [(0, 1, 3)]) is False   # whole chunks only
    assert c.can_load_prefix_replay_checkpoint(Request("x", range(8)), 0, 16) is False
    assert c.get_kv_connector_stats() is None                 # nothing happened here
    s = FerryConnectorStats(data={"loads": 2})
    assert s.to_dict() == {"loads": 2}                        # Scheduler.make_stats
    c.shutdown()


def async_connectors(model, store, extra=None):
    """Request "a" stored by an engine, then a worker and a scheduler
    connector with async loads (ferry.<key> for each of extra) over the
    same store; (worker, scheduler, the worker's caches, a's KV)."""
    eng = Engine(model, store)
    kv_a = serve_a(eng)
    eng.close()
    register_store(NAME, store)
    cfg = vllm_config({"ferry.store": NAME, "ferry.async_load": True,
                       **{"ferry." + k: v for k, v in (extra or {}).items()}})
    cls = connector_class(cfg)
    w, c = cls(cfg, Role.WORKER, None), cls(cfg, Role.SCHEDULER, None)
    caches = model.new_caches(BLOCKS, BS)
    w.register_kv_caches(dict(zip(layer_names(model), caches)))
    return w, c, caches, kv_a


def loading_request(c, sched, announce=False):
    """Request "b" (a's 32 tokens cached) matched, allocated blocks 20..35
    and waiting for its remote KV in sched, as vLLM's scheduler leaves it
    (announce: on_new_request first, as 00f4240e calls it); (request,
    blocks, the step's SchedulerOutput with the connector's metadata)."""
    _, b = prompts()
    rb = Request("b", b)
    if announce:
        c.on_new_request(rb)
    assert c.get_num_new_matched_tokens(rb, 0) == (32, True)
    blocks = list(range(20, 36))
    c.update_state_after_alloc(rb, KVCacheBlocks(blocks), 32)
    rb.status = WAITING_FOR_REMOTE_KVS
    sched.requests["b"] = rb
    so = empty_output(has_sync_kv_loads=False)
    so.kv_connector_metadata = c.build_connector_meta(so)
    return rb, blocks, so


@pytest.mark.parametrize("layerwise", [False, True])
def test_an_async_only_step_starts_its_loads_after_the_forward(model, store, layerwise):
    """has_sync_kv_loads False: start_load_kv comes after the forward (whose
    attention layers already called wait_for_layer_load for the running
    batch); the load is reported through get_transfer_results in later steps
    without a forward, wait_for_save being called in each; the blocks vLLM
    keeps for the finished request count as a pending free until the
    worker names it."""
    extra = {"layerwise": True} if layerwise else {}
    w, c, caches, kv_a = async_connectors(model, store, extra)
    sched = Sched(c)
    rb, blocks, so = loading_request(c, sched, announce=True)
    calls = []
    names = layer_names(model)
    # another request's forward: its attention layers ask for their loads first
    out = worker_step(w, so, lambda: [w.wait_for_layer_load(n) for n in names], calls)
    assert calls == ["forward", "start_load_kv"]
    sched.update_from_output(out)
    outs = [out]
    if "b" not in out.finished_recving:     # (the load may be over within its step)
        outs += poll(w, (), lambda o: "b" in o[-1].finished_recving)
    for o in outs[1:]:
        sched.update_from_output(o)
    assert [o.finished_recving for o in outs if o.finished_recving] == [{"b"}]
    assert all(not o.failed_recving and not o.invalid_block_ids for o in outs)
    assert torch.equal(model.kv_of(caches, blocks, 32), kv_a)
    assert sched.finished_recving == {"b"}
    c.update_state_after_alloc(rb, KVCacheBlocks(blocks), 0)   # promoted, allocated again
    # aborted: vLLM keeps the blocks (the load was deferred) until the worker says
    rb.status = FINISHED
    assert c.request_finished(rb, blocks) == (True, None)
    assert c.has_pending_block_frees() is True
    outs = poll(w, {"b"}, lambda o: "b" in o[-1].finished_sending)
    for o in outs:
        sched.update_from_output(o)
    assert "b" not in sched.requests
    assert c.has_pending_block_frees() is False
    w.shutdown()
    c.shutdown()


def test_a_request_aborted_while_loading_is_named_once(model, store):
    """vLLM frees a finished request's blocks on finished_recving and asserts
    it still knows every finished_sending request: a request aborted during
    its async load must be in one of the two sets, not both."""
    w, c, _, _ = async_connectors(model, store)
    sched = Sched(c)
    rb, blocks, so = loading_request(c, sched)
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(FWD)              # started, never polled before the abort
    w.clear_connector_metadata()
    rb.status = FINISHED              # Scheduler.finish_requests: aborted
    assert c.request_finished(rb, blocks) == (True, None)
    outs = poll(w, {"b"}, lambda o: bool(o[-1].finished_recving | o[-1].finished_sending))
    outs += poll(w, (), lambda o: len(o) >= 3)      # and nothing more comes
    named = [o.finished_recving | o.finished_sending for o in outs]
    assert sum("b" in n for n in named) == 1
    for o in outs:
        sched.update_from_output(o)
    assert "b" not in sched.requests
    c.update_connector_output(outs[-1])
    assert c.has_pending_block_frees() is False
    w.shutdown()
    c.shutdown()


def test_async_saves_are_a_pending_block_free(model, store):
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.async_save": True})
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    eng.step_new(ra)
    assert eng.sched.has_pending_block_frees() is False
    assert eng.sched.request_finished(ra, eng.blocks["a"]) == (True, None)
    assert eng.sched.has_pending_block_frees() is True   # vLLM waits, does not preempt
    outs = poll(eng.worker, {"a"}, lambda o: "a" in o[-1].finished_sending)
    assert outs[-1].finished_sending == {"a"}
    for o in outs:
        eng.sched.update_connector_output(o)
    assert eng.sched.has_pending_block_frees() is False
    assert store.lookup(a) == 32
    eng.close()


def test_layerwise_async_saves_are_never_a_block_free_left_pending(model, store):
    """"ferry.layerwise" with "ferry.async_save": the layerwise stores end in
    wait_for_save, and the worker then names no request in
    finished_sending. A scheduler that still answered request_finished True
    kept the request's blocks for a report that never came: vLLM frees them
    only on it (vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/v1/core/sched/scheduler.py, Scheduler._free_request and
    _update_from_kv_xfer_finished), and has_pending_block_frees stayed True,
    so Scheduler.schedule stopped instead of preempting for good. Whatever
    request_finished answers, the worker's reports must agree with it."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True,
                                      "ferry.async_save": True})
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    eng.step_new(ra)
    assert store.lookup(a) == 32
    held, _ = eng.sched.request_finished(ra, eng.blocks["a"])
    outs = poll(eng.worker, {"a"}, lambda o: "a" in o[-1].finished_sending, timeout=2)
    named = [o for o in outs if "a" in o.finished_sending]
    assert len(named) == (1 if held else 0)
    for o in outs:
        eng.sched.update_connector_output(o)
    assert eng.sched.has_pending_block_frees() is False
    eng.close()


def test_a_hybrid_models_failed_load_is_reported_for_its_request():
    """Two KV cache groups (full attention, sliding window): block ids are
    unique only within a group, so the newest scheduler raises on
    invalid_block_ids. ferry loads such a model asynchronously and reports a
    load that came short in failed_recving; the request starts over, and its
    next lookup answers only what every group still holds."""
    model = TinyLlama(seed=4321)
    lay = ferry.Layout.from_model(1, model.kv_heads, model.head_dim, dtype="f32")
    store = ferry.KVStore("tiny-hybrid", lay, l1=64 * CHUNK * lay.token_bytes,
                          chunk_tokens=CHUNK)
    register_store(NAME, store)
    try:
        cfg = vllm_config({"ferry.store": NAME})
        cls = connector_class(cfg)
        kcc = kv_cache_config(SlidingWindowSpec(W))
        worker = cls(cfg, Role.WORKER, kcc)
        caches = model.new_caches(64, BS)
        worker.register_kv_caches({L0: caches[0], L1: caches[1]})
        c = cls(cfg, Role.SCHEDULER, kcc)
        sched = Sched(c, groups=2)
        a, b = prompts()
        ra = Request("a", a)
        assert c.get_num_new_matched_tokens(ra, 0) == (0, False)
        ta = [list(range(1, 11)), list(range(11, 21))]
        c.update_state_after_alloc(ra, None, 0)
        step(c, worker, model, caches, ra, ta, 0, 40)
        c.request_finished_all_groups(ra, tuple(ta))
        salt1 = "\0ferry-group\0" "1"
        assert store.lookup(a) == 32 and store.lookup(a, salt=salt1) == 32
        rb = Request("b", b)
        assert c.get_num_new_matched_tokens(rb, 0) == (32, True)   # async: one group may fail
        full, sliding = list(range(21, 37)), [0] * 4 + list(range(37, 49))
        c.update_state_after_alloc(rb, KVCacheBlocks(full, sliding), 32)
        rb.status = WAITING_FOR_REMOTE_KVS
        sched.requests["b"] = rb
        # the sliding group's second chunk is lost after the plan
        store.unpin(b[:32], salt=salt1)
        store.delete(b[:32], salt=salt1)
        so = empty_output(has_sync_kv_loads=False)
        so.kv_connector_metadata = c.build_connector_meta(so)
        assert [(s.req_id, s.is_async) for s in so.kv_connector_metadata.loads] == [("b", True)]
        outs = [worker_step(worker, so, None)]
        if "b" not in outs[0].finished_recving:
            outs += poll(worker, (), lambda o: "b" in o[-1].finished_recving)
        for o in outs:
            sched.update_from_output(o)       # would raise on invalid_block_ids
        assert outs[-1].finished_recving == {"b"} and outs[-1].failed_recving == {"b"}
        assert all(not o.invalid_block_ids for o in outs)
        assert sched.failed_recving == {"b"} and rb.num_computed_tokens == 0
        # _update_waiting_for_remote_kv frees the blocks; the next schedule()
        # looks the request up again: group 1 holds neither chunk now
        c.update_state_after_alloc(rb, KVCacheBlocks([], []), 0)
        assert c.get_num_new_matched_tokens(rb, 0) == (0, False)
        worker.shutdown()
        c.shutdown()
    finally:
        unregister_store(NAME)
        store.close()


def test_cuda_graph_capture_between_steps_leaves_nothing_behind(model, store):
    """Capture runs dummy forwards with no metadata bound (the per-layer
    hooks run in the layerwise form's PIECEWISE graphs), then vLLM calls
    reset_capture_state (base.py at 00f4240e); finish_forward follows each
    forward. None of it may start a transfer or leave state for the next
    real step, which still loads and stores bitwise."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    w = eng.worker
    for name, cache in zip(layer_names(model), eng.caches):
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, cache, SimpleNamespace())
    w.finish_forward()
    w.reset_capture_state()
    assert w._saving is None and w._loading == [] and w.get_kv_connector_stats() is None
    assert w.get_mem_pool_context() is None
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    eng.step_new(rb)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.finish(rb)
    eng.close()


# ---- streaming input (resumable requests) ----
# vllm-project/vllm b4622cf924bc72504aed99e486062d6633fde39e,
# vllm/v1/core/sched/scheduler.py: a resumable request that stops is not
# finished (_handle_stopped_request: no _free_request, so no
# request_finished, its blocks kept); the next StreamingUpdate (add_request
# with the same id) goes through _update_request_as_session: the prompt is
# extended with the output tokens already computed (the last sampled one
# is dropped) and the update's prompt_token_ids, mm_features appended, the
# status WAITING. schedule() then takes it from the waiting queue with
# num_computed_tokens above 0: no get_computed_blocks and no
# get_num_new_matched_tokens, allocate_slots, update_state_after_alloc(
# request, blocks, 0), and NewRequestData.from_request (all its block ids,
# its num_computed_tokens). Request and StreamingUpdate:
# dba83d52c06471eabafba4310718ac7a100cbfa4, vllm/v1/request.py.

def _next_round(eng, r, new_tokens, mm=()):
    """Scheduler._update_request_as_session, then the session's admission."""
    kept = r.all_token_ids[len(r.prompt_token_ids):r.num_computed_tokens]
    r.prompt_token_ids = r.prompt_token_ids + kept + list(new_tokens)
    r.all_token_ids = list(r.prompt_token_ids)
    r.num_tokens = len(r.all_token_ids)
    r.mm_features = list(getattr(r, "mm_features", [])) + list(mm)
    blocks = eng.blocks[r.request_id]
    blocks += [eng.free.pop(0) for _ in range(-(-r.num_tokens // BS) - len(blocks))]
    eng.sched.update_state_after_alloc(r, KVCacheBlocks(blocks), 0)


def _decode(eng, r, sampled):
    """One decode step feeding the token sampled last (vLLM appended it to
    all_token_ids); `sampled` is the one this step samples."""
    pos = r.num_computed_tokens
    blocks = eng.blocks[r.request_id]
    if pos // BS >= len(blocks):
        blocks.append(eng.free.pop(0))
    view = SimpleNamespace(request_id=r.request_id, prompt_token_ids=r.all_token_ids,
                           num_tokens=pos + 1, num_computed_tokens=pos)
    meta = eng.step_cached(view)
    r.num_computed_tokens = view.num_computed_tokens
    r.all_token_ids.append(sampled)
    return meta


def test_a_streaming_sessions_later_rounds_are_stored(model, store):
    """A streaming session's first round was stored; its later rounds never
    were: vLLM asks nothing of the connector for them but
    update_state_after_alloc(request, blocks, 0) and the step's
    NewRequestData, and the connector kept the first round's tokens and
    prompt length, so no chunk past the first prompt was ever planned.
    Now the round's grown prompt is taken there, and its chunks are stored
    under its own tokens: a later request with the same tokens loads them,
    the bytes the session computed."""
    eng = Engine(model, store)
    a, _ = prompts()
    r = Request("s", a)
    r.resumable = True
    assert eng.admit(r) == 0
    meta = eng.step_new(r)                          # round 1: its 40-token prompt
    assert [s.tokens for s in meta.saves] == [a[:32]]
    r.all_token_ids.append(101)                     # sampled by the prefill
    assert _decode(eng, r, 102).saves == []         # 101 computed; 102 stops the round
    new = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    _next_round(eng, r, new)
    round2 = a + [101] + new                        # 102 dropped, as vLLM drops it
    assert r.prompt_token_ids == round2 and r.num_computed_tokens == 41
    meta = eng.step_new(r)                          # round 2: tokens 41..69
    assert [(s.tokens, s.start) for s in meta.saves] == [(round2[:64], 41)]
    kv = model.kv_of(eng.caches, eng.blocks["s"], 64).clone()
    f = Request("f", round2)
    assert eng.admit(f) == 64
    eng.load_only(f)
    assert eng.errors == set()
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["f"], 64), kv)
    eng.finish(f)
    eng.finish(r)
    eng.close()


def test_a_streaming_round_with_a_new_image_is_keyed_by_it(model, store):
    """A round may bring images (the update's mm_features): their
    placeholder token ids are the same for any image, so the round's chunks
    must be keyed by the session's images, the new one included, or a
    request with the same tokens and another image would load them. The
    round's chunks are stored under the new salt (every chunk of the
    round's tokens, the first round's again); the first round's stay under
    its own."""
    eng = Engine(model, store)
    a, _ = prompts()
    r = Request("s", a)
    r.resumable = True
    eng.admit(r)
    eng.step_new(r)                                 # round 1, no image: a[:32] stored
    r.all_token_ids.append(101)                     # the prefill's token stops the round
    placeholders = [9] * 24
    _next_round(eng, r, placeholders, mm=[SimpleNamespace(identifier="image-2")])
    round2 = a + placeholders
    meta = eng.step_new(r)
    assert [s.tokens for s in meta.saves] == [round2[:64]]

    def req(rid, image):
        q = Request(rid, round2)
        q.mm_features = [SimpleNamespace(identifier=image)] if image else []
        return q
    qs = [req("i2", "image-2"), req("i3", "image-3"), req("none", None)]
    assert [eng.admit(q) for q in qs] == [63, 0, 32]
    for q in qs + [r]:
        eng.finish(q)
    eng.close()


def test_a_streaming_round_over_several_steps_after_a_loaded_round(model, store):
    """The rounds as they also come: round 1 loads its prompt's chunks
    from ferry (pinned under round 1's salt and tokens), round 2 brings
    an image (a new salt) and is computed over two steps (chunked
    prefill: its first step is the session's NewRequestData, the second
    its CachedRequestData). Each step stores the chunks it completed,
    every chunk of the round's tokens under the round's salt; a request
    with the round's tokens and images loads the bytes the session
    computed; and no pin of round 1 outlives the session."""
    eng = Engine(model, store)
    serve_a(eng)
    a, _ = prompts()
    r = Request("s", a)
    r.resumable = True
    assert eng.admit(r) == 32                       # round 1: a's two chunks loaded
    assert eng.step_new(r).saves == []              # 32..40: no chunk completed
    r.all_token_ids.append(101)
    assert _decode(eng, r, 102).saves == []         # 101 computed; 102 stops the round
    new = [9] * 24 + torch.randint(0, 512, (30,),
                                   generator=torch.Generator().manual_seed(5)).tolist()
    image = SimpleNamespace(identifier="image-2")
    _next_round(eng, r, new, mm=[image])
    round2 = a + [101] + new                        # 95 tokens, 41 computed
    first = eng.step_new(r, budget=20)              # 41..61
    assert [(s.tokens, s.start) for s in first.saves] == [(round2[:48], 41)]
    second = eng.step_cached(r)                     # 61..95
    assert [(s.tokens, s.start) for s in second.saves] == [(round2[:80], 61)]
    kv = model.kv_of(eng.caches, eng.blocks["s"], 80).clone()
    f = Request("f", round2)
    f.mm_features = [image]
    assert eng.admit(f) == 80
    eng.load_only(f)
    assert eng.errors == set()
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["f"], 80), kv)
    eng.finish(f)
    eng.finish(r)
    assert store.delete(a[:32]) == 2                # no pin of round 1 left
    eng.close()


class _Factory:
    """KVConnectorFactory's registry by name, as vllm-project/vllm
    a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630 declares it
    (vllm/distributed/kv_transfer/kv_connector/factory.py: register_connector
    refuses a name taken; get_connector_class_by_name raises ValueError for
    a name not registered, whatever module paths were used)."""
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        import importlib

        def loader():
            return getattr(importlib.import_module(module_path), class_name)
        cls._registry[name] = loader

    @classmethod
    def get_connector_class_by_name(cls, connector_name):
        if connector_name not in cls._registry:
            raise ValueError(f"Connector '{connector_name}' is not registered.")
        return cls._registry[connector_name]()


def _fake_vllm_factory(monkeypatch):
    import sys
    import types
    parts = "vllm.distributed.kv_transfer.kv_connector.factory".split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        mod = types.ModuleType(name)
        if i == len(parts):
            mod.KVConnectorFactory = type("KVConnectorFactory", (_Factory,), {"_registry": {}})
        monkeypatch.setitem(sys.modules, name, mod)
    return sys.modules["vllm.distributed.kv_transfer.kv_connector.factory"].KVConnectorFactory


def test_a_multiconnector_rebuilds_ferrys_stats_by_its_name(monkeypatch):
    """Inside vLLM's MultiConnector, the stats reach the API server as
    {"FerryConnector": FerryConnectorStats.to_dict()} (Scheduler.make_stats,
    MultiKVConnectorStats.to_dict), and MultiConnector.build_kv_connector_stats
    rebuilds each child's by KVConnectorFactory.get_connector_class_by_name
    (vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py). A
    connector vLLM loaded by module path alone is not registered there: the
    server's stat logger raised ValueError. vLLM runs the
    "vllm.general_plugins" entry points in each of its processes; ferry's
    registers the name, and so does loading ferry's connector module."""
    import tomllib
    from pathlib import Path

    import ferry.adapters as adapters
    factory = _fake_vllm_factory(monkeypatch)
    with pytest.raises(ValueError):
        factory.get_connector_class_by_name("FerryConnector")
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    hook = meta["project"]["entry-points"]["vllm.general_plugins"]["ferry"]
    assert hook == "ferry.adapters:register_vllm_connector"
    assert adapters.register_vllm_connector() is True
    assert adapters.register_vllm_connector() is True      # each process, any number of times
    cls = factory.get_connector_class_by_name("FerryConnector")
    assert cls is FerryConnector
    # MultiConnector.get_kv_connector_stats -> to_dict -> build_kv_connector_stats
    sent = {cls.__name__: FerryConnectorStats(data={"loads": 2, "save_tokens": 64}).to_dict()}
    rebuilt = {name: factory.get_connector_class_by_name(name).build_kv_connector_stats(data=d)
               for name, d in sent.items()}
    assert rebuilt["FerryConnector"].reduce() == {"loads": 2, "save_tokens": 64}


def test_without_vllm_the_plugin_hook_registers_nothing():
    import ferry.adapters as adapters
    assert base.VLLM or adapters.register_vllm_connector() is False


def test_a_daemon_schedulers_layout_counts_the_layers_vllm_caches(tmp_path):
    """With "ferry.server" the scheduler's lookup-only client says its KV
    layout to the daemon, which refuses one that is not its own (HELLO). The
    workers' layout is that of the caches vLLM registers: every layer of the
    KV cache group, a speculative drafter's too (vllm-project/vllm
    00da92319af4b2ad2cde8525b7b609c779bdc52f,
    vllm/model_executor/models/llama_eagle.py: EagleLlamaForCausalLM names
    its layers model.layers.{target layers + i}, attention layers that get
    KV caches beside the target's). The scheduler took its layer count from
    model_config.get_num_layers, the target's alone, and its first lookup
    raised (the daemon serves the workers' layout). The scheduler is built
    with the same kv_cache_config (Scheduler.__init__ ->
    KVConnectorFactory.create_connector at 00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/v1/core/sched/scheduler.py): its group's layers are the count."""
    from ferry.adapters import registered_store
    from test_server import Daemon
    model = TinyLlama(dim=256, layers=2, heads=4, kv_heads=2, ffn=256, seed=4321,
                      dtype=torch.bfloat16)        # the daemon's tiny preset: 2 layers
    d = Daemon(str(tmp_path)).start()
    try:
        extra = {"ferry.server": d.url, "ferry.store": NAME, "ferry.chunk_tokens": CHUNK}
        eng = Engine(model, extra=extra)
        assert registered_store(NAME).layout.num_layers == 2   # target layer + drafter's
        # the target model has 1 layer; its EAGLE drafter's is model.layers.1
        mc = SimpleNamespace(model="tiny-llama", dtype=torch.bfloat16, use_mla=False,
                             get_num_layers=lambda pc: 1,
                             get_num_kv_heads=lambda pc: model.kv_heads,
                             get_head_size=lambda: model.head_dim)
        cfg = vllm_config(dict(extra, **{"ferry.store": "scheduler-process"}))
        cfg.model_config = mc
        kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            kv_cache_spec=type("FullAttentionSpec", (), {})(), layer_names=layer_names(model))])
        eng.sched.shutdown()
        eng.sched = connector_class(cfg)(cfg, Role.SCHEDULER, kcc)
        kv_a = serve_a(eng)
        _, b = prompts()
        rb = Request("b", b)
        assert eng.admit(rb) == 32
        eng.step_new(rb)
        assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
        eng.finish(rb)
        eng.close()
    finally:
        unregister_store(NAME)
        d.stop()


def test_a_layerwise_load_is_reported_before_the_drafters_forward(model, store):
    """vLLM's model runner with a drafter whose KV the connector saves
    (vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/v1/worker/kv_connector_model_runner_mixin.py,
    _get_kv_connector_output(defer_finalize=True) then
    finalize_kv_connector): start_load_kv, the target's forward, then
    get_transfer_results and get_block_ids_with_load_errors for the step's
    output, and only then the drafter's forward (its layers' waits) and
    wait_for_save. A layerwise load ended at the wait of its last layer, a
    drafter's: a load that came short was reported a step late, after vLLM
    had sampled from the blocks it did not fill. Here layer 1 plays the
    drafter's layer."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    store.unpin(b[:32])                     # the chunks lost after the plan
    assert store.delete(b[:32]) == 2
    names = layer_names(model)
    w = eng.worker
    reported = []

    def execute(so, req, n):
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(FWD)
        w.wait_for_layer_load(names[0])                    # the target's forward
        w.save_kv_layer(names[0], eng.caches[0], SimpleNamespace())
        res = w.get_transfer_results(so.finished_req_ids)  # the step's output
        reported.append((res, w.get_block_ids_with_load_errors()))
        w.wait_for_layer_load(names[1])                    # the drafter's forward
        w.save_kv_layer(names[1], eng.caches[1], SimpleNamespace())
        w.wait_for_save()                                  # finalize_kv_connector
        w.clear_connector_metadata()

    eng.execute = execute
    eng.step_new(rb)
    (res, errors), = reported
    assert errors == set(eng.blocks["b"][:8])              # in the step that loaded
    assert res.failed_recving == set()
    assert w.get_block_ids_with_load_errors() == set()     # and once
    eng.finish(rb)
    eng.close()


def test_a_daemon_schedulers_layout_has_the_kv_caches_dtype(monkeypatch):
    """vLLM's fp8 KV cache ("fp8", "fp8_e4m3", "fp8_e5m2") is stored as
    torch.uint8 (STR_DTYPE_TO_TORCH_DTYPE, vllm/utils/torch_utils.py), which
    is the dtype of the group's KV cache spec and of the caches the workers
    register (their layout, the daemon's); model_config.dtype stays the
    model's (bfloat16). The scheduler's lookup-only client said bfloat16,
    which the daemon refuses (HELLO compares dtypes): its dtype is the
    spec's now."""
    from ferry.adapters import vllm as vllm_adapter
    opened = []

    class Client:
        def __init__(self, **kw):
            opened.append(kw)

        def close(self):
            pass

    monkeypatch.setattr(vllm_adapter, "KVStore", Client)
    mc = SimpleNamespace(model="m", dtype=torch.bfloat16, use_mla=False,
                         get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 2,
                         get_head_size=lambda: 64)
    cfg = vllm_config({"ferry.server": "unix:/nonexistent", "ferry.store": "elsewhere"})
    cfg.model_config = mc
    spec = type("FullAttentionSpec", (), {})()
    spec.dtype = torch.uint8
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec, layer_names=["model.layers.0.attn", "model.layers.1.attn"])])
    c = FerryConnector(cfg, Role.SCHEDULER, kcc)
    c.store
    caches = [torch.zeros(2, 8, 16, 2, 64, dtype=torch.uint8) for _ in range(2)]
    assert opened[0]["layout"] == ferry.Layout.from_kv_caches(caches)   # the workers'
    c._store = None


@pytest.mark.parametrize("broken", ["import", "register"])
def test_the_plugin_hook_never_raises_into_vllm(monkeypatch, broken, caplog):
    """vLLM runs every "vllm.general_plugins" entry point in each of its
    processes, whether or not that process (or its engine) uses ferry, and
    calls the hook unguarded (vllm-project/vllm
    01425553bdbed63400efa72ff14a8f4ffe20bada, vllm/plugins/__init__.py:
    load_general_plugins runs func() outside load_plugins_by_group's
    try). A factory module whose import raises something other than
    ImportError (vLLM's modules raise RuntimeError where, say, the platform
    cannot be told) or a factory that refuses the name in another way than
    ValueError stopped the vLLM process; the hook now logs a warning and
    answers False."""
    import sys

    import ferry.adapters as adapters
    factory = _fake_vllm_factory(monkeypatch)
    name = "vllm.distributed.kv_transfer.kv_connector.factory"
    if broken == "import":
        class Finder:                      # the factory's import raises
            @staticmethod
            def find_spec(fullname, path=None, target=None):
                if fullname == name:
                    raise RuntimeError("vLLM failed to infer the device type")
                return None
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(sys.modules[name.rpartition(".")[0]], "__path__", [],
                            raising=False)    # (a package: its children are looked up)
        monkeypatch.setattr(sys, "meta_path", [Finder] + sys.meta_path)
    else:
        def refuse(cls, *a):
            raise RuntimeError("registry frozen")
        monkeypatch.setattr(factory, "register_connector", classmethod(refuse))
    with caplog.at_level("WARNING"):
        assert adapters.register_vllm_connector() is False
    assert "FerryConnector" in caplog.text
