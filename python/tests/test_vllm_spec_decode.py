"""Speculative decoding through ferry's vLLM connector, in the call order of
vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1 (the newest the
index holds), vllm/v1/worker/kv_connector_model_runner_mixin.py: with a
speculative config the model runner enters _get_kv_connector_output with
defer_finalize=True: bind_connector_metadata; start_load_kv before the
target's forward when scheduler_output.has_sync_kv_loads, else after it;
then get_transfer_results and get_block_ids_with_load_errors for the step's
output, but no wait_for_save; the drafter's forward (EAGLE: its attention
layers have KV caches of their own, written for the step's positions) runs
after, and only then finalize_kv_connector: wait_for_save,
clear_connector_metadata. So the drafter's layers are written between the
target's forward and wait_for_save.

The drafter's layers are either more layers of the target's KV cache group
(EAGLE's model.layers.{N + i}) or a KV cache group of their own; here the
tiny Llama's layer 1 plays the drafter's. A decode step schedules the
sampled token and num_speculative_tokens drafts past the prompt; ferry
stores whole prompt chunks only (the scheduler's _plan: min(num_computed +
num_scheduled, prompt_len) // chunk * chunk), never a chunk that would hold
drafts or sampled tokens, rejected ones included."""
import time
from types import SimpleNamespace

import pytest
import torch

import ferry
from ferry.adapters import register_store, unregister_store
from ferry.adapters import _vllm_base as base
from test_adapter_vllm import BS, CHUNK, NAME, Request, connector_class, layer_names, vllm_config
from test_vllm_contract import KVCacheBlocks
from test_vllm_hybrid import FullAttentionSpec, kv_cache_config
from tiny_llama import TinyLlama

Role = base.KVConnectorRole
FWD = SimpleNamespace(attn_metadata={}, no_compile_layers={})
SPEC = 3            # num_speculative_tokens
PROMPT = 40         # not a multiple of CHUNK (16)
TARGET, DRAFT = 0, 1


class Run:
    """One request's forward passes: its KV computed in a scratch cache of
    its own (the reference), each layer's positions copied into vLLM's
    caches through that layer's KV cache group block table when the
    target's (layer 0) or the drafter's (layer 1) forward runs."""

    def __init__(self, model, caches, tables, tokens):
        self.model, self.caches, self.tables, self.tokens = model, caches, tables, tokens
        self.scratch = model.new_caches(32, BS)
        self.vtable = list(range(32))

    def compute(self, start, n):
        self.model.forward(self.tokens[start:start + n], start, self.scratch, self.vtable)

    def write(self, layer, start, n):
        p = torch.arange(start, start + n)
        src = torch.as_tensor(self.vtable)[p // BS]
        dst = torch.as_tensor(self.tables[layer])[p // BS]
        self.caches[layer][:, dst, p % BS] = self.scratch[layer][:, src, p % BS]


def runner_step(w, so, run, start, n, layerwise, names):
    """GPUModelRunner.execute_model + sample_tokens with a drafter: the
    mixin's _get_kv_connector_output(defer_finalize=True) around the
    target's forward, the drafter's forward, finalize_kv_connector."""
    calls = []
    w.handle_preemptions(so.kv_connector_metadata)
    w.bind_connector_metadata(so.kv_connector_metadata)
    if so.has_sync_kv_loads:
        w.start_load_kv(FWD)
    if n:
        run.compute(start, n)

    def layer(L):
        w.wait_for_layer_load(names[L])
        run.write(L, start, n)
        calls.append(L)
        if layerwise:
            w.save_kv_layer(names[L], run.caches[L], SimpleNamespace())

    if n:
        layer(TARGET)                       # the target's forward
    if not so.has_sync_kv_loads:
        w.start_load_kv(FWD)
    res = w.get_transfer_results(so.finished_req_ids)
    errors = w.get_block_ids_with_load_errors()
    if n:
        layer(DRAFT)                        # propose_draft_token_ids: the drafter's forward
    if not layerwise:                       # (the whole form stores in wait_for_save)
        for L in (TARGET, DRAFT):
            w.save_kv_layer(names[L], run.caches[L], SimpleNamespace())
    w.wait_for_save()                       # finalize_kv_connector
    w.clear_connector_metadata()
    return res, errors


def output(new=(), cached=(), sched=None, sync=False, finished=()):
    """A SchedulerOutput: new = [(rid, tokens, tables, computed)], cached =
    [(rid, computed, new tables)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=t, block_ids=tuple(b),
                                            num_computed_tokens=c) for r, t, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[b for _, _, b in cached],
            num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens=dict(sched or {}), finished_req_ids=set(finished),
        preempted_req_ids=set(), has_sync_kv_loads=sync)


def engine(groups, layerwise):
    """The tiny Llama (layer 0 the target's, layer 1 the drafter's), its
    store, and a worker and scheduler as vLLM builds them: the drafter's
    layer in the target's KV cache group (groups 1: chunks of both layers)
    or in a group of its own (groups 2: chunks of one layer per group)."""
    model = TinyLlama(seed=4321)
    lay = ferry.Layout.from_model(3 - groups, model.kv_heads, model.head_dim, dtype="f32")
    store = ferry.KVStore("tiny-spec", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK)
    register_store(NAME, store)
    names = layer_names(model)
    kcc = kv_cache_config(FullAttentionSpec()) if groups == 2 else SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=names)])
    cfg = vllm_config({"ferry.store": NAME, "ferry.layerwise": layerwise})
    cls = connector_class(cfg)
    worker = cls(cfg, Role.WORKER, kcc)
    caches = model.new_caches(64, BS)
    worker.register_kv_caches(dict(zip(names, caches)))
    sched = cls(cfg, Role.SCHEDULER, kcc)
    return model, store, worker, sched, caches, names


def _tables(groups, blocks):
    """Each layer's block table, and the block_ids vLLM hands the connector."""
    if groups == 1:
        return [blocks[0], blocks[0]], (blocks[0],)
    return [blocks[0], blocks[1]], (blocks[0], blocks[1])


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_drafter_layers_written_before_wait_for_save_store_whole_prompt_chunks(groups, layerwise):
    model, store, worker, sched, caches, names = engine(groups, layerwise)
    salts = [None] if groups == 1 else [None, "\0ferry-group\0" "1"]
    g = torch.Generator().manual_seed(11)
    a = torch.randint(0, 512, (PROMPT,), generator=g).tolist()
    extra = torch.randint(0, 512, (24,), generator=g).tolist()  # sampled tokens and drafts
    try:
        # ---- request a: a chunked prefill, then decode steps of 1 + SPEC tokens ----
        ids = [list(range(1, 15)), list(range(15, 29))]
        tables, block_ids = _tables(groups, ids)
        ra = Request("a", a)
        assert sched.get_num_new_matched_tokens(ra, 0) == (0, False)
        sched.update_state_after_alloc(ra, KVCacheBlocks(*block_ids), 0)
        run = Run(model, caches, tables, a + extra)
        saves, computed = [], 0
        # 30 prompt tokens, then the last 10 (crossing the prompt's end), then
        # decodes: each scheduled the sampled token and SPEC drafts past the
        # prompt; vLLM takes back the rejected drafts (num_computed_tokens
        # grows by the accepted ones and the sampled one only)
        plan = [(30, 30), (10, 10), (1 + SPEC, 1 + 1), (1 + SPEC, 1 + 3), (1 + SPEC, 1 + 0),
                (1 + SPEC, 1 + 3)]
        for i, (n, accepted) in enumerate(plan):
            so = output(new=[("a", a, block_ids, 0)] if i == 0 else (),
                        cached=[("a", computed, None)] if i else (), sched={"a": n})
            so.kv_connector_metadata = meta = sched.build_connector_meta(so)
            saves.append([len(s.tokens) for s in meta.saves])
            res, errors = runner_step(worker, so, run, computed, n, layerwise, names)
            assert errors == set() and res.failed_recving == set()
            computed += accepted
        assert computed > 48           # past the third chunk's end: only 40 prompt tokens
        # whole prompt chunks, each once: 16 after the first step, 32 after
        # the second; never the 32..48 chunk of prompt, sampled and draft tokens
        assert saves == [[16], [32], [], [], [], []]   # (one save a request, every group)
        for s in salts:
            assert store.lookup(a + extra, salt=s) == 32
        kv_a = model.kv_of(caches, tables[0], 32)[TARGET].clone(), \
            model.kv_of(caches, tables[1], 32)[DRAFT].clone()
        # the drafter's layer as the drafter wrote it (before wait_for_save)
        assert torch.equal(kv_a[1], model.kv_of(run.scratch, run.vtable, 32)[DRAFT])
        assert sched.request_finished(ra, block_ids)[0] is False

        # ---- request b, the same prompt: ferry's 32 tokens load into both layers ----
        ids = [list(range(29, 43)), list(range(43, 57))]
        tables, block_ids = _tables(groups, ids)
        rb = Request("b", a)
        hit, is_async = sched.get_num_new_matched_tokens(rb, 0)
        assert hit == 32 and is_async is (groups == 2)   # (several groups load async)
        sched.update_state_after_alloc(rb, KVCacheBlocks(*block_ids), 32)
        runb = Run(model, caches, tables, a)
        runb.compute(0, 32)
        if is_async:                   # a step of the load only, then until it is over
            so = output(finished={"a"})
            so.kv_connector_metadata = sched.build_connector_meta(so)
            assert [(s.req_id, len(s.tokens)) for s in so.kv_connector_metadata.loads] == \
                [("b", 32)]
            got, errors = runner_step(worker, so, runb, 32, 0, layerwise, names)
            deadline = time.monotonic() + 30
            while "b" not in got.finished_recving and time.monotonic() < deadline:
                so = output()
                so.kv_connector_metadata = sched.build_connector_meta(so)
                got, errors = runner_step(worker, so, runb, 32, 0, layerwise, names)
            assert got.finished_recving == {"b"} and got.failed_recving == set()
            sched.update_state_after_alloc(rb, KVCacheBlocks(*[[] for _ in block_ids]), 0)
            so = output(new=[("b", a, block_ids, 32)], sched={"b": PROMPT - 32})
        else:
            so = output(new=[("b", a, block_ids, 0)], sched={"b": PROMPT - 32}, sync=True,
                        finished={"a"})
        so.kv_connector_metadata = meta = sched.build_connector_meta(so)
        assert meta.saves == []        # nothing past what ferry holds is a whole chunk
        res, errors = runner_step(worker, so, runb, 32, PROMPT - 32, layerwise, names)
        assert errors == set() and res.failed_recving == set()
        assert torch.equal(model.kv_of(caches, tables[0], 32)[TARGET], kv_a[0])
        assert torch.equal(model.kv_of(caches, tables[1], 32)[DRAFT], kv_a[1])
        sched.request_finished(rb, block_ids)

        # ---- a chunk is a hit only where every KV cache group holds it ----
        if groups == 2:
            store.delete(a[:32], salt=salts[1])     # the drafter's group: only its first
            store.store(a[:16], [caches[DRAFT]], tables[1][:4], salt=salts[1])
            assert store.lookup(a) == 32 and store.lookup(a, salt=salts[1]) == 16
            assert sched.get_num_new_matched_tokens(Request("c", a), 0)[0] == 16
            store.delete(a[:16], salt=salts[1])
            assert sched.get_num_new_matched_tokens(Request("d", a), 0)[0] == 0
        else:
            assert store.layout.num_layers == 2      # each chunk: the target's and drafter's
    finally:
        worker.shutdown()
        sched.shutdown()
        unregister_store(NAME)
        store.close()
