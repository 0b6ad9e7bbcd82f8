"""ferry's vLLM connector under vLLM's process topology.

vLLM builds the scheduler's connector (KVConnectorRole.SCHEDULER) in the
engine core process and one worker connector (WORKER) per GPU, each in its
own process under the multiprocessing executor: tensor-parallel rank r of
tensor_parallel_size, pipeline stage s of pipeline_parallel_size, and with
data parallelism one engine core (scheduler and workers) per DP replica,
each with its own parallel_config.data_parallel_rank. Every process gets
the same kv_connector_extra_config. The ranks come from
vllm/distributed/parallel_state.py (vllm-project/vllm
0030a317c88a6e37f69ab74a3ecb25e7372a1701 and later: get_tensor_model_parallel_rank,
get_pp_group() -> GroupCoordinator with rank_in_group). The engine core
builds the workers and lets them register their caches before it builds
the scheduler (vllm-project/vllm 00080ee13c7a451fce071ccb8d0e94d395acf5a7,
vllm/v1/engine/core.py, EngineCore.__init__: _initialize_kv_caches, then
Scheduler(...)). vLLM is not installable here: a process is stood in for by
its own "ferry.store" name and the rank helpers vllm.distributed answers
in it.
"""
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from ferry import FerryError
from ferry.adapters import registered_store, unregister_store
from ferry.adapters import _vllm_base
from ferry.adapters.vllm import FerryConnector, FerryConnectorMetadata, LoadSpec, SaveSpec
from tiny_llama import TinyLlama

Role = _vllm_base.KVConnectorRole
CHUNK, BS, BLOCKS = 16, 4, 16
TOKENS = list(range(1, 2 * CHUNK + 1))


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in [n for n in list(_opened)]:
        s = unregister_store(n)
        if s is not None:
            s.close()
    _opened.clear()


_opened = set()


class Ranks:
    """vllm.distributed as one process of the topology sees it."""

    def __init__(self, monkeypatch):
        self.tp = self.pp = self.pcp = 0
        vllm = ModuleType("vllm")
        dist = ModuleType("vllm.distributed")
        dist.get_tensor_model_parallel_rank = lambda: self.tp
        dist.get_pp_group = lambda: SimpleNamespace(rank_in_group=self.pp)
        dist.get_pcp_group = lambda: SimpleNamespace(rank_in_group=self.pcp)
        vllm.distributed = dist
        monkeypatch.setitem(sys.modules, "vllm", vllm)
        monkeypatch.setitem(sys.modules, "vllm.distributed", dist)


def config(extra, tp=1, pp=1, dp=(0, 1), model="tiny-llama", pcp=1, dcp=1):
    """dp is (data_parallel_rank, data_parallel_size), or (index, size,
    "dense"): a dense model's replica, which vLLM runs as an independent
    DP=1 engine (see test_dense_dp_replicas_open_their_own_l2)."""
    ktc = SimpleNamespace(kv_connector="FerryConnector",
                          kv_connector_module_path="ferry.adapters.vllm",
                          kv_role="kv_both", kv_connector_extra_config=extra)
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                         data_parallel_rank=dp[0], data_parallel_size=dp[1],
                         data_parallel_index=dp[0], prefill_context_parallel_size=pcp,
                         decode_context_parallel_size=dcp)
    if dp[2:] == ("dense",):    # ParallelConfig.reconfigure_for_independent_dp_rank
        pc.data_parallel_rank, pc.data_parallel_size = 0, 1
    return SimpleNamespace(kv_transfer_config=ktc, parallel_config=pc,
                           cache_config=SimpleNamespace(block_size=BS),
                           model_config=SimpleNamespace(model=model))


def worker(ranks, extra, *, tp=(0, 1), pp=(0, 1), dp=(0, 1), model="tiny-llama", seed=0,
           net=None, pcp=(0, 1), dcp=1):
    """One worker process: its connector, with caches registered (filled
    with this rank's own values from `seed`)."""
    ranks.tp, ranks.pp, ranks.pcp = tp[0], pp[0], pcp[0]
    name = f"w-pp{pp[0]}-dp{dp[0]}-pcp{pcp[0]}-tp{tp[0]}" + "".join(dp[2:])
    _opened.add(name)
    w = FerryConnector(config(dict(extra, **{"ferry.store": name,
                                             "ferry.chunk_tokens": CHUNK}),
                              tp=tp[1], pp=pp[1], dp=dp, model=model, pcp=pcp[1], dcp=dcp),
                       Role.WORKER, None)
    caches = (net or TinyLlama()).new_caches(BLOCKS, BS)
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
    return w, caches


def save(w, blocks):
    w.bind_connector_metadata(FerryConnectorMetadata(
        saves=[SaveSpec("r", TOKENS, list(blocks))]))
    w.wait_for_save()
    w.clear_connector_metadata()


def load(w, blocks):
    w.bind_connector_metadata(FerryConnectorMetadata(
        loads=[LoadSpec("r", TOKENS, list(blocks), 0, len(TOKENS))]))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    return w.get_block_ids_with_load_errors()


def blocks_of(caches, ids):
    return [c[:, ids].clone() for c in caches]


SRC, DST = list(range(0, 8)), list(range(8, 16))
TOPOLOGY = [dict(tp=(t, 2), pp=(p, 2), dp=(d, 2)) for d in range(2) for p in range(2)
            for t in range(2)]


def test_every_worker_of_tp_pp_dp_opens_its_own_l2(monkeypatch, tmp_path):
    """TP 2 x PP 2 x DP 2: eight worker processes, one extra config with one
    "ferry.l2" directory. An L2 directory has one owner: each worker opens
    its own under it (before, the second worker's open failed with EBUSY
    and vLLM's start with it)."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M"}
    workers = [worker(ranks, extra, **r, seed=i) for i, r in enumerate(TOPOLOGY)]
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert len(dirs) == len(TOPOLOGY)
    assert "vllm-pp1of2-dp0-tp1of2" in dirs
    for w, _ in workers:
        w.shutdown()


def test_dense_dp_replicas_open_their_own_l2(monkeypatch, tmp_path):
    """DP 2 of a dense (non-MoE) model: vLLM runs each replica as an
    independent DP=1 engine. EngineCoreProc.run_engine_core sets
    parallel_config.data_parallel_index = dp_rank, then for a non-MoE model
    calls reconfigure_for_independent_dp_rank(), which sets
    data_parallel_size 1 and data_parallel_rank 0 and leaves
    data_parallel_index (vllm-project/vllm
    00080ee13c7a451fce071ccb8d0e94d395acf5a7, vllm/v1/engine/core.py;
    vllm-project/vllm 00193b82b0e2d4faea5d3b4ea4f6c4c2bd9d057a,
    vllm/config/parallel.py). Both replicas' workers on one host must still
    open directories of their own: before, both named theirs dp0of1 and
    the second's open failed with FERRY_EBUSY, and vLLM's start with it."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M"}
    ws = [worker(ranks, extra, dp=(d, 2, "dense"), seed=d) for d in range(2)]
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert dirs == ["vllm-pp0of1-dp0-tp0of1", "vllm-pp0of1-dp1-tp0of1"]
    for w, _ in ws:
        w.shutdown()


def test_a_restart_finds_its_own_ranks_data_and_no_other(monkeypatch, tmp_path):
    """A persistent L2 is found again by the same rank of the same topology:
    each rank loads the bytes it stored, not another rank's. A restart at
    another TP size is a miss; another model on the same directories is
    refused (the persistent L2 records the model), never another's bytes."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M", "ferry.persistent": True}
    ws = [worker(ranks, extra, tp=(t, 2), seed=t) for t in range(2)]
    want = []
    for w, caches in ws:
        save(w, SRC)
        want.append(blocks_of(caches, SRC))
        w.store.sync()
    assert not torch.equal(want[0][0], want[1][0])
    for w, _ in ws:
        w.shutdown()
    for t in (1, 0):   # restarted in another order: rank 1 first
        w, caches = worker(ranks, extra, tp=(t, 2), seed=10 + t)
        assert load(w, DST) == set()
        for got, exp in zip(blocks_of(caches, DST), want[t]):
            assert torch.equal(got, exp)
        w.shutdown()
    w, caches = worker(ranks, extra, tp=(0, 1), seed=20)   # TP 1 now: a miss
    assert w.store.lookup(TOKENS) == 0
    w.shutdown()
    with pytest.raises(FerryError, match="model|mismatch|MISMATCH"):
        worker(ranks, extra, tp=(0, 2), model="other-model")
    assert registered_store("w-pp0-dp0-pcp0-tp0") is None


def test_a_model_ferry_cannot_cache_is_not_refused_as_apart(monkeypatch, caplog):
    """A model whose every KV cache group holds state ferry does not cache
    (an all-Mamba model: MambaSpec) turns the connector off, with a
    warning; its worker opens no store. In one process (vLLM's
    single-process executor) the scheduler must not take that for a
    scheduler apart from its workers and refuse vLLM's start naming the
    multiprocessing executor; its lookups are misses (before a72becd the
    first lookup raised, reaching for a store no worker opened)."""
    class MambaSpec:
        pass
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=MambaSpec(), layer_names=["model.layers.0.mixer"])])
    extra = {"ferry.l1": "2M", "ferry.store": "mamba-proc", "ferry.chunk_tokens": CHUNK}
    _opened.add("mamba-proc")
    w = FerryConnector(config(extra), Role.WORKER, kcc)
    w.register_kv_caches({"model.layers.0.mixer": [torch.zeros(BLOCKS, 3, 8),
                                                   torch.zeros(BLOCKS, 4, 8, 8)]})
    with caplog.at_level("WARNING", logger="ferry.vllm"):
        sched = FerryConnector(config(extra), Role.SCHEDULER, kcc)
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        blocks = list(range(9))
        sched.update_state_after_alloc(REQ, SimpleNamespace(block_ids=(blocks,)), 0)
        new = SimpleNamespace(req_id="q", prompt_token_ids=REQ.prompt_token_ids,
                              block_ids=(blocks,), num_computed_tokens=0)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                                 all_token_ids={}, new_block_ids=[], num_computed_tokens=[],
                                 num_output_tokens=[])
        meta = sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
            num_scheduled_tokens={"q": len(TOKENS) + 1}, finished_req_ids=set()))
        assert not meta.loads and not meta.saves
        assert sched.request_finished(REQ, blocks) == (False, None)
    assert "MambaSpec" in caplog.text and "neither loads nor stores" in caplog.text
    sched.shutdown()
    w.shutdown()


def test_an_l2_the_previous_ferry_left_in_dir_is_named_once(monkeypatch, tmp_path, caplog):
    """Before 558d5e4 a worker opened "ferry.l2"'s DIR itself (one worker:
    TP, PP and DP of one). Each worker now opens a directory under DIR, so
    the slab left in DIR is no longer read (a persistent one's chunks are
    misses) and still holds its SIZE of the drive. That is said once, as
    a warning naming the slab and the directory now used, never in
    silence; what it advises (move the slab into the TP 1 worker's
    directory) finds the chunks again; a DIR holding no slab of its own
    says nothing."""
    import os
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M", "ferry.persistent": True}
    one = tmp_path / "vllm-pp0of1-dp0-tp0of1"
    w, _ = worker(ranks, extra)          # the slab a one-worker vLLM left in DIR
    save(w, SRC)
    w.store.sync()
    w.shutdown()
    for f in ("ferry_pslab.bin", "ferry_pslab.idx"):
        os.rename(one / f, tmp_path / f)
    with caplog.at_level("WARNING", logger="ferry.vllm"):
        for t in range(2):
            w, _ = worker(ranks, extra, tp=(t, 2))
            w.shutdown()
        w, _ = worker(ranks, extra)      # again in this process: said once
        assert w.store.lookup(TOKENS) == 0
        w.shutdown()
    said = [r.getMessage() for r in caplog.records if "ferry_pslab.bin" in r.getMessage()]
    assert len(said) == 1, said
    assert str(tmp_path / "ferry_pslab.bin") in said[0]
    assert "vllm-pp0of1-dp0-tp0of2" in said[0] and str(one) in said[0]
    for f in ("ferry_pslab.bin", "ferry_pslab.idx"):   # as the warning says
        os.replace(tmp_path / f, one / f)
    w, _ = worker(ranks, extra)
    assert w.store.lookup(TOKENS) == len(TOKENS)
    w.shutdown()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferry.vllm"):
        w, _ = worker(ranks, {"ferry.l1": "2M", "ferry.l2": f"{tmp_path / 'fresh'}:16M"})
        w.shutdown()
    assert not [r for r in caplog.records if "slab" in r.getMessage()]


def daemon_scheduler(url, net, **topology):
    """The scheduler's connector in the engine core process: "ferry.server",
    its layout from vLLM's model_config."""
    cfg = config({"ferry.server": url, "ferry.store": "scheduler-process",
                  "ferry.chunk_tokens": CHUNK}, **topology)
    cfg.model_config = SimpleNamespace(
        model="tiny-llama", dtype=torch.bfloat16, use_mla=False,
        get_num_layers=lambda pc: net.layers, get_num_kv_heads=lambda pc: net.kv_heads,
        get_head_size=lambda: net.head_dim)
    return FerryConnector(cfg, Role.SCHEDULER, None)


def daemon_net():
    return TinyLlama(dim=256, layers=2, heads=4, kv_heads=2, ffn=256,
                     dtype=torch.bfloat16)              # the daemon's tiny preset


REQ = SimpleNamespace(request_id="q", prompt_token_ids=TOKENS + [7],
                      all_token_ids=TOKENS + [7], cache_salt=None)


def test_a_hit_is_what_every_tp_rank_holds(monkeypatch, tmp_path):
    """TP 2 with "ferry.server": each TP rank stores its own heads under its
    own keys. A hit the scheduler reports is loaded by every rank, so it
    counts a chunk once every rank holds it: before, it asked for rank 0's
    keys only, reported a hit rank 1 could not load, and under vLLM's
    default kv_load_failure_policy "fail" (vllm-project/vllm
    00f4240ee6458263d76cf51ca7901ce1350bb4d1, vllm/config/kv_transfer.py)
    the request failed."""
    from test_server import Daemon
    net, ranks = daemon_net(), Ranks(monkeypatch)
    d = Daemon(str(tmp_path)).start()
    try:
        ws = [worker(ranks, {"ferry.server": d.url}, tp=(t, 2), seed=t, net=net)
              for t in range(2)]
        sched = daemon_scheduler(d.url, net, tp=2)
        save(ws[0][0], SRC)                 # rank 0 only: no hit yet
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        save(ws[1][0], SRC)
        assert sched.get_num_new_matched_tokens(REQ, 0) == (len(TOKENS), False)
        for w, _ in ws:
            assert load(w, DST) == set()
        sched.shutdown()
        for w, _ in ws:
            w.shutdown()
    finally:
        d.stop()


def test_a_rank_client_that_fails_to_open_leaves_no_rank_behind(monkeypatch, tmp_path):
    """The scheduler opens its lookup clients of the other TP ranks at the
    first lookup. One that fails (the daemon at its max_clients answers
    FERRY_EBUSY) fails that lookup, and the clients opened before it are
    closed (each holds a connection and a thread of the daemon). The next
    lookup opens them all again: it never counts rank 0's chunks alone,
    which rank 1 and 2 could not load (before, the failed open left the
    scheduler with rank 0's client only, and a later lookup reported
    rank 0's chunks as a hit)."""
    from test_server import Daemon
    net, ranks = daemon_net(), Ranks(monkeypatch)
    d = Daemon(str(tmp_path)).start()
    try:
        w, _ = worker(ranks, {"ferry.server": d.url}, tp=(0, 3), net=net)
        save(w, SRC)                        # rank 0 only: no hit
        sched = daemon_scheduler(d.url, net, tp=3)
        real, opened, fail = sched._open_lookup_client, [], [2]

        def open_client(rank=0):
            if rank in fail:
                fail.remove(rank)
                raise FerryError(-4116, "the daemon serves as many clients as it may",
                                 "ferry_kv_open")
            s = real(rank)
            opened.append((rank, s))
            return s
        monkeypatch.setattr(sched, "_open_lookup_client", open_client)
        with pytest.raises(FerryError, match="as many clients"):
            sched.get_num_new_matched_tokens(REQ, 0)
        assert [r for r, s in opened if r and s._h] == [], "a rank's client left open"
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        sched.shutdown()
        assert all(s._h is None for _, s in opened)
        w.shutdown()
    finally:
        d.stop()


def test_pipeline_stages_sharing_a_daemon_keep_their_own_kv(monkeypatch, tmp_path):
    """PP 2 with "ferry.server": both stages' workers are TP rank 0 of 1 of
    the same model, and with an even split their layouts are the same, so
    one daemon takes both. Each stage's chunks hold its own layers' KV:
    stage 1 must load what stage 1 stored, never stage 0's bytes (before,
    both stages stored under one key and stage 1 was handed stage 0's
    layers). The scheduler's lookup counts a chunk only once every stage
    holds it."""
    from test_server import Daemon
    net, ranks = daemon_net(), Ranks(monkeypatch)
    d = Daemon(str(tmp_path)).start()
    try:
        extra = {"ferry.server": d.url}
        ws = [worker(ranks, extra, pp=(s, 2), seed=s, net=net) for s in range(2)]
        sched = daemon_scheduler(d.url, net, pp=2)
        save(ws[0][0], SRC)                 # stage 0 only: no hit yet
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        save(ws[1][0], SRC)
        assert sched.get_num_new_matched_tokens(REQ, 0) == (len(TOKENS), False)
        for w, caches in ws:
            want = blocks_of(caches, SRC)
            assert load(w, DST) == set()
            for got, exp in zip(blocks_of(caches, DST), want):
                assert torch.equal(got, exp)
        sched.shutdown()
        for w, _ in ws:
            w.shutdown()
    finally:
        d.stop()


def test_a_lookup_stops_at_the_first_key_no_worker_holds(monkeypatch, tmp_path):
    """TP 2 x PP 2 with "ferry.server": a hit needs every rank's chunks of
    every stage, four keys, each a round trip to the daemon from the
    scheduler (get_num_new_matched_tokens is on vLLM's scheduling path:
    vllm-project/vllm b4622cf924bc72504aed99e486062d6633fde39e,
    vllm/v1/core/sched/scheduler.py, Scheduler.schedule). Before, all four
    were asked for every token whatever the first answered; now a key that
    holds nothing ends the lookup (the least is 0), and each key is asked
    only for the chunks the least so far covers. The answers are those of
    asking all four."""
    from test_server import Daemon
    from ferry.kv import KVStore
    net, ranks = daemon_net(), Ranks(monkeypatch)
    d = Daemon(str(tmp_path)).start()
    try:
        extra = {"ferry.server": d.url}
        ws = {(t, s): worker(ranks, extra, tp=(t, 2), pp=(s, 2), seed=2 * s + t, net=net)[0]
              for s in range(2) for t in range(2)}
        sched = daemon_scheduler(d.url, net, tp=2, pp=2)
        asked, real = [], KVStore.lookup

        def lookup(store, tokens, **kw):
            got = real(store, tokens, **kw)
            if store in sched._ranks:
                asked.append((len(tokens), got))
            return got
        monkeypatch.setattr(KVStore, "lookup", lookup)
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        sched._rank_stores()
        assert asked == [(len(REQ.all_token_ids), 0)]   # one round trip, not four
        asked.clear()
        save(ws[0, 0], SRC)
        save(ws[0, 1], SRC)                 # rank 0's stages, rank 1's not
        assert sched.get_num_new_matched_tokens(REQ, 0) == (0, False)
        assert asked == [(len(REQ.all_token_ids), len(TOKENS)), (len(TOKENS), len(TOKENS)),
                         (len(TOKENS), 0)]
        asked.clear()
        save(ws[1, 0], SRC)
        save(ws[1, 1], SRC)
        assert sched.get_num_new_matched_tokens(REQ, 0) == (len(TOKENS), False)
        assert [got for _, got in asked] == [len(TOKENS)] * 4
        sched.shutdown()
        for w in ws.values():
            w.shutdown()
    finally:
        d.stop()


def test_a_scheduler_apart_from_its_workers_refuses_an_in_process_store(monkeypatch, tmp_path):
    """With "ferry.l1" the store lives in the worker's process. The engine
    core lets its workers register their caches before it builds the
    scheduler (EngineCore.__init__ at 00080ee1), so a scheduler that finds
    no store registered in its process runs apart from its workers (the
    multiprocessing executor: TP above one, or DP replicas' engines): it
    cannot see what they store. It is refused when vLLM builds it, naming
    "ferry.server", not at the first request (before, vLLM started and the
    first request's lookup raised inside the scheduler's step)."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M", "ferry.store": "sched-proc",
             "ferry.chunk_tokens": CHUNK}
    with pytest.raises(ValueError, match='"ferry.server"'):
        FerryConnector(config(extra, tp=2), Role.SCHEDULER, None)
    # one process (vLLM's single-process executor): the worker's store is found
    w, _ = worker(ranks, {"ferry.l1": "2M"}, tp=(0, 1))
    sched = FerryConnector(config(dict(extra, **{"ferry.store": "w-pp0-dp0-pcp0-tp0"})),
                           Role.SCHEDULER, None)
    assert sched.store is w.store
    w.shutdown()


# ---- external_launcher (torchrun: verl, OpenRLHF) ----
# ExecutorWithExternalLauncher (vllm-project/vllm
# 01e4fce07423dafcc832600ba05159fb28dc1126, vllm/v1/executor/uniproc_executor.py)
# is a UniProcExecutor per rank: torchrun starts every rank's process, each
# builds a whole engine (EngineCore.__init__: its one worker, whose connector
# registers its caches, then its own Scheduler with its own connector), and
# the ranks stay in step only because each schedules alike.
# parallel_config.distributed_executor_backend is "external_launcher"
# (vllm-project/vllm 00193b82b0e2d4faea5d3b4ea4f6c4c2bd9d057a, vllm/config/parallel.py).

def external(cfg):
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    return cfg


def test_external_launcher_refuses_a_store_of_its_rank_alone(monkeypatch, tmp_path):
    """TP 2 under external_launcher with "ferry.l1": each rank's worker opens
    its own store in its own process and registers it, so each rank's
    scheduler finds a store (a72becd does not refuse it) and counts what
    its rank alone holds. A chunk rank 0 stored and rank 1 did not (rank
    1's store was full, or evicted it) was a hit of 32 tokens for rank 0's
    scheduler and a miss for rank 1's: the ranks schedule apart and their
    TP collectives hang. Refused when vLLM builds the worker's connector
    (the first built), naming the setting and "ferry.server"; a rank's
    scheduler given a store registered in its process is refused too. At
    TP, PP and PCP of one (torchrun for DP alone) each engine is whole and
    its in-process store is right."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M", "ferry.chunk_tokens": CHUNK}
    for t in range(2):
        ranks.tp = t
        with pytest.raises(ValueError, match='external_launcher.*"ferry.server"'):
            FerryConnector(external(config(dict(extra, **{"ferry.store": f"x{t}"}), tp=2)),
                           Role.WORKER, None)
        assert registered_store(f"x{t}") is None
    w, _ = worker(ranks, {"ferry.l1": "2M"})    # a store the user registered in the rank
    with pytest.raises(ValueError, match="external_launcher"):
        FerryConnector(external(config(dict(extra, **{"ferry.store": "w-pp0-dp0-pcp0-tp0"}),
                                       pp=2)), Role.SCHEDULER, None)
    # given "ferry.server" too, the rank's worker refuses that store
    on = {"ferry.server": "unix:/nowhere", "ferry.store": "w-pp0-dp0-pcp0-tp0",
          "ferry.chunk_tokens": CHUNK}
    other = FerryConnector(external(config(on, tp=2)), Role.WORKER, None)
    with pytest.raises(ValueError, match="rank's chunks alone"):
        other.register_kv_caches({f"model.layers.{i}.self_attn.attn": c
                                  for i, c in enumerate(TinyLlama().new_caches(BLOCKS, BS))})
    w.shutdown()
    ranks.tp = 0
    _opened.add("solo")
    solo = dict(extra, **{"ferry.store": "solo"})
    w = FerryConnector(external(config(solo, dp=(1, 2))), Role.WORKER, None)
    caches = TinyLlama().new_caches(BLOCKS, BS)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
    sched = FerryConnector(external(config(solo, dp=(1, 2))), Role.SCHEDULER, None)
    assert sched.store is w.store
    save(w, SRC)
    assert sched.get_num_new_matched_tokens(REQ, 0) == (len(TOKENS), False)
    sched.shutdown()
    w.shutdown()


# one rank's process under torchrun: vllm.distributed's rank helpers, the
# gloo world of two, and its engine's config (argv: rank, tmp dir, daemon)
_RANK_HEAD = r'''
import json, os, sys, time
from types import ModuleType, SimpleNamespace
import torch, torch.distributed as dist
rank, tmp, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
vllm, vd = ModuleType("vllm"), ModuleType("vllm.distributed")
vd.get_tensor_model_parallel_rank = lambda: rank
vd.get_pp_group = lambda: SimpleNamespace(rank_in_group=0)
vllm.distributed = vd
sys.modules["vllm"], sys.modules["vllm.distributed"] = vllm, vd
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
import test_vllm_ranks as T
from ferry.adapters.vllm import FerryConnector

def cfg():
    c = T.external(T.config({"ferry.server": url, "ferry.chunk_tokens": T.CHUNK,
                             "ferry.store": "rank"}, tp=2))
    net = T.daemon_net()
    c.model_config = SimpleNamespace(
        model="tiny-llama", dtype=torch.bfloat16, use_mla=False,
        get_num_layers=lambda pc: net.layers, get_num_kv_heads=lambda pc: net.kv_heads,
        get_head_size=lambda: net.head_dim)
    return c
'''

_RANK = _RANK_HEAD + r'''
# EngineCore.__init__ in this rank's process: the worker registers its caches,
# then the scheduler is built
w = FerryConnector(cfg(), T.Role.WORKER, None)
caches = T.daemon_net().new_caches(T.BLOCKS, T.BS)
g = torch.Generator().manual_seed(rank)
for c in caches:
    c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
w.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
sched = FerryConnector(cfg(), T.Role.SCHEDULER, None)
hits = []
REQ = lambda rid: SimpleNamespace(request_id=rid, prompt_token_ids=T.TOKENS + [7],
                                  all_token_ids=T.TOKENS + [7], cache_salt=None)
# 1: rank 0's worker stored the chunks, rank 1's not (yet)
if rank == 0:
    T.save(w, T.SRC)
dist.barrier()
hits.append(sched.get_num_new_matched_tokens(REQ("a"), 0)[0])
# 2: rank 1's store lands while rank 0's scheduler is already asking
mark = os.path.join(tmp, "asked")
if rank == 0:
    real = getattr(sched, "_agree", None)   # (where the ranks agree on a hit)
    def agree(hit, error):
        open(mark, "w").close()
        return real(hit, error)
    if real is not None:
        sched._agree = agree
else:
    for _ in range(500):    # (a scheduler that asks no other rank never marks)
        if os.path.exists(mark):
            break
        time.sleep(0.01)
    T.save(w, T.SRC)
hits.append(sched.get_num_new_matched_tokens(REQ("b"), 0)[0])
dist.barrier()
hits.append(sched.get_num_new_matched_tokens(REQ("c"), 0)[0])
sched.shutdown()
w.shutdown()
json.dump(hits, open(os.path.join(tmp, f"hits{rank}"), "w"))
dist.destroy_process_group()
'''


def test_external_launcher_ranks_agree_on_every_hit(tmp_path):
    """TP 2 under external_launcher with "ferry.server": two rank processes,
    each an engine (its worker's daemon client registered in its process,
    then its scheduler), as torchrun starts them. Every rank's scheduler
    must answer every lookup alike. Before, each scheduler took its
    worker's registered client and asked for its own rank's keys only:
    with rank 0's chunks stored and rank 1's not, rank 0 answered a hit of
    32 tokens and rank 1 a miss. Asking for every rank's keys is not
    enough either: the ranks' schedulers ask at moments of their own, and a
    store that lands between (rank 1's here, while rank 0's scheduler is
    asking) made rank 1's answer a hit and rank 0's a miss. The ranks now
    agree on the least of their answers, over a group of the engine's
    ranks."""
    import json
    import os
    import subprocess
    from test_server import Daemon
    d = Daemon(str(tmp_path)).start()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path), d.url],
                                  env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=60)[1])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("a rank hung: the ranks took different steps")
        assert all(p.returncode == 0 for p in procs), errs
        hits = [json.load(open(tmp_path / f"hits{r}")) for r in range(2)]
    finally:
        d.stop()
    assert hits[0] == hits[1] == [0, 0, len(TOKENS)], hits


# argv[4]: how rank 1's load fails ("short": its second chunk fails its
# checksum; "raise": its retrieve raises), argv[5]: the worker's form
# ("whole" or "layerwise")
_LOAD_RANK = _RANK_HEAD + r'''
from test_vllm_contract import KVCacheBlocks
from ferry import FerryError
failure, form = sys.argv[4], sys.argv[5]


def cfg_form():
    c = cfg()
    c.kv_transfer_config.kv_connector_extra_config["ferry.layerwise"] = form == "layerwise"
    return c


w = FerryConnector(cfg_form(), T.Role.WORKER, None)
caches = T.daemon_net().new_caches(T.BLOCKS, T.BS)
g = torch.Generator().manual_seed(rank)
for c in caches:
    c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
names = [f"model.layers.{i}.self_attn.attn" for i in range(len(caches))]
w.register_kv_caches(dict(zip(names, caches)))
sched = FerryConnector(cfg_form(), T.Role.SCHEDULER, None)
w.store.store(T.TOKENS, caches, list(T.SRC))    # every rank stores its chunks
dist.barrier()
if rank == 1 and failure == "short":
    real = w.store.retrieve
    w.store.retrieve = lambda *a, **k: min(real(*a, **k), T.CHUNK)
elif rank == 1:                     # an L2 read that failed, a lost daemon connection
    def fail(*a, **k):
        raise FerryError(-5, "an L2 read failed", "ferry_kv_retrieve")
    w.store.retrieve = w.store.retrieve_layers = fail
req = SimpleNamespace(request_id="q", prompt_token_ids=T.TOKENS + [7],
                      all_token_ids=T.TOKENS + [7], cache_salt=None)
out = {}
# Scheduler.schedule: the lookup (agreed), allocate_slots, update_state_after_alloc,
# build_connector_meta; then the worker's step and what it reports
n, _ = sched.get_num_new_matched_tokens(req, 0)
ids = list(range(7, 16))
sched.update_state_after_alloc(req, KVCacheBlocks(ids), n)
so = SimpleNamespace(
    scheduled_new_reqs=[SimpleNamespace(req_id="q", prompt_token_ids=req.prompt_token_ids,
                                        block_ids=(ids,), num_computed_tokens=n)],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                          num_computed_tokens=[]),
    num_scheduled_tokens={"q": len(req.all_token_ids) - n}, finished_req_ids=set())
meta = sched.build_connector_meta(so)
w.bind_connector_metadata(meta)
w.start_load_kv(None)
for name in names:                  # the forward: each layer's attention waits for it
    w.wait_for_layer_load(name)
w.wait_for_save()
out["hit"], out["errors"] = n, sorted(w.get_block_ids_with_load_errors())
w.clear_connector_metadata()
sched.request_finished(req, ids)
sched.shutdown()
w.shutdown()
json.dump(out, open(os.path.join(tmp, f"out{rank}"), "w"))
dist.destroy_process_group()
'''

def test_external_launcher_ranks_report_a_short_load_alike(tmp_path):
    """TP 2 under external_launcher with "ferry.server": both ranks' schedulers
    agree on a hit of 32 tokens, and rank 1's load of it comes up short (its
    second chunk fails its checksum: 16 tokens). Each rank's worker reports
    get_block_ids_with_load_errors to its own rank's engine core
    (ExecutorWithExternalLauncher, vllm-project/vllm
    01e4fce07423dafcc832600ba05159fb28dc1126,
    vllm/v1/executor/uniproc_executor.py), whose
    Scheduler.update_from_output hands them to _handle_invalid_blocks: with
    kv_load_failure_policy "recompute" the request's computed tokens are cut
    back to the first bad block, with "fail" the request is failed
    (b4622cf924bc72504aed99e486062d6633fde39e,
    vllm/v1/core/sched/scheduler.py). Before, rank 1 reported blocks 11-14
    and rank 0 none: rank 1 recomputed (or failed) what rank 0 went on
    from, and the ranks' schedules parted. The ranks now agree each load's
    result (the least tokens it got on any rank) and report the same
    blocks."""
    out = _two_ranks(tmp_path, "short", "whole")
    assert out[0] == out[1] == {"hit": len(TOKENS), "errors": [11, 12, 13, 14]}, out


@pytest.mark.parametrize("form", ["whole", "layerwise"])
def test_external_launcher_ranks_agree_a_load_that_raised_on_one(tmp_path, form):
    """As above, with rank 1's retrieve raising (an L2 read that failed, a
    lost daemon connection) instead of coming up short, in both worker
    forms: the layerwise one starts the load in start_load_kv
    (retrieve_layers), finishes it at the last layer's
    wait_for_layer_load, and agrees it in wait_for_save. Each rank's
    engine calls start_load_kv, the forward (one wait_for_layer_load per
    layer), wait_for_save, get_block_ids_with_load_errors, in that order,
    every step (vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1,
    vllm/v1/worker/kv_connector_model_runner_mixin.py,
    _get_kv_connector_output). The failed rank still takes part in the
    agreement (no rank waits on the MIN all-reduce alone), and both report
    every block of the load, the ones rank 0 did load included, so both
    schedulers recompute (or fail) the request alike."""
    out = _two_ranks(tmp_path, "raise", form)
    every = list(range(7, 7 + len(TOKENS) // BS))
    assert out[0] == out[1] == {"hit": len(TOKENS), "errors": every}, out


def _two_ranks(tmp_path, failure, form):
    """_LOAD_RANK in two gloo processes on one daemon; what each reported."""
    import json
    import os
    import subprocess
    from test_server import Daemon
    d = Daemon(str(tmp_path)).start()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _LOAD_RANK, str(r), str(tmp_path),
                                   d.url, failure, form],
                                  env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=60)[1])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("a rank hung: the ranks took different steps")
        assert all(p.returncode == 0 for p in procs), errs
        return [json.load(open(tmp_path / f"out{r}")) for r in range(2)]
    finally:
        d.stop()


def test_a_load_that_fails_is_reported_as_one_that_came_short(monkeypatch):
    """A retrieve that raises (an L2 read that failed, a device copy
    error) raised out of start_load_kv into vLLM's step, and under
    external_launcher that rank alone left the step the others agree
    their loads in. Its blocks are reported now, as for a load that came
    up short: vLLM recomputes them or fails the request, by its policy."""
    ranks = Ranks(monkeypatch)
    w, _ = worker(ranks, {"ferry.l1": "2M"})
    save(w, SRC)

    def fail(*a, **k):
        raise FerryError(-5, "an L2 read failed", "ferry_kv_retrieve")
    monkeypatch.setattr(w.store, "retrieve", fail)
    assert load(w, DST) == set(DST)
    w.shutdown()


# ---- context parallelism ----
# vLLM lays its ranks out ExternalDP x DP x PP x PCP x TP: the PCP group holds
# the ranks of one TP rank (vllm-project/vllm 0c175ae9295b575078961a68c4d3a2a838dce5ef,
# vllm/distributed/parallel_state.py, initialize_model_parallel). PCP adds
# processes but no KV shard: "Only DCP shards the KV cache. With PCP ... each
# rank inserts the FULL sequence into its cache" (vllm-project/vllm
# 01edfd091847f63b5db913c293f4834c823dac40, vllm/v1/worker/block_table.py).
# DCP reuses the TP ranks (vllm/config/parallel.py at 00193b82) and shards
# each request's KV across them by position.

def test_prefill_context_parallel_ranks_open_their_own_l2(monkeypatch, tmp_path):
    """TP 2 x PCP 2: four worker processes, two of each TP rank (same
    pipeline stage, replica and TP rank), one extra config. Before, the two
    PCP ranks of a TP rank named the same directory and the second's open
    failed with FERRY_EBUSY (and vLLM's start with it). Each opens its
    own now; a PCP of one keeps the names it had."""
    ranks = Ranks(monkeypatch)
    extra = {"ferry.l1": "2M", "ferry.l2": f"{tmp_path}:16M"}
    ws = [worker(ranks, extra, tp=(t, 2), pcp=(c, 2), seed=2 * c + t)
          for c in range(2) for t in range(2)]
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert dirs == [f"vllm-pp0of1-dp0-pcp{c}of2-tp{t}of2" for c in range(2) for t in range(2)]
    for w, _ in ws:
        w.shutdown()
    w, _ = worker(ranks, {"ferry.l1": "2M", "ferry.l2": f"{tmp_path / 'one'}:16M"})
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["vllm-pp0of1-dp0-tp0of1"]
    w.shutdown()


def dcp_slots(ids, positions, rank, world):
    """(block, offset) of each of `positions` a DCP rank holds, as vLLM's
    _compute_slot_mapping_kernel lays them out (block_table.py at 01edfd09,
    cp_kv_cache_interleave_size 1): a virtual block of BS x world tokens,
    position p on rank p % world."""
    vb = BS * world
    return {p: (ids[p // vb], (p % vb) // world) for p in positions if p % vb % world == rank}


def test_decode_context_parallel_is_refused_not_given_wrong_bytes(monkeypatch):
    """TP 2 with decode_context_parallel_size 2: rank 0 holds the even
    positions of each request, BS of them in each of its blocks (a virtual
    block of 2 x BS tokens). Request A stores its 32 prompt tokens; request
    B shares that prompt, and vLLM's own prefix cache already holds its
    first virtual block (A's block 0: num_computed_tokens 8), so ferry
    loads tokens 8 to 32 into B's blocks. Every position rank 0 holds must
    then be A's KV. ferry read each block as BS consecutive tokens of the
    request, so it asked for twice the blocks vLLM holds: A's save failed
    with ENOBUFS, and vLLM's step with it; given the blocks (8 and 8, as a
    longer request holds) it stored and loaded the wrong positions, and
    B's positions 8 to 14 on rank 0 were never written (attention read
    whatever the blocks held). Until ferry lays chunks out as DCP does, a
    connector built for DCP above one is refused, naming the setting."""
    ranks = Ranks(monkeypatch)
    try:
        w, caches = worker(ranks, {"ferry.l1": "2M"}, tp=(0, 2), dcp=2)
    except ValueError as e:
        assert "decode_context_parallel_size" in str(e)
        with pytest.raises(ValueError, match="decode_context_parallel_size"):
            FerryConnector(config({"ferry.server": "unix:/nowhere"}, tp=2, dcp=2),
                           Role.SCHEDULER, None)
        return
    a_ids, b_ids = [0, 1, 2, 3, 4], [0, 8, 9, 10, 11]   # cdiv(33, 2 x BS) blocks each
    for c in caches:
        c.zero_()
        for p, (blk, off) in dcp_slots(a_ids, range(len(TOKENS)), 0, 2).items():
            c[:, blk, off] = p + 1
    w.bind_connector_metadata(FerryConnectorMetadata(saves=[SaveSpec("a", TOKENS, a_ids)]))
    w.wait_for_save()
    w.clear_connector_metadata()
    w.bind_connector_metadata(FerryConnectorMetadata(
        loads=[LoadSpec("b", TOKENS, b_ids, 2 * BS, len(TOKENS))]))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    w.get_block_ids_with_load_errors()
    for c in caches:
        for p, (blk, off) in dcp_slots(b_ids, range(len(TOKENS)), 0, 2).items():
            assert float(c[0, blk, off].flatten()[0]) == p + 1, f"position {p}"
    w.shutdown()
