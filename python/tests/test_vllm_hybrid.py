"""A hybrid model through ferry's vLLM connector (SupportsHMA): one
full-attention KV cache group and one sliding-window group, as vLLM's
KVCacheConfig.kv_cache_groups describe them (vllm-project/vllm
003df2961dd8830c317a61f9745ccd557da9fa06; spec classes named as in
vllm/v1/kv_cache_interface.py). vLLM is not installed: the groups, their
block tables (the sliding group's blocks below its window are vLLM's null
block 0) and the windowed attention are stand-ins around the tiny Llama.
"""
import contextlib
from types import SimpleNamespace

import torch

import ferry
from ferry.adapters import register_store, unregister_store
from ferry.adapters import _vllm_base as base
from ferry.adapters import vllm as vllm_adapter
from test_adapter_vllm import BS, CHUNK, NAME, Request, connector_class, prompts, vllm_config
from tiny_llama import TinyLlama

W = 16          # the sliding window, in tokens
NULL = 0        # vLLM's null block
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


class FullAttentionSpec:
    pass


class SlidingWindowSpec:
    def __init__(self, sliding_window):
        self.sliding_window = sliding_window


class MambaSpec:
    pass


def kv_cache_config(second):
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=[L0]),
        SimpleNamespace(kv_cache_spec=second, layer_names=[L1])])


def forward(model, tokens, start, caches, tables):
    """TinyLlama.forward with a block table per layer and layer 1 attending
    only to the last W positions."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n = tokens.numel()
    pos = torch.arange(start, start + n)
    all_pos = torch.arange(start + n)
    x = model.embed[tokens]
    rep = model.heads // model.kv_heads
    for L, p in enumerate(model.blocks):
        table = torch.as_tensor(tables[L], dtype=torch.long)
        blk, row = table[all_pos // BS], all_pos % BS
        mask = all_pos[None, :] <= pos[:, None]
        if L == 1:
            mask &= all_pos[None, :] > pos[:, None] - W
        h = model._rms(x, p["attn_norm"])
        q = (h @ p["wq"].T).view(n, model.heads, model.head_dim)
        k = (h @ p["wk"].T).view(n, model.kv_heads, model.head_dim)
        v = (h @ p["wv"].T).view(n, model.kv_heads, model.head_dim)
        q, k = model._rope(q, pos), model._rope(k, pos)
        caches[L][0, table[pos // BS], pos % BS] = k
        caches[L][1, table[pos // BS], pos % BS] = v
        K = caches[L][0, blk, row].repeat_interleave(rep, dim=1)
        V = caches[L][1, blk, row].repeat_interleave(rep, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, K) / model.head_dim ** 0.5
        att = att.masked_fill(~mask[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, V).reshape(n, -1)
        x = x + o @ p["wo"].T
        h = model._rms(x, p["ffn_norm"])
        x = x + (torch.nn.functional.silu(h @ p["w1"].T) * (h @ p["w3"].T)) @ p["w2"].T
    return model._rms(x, model.norm) @ model.out.T


def step(sched, worker, model, caches, req, tables, start, n):
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                          block_ids=tuple(tables), num_computed_tokens=start)
    so = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: n},
                         scheduled_cached_reqs=SimpleNamespace(
                             req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[]), finished_req_ids=set())
    meta = sched.build_connector_meta(so)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    logits = forward(model, req.prompt_token_ids[start:start + n], start, caches, tables) \
        if n else None
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return meta, logits, errors


@contextlib.contextmanager
def tiny_store():
    """The tiny Llama and an in-process store for it, registered as NAME;
    unregistered and closed after."""
    model = TinyLlama(seed=4321)
    lay = ferry.Layout.from_model(1, model.kv_heads, model.head_dim, dtype="f32")
    store = ferry.KVStore("tiny-hybrid", lay, l1=64 * CHUNK * lay.token_bytes,
                          chunk_tokens=CHUNK)
    register_store(NAME, store)
    try:
        yield model, store
    finally:
        unregister_store(NAME)
        store.close()


@contextlib.contextmanager
def hybrid_engine(extra=None):
    """TinyLlama's two layers as a hybrid model (a full-attention group and a
    sliding-window group of W tokens), its store registered as NAME (see
    tiny_store), a worker with its caches registered and a scheduler, built
    as vLLM builds them."""
    with tiny_store() as (model, store):
        cfg = vllm_config({"ferry.store": NAME, **(extra or {})})
        cls = connector_class(cfg)
        kcc = kv_cache_config(SlidingWindowSpec(W))
        worker = cls(cfg, base.KVConnectorRole.WORKER, kcc)
        caches = model.new_caches(64, BS)
        worker.register_kv_caches({L0: caches[0], L1: caches[1]})
        sched = cls(cfg, base.KVConnectorRole.SCHEDULER, kcc)
        yield model, store, worker, sched, caches


def test_a_sliding_window_group_is_stored_and_loaded_inside_its_window(monkeypatch):
    """As an engine of 003df296 drives it (no get_transfer_results: a hybrid
    model's loads stay synchronous). The newest engine's path, where such
    loads go async so a failure can be reported per request, is in
    test_vllm_newest.py."""
    monkeypatch.setattr(vllm_adapter, "_PER_REQUEST_FAILURES", False)
    with hybrid_engine() as (model, store, worker, sched, caches):
        a, b = prompts()
        ra = Request("a", a)
        assert sched.get_num_new_matched_tokens(ra, 0) == (0, False)
        ta = [list(range(1, 11)), list(range(11, 21))]
        sched.update_state_after_alloc(ra, None, 0)
        _, _, err = step(sched, worker, model, caches, ra, ta, 0, 40)
        assert err == set()
        sched.request_finished_all_groups(ra, tuple(ta))
        assert store.lookup(a) == 32 and store.lookup(a, salt="\0ferry-group\0" "1") == 32
        kv_a = [c.clone() for c in caches]
        rb = Request("b", b)
        assert sched.get_num_new_matched_tokens(rb, 0) == (32, False)
        # vLLM's tables for b: the sliding group's blocks wholly below the
        # window of the 32 loaded tokens (tokens < 32 - W + 1) are the null block
        full = list(range(21, 37))
        sliding = [NULL] * 4 + list(range(37, 49))
        before = caches[1][:, NULL].clone()
        sched.update_state_after_alloc(rb, None, 32)
        meta, got, err = step(sched, worker, model, caches, rb, [full, sliding], 32, 32)
        assert err == set()
        assert [(s.skip, s.need) for s in meta.loads] == [(0, 32)]
        assert torch.equal(caches[1][:, NULL], before)      # the null block never written
        t = torch.arange(32)
        assert torch.equal(caches[0][:, torch.tensor(full)[t // BS], t % BS],
                           kv_a[0][:, torch.tensor(ta[0])[t // BS], t % BS])
        w = torch.arange(32 - W + 1, 32)
        assert torch.equal(caches[1][:, torch.tensor(sliding)[w // BS], w % BS],
                           kv_a[1][:, torch.tensor(ta[1])[w // BS], w % BS])
        # logits bitwise those of b computed after a with every block kept
        ref = model.new_caches(64, BS)
        tr = [list(range(1, 17)), list(range(17, 33))]
        forward(model, a, 0, ref, tr)
        want = forward(model, b[32:], 32, ref, tr)
        assert torch.equal(got, want)
        sched.request_finished_all_groups(rb, ([], []))
        worker.shutdown()
        sched.shutdown()


def test_a_group_ferry_cannot_cache_turns_the_connector_off(caplog):
    with tiny_store() as (model, store):
        cfg = vllm_config({"ferry.store": NAME})
        cls = connector_class(cfg)
        sched = cls(cfg, base.KVConnectorRole.SCHEDULER, kv_cache_config(MambaSpec()))
        a, _ = prompts()
        store_src = model.new_caches(16, BS)[:1]
        store.store(a[:32], store_src, list(range(8)))       # group 0's chunks are there
        assert sched.get_num_new_matched_tokens(Request("a", a), 0) == (0, False)
        assert "MambaSpec" in caplog.text and "neither loads nor stores" in caplog.text
        short = cls(cfg, base.KVConnectorRole.SCHEDULER,
                    kv_cache_config(SlidingWindowSpec(CHUNK - 1)))
        assert short.get_num_new_matched_tokens(Request("a2", a), 0) == (0, False)
        assert "shorter than" in caplog.text


def test_a_sliding_group_never_stores_blocks_vllm_let_go(monkeypatch):
    """vLLM hands a sliding-window group the null block for every block
    wholly below the window: a local prefix-cache hit
    (SlidingWindowManager.find_longest_cache_hit returns [NULL, ..., hit
    blocks]) and, as prefill moves on, remove_skipped_blocks(request,
    num_computed_tokens) frees them (vllm-project/vllm
    129ab7c60cbb8eb11e875373e67f7e521b74aa30,
    vllm/v1/core/single_type_kv_cache_manager.py). A save of the request's
    prompt from token 0 must not read those blocks into ferry: here a's
    chunks left ferry (evicted) while vLLM kept them, b hits them locally,
    and b's save would store the null block's bytes as b's window-group
    chunks, which a later request loading inside its window would read."""
    monkeypatch.setattr(vllm_adapter, "_PER_REQUEST_FAILURES", False)
    with hybrid_engine() as (model, store, worker, sched, caches):
        g1 = "\0ferry-group\0" "1"
        a, b = prompts()
        ra = Request("a", a)
        assert sched.get_num_new_matched_tokens(ra, 0) == (0, False)
        ta = [list(range(1, 11)), list(range(11, 21))]
        sched.update_state_after_alloc(ra, None, 0)
        step(sched, worker, model, caches, ra, ta, 0, 40)
        sched.request_finished_all_groups(ra, tuple(ta))
        store.clear()                       # ferry evicted a; vLLM still has it
        rb = Request("b", b)
        assert sched.get_num_new_matched_tokens(rb, 32) == (0, False)
        sched.update_state_after_alloc(rb, None, 0)
        # b's 32-token local hit: the full group shares a's blocks, the sliding
        # group gets the null block below the window (32 - W + 1 = 17 tokens:
        # 4 blocks) and a's blocks above it
        full = ta[0][:8] + list(range(21, 29))
        sliding = [NULL] * 4 + ta[1][4:8] + list(range(29, 37))
        step(sched, worker, model, caches, rb, [full, sliding], 32, 32)
        # every chunk ferry holds for b's window group is b's KV
        ref = model.new_caches(64, BS)
        tr = [list(range(1, 17)), list(range(17, 33))]
        forward(model, b, 0, ref, tr)
        held = store.lookup(b, salt=g1)
        out = model.new_caches(64, BS)[1:]
        if held:
            assert store.retrieve(b[:held], out, tr[1], salt=g1) == held
        t = torch.arange(held)
        assert torch.allclose(out[0][:, torch.tensor(tr[1])[t // BS], t % BS],
                              ref[1][:, torch.tensor(tr[1])[t // BS], t % BS], atol=1e-5)
        assert store.lookup(b) == 64        # the full group's chunks were stored
        assert sched.get_num_new_matched_tokens(Request("c", b), 0)[0] == held
        sched.request_finished_all_groups(rb, ([], []))
        worker.shutdown()
        sched.shutdown()


def test_a_sliding_group_never_stores_blocks_vllm_reused(monkeypatch):
    """Chunked prefill: when b's second step is scheduled, vLLM's
    remove_skipped_blocks(b, 32) gives the sliding group's blocks below
    32 - W + 1 back (vllm-project/vllm
    129ab7c60cbb8eb11e875373e67f7e521b74aa30,
    vllm/v1/core/single_type_kv_cache_manager.py) and another request's
    forward writes them, while the worker's block table for b still names
    them. With b's first chunks gone from ferry, the second step's save must
    not store that request's KV as b's."""
    monkeypatch.setattr(vllm_adapter, "_PER_REQUEST_FAILURES", False)
    with hybrid_engine() as (model, store, worker, sched, caches):
        g1 = "\0ferry-group\0" "1"
        _, b = prompts()
        rb = Request("b", b)
        assert sched.get_num_new_matched_tokens(rb, 0) == (0, False)
        sched.update_state_after_alloc(rb, None, 0)
        tb = [list(range(1, 17)), list(range(17, 33))]
        step(sched, worker, model, caches, rb, [tb[0][:8], tb[1][:8]], 0, 32)
        assert store.lookup(b, salt=g1) == 32
        store.clear()                                     # ferry evicted b's chunks
        caches[1][:, tb[1][:4]] = torch.randn_like(caches[1][:, tb[1][:4]])  # reused
        so = SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={"b": 32}, finished_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["b"], resumed_req_ids=set(), num_computed_tokens=[32],
                new_block_ids=[(tb[0][8:], tb[1][8:])]))
        meta = sched.build_connector_meta(so)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        forward(model, b[32:], 32, caches, tb)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        ref = model.new_caches(64, BS)
        forward(model, b, 0, ref, tb)
        held = store.lookup(b, salt=g1)
        out = model.new_caches(64, BS)[1:]
        if held:
            assert store.retrieve(b[:held], out, tb[1], salt=g1) == held
        t = torch.arange(held)
        assert torch.allclose(out[0][:, torch.tensor(tb[1])[t // BS], t % BS],
                              ref[1][:, torch.tensor(tb[1])[t // BS], t % BS], atol=1e-5)
        assert store.lookup(b) == 64
        sched.request_finished_all_groups(rb, ([], []))
        worker.shutdown()
        sched.shutdown()


def test_an_async_save_of_a_sliding_group_ends_before_vllm_frees_its_blocks(monkeypatch):
    """"ferry.async_save": b's first step starts its stores and returns. At
    b's next step vLLM frees the sliding group's blocks below the window
    (remove_skipped_blocks(b, 32); vllm-project/vllm
    129ab7c60cbb8eb11e875373e67f7e521b74aa30,
    vllm/v1/core/single_type_kv_cache_manager.py) though b still runs, so
    no preemption is reported for b, and another request's forward writes
    them. The sliding group's store must have read them first."""
    from test_vllm_older import slow_stores
    monkeypatch.setattr(vllm_adapter, "_PER_REQUEST_FAILURES", False)
    with hybrid_engine({"ferry.async_save": True}) as (model, store, worker, sched, caches):
        ops = slow_stores(store, monkeypatch)
        g1 = "\0ferry-group\0" "1"
        _, b = prompts()
        rb = Request("b", b)
        assert sched.get_num_new_matched_tokens(rb, 0) == (0, False)
        sched.update_state_after_alloc(rb, None, 0)
        tb = [list(range(1, 17)), list(range(17, 33))]
        step(sched, worker, model, caches, rb, [tb[0][:8], tb[1][:8]], 0, 32)
        so = SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={"b": 32}, finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["b"], resumed_req_ids=set(), num_computed_tokens=[32],
                new_block_ids=[(tb[0][8:], tb[1][8:])]))
        meta = sched.build_connector_meta(so)
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        caches[1][:, tb[1][:4]] = torch.randn_like(caches[1][:, tb[1][:4]])  # reused
        forward(model, b[32:], 32, caches, tb)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        for op in ops:
            op.wait()
        ref = model.new_caches(64, BS)
        forward(model, b, 0, ref, tb)
        held = store.lookup(b, salt=g1)
        out = model.new_caches(64, BS)[1:]
        assert store.retrieve(b[:held], out, tb[1], salt=g1) == held
        t = torch.arange(held)
        assert torch.allclose(out[0][:, torch.tensor(tb[1])[t // BS], t % BS],
                              ref[1][:, torch.tensor(tb[1])[t // BS], t % BS], atol=1e-5)
        assert held == 64 and store.lookup(b) == 64
        assert sched.request_finished_all_groups(rb, ([], []))[0] is True
        worker.shutdown()
        sched.shutdown()


def test_a_failed_layerwise_store_leaves_no_other_stores_pins(monkeypatch):
    """Layerwise: the step's stores end in wait_for_save, each dropping the
    pins a sliding group's store took on its chunks below the window. A
    store that fails (an L2 write error: not "ferry full") is raised to
    vLLM, but only after every other store of the step ended: here the full
    group's store fails first and the sliding group's pins must still go
    (else its chunks stay read-locked, unevictable, until the lock's TTL)."""
    import errno
    monkeypatch.setattr(vllm_adapter, "_PER_REQUEST_FAILURES", False)
    with hybrid_engine({"ferry.layerwise": True}) as (model, store, worker, sched, caches):
        pins = []
        real_pin, real_unpin = store.pin, store.unpin
        monkeypatch.setattr(store, "pin",
                            lambda t, **kw: pins.append(real_pin(t, **kw)) or pins[-1])
        monkeypatch.setattr(store, "unpin",
                            lambda t, **kw: pins.append(-real_unpin(t, **kw)) or -pins[-1])
        _, b = prompts()
        rb = Request("b", b)
        assert sched.get_num_new_matched_tokens(rb, 0) == (0, False)
        sched.update_state_after_alloc(rb, None, 0)
        tb = [list(range(1, 17)), list(range(17, 33))]

        def run(so, start, n, fail):
            meta = sched.build_connector_meta(so)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            forward(model, b[start:start + n], start, caches, tb)
            worker.save_kv_layer(L0, caches[0], None)
            worker.save_kv_layer(L1, caches[1], None)
            if fail:
                real_wait = ferry.LayerOp.wait
                calls = []

                def wait(op, timeout=None):
                    calls.append(op)
                    got = real_wait(op, timeout)
                    if len(calls) == 1:   # the full group's store, once it ended
                        raise ferry.FerryError(-errno.EIO, "an L2 write failed", "store")
                    return got
                monkeypatch.setattr(ferry.LayerOp, "wait", wait)
                try:
                    worker.wait_for_save()
                except ferry.FerryError as e:
                    assert e.code == -errno.EIO
                else:
                    raise AssertionError("the failed store was not raised")
                monkeypatch.setattr(ferry.LayerOp, "wait", real_wait)
            else:
                worker.wait_for_save()
            worker.clear_connector_metadata()

        new = SimpleNamespace(req_id="b", prompt_token_ids=b, num_computed_tokens=0,
                              block_ids=(tb[0][:8], tb[1][:8]))
        run(SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"b": 32},
                            finished_req_ids=set(), scheduled_cached_reqs=SimpleNamespace(
                                req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                num_computed_tokens=[])), 0, 32, False)
        run(SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={"b": 32}, finished_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["b"], resumed_req_ids=set(), num_computed_tokens=[32],
                new_block_ids=[(tb[0][8:], tb[1][8:])])), 32, 32, True)
        assert pins and pins[0] == 32       # the sliding group's chunks below its window
        assert sum(pins) == 0, pins         # every pin dropped
        sched.request_finished_all_groups(rb, ([], []))
        worker.shutdown()
        sched.shutdown()


def test_a_worker_of_a_mamba_hybrid_registers_its_caches(caplog):
    """A Mamba hybrid's worker is handed every layer's cache, its Mamba
    layers' as a list of state tensors (conv, ssm), not one paged tensor
    (vllm-project/vllm 000fc94b754f66aeb60ef5acf1ea2e94cdc65164,
    vllm/v1/worker/gpu_model_runner.py: initialize_kv_cache hands
    register_kv_caches what allocate_kv_cache built, where a MambaSpec
    layer's entry is `kv_caches[layer_name] = state_tensors`). The
    connector is off for such a model (a hit must cover every group), but
    its worker must register them: before, it read a paged layout from
    every layer's cache and the list's failed vLLM's start."""
    with tiny_store() as (model, store):
        cfg = vllm_config({"ferry.store": NAME})
        cls = connector_class(cfg)
        w = cls(cfg, base.KVConnectorRole.WORKER, kv_cache_config(MambaSpec()))
        attn = model.new_caches(16, BS)[0]
        w.register_kv_caches({L0: attn, L1: [torch.zeros(16, 3, 8), torch.zeros(16, 4, 8, 8)]})
        assert w.store is store
        w.shutdown()
