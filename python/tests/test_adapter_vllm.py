"""ferry's vLLM KV connector driven through the calls vLLM makes, in vLLM's order.

vLLM is not installable here, so the engine is replayed from its source
(vllm-project/vllm, v1 engine, 2025-2026):
- loading: KVConnectorFactory.get_connector_class (vllm/distributed/
  kv_transfer/kv_connector/factory.py) imports kv_connector_module_path and
  takes kv_connector from it; create_connector builds one connector per role
  with (vllm_config, role, kv_cache_config).
- scheduler, Scheduler.schedule (vllm/v1/core/sched/scheduler.py): for a
  waiting request, kv_cache_manager.get_computed_blocks (vLLM's own prefix
  cache), then connector.get_num_new_matched_tokens(request,
  num_new_local_computed_tokens), allocate_slots, then
  connector.update_state_after_alloc(request, blocks,
  num_external_computed_tokens); after the step's requests,
  connector.build_connector_meta(scheduler_output) becomes
  scheduler_output.kv_connector_metadata. Scheduler._connector_finished calls
  connector.request_finished(request, block_ids) once when a request
  finishes or is aborted.
- worker, KVConnectorModelRunnerMixin._get_kv_connector_output
  (vllm/v1/worker/kv_connector_model_runner_mixin.py): bind_connector_metadata,
  start_load_kv(forward_context), the forward pass (in which
  maybe_transfer_kv_layer, vllm/model_executor/layers/attention/
  kv_transfer_utils.py, calls wait_for_layer_load(layer) before each attention
  layer and save_kv_layer(layer, kv_cache, attn_metadata) after it),
  wait_for_save(), get_finished(finished_req_ids),
  get_block_ids_with_load_errors(), clear_connector_metadata().
The model is the package's tiny Llama (tests/tiny_llama.py), which runs all
layers in one call: the per-layer hooks are called around it in layer order,
or, for the layerwise form ("ferry.layerwise"), inside it as vLLM calls
them: wait_for_layer_load(layer) before the layer touches its cache,
save_kv_layer(layer, ...) once the layer's K and V are written.
"""
import importlib
from types import SimpleNamespace

import pytest
import torch

import ferry
from ferry import FerryError
from ferry.adapters import register_store, registered_store, unregister_store
from ferry.adapters import _vllm_base
from ferry.adapters.vllm import _embeds_digest
from tiny_llama import TinyLlama

CHUNK, BS, BLOCKS = 16, 4, 64
NAME = "vllm-test"


def layer_names(model):
    return [f"model.layers.{i}.self_attn.attn" for i in range(model.layers)]


def vllm_config(extra):
    ktc = SimpleNamespace(kv_connector="FerryConnector",
                          kv_connector_module_path="ferry.adapters.vllm",
                          kv_role="kv_both", kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=BS),
                           model_config=SimpleNamespace(model="tiny-llama"))


def connector_class(cfg):
    """KVConnectorFactory.get_connector_class for a connector not in vLLM's registry."""
    ktc = cfg.kv_transfer_config
    return getattr(importlib.import_module(ktc.kv_connector_module_path), ktc.kv_connector)


class Request(SimpleNamespace):
    """The vllm.v1.request.Request fields the connector reads."""

    def __init__(self, rid, tokens, salt=None):
        toks = [int(t) for t in tokens]
        super().__init__(request_id=rid, prompt_token_ids=toks, all_token_ids=list(toks),
                         num_tokens=len(toks), cache_salt=salt, num_computed_tokens=0)


class Engine:
    """vLLM's scheduler and one worker around the tiny model, one process."""

    def __init__(self, model, store=None, extra=None, caches=None):
        self.model = model
        if store is not None:
            register_store(NAME, store)
        self.cfg = vllm_config(extra or {"ferry.store": NAME})
        cls = connector_class(self.cfg)
        Role = _vllm_base.KVConnectorRole
        # the worker's connector first: vLLM initializes workers and their caches
        # before it builds the scheduler (EngineCore)
        self.worker = cls(self.cfg, Role.WORKER, None)
        self.caches = caches if caches is not None else model.new_caches(BLOCKS, BS)
        self.worker.register_kv_caches(dict(zip(layer_names(model), self.caches)))
        self.sched = cls(self.cfg, Role.SCHEDULER, None)
        self.free = list(range(BLOCKS))
        self.blocks = {}
        self.finished = set()
        self.errors = set()
        # the layerwise form: the layers save_kv_layer is called for (None: whole form)
        self.layerwise = (set(range(model.layers))
                          if str((extra or {}).get("ferry.layerwise")) == "True" else None)

    # -- Scheduler.schedule, for one waiting request --
    def admit(self, req, local=0, local_blocks=()):
        ext, is_async = self.sched.get_num_new_matched_tokens(req, local)
        assert is_async is False
        need = -(-req.num_tokens // BS) - len(local_blocks)
        blocks = list(local_blocks) + [self.free.pop(0) for _ in range(need)]
        self.blocks[req.request_id] = blocks
        self.sched.update_state_after_alloc(req, SimpleNamespace(block_ids=(blocks,)), ext)
        req.num_computed_tokens = local + ext
        return ext

    def step_new(self, req, budget=None):
        n = req.num_tokens - req.num_computed_tokens
        n = min(n, budget) if budget else n
        new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                              block_ids=(self.blocks[req.request_id],),
                              num_computed_tokens=req.num_computed_tokens)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                                 all_token_ids={}, new_block_ids=[], num_computed_tokens=[],
                                 num_output_tokens=[])
        return self._run(req, n, SimpleNamespace(scheduled_new_reqs=[new],
                                                  scheduled_cached_reqs=cached))

    def step_cached(self, req, budget=None):
        n = req.num_tokens - req.num_computed_tokens
        n = min(n, budget) if budget else n
        cached = SimpleNamespace(req_ids=[req.request_id], resumed_req_ids=set(),
                                 new_token_ids=[[]], all_token_ids={}, new_block_ids=[None],
                                 num_computed_tokens=[req.num_computed_tokens],
                                 num_output_tokens=[0])
        return self._run(req, n, SimpleNamespace(scheduled_new_reqs=[],
                                                  scheduled_cached_reqs=cached))

    def _run(self, req, n, so):
        so.num_scheduled_tokens = {req.request_id: n}
        so.total_num_scheduled_tokens = n
        so.finished_req_ids, self.finished = self.finished, set()
        meta = self.sched.build_connector_meta(so)
        so.kv_connector_metadata = meta
        self.execute(so, req, n)
        req.num_computed_tokens += n
        return meta

    # -- KVConnectorModelRunnerMixin._get_kv_connector_output around the forward --
    def execute(self, so, req, n):
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(SimpleNamespace(attn_metadata={}, no_compile_layers={}))
        names = layer_names(self.model)
        if self.layerwise is not None:
            start = req.num_computed_tokens
            saved = self.layerwise  # the layers save_kv_layer is called for
            self.model.forward(req.prompt_token_ids[start:start + n], start, self.caches,
                               self.blocks[req.request_id],
                               before_layer=lambda L: w.wait_for_layer_load(names[L]),
                               after_kv=lambda L: L in saved and w.save_kv_layer(
                                   names[L], self.caches[L], SimpleNamespace()))
            w.wait_for_save()
            assert w.get_finished(so.finished_req_ids) == (None, None)
            self.errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            return
        for name in names:
            w.wait_for_layer_load(name)
        start = req.num_computed_tokens
        self.model.forward(req.prompt_token_ids[start:start + n], start, self.caches,
                           self.blocks[req.request_id])
        for name, cache in zip(names, self.caches):
            w.save_kv_layer(name, cache, SimpleNamespace())
        w.wait_for_save()
        assert w.get_finished(so.finished_req_ids) == (None, None)
        self.errors |= w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()

    def load_only(self, req):
        """A step whose forward is not run: only the connector's load."""
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(
            req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            block_ids=(self.blocks[req.request_id],), num_computed_tokens=req.num_computed_tokens)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req.request_id: 0}, finished_req_ids=set())
        meta = self.sched.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return meta

    def finish(self, req):
        """Scheduler._free_request -> _connector_finished -> request_finished."""
        assert self.sched.request_finished(req, self.blocks[req.request_id]) == (False, None)
        self.finished.add(req.request_id)
        self.free.extend(self.blocks.pop(req.request_id))

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()
        unregister_store(NAME)


def prompts():
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 512, (40,), generator=g).tolist()
    b = a[:36] + torch.randint(0, 512, (28,), generator=g).tolist()  # 64 tokens, shares 36
    return a, b


def serve_a(eng):
    a, _ = prompts()
    ra = Request("a", a)
    assert eng.admit(ra) == 0              # nothing cached yet
    meta = eng.step_new(ra)
    assert [s.tokens for s in meta.saves] == [a[:32]]  # the two whole chunks of 40 tokens
    kv_a = eng.model.kv_of(eng.caches, eng.blocks["a"], 32).clone()
    eng.finish(ra)
    return kv_a


def test_connector_loads_as_vllms_factory_loads_it(store):
    cfg = vllm_config({"ferry.store": NAME})
    cls = connector_class(cfg)
    from ferry.adapters.vllm import FerryConnector
    assert cls is FerryConnector
    assert issubclass(cls, _vllm_base.KVConnectorBase_V1)
    register_store(NAME, store)
    for role in _vllm_base.KVConnectorRole:
        c = cls(cfg, role, None)        # vLLM with kv_cache_config
        assert c.role == role
        assert cls(cfg, role).role == role  # and the two-argument form


def test_real_vllm_base_class_when_installed():
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from ferry.adapters.vllm import FerryConnector
    assert issubclass(FerryConnector, base.KVConnectorBase_V1)


def test_stand_in_base_without_vllm():
    if _vllm_base.VLLM:
        pytest.skip("vLLM is installed: its own base class is used")
    from ferry.adapters.vllm import FerryConnector
    assert FerryConnector.__mro__[1].__module__ == "ferry.adapters._vllm_base"
    assert not getattr(FerryConnector, "__abstractmethods__", None)


def test_prefix_stored_by_one_request_is_loaded_bitwise_by_the_next(model, store):
    eng = Engine(model, store)
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32             # two chunks from ferry, vLLM computes the rest
    before = [c.clone() for c in eng.caches]
    meta = eng.step_new(rb)
    assert [(s.skip, s.need, len(s.tokens)) for s in meta.loads] == [(0, 32, 32)]
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    # only b's blocks changed
    other = [x for x in range(BLOCKS) if x not in eng.blocks["b"]]
    for c0, c1 in zip(before, eng.caches):
        assert torch.equal(c0[:, other], c1[:, other])
    # the logits b computes from the loaded prefix are those of b computed
    # from a prefix kept in memory (the same split prefill)
    ref = model.new_caches(BLOCKS, BS)
    table = list(range(16))
    model.forward(prompts()[0], 0, ref, table)   # a's prefill, kept in memory
    want = model.forward(b[32:], 32, ref, table)
    got = model.forward(b[32:], 32, eng.caches, eng.blocks["b"])
    assert torch.equal(got, want)
    assert eng.errors == set()
    eng.finish(rb)
    eng.close()


def test_a_miss_loads_nothing(model, store):
    eng = Engine(model, store)
    serve_a(eng)
    rc = Request("c", list(range(1000, 1040)))
    assert eng.admit(rc) == 0
    before = [c.clone() for c in eng.caches]
    meta = eng.load_only(rc)
    assert meta.loads == []
    for c0, c1 in zip(before, eng.caches):
        assert torch.equal(c0, c1)
    eng.finish(rc)
    eng.close()


def test_vllms_own_prefix_blocks_are_never_written(model, store):
    eng = Engine(model, store)
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    # vLLM's prefix cache already holds b's first 8 tokens in two shared blocks
    shared = [eng.free.pop(0), eng.free.pop(0)]
    for c in eng.caches:
        c[:, shared] = 7.0
    assert eng.admit(rb, local=8, local_blocks=shared) == 24
    meta = eng.load_only(rb)
    assert [(s.skip, s.need) for s in meta.loads] == [(8, 32)]
    for c in eng.caches:
        assert torch.all(c[:, shared] == 7.0)
    got = model.kv_of(eng.caches, eng.blocks["b"], 32)
    assert torch.equal(got[:, :, 8:], kv_a[:, :, 8:])
    assert eng.errors == set()
    eng.finish(rb)
    eng.close()


def test_finished_or_aborted_request_releases_its_pins(model, store):
    eng = Engine(model, store)
    serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    with pytest.raises(FerryError) as ei:   # pinned from allocation until the end
        store.delete(b[:32])
    assert ei.value.name == "FERRY_ELOCKED"
    eng.finish(rb)                          # aborted before it ever ran
    assert store.delete(b[:32]) == 2
    assert store.lookup(b) == 0
    eng.close()


def test_a_chunk_lost_after_the_plan_is_reported_for_recompute(model, store):
    eng = Engine(model, store)
    serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    store.unpin(b[:32])                     # what a read TTL expiring would do
    assert store.delete(b[:32]) == 2        # ...and an eviction before the load
    before = [c.clone() for c in eng.caches]
    eng.load_only(rb)
    # the 8 blocks vLLM was promised go back to it to recompute, unwritten
    assert eng.errors == set(eng.blocks["b"][:8])
    for c0, c1 in zip(before, eng.caches):
        assert torch.equal(c0, c1)
    eng.finish(rb)
    eng.close()


def test_cache_salt_isolates_requests(model, store):
    eng = Engine(model, store)
    a, _ = prompts()
    r1 = Request("s1", a, salt="tenant-1")
    eng.admit(r1)
    eng.step_new(r1)
    eng.finish(r1)
    assert eng.admit(Request("s2", a, salt="tenant-2")) == 0
    assert eng.admit(Request("s3", a, salt="tenant-1")) == 32
    eng.finish(Request("s2", a))
    eng.finish(Request("s3", a))
    eng.close()


def test_chunked_prefill_saves_each_completed_chunk(model, store):
    eng = Engine(model, store)
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    saved = [[len(s.tokens) for s in eng.step_new(ra, budget=20).saves]]
    saved.append([len(s.tokens) for s in eng.step_cached(ra, budget=12).saves])
    saved.append([len(s.tokens) for s in eng.step_cached(ra, budget=20).saves])
    assert saved == [[16], [32], []]
    assert store.lookup(a) == 32
    eng.finish(ra)
    eng.close()


def test_flashinfer_caches_are_used_through_a_view(model, store):
    flat = [torch.zeros(BLOCKS, 2, BS, model.kv_heads, model.head_dim) for _ in range(model.layers)]
    eng = Engine(model, store, caches=[c.transpose(0, 1) for c in flat])
    eng.worker.register_kv_caches(dict(zip(layer_names(model), flat)))
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    eng.admit(rb)
    eng.load_only(rb)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.finish(rb)
    eng.close()


@pytest.mark.parametrize("kind", ["HND", "packed"])
def test_hnd_and_packed_caches_are_read_by_their_strides(model, store, kind):
    """vLLM's HND view ([2, blocks, heads, bs, hd] allocated, the [2, blocks,
    bs, heads, hd] permutation passed) and packed K|V [blocks, heads, bs,
    2*hd]: registered as they are, loaded bitwise."""
    H, D = model.kv_heads, model.head_dim
    if kind == "HND":
        raw = [torch.zeros(2, BLOCKS, H, BS, D).permute(0, 1, 3, 2, 4)
               for _ in range(model.layers)]
        views = raw
    else:
        raw = [torch.zeros(BLOCKS, H, BS, 2 * D) for _ in range(model.layers)]
        views = [c.view(BLOCKS, H, BS, 2, D).permute(3, 0, 2, 1, 4) for c in raw]
    eng = Engine(model, store, caches=views)
    eng.worker.register_kv_caches(dict(zip(layer_names(model), raw)))
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    eng.admit(rb)
    eng.load_only(rb)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.finish(rb)
    eng.close()


def test_cross_layer_blocks_are_read_by_their_strides(model, store):
    """register_cross_layers_kv_cache (vllm-project/vllm 003df2961dd8830c317a61f9745ccd557da9fa06,
    vllm/distributed/kv_transfer/kv_connector/v1/base.py): one tensor for every layer,
    num_layers first; here blocks hold every layer ([blocks][layers][2][bs][heads][hd])
    and the tensor is the [layers][2][blocks][bs][heads][hd] view of them, as it is
    with no attention backend to say otherwise (the physical order vLLM passes with
    one: test_vllm_older.py)."""
    H, D, L = model.kv_heads, model.head_dim, model.layers
    phys = torch.zeros(BLOCKS, L, 2, BS, H, D)
    cross = phys.permute(1, 2, 0, 3, 4, 5)
    eng = Engine(model, store, caches=[cross[i] for i in range(L)])
    assert eng.worker.prefer_cross_layer_blocks is False
    eng.worker.register_cross_layers_kv_cache(cross, None)
    kv_a = serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    eng.admit(rb)
    eng.load_only(rb)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    eng.finish(rb)
    eng.close()


def test_worker_opens_the_store_the_scheduler_then_finds(model):
    eng = Engine(model, extra={"ferry.store": NAME, "ferry.l1": "4M",
                               "ferry.chunk_tokens": CHUNK})
    s = registered_store(NAME)
    assert s is not None and s.layout == ferry.Layout.from_kv_caches(eng.caches)
    serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    eng.finish(rb)
    eng.close()
    assert registered_store(NAME) is None


def test_bad_configurations_are_refused(model, store):
    cls = connector_class(vllm_config({}))
    Role = _vllm_base.KVConnectorRole
    nolayout = cls(vllm_config({"ferry.server": "unix:/nonexistent/ferry.sock",
                                "ferry.store": "nowhere"}), Role.SCHEDULER)
    with pytest.raises(ValueError, match="needs the KV layout"):
        nolayout.get_num_new_matched_tokens(Request("x", range(40)), 0)
    c = cls(vllm_config({"ferry.store": "nowhere"}), Role.SCHEDULER)
    with pytest.raises(RuntimeError, match="no store registered"):
        c.get_num_new_matched_tokens(Request("x", range(40)), 0)
    register_store(NAME, store)
    w = cls(vllm_config({"ferry.store": NAME}), Role.WORKER)
    wrong = [torch.zeros(2, 8, BS, 3, 8) for _ in range(model.layers)]
    with pytest.raises(ValueError, match="the store"):
        w.register_kv_caches(dict(zip(layer_names(model), wrong)))


def test_a_fully_cached_prompt_leaves_vllm_its_last_token(model, store):
    eng = Engine(model, store)
    kv_a = serve_a(eng)
    a, _ = prompts()
    rd = Request("d", a[:32])               # every token of the prompt is in ferry
    assert eng.admit(rd) == 31              # vLLM must compute the last one itself
    meta = eng.step_new(rd)
    assert [(s.need, len(s.tokens)) for s in meta.loads] == [(31, 32)]
    # the loaded 31 tokens are a's (the 32nd is vLLM's own recompute)
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["d"], 31), kv_a[:, :, :31])
    assert eng.errors == set()
    eng.finish(rd)
    eng.close()


def test_a_preempted_request_reloads_its_own_prefix(model, store):
    """Preemption: vLLM frees the request's blocks, looks it up again when it
    reschedules it (get_num_new_matched_tokens with num_computed_tokens 0),
    and sends it as a cached request in resumed_req_ids with all its new
    block ids (CachedRequestData, vllm/v1/core/sched/output.py)."""
    eng = Engine(model, store)
    serve_a(eng)
    _, b = prompts()
    rb = Request("b", b)
    eng.admit(rb)
    eng.step_new(rb)                        # b's 64 tokens computed and stored
    kv_b = model.kv_of(eng.caches, eng.blocks["b"], 64).clone()
    eng.free.extend(eng.blocks.pop("b"))    # preempted: blocks freed
    for c in eng.caches:
        c.zero_()
    rb.num_computed_tokens = 0
    eng.free.reverse()                      # other blocks this time
    assert eng.admit(rb) == 63
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["b"], resumed_req_ids={"b"}, new_token_ids=[[]], all_token_ids={},
            new_block_ids=[(eng.blocks["b"],)], num_computed_tokens=[63], num_output_tokens=[0]),
        num_scheduled_tokens={"b": 1}, finished_req_ids=set())
    meta = eng.sched.build_connector_meta(so)
    assert [(s.need, s.block_ids) for s in meta.loads] == [(63, eng.blocks["b"])]
    assert meta.saves == []                 # nothing new to store
    eng.worker.bind_connector_metadata(meta)
    eng.worker.start_load_kv(None)
    eng.worker.clear_connector_metadata()
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 63), kv_b[:, :, :63])
    eng.finish(rb)
    eng.close()


def test_caches_ferry_cannot_reach_are_refused_at_registration(model, store):
    register_store(NAME, store)
    w = connector_class(vllm_config({"ferry.store": NAME}))(
        vllm_config({"ferry.store": NAME}), _vllm_base.KVConnectorRole.WORKER)
    meta = [torch.zeros(2, 8, BS, model.kv_heads, model.head_dim, device="meta")
            for _ in range(model.layers)]
    with pytest.raises(ValueError, match="device"):
        w.register_kv_caches(dict(zip(layer_names(model), meta)))


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports cuda:1 (the device checks run before any
    byte moves, so they are testable without a GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def _cuda_caches(model):
    return [torch.zeros(2, 8, BS, model.kv_heads, model.head_dim).as_subclass(_FakeCuda)
            for _ in range(model.layers)]


def test_cuda_caches_are_device_buffers_of_a_store_on_their_gpu(model, store, monkeypatch):
    """The module's promise: CUDA caches move as device buffers. The store a
    worker opens itself ("ferry.l1" or "ferry.server") is opened on the
    caches' GPU; a registered store without that device refuses them at
    registration, naming the device it needs."""
    from ferry.adapters import vllm as fv

    class Opened(Exception):
        pass

    asked = []

    def kvstore(*args, **kw):
        asked.append(kw.get("device"))
        raise Opened()

    monkeypatch.setattr(fv, "KVStore", kvstore)
    for extra in ({"ferry.store": NAME, "ferry.l1": "4M"},
                  {"ferry.store": NAME, "ferry.server": "unix:/nonexistent/ferry.sock"}):
        cfg = vllm_config(extra)
        w = connector_class(cfg)(cfg, _vllm_base.KVConnectorRole.WORKER)
        with pytest.raises(Opened):
            w.register_kv_caches(dict(zip(layer_names(model), _cuda_caches(model))))
    assert asked == ["cuda:1", "cuda:1"]
    monkeypatch.undo()
    register_store(NAME, store)                       # opened without a device
    cfg = vllm_config({"ferry.store": NAME})
    w = connector_class(cfg)(cfg, _vllm_base.KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match=r"cuda:1 needs a store opened with device='cuda:1'"):
        w.register_kv_caches(dict(zip(layer_names(model), _cuda_caches(model))))


def test_multimodal_inputs_are_part_of_the_key(model, store):
    """Requests with images carry the same placeholder token ids for any image;
    vLLM tells them apart by Request.mm_features[i].identifier."""
    eng = Engine(model, store)
    a, _ = prompts()

    def with_image(rid, ident):
        r = Request(rid, a)
        r.mm_features = [SimpleNamespace(identifier=ident)]
        return r

    r1 = with_image("m1", "image-1")
    eng.admit(r1)
    eng.step_new(r1)
    eng.finish(r1)
    r2, r3 = with_image("m2", "image-2"), with_image("m3", "image-1")
    assert eng.admit(r2) == 0               # same tokens, another image
    assert eng.admit(r3) == 32
    assert eng.admit(Request("m4", a)) == 0  # and no image at all
    for r in (r2, r3, Request("m4", a)):
        eng.finish(r)
    eng.close()


def test_lora_and_prompt_embeds_are_part_of_the_key(model, store):
    """vLLM keys its own prefix cache by the request's LoRA adapter name and
    by a hash of its prompt embeddings as well as its tokens
    (generate_block_hash_extra_keys: _gen_lora_extra_hash_keys,
    _gen_prompt_embeds_extra_hash_keys; vllm-project/vllm
    bbf906a88ba1a39104884c88c9811a4f968e4659, vllm/v1/core/kv_cache_utils.py):
    an adapter's KV is not the base model's, and a prompt given as
    embeddings has placeholder token ids (Request: [0] * its length)."""
    eng = Engine(model, store)
    a, _ = prompts()

    def req(rid, lora=None, embeds=None):
        r = Request(rid, a)
        r.lora_request = None if lora is None else SimpleNamespace(lora_name=lora,
                                                                   lora_int_id=7)
        r.prompt_embeds = embeds
        return r

    r1 = req("l1", lora="alpha")
    assert eng.admit(r1) == 0
    eng.step_new(r1)
    eng.finish(r1)
    others = [req("l2"), req("l3", lora="beta")]
    assert [eng.admit(r) for r in others] == [0, 0]     # the base model, another adapter
    same = req("l4", lora="alpha")
    assert eng.admit(same) == 32
    e1 = torch.randn(len(a), 8)
    r5 = req("e1", embeds=e1)
    assert eng.admit(r5) == 0
    eng.step_new(r5)
    eng.finish(r5)
    r6, r7 = req("e2", embeds=torch.randn(len(a), 8)), req("e3", embeds=e1.clone())
    assert eng.admit(r6) == 0               # same placeholder tokens, other embeddings
    assert eng.admit(r7) == 32
    for r in others + [same, r6, r7]:
        eng.finish(r)
    eng.close()


def test_a_salt_spelled_as_another_requests_key_finds_nothing(model, store):
    r"""ferry's salt joins cache_salt, the LoRA name and the multimodal
    identities with NUL-separated tags. cache_salt and multimodal UUIDs are
    the client's strings: one spelled as another request's tagged parts
    ("\0lora\0alpha", an image id ending "\0ferry-group\0"...) must not
    name that request's chunks (the base model would load an adapter's KV,
    or store its own under the adapter's key). Salts without a NUL keep the
    keys they always had: what the Python API stores under them."""
    eng = Engine(model, store)
    a, _ = prompts()

    def req(rid, salt=None, lora=None, mm=None, embeds=None):
        r = Request(rid, a, salt=salt)
        r.lora_request = None if lora is None else SimpleNamespace(lora_name=lora)
        if mm is not None:
            r.mm_features = [SimpleNamespace(identifier=i) for i in mm]
        r.prompt_embeds = embeds
        return r

    e = torch.randn(len(a), 8)
    stored = [req("x1", lora="alpha"), req("x2", mm=["img"]),
              req("x3", lora="alpha", mm=["img"]), req("x4", mm=["img"], embeds=e)]
    for r in stored:
        eng.admit(r)
        eng.step_new(r)
        eng.finish(r)
    forged = [req("y1", salt="\0lora\0alpha"),       # no adapter, its salt spelled as one
              req("y2", salt="\0mm\0img"),            # no image
              req("y3", lora="alpha\0mm\0img"),       # an adapter's name, no image
              req("y4", mm=["img", "embeds", _embeds_digest(e)])]   # images' ids, no embeds
    assert [eng.admit(r) for r in forged] == [0, 0, 0, 0]
    for r in forged:
        eng.finish(r)
    again = [req("z1", lora="alpha"), req("z2", mm=["img"]),
             req("z3", lora="alpha", mm=["img"]), req("z4", mm=["img"], embeds=e.clone())]
    assert [eng.admit(r) for r in again] == [32] * 4   # the real ones still hit
    # salts without a NUL are the keys the Python API uses
    r9 = req("x9", salt="tenant-9")
    eng.admit(r9)
    eng.step_new(r9)
    eng.finish(r9)
    assert store.lookup(a, salt="tenant-9") == 32
    assert store.lookup(a, salt="tenant-9\0lora\0alpha") == 0
    r10 = req("x10", salt=b"t\xff")    # a salt given as bytes stays those bytes
    eng.admit(r10)
    eng.step_new(r10)
    eng.finish(r10)
    assert store.lookup(a, salt=b"t\xff") == 32
    for r in again:
        eng.finish(r)
    eng.close()


def test_a_request_never_looked_up_is_not_stored_without_its_salt(model, store):
    """vLLM's MultiConnector as it was first written asks its connectors in
    turn and returns at the first with a hit: a connector after it is never
    asked (get_num_new_matched_tokens) nor told of the allocation, but its
    build_connector_meta sees the request scheduled. NewRequestData has no
    cache_salt (vllm-project/vllm 00e8f1fd, vllm/v1/core/sched/output.py),
    so ferry cannot key it: it is not stored, rather than stored where a
    request of another tenant (or of no tenant) with that prompt finds it."""
    eng = Engine(model, store)
    a, _ = prompts()
    r = Request("t1", a, salt="tenant-1")
    # Scheduler.schedule: another connector answered first; ferry not asked
    eng.blocks["t1"] = [eng.free.pop(0) for _ in range(-(-r.num_tokens // BS))]
    meta = eng.step_new(r, budget=20)
    assert meta.saves == []
    meta = eng.step_cached(r)
    assert meta.saves == []
    eng.finish(r)
    assert store.lookup(a) == 0
    assert eng.admit(Request("t2", a)) == 0            # no tenant
    assert eng.admit(Request("t3", a, salt="tenant-2")) == 0
    for rid in ("t2", "t3"):
        eng.finish(Request(rid, a))
    eng.close()


def test_layerwise_form_loads_and_saves_layer_by_layer_bitwise(model, store, monkeypatch):
    calls = []
    real_wait, real_done = ferry.LayerOp.wait_layer, ferry.LayerOp.layer_done
    monkeypatch.setattr(ferry.LayerOp, "wait_layer",
                        lambda op, L, timeout=None: calls.append(("wait", L)) or
                        real_wait(op, L, timeout))
    monkeypatch.setattr(ferry.LayerOp, "layer_done",
                        lambda op, L: calls.append(("done", L)) or real_done(op, L))
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    kv_a = serve_a(eng)  # a's two chunks saved layer by layer during its forward
    assert calls == [("done", L) for L in range(model.layers)]
    assert store.lookup(prompts()[0]) == 32
    calls.clear()
    _, b = prompts()
    rb = Request("b", b)
    assert eng.admit(rb) == 32
    meta = eng.step_new(rb)
    assert [(sp.skip, sp.need) for sp in meta.loads] == [(0, 32)]
    # each layer waited for right before it ran, and handed to b's save once written
    assert calls == [(k, L) for L in range(model.layers) for k in ("wait", "done")]
    assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
    ref = model.new_caches(BLOCKS, BS)
    table = list(range(16))
    model.forward(prompts()[0], 0, ref, table)
    want = model.forward(b[32:], 32, ref, table)
    got = model.forward(b[32:], 32, eng.caches, eng.blocks["b"])
    assert torch.equal(got, want)
    assert eng.errors == set()
    assert store.lookup(b) == 64
    eng.finish(rb)
    eng.close()


def test_layerwise_save_missing_a_layer_stores_nothing(model, store):
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    eng.layerwise = {0}  # the forward calls save_kv_layer for layer 0 only
    a, _ = prompts()
    ra = Request("a", a)
    eng.admit(ra)
    eng.step_new(ra)
    assert eng.worker.saves_skipped == 1
    assert store.lookup(a) == 0
    assert store.stats()["tier"]["l1"]["chunks"] == 0
    eng.finish(ra)
    eng.close()


def test_through_a_ferry_serve_daemon_scheduler_and_worker_apart(tmp_path):
    """"ferry.server": the worker opens a client of a real `ferry serve` when
    vLLM registers its caches; the scheduler, finding no store in its
    process, opens a lookup-only client whose layout comes from vLLM's
    model_config. Prefix stored by one request is loaded bitwise by the next."""
    from test_server import Daemon
    model = TinyLlama(dim=256, layers=2, heads=4, kv_heads=2, ffn=256, seed=4321,
                      dtype=torch.bfloat16)        # the daemon's tiny preset
    d = Daemon(str(tmp_path)).start()
    try:
        extra = {"ferry.server": d.url, "ferry.store": NAME, "ferry.chunk_tokens": CHUNK}
        eng = Engine(model, extra=extra)
        worker_store = registered_store(NAME)
        assert worker_store is not None and worker_store.layout == ferry.Layout.from_kv_caches(
            eng.caches)
        # the scheduler in another process: no registered store there
        mc = SimpleNamespace(model="tiny-llama", dtype=torch.bfloat16, use_mla=False,
                             get_num_layers=lambda pc: model.layers,
                             get_num_kv_heads=lambda pc: model.kv_heads,
                             get_head_size=lambda: model.head_dim)
        cfg = vllm_config(dict(extra, **{"ferry.store": "scheduler-process"}))
        cfg.model_config = mc
        eng.sched.shutdown()
        eng.sched = connector_class(cfg)(cfg, _vllm_base.KVConnectorRole.SCHEDULER, None)
        kv_a = serve_a(eng)
        assert eng.sched.store is not worker_store
        _, b = prompts()
        rb = Request("b", b)
        assert eng.admit(rb) == 32         # the daemon's chunks, pinned through the client
        meta = eng.step_new(rb)
        assert [(s.skip, s.need, len(s.tokens)) for s in meta.loads] == [(0, 32, 32)]
        assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
        with pytest.raises(FerryError):    # the scheduler's client maps no pool
            eng.sched.store.store(b[:32], eng.caches, eng.blocks["b"])
        assert eng.errors == set()
        eng.finish(rb)
        eng.close()
        assert registered_store(NAME) is None
    finally:
        unregister_store(NAME)
        d.stop()


def test_layerwise_save_kv_layer_never_raises_into_the_forward(model, store):
    """save_kv_layer runs inside the model's attention layers (vLLM's
    maybe_save_kv_layer_to_connector; vllm-project/vllm
    00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/distributed/kv_transfer/kv_connector/v1/base.py: "called from
    within attention layer"): a store that cannot take a layer (here one
    handed over twice in a step, its KV written again after the first
    hand-over) is cancelled and counted, never an exception in the forward,
    and nothing of it is stored."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    w, names = eng.worker, layer_names(model)
    a, _ = prompts()
    ra = Request("a", a)
    assert eng.admit(ra) == 0
    new = SimpleNamespace(req_id="a", prompt_token_ids=a, block_ids=(eng.blocks["a"],),
                          num_computed_tokens=0)
    so = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"a": len(a)},
                         scheduled_cached_reqs=SimpleNamespace(
                             req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[]))
    w.bind_connector_metadata(eng.sched.build_connector_meta(so))
    w.start_load_kv(None)
    model.forward(a, 0, eng.caches, eng.blocks["a"])
    w.save_kv_layer(names[0], eng.caches[0], SimpleNamespace())
    eng.caches[0].add_(1.0)                 # layer 0 written again after its hand-over
    for name, cache in zip(names, eng.caches):
        w.save_kv_layer(name, cache, SimpleNamespace())
    w.wait_for_save()
    w.clear_connector_metadata()
    assert store.lookup(a) == 0
    assert w.get_kv_connector_stats().data["saves_skipped"] == 1
    eng.finish(ra)
    eng.close()


def test_shutdown_mid_step_ends_the_layerwise_ops(model, store):
    """A worker shut down inside a step (the engine failed in its forward;
    vLLM's shutdown calls the connector's shutdown,
    vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1 base.py:
    "ensure that all the async operations are completed") ends the step's
    layerwise stores: a store registered by the application outlives the
    connector, and a store left waiting for layers would hold its chunks'
    slots write-locked (the lock's TTL: minutes), so no one could store them."""
    eng = Engine(model, store, extra={"ferry.store": NAME, "ferry.layerwise": True})
    w, names = eng.worker, layer_names(model)
    a, _ = prompts()
    ra = Request("a", a)
    assert eng.admit(ra) == 0
    new = SimpleNamespace(req_id="a", prompt_token_ids=a, block_ids=(eng.blocks["a"],),
                          num_computed_tokens=0)
    so = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"a": len(a)},
                         scheduled_cached_reqs=SimpleNamespace(
                             req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[]))
    w.bind_connector_metadata(eng.sched.build_connector_meta(so))
    w.start_load_kv(None)
    model.forward(a, 0, eng.caches, eng.blocks["a"])
    w.save_kv_layer(names[0], eng.caches[0], SimpleNamespace())   # then the engine fails
    eng.close()
    assert store.lookup(a) == 0
    assert store.store(a[:32], eng.caches, eng.blocks["a"]) == 32
