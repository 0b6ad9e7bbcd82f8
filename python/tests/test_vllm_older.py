"""ferry's vLLM connector against the KVConnectorBase_V1 the index now holds,
vllm-project/vllm 13f4ad0f55b08ca1d37d1459f50ce950feaeb547
(vllm/distributed/kv_transfer/kv_connector/v1/base.py), which is OLDER than
00f4240ee6458263d76cf51ca7901ce1350bb4d1 (test_vllm_newest.py) and than
003df2961dd8830c317a61f9745ccd557da9fa06 (test_vllm_contract.py). From its
code: handle_preemptions(self, preempted_req_ids: set[str]) (later: the
step's KVConnectorMetadata); the constructor's kv_cache_config is Optional
and its absence only warned about; get_num_new_matched_tokens may answer
None ("query again later"); no get_transfer_results,
KVConnectorWorkerMetadata / build_connector_worker_meta,
requires_piecewise_for_cudagraph, requires_kv_delivery, on_new_request,
has_pending_block_frees, finish_forward or reset_capture_state; the
cross-layer pair prefer_cross_layer_blocks / register_cross_layers_kv_cache
is there. The model runner of that API calls
handle_preemptions(scheduler_output.preempted_req_ids) when the set is not
empty, before it updates its request states and before the step's
bind_connector_metadata, start_load_kv and forward (which may write the
preempted requests' freed blocks).

What a connector must do there that ferry did not: take the set of ids.
ferry read `.preempted` off its argument, so on such an engine an async
store of a preempted request went on reading blocks vLLM had handed to
another request, and stored that request's KV under the first one's tokens.
And, on any engine, read kv_connector_extra_config's booleans as written:
"false" from a YAML file or an environment variable was True for
ferry.persistent, "true" was False for ferry.cross_layer_blocks (the
prefer_cross_layer_blocks 13f4ad0f still asks), and a misspelt value
silently switched a setting off. And take the cross-layer cache the way
vLLM allocates it (physical order, not num_layers first).
"""
from types import SimpleNamespace

import pytest
import torch

import ferry
from ferry.adapters import _vllm_base as base
from ferry.adapters.vllm import FerryConnector, FerrySecondaryTier
from ferry.adapters import vllm as vllm_adapter
from test_adapter_vllm import (BLOCKS, BS, CHUNK, NAME, Engine, Request, connector_class,
                               layer_names, prompts, serve_a, vllm_config)
from test_vllm_contract import empty_output

Role = base.KVConnectorRole
FWD = None


class _Later:
    """An async store whose copy has not read its blocks yet: it reads them
    when waited for, or at a poll once `released` (the copy engine got to it)."""

    def __init__(self, run):
        self._run, self._rc, self.released = run, None, False

    def _go(self):
        if self._rc is None:
            self._rc = self._run()
        return self._rc

    def wait(self, timeout=None):
        return self._go()

    def done(self):
        if self.released:
            self._go()
        return self._rc is not None

    def cancel(self):
        return False


def slow_stores(store, monkeypatch):
    ops = []

    def store_async(tokens, kv, block_table=None, *, salt=None, partial=False):
        op = _Later(lambda: store.store(tokens, kv, block_table, salt=salt, partial=partial))
        ops.append(op)
        return op
    monkeypatch.setattr(store, "store_async", store_async)
    return ops


@pytest.mark.parametrize("engine", ["13f4ad0f", "00f4240e"])
def test_a_preempted_requests_async_store_ends_before_its_blocks_are_reused(
        model, store, monkeypatch, engine):
    """Request "a" prefills with "ferry.async_save"; its store is still in
    flight when the scheduler preempts it (Scheduler._preempt_request frees
    its blocks) and hands the blocks to "c", whose forward writes them. The
    worker is told first: 13f4ad0f's model runner calls
    handle_preemptions(scheduler_output.preempted_req_ids); 00f4240e's
    (vllm/v1/worker/gpu/kv_connector.py, ActiveKVConnector.pre_forward)
    calls handle_preemptions(kv_connector_metadata) and then binds it. Either
    way the store must have read a's KV before c's forward: a later request
    sharing a's prefix loads a's KV, bitwise."""
    ops = slow_stores(store, monkeypatch)
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.async_save": True})
    w = eng.worker
    a, b = prompts()
    ra = Request("a", a)
    assert eng.admit(ra) == 0
    meta = eng.step_new(ra)
    assert [s.tokens for s in meta.saves] == [a[:32]] and len(ops) == 1
    kv_a = model.kv_of(eng.caches, eng.blocks["a"], 32).clone()
    assert store.lookup(a) == 0                     # the store has not read a's blocks
    # next step: "a" preempted, its blocks given to "c"
    so = empty_output(preempted_req_ids={"a"}, finished_req_ids=set())
    so.kv_connector_metadata = eng.sched.build_connector_meta(so)
    if engine == "13f4ad0f":
        w.handle_preemptions(so.preempted_req_ids)
    else:
        w.handle_preemptions(so.kv_connector_metadata)
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(FWD)
    c = [(t + 1) % 512 for t in a]
    model.forward(c, 0, eng.caches, eng.blocks["a"])    # c's forward writes a's old blocks
    assert not torch.equal(model.kv_of(eng.caches, eng.blocks["a"], 32), kv_a)
    w.wait_for_save()
    for op in ops:
        op.released = True                            # the copy engine gets to it now
    w.get_finished(set())
    w.clear_connector_metadata()
    assert store.lookup(a) == 32
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    eng.load_only(rb)
    assert eng.errors == set()
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.close()


def test_preempted_ids_and_metadata_together_are_both_handled(model, store,
                                                             monkeypatch):
    """Engines that pass (preempted_req_ids, connector_metadata), ids first,
    as some connectors built on 13f4ad0f's API take it: every id named in
    either is waited for."""
    ops = slow_stores(store, monkeypatch)
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.async_save": True})
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    eng.step_new(ra)
    assert len(ops) == 1 and ops[0].done() is False
    meta = eng.sched.build_connector_meta(empty_output(preempted_req_ids=set()))
    eng.worker.handle_preemptions({"a"}, meta)
    assert ops[0].done() is True and store.lookup(a) == 32
    eng.worker.handle_preemptions(set())            # nothing preempted: nothing to do
    eng.worker.handle_preemptions(None)
    eng.close()


@pytest.mark.parametrize("value,want", [(True, True), ("true", True), ("True", True),
                                        ("1", True), ("on", True), (False, False),
                                        ("false", False), ("False", False), ("0", False),
                                        ("no", False), (None, False)])
def test_boolean_settings_are_read_as_written(value, want, monkeypatch):
    """kv_connector_extra_config from a YAML file or an environment variable
    carries "false" as a string: bool("false") is True, and "true" did not
    turn on ferry.cross_layer_blocks (13f4ad0f still asks
    prefer_cross_layer_blocks). Both read as written now, for every flag."""
    cfg = vllm_config({"ferry.store": NAME, "ferry.cross_layer_blocks": value,
                       "ferry.async_save": value})
    c = connector_class(cfg)(cfg, Role.WORKER, None)
    assert c.prefer_cross_layer_blocks is want
    assert c._async_save is want
    assert FerryConnector.requires_piecewise_for_cudagraph({"ferry.layerwise": value}) is want
    # the store a worker opens itself: "ferry.persistent"
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    monkeypatch.setattr(vllm_adapter, "register_store", lambda name, s: None)
    w = connector_class(cfg)(vllm_config({"ferry.store": "none-such", "ferry.l1": "4M",
                                          "ferry.persistent": value}), Role.WORKER, None)
    w._open_store(None)
    assert seen["persistent"] is want


def test_a_misspelt_boolean_setting_is_refused():
    for key in ("ferry.async_save", "ferry.async_load", "ferry.layerwise",
                "ferry.cross_layer_blocks", "ferry.persistent", "ferry.kv_events"):
        cfg = vllm_config({"ferry.store": NAME, key: "ture"})
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            connector_class(cfg)(cfg, Role.SCHEDULER, None)
    # refused too where vLLM's own kv_events_config already turns events on
    cfg = vllm_config({"ferry.store": NAME, "ferry.kv_events": "ture"})
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    with pytest.raises(ValueError, match=r"ferry\.kv_events"):
        connector_class(cfg)(cfg, Role.SCHEDULER, None)


def test_the_secondary_tiers_persistent_setting_is_read_as_written(monkeypatch):
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
            self.layout = kw["layout"]
            self.chunk_tokens = kw["chunk_tokens"]
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    FerrySecondaryTier(None, view, l1="1M", model="m", persistent="false")
    assert seen["persistent"] is False
    with pytest.raises(ValueError, match="persistent"):
        FerrySecondaryTier(None, view, l1="1M", model="m", persistent="maybe")


class _Backend:
    """An attention backend's two static methods allocate_uniform_kv_caches reads."""

    def __init__(self, name, shape, order):
        self.__name__, self._shape, self._order = name, shape, order

    def get_kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size, **_):
        return self._shape(num_blocks, block_size, num_kv_heads, head_size)

    def get_kv_cache_stride_order(self, include_num_layers_dimension=False):
        assert include_num_layers_dimension
        return self._order


_FA = lambda n, b, h, d: (2, n, b, h, d)      # noqa: E731 (FlashAttention)
_FI = lambda n, b, h, d: (n, 2, b, h, d)      # noqa: E731 (FlashInfer)


@pytest.mark.parametrize("backend", [
    _Backend("FlashAttention NHD", _FA, (2, 0, 1, 3, 4, 5)),
    _Backend("FlashAttention HND", _FA, (2, 4, 0, 1, 3, 5)),
    _Backend("FlashInfer NHD", _FI, (1, 0, 2, 3, 4, 5)),
    _Backend(None, _FA, None)], ids=lambda b: str(b.__name__))
def test_a_cross_layer_cache_is_taken_in_vllms_physical_order(model, store, backend):
    """With prefer_cross_layer_blocks (still asked at 13f4ad0f),
    KVConnectorModelRunnerMixin.allocate_uniform_kv_caches
    (vllm/v1/worker/kv_connector_model_runner_mixin.py) builds the shape
    (num_layers,) + get_kv_cache_shape(...), permutes it by
    get_kv_cache_stride_order(include_num_layers_dimension=True)
    (vllm/v1/attention/backends/flash_attn.py: (2, 0, 1, 3, 4, 5) for NHD,
    (2, 4, 0, 1, 3, 5) for HND), views one buffer in that physical shape and
    passes THAT to register_cross_layers_kv_cache(kv_cache, attn_backend);
    the layers get permuted[i] of the inverse permutation. FlashAttention's
    NHD tensor is [num_blocks, num_layers, 2, ...]: ferry took dim 0 as the
    layers and refused it (or, without KV cache groups, registered every
    block as a layer). A backend without the stride order (here: the last
    case) leaves the tensor num_layers first."""
    L, H, D = model.layers, model.kv_heads, model.head_dim
    logical = (L,) + backend.get_kv_cache_shape(BLOCKS, BS, H, D)
    order = backend._order or tuple(range(len(logical)))
    cross = torch.zeros(tuple(logical[i] for i in order))       # the physical buffer
    per_layer = cross.permute(*[order.index(i) for i in range(len(order))])
    views = [per_layer[i] if backend._shape is _FA else per_layer[i].transpose(0, 1)
             for i in range(L)]
    cfg = vllm_config({"ferry.store": NAME, "ferry.cross_layer_blocks": True})
    eng = Engine(model, store, extra=cfg.kv_transfer_config.kv_connector_extra_config,
                 caches=views)
    eng.worker.shutdown()   # (vLLM calls one of the two registrations: this one)
    eng.worker = connector_class(cfg)(cfg, Role.WORKER, _one_group(layer_names(model)))
    assert eng.worker.prefer_cross_layer_blocks is True
    eng.worker.register_cross_layers_kv_cache(
        cross, backend if backend.__name__ else SimpleNamespace())
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    eng.load_only(rb)
    assert eng.errors == set()
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.finish(rb)
    eng.close()


def _one_group(names):
    """KVCacheConfig with one full-attention group of every layer."""
    FullAttentionSpec = type("FullAttentionSpec", (), {})
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        layer_names=list(names), kv_cache_spec=FullAttentionSpec())])


def test_kv_events_carry_only_the_fields_the_engines_events_declare(model, store, monkeypatch):
    """Connectors' KV events (take_events) are as old as the two-argument
    constructor (vllm-project/vllm 23ec7c7fab7aa8edb1c14195c048113e210683fa,
    vllm/distributed/kv_transfer/kv_connector/v1/base.py), and the events of
    such a vLLM have neither medium nor lora_name: BlockStored(block_hashes,
    parent_block_hash, token_ids, block_size, lora_id), BlockRemoved(
    block_hashes) (b4e69e0af33f4698e157a262cc787fe61983cd3d,
    vllm/distributed/kv_events.py; msgspec Structs, which refuse a keyword
    they do not declare, as the dataclasses below do). ferry built them with
    medium= and lora_name= inside build_connector_meta and the lookup: with KV
    events on, the scheduler raised TypeError. Newer fields with defaults
    (group_idx, extra_keys) are left to them."""
    from dataclasses import dataclass

    @dataclass
    class BlockStored:
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object

    @dataclass
    class BlockRemoved:
        block_hashes: list

    monkeypatch.setattr(vllm_adapter, "BlockStored", BlockStored)
    monkeypatch.setattr(vllm_adapter, "BlockRemoved", BlockRemoved)
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.kv_events": True})
    serve_a(eng)
    ev = list(eng.sched.take_events())
    assert [type(e) for e in ev] == [BlockStored]
    assert len(ev[0].block_hashes) == 2 and ev[0].block_size == CHUNK
    assert ev[0].token_ids == list(prompts()[0][:32]) and ev[0].lora_id is None
    a, _ = prompts()
    store.delete(a[:32])
    eng.admit(Request("c", a))                    # the lookup finds them gone
    ev = list(eng.sched.take_events())
    assert [type(e) for e in ev] == [BlockRemoved] and len(ev[0].block_hashes) == 2
    eng.finish(Request("c", a))
    eng.close()


@pytest.mark.parametrize("cache_dtype,want", [("fp8", torch.uint8), ("fp8_e5m2", torch.uint8),
                                              ("auto", torch.bfloat16),
                                              ("bfloat16", torch.bfloat16)])
def test_a_daemon_schedulers_layout_has_the_cache_dtype_without_a_kv_cache_config(
        cache_dtype, want, monkeypatch):
    """A vLLM that builds connectors with (vllm_config, role) alone
    (vllm-project/vllm 23ec7c7fab7aa8edb1c14195c048113e210683fa,
    vllm/distributed/kv_transfer/kv_connector/v1/base.py) gives the
    scheduler no KV cache spec to read the caches' dtype from. An fp8 KV
    cache ("fp8", "fp8_e4m3", "fp8_e5m2": cache_config.cache_dtype) is
    still stored as torch.uint8 (STR_DTYPE_TO_TORCH_DTYPE and
    get_kv_cache_torch_dtype, vllm/utils/torch_utils.py at
    0024350b5da3ad174435e62a15273c0d3caba57b), the dtype of the caches the
    workers register and of the daemon's layout. The scheduler's lookup-only
    client said model_config.dtype (bfloat16), which the daemon refuses
    (HELLO): the first lookup raised inside vLLM's schedule()."""
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
    cfg.cache_config.cache_dtype = cache_dtype
    c = FerryConnector(cfg, Role.SCHEDULER)       # no kv_cache_config
    c.store
    caches = [torch.zeros(2, 8, 16, 2, 64, dtype=want) for _ in range(2)]
    assert opened[0]["layout"] == ferry.Layout.from_kv_caches(caches)   # the workers'
    c._store = None
