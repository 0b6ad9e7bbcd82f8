"""An engine team's first hour with the package, done adversarially: what
an integrator following README's Python section and the docstrings tries
first, and how it goes wrong. Each case that could crash the interpreter
runs in a child process (a crash is its exit status, not the runner's).

- one store, 8 threads storing, looking up and retrieving (blocking and
  async, every retrieved byte compared) while two threads close it: the
  others get FerryError (EBADF), no crash, no wrong byte (with and without
  a device: a second close() released the device under the first);
- ExpertPool/Planner from threads: ensure() at once from 8 threads (the C
  objects are one-thread-at-a-time) and a close() mid-way; the policy of a
  closed pool (was a NULL dereference);
- integers ctypes would wrap: expert ids and layers past 2^32 (2^32 + 1
  became expert 1), floats truncated, negative layout sizes;
- tensors: empty, size-1 axes with any stride, resized or re-pointed
  while an async op is in flight, read-only destinations, a scalar token.
"""
import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry import FerryError  # noqa: E402

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")

PRELUDE = """
import errno, random, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
"""


def run_child(body, timeout=120):
    code = PRELUDE.format(pkg=PKG) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def store(**kw):
    kw.setdefault("chunk_tokens", 16)
    return ferry.KVStore("first-hour", LAY, l1="16M", **kw)


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)


# -- threads and close --

@pytest.mark.parametrize("device", [None, "host"])
def test_eight_threads_and_two_closers_no_crash_no_wrong_byte(device):
    out = run_child(f"""
        # rounds: the race two closers lost (the device closed under the other's
        # calls) crashed about one round in two
        counts = {{"ok": 0, "bad": 0, "ebadf": 0, "other": []}}
        for rnd in range(5):
            s = ferry.KVStore("first-hour", LAY, l1="16M", chunk_tokens=16, device={device!r})
            N = 64
            data = {{}}
            for k in range(16):
                toks = np.arange(N, dtype=np.int64) + k * 1000
                x = torch.randn(2, 2, N, 128).to(torch.bfloat16)
                data[k] = (toks, x)
                s.store(toks, x)
            started = threading.Event()
            stop = time.time() + 0.6
            def worker(i):
                r = random.Random(i)
                while time.time() < stop:
                    k = r.randrange(16)
                    toks, x = data[k]
                    try:
                        what = r.randrange(4)
                        if what == 0:
                            s.store(toks, x)
                        elif what == 1:
                            s.lookup(toks)
                        else:
                            y = torch.zeros_like(x)
                            n = s.retrieve(toks, y) if what == 2 else s.retrieve_async(toks, y).wait()
                            if n != N or not torch.equal(x, y):
                                counts["bad"] += 1
                            counts["ok"] += 1
                        started.set()
                    except FerryError as e:
                        if e.code == -errno.EBADF:
                            counts["ebadf"] += 1
                        else:
                            counts["other"].append(repr(e))
            def closer():
                started.wait(5)
                time.sleep(0.2)
                s.close()
            with ThreadPoolExecutor(10) as ex:
                fs = [ex.submit(worker, i) for i in range(8)] + [ex.submit(closer) for _ in range(2)]
                for f in fs:
                    f.result()
        print(counts["ok"], counts["bad"], counts["ebadf"], counts["other"])
    """)
    ok, bad, ebadf, other = out.split(maxsplit=3)
    assert int(ok) > 0 and int(bad) == 0, out
    assert int(ebadf) > 0, out            # calls after the close were refused, cleanly
    assert other.strip() == "[]", out


def test_device_empty_after_close_is_ebadf():
    s = store(device="host")
    t = s.device_empty((2, 2, 16, 128), torch.bfloat16)
    assert t.shape == (2, 2, 16, 128)
    s.close()
    s.close()                              # twice: nothing more to release
    with pytest.raises(FerryError) as e:
        s.device_empty((2, 2, 16, 128), torch.bfloat16)
    assert e.value.code == -errno.EBADF


def test_op_outlives_its_store_dropped_by_gc():
    s = store()
    toks = np.arange(64)
    x = kv(64)
    s.store(toks, x)
    y = torch.zeros_like(x)
    op = s.retrieve_async(toks, y)
    del s
    gc.collect()
    assert op.wait() == 64 and torch.equal(x, y)


# -- the expert pool from threads --

def test_pool_concurrent_ensure_and_close_from_threads():
    out = run_child("""
        L, E, S, R = 2, 16, 6, 256
        bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        pool = ferry.ExpertPool(L, E, S, [bank], policy="lru")
        planner = ferry.Planner(L, E, S)
        view = pool.slot_tensor(0)
        bad, other, ebadf = [], [], [0]
        def worker(i):
            r = random.Random(i)
            for _ in range(300):
                layer, experts = r.randrange(L), r.sample(range(E), 2)
                try:
                    planner.ensure(layer, experts)
                    pool.ensure(layer, experts)
                except FerryError as e:
                    if e.code == -errno.EBADF:
                        ebadf[0] += 1
                    else:
                        other.append(repr(e))
        with ThreadPoolExecutor(8) as ex:
            for f in [ex.submit(worker, i) for i in range(8)]:
                f.result()
        pool.check()                                  # planner and slots agree slot by slot
        for layer in range(L):
            for e in range(E):
                slot = pool.ensure(layer, [e])[0]
                if not torch.equal(view[slot], bank[layer * E + e]):
                    bad.append((layer, e))
        # a close from another thread while 8 threads ensure
        def closer():
            time.sleep(0.05)
            pool.close()
            planner.close()
        with ThreadPoolExecutor(9) as ex:
            fs = [ex.submit(worker, i) for i in range(8)] + [ex.submit(closer)]
            for f in fs:
                f.result()
        print(len(bad), len(other), ebadf[0], other[:3])
    """)
    bad, other, ebadf, _ = out.split(maxsplit=3)
    assert bad == "0" and other == "0", out
    assert int(ebadf) > 0, out


def test_pool_policy_after_close_raises_instead_of_crashing():
    out = run_child("""
        bank = torch.zeros(2 * 8, 64, dtype=torch.uint8)
        pool = ferry.ExpertPool(2, 8, 4, [bank])
        assert pool.policy == "auto" or pool.policy in ferry.policies()
        pool.close()
        try:
            pool.policy
        except FerryError as e:
            print(e.code)
    """)
    assert out.strip() == str(-errno.EBADF)


def test_slot_view_read_after_close_holds_the_last_bytes():
    """slot_tensor's view keeps the slots' memory: read after close() (and
    after the pool is dropped) it holds the rows last copied in, where it
    used to read freed memory (a segfault); views derived from it too."""
    L, E, S, R = 2, 8, 4, 4096
    bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    pool = ferry.ExpertPool(L, E, S, [bank], policy="lru")
    slots = pool.ensure(1, [2, 5])
    view = pool.slot_tensor(0)
    row = view[slots[1]]                      # a view of the view
    words = pool.slot_tensor(0, dtype=torch.int32)
    pool.close()
    with pytest.raises(FerryError):
        pool.slot_tensor(0)                   # no new view of a closed pool
    del pool
    gc.collect()
    assert torch.equal(view[slots[0]], bank[E + 2])
    assert torch.equal(row, bank[E + 5])
    assert torch.equal(words[slots[1]], bank[E + 5].view(torch.int32))
    del view, words
    gc.collect()
    assert torch.equal(row, bank[E + 5])      # the last view still holds it
    # a pool with views never taken closes at once, and one whose views are
    # all gone frees them with close
    p2 = ferry.ExpertPool(L, E, S, [bank], policy="lru")
    v2 = p2.slot_tensor(0)
    del v2
    p2.close()
    assert p2._mem is None and p2._slots is None and p2._dev is None


def test_pool_refuses_ids_a_cast_would_wrap_or_truncate():
    bank = torch.arange(2 * 8 * 64, dtype=torch.int64).to(torch.uint8).reshape(16, 64)
    with ferry.ExpertPool(2, 8, 4, [bank]) as pool, ferry.Planner(2, 8, 4) as planner:
        for p in (pool, planner):
            for experts in ([2**32 + 1], [-1], [2**64]):
                with pytest.raises(FerryError) as e:
                    p.ensure(0, experts)
                assert e.value.code == -errno.EINVAL and str(experts[0]) in e.value.message
            with pytest.raises(TypeError):
                p.ensure(0, [1.7])
            with pytest.raises(TypeError):
                p.ensure(0, [True])
            with pytest.raises(ValueError):
                p.ensure(0, [[1, 2]])
            for layer in (2**32, -1):
                with pytest.raises(FerryError) as e:
                    p.ensure(layer, [1])
                assert e.value.code == -errno.EINVAL and str(layer) in e.value.message
        with pytest.raises(FerryError):
            planner.lookup(0, 2**32 + 2)
        with pytest.raises(FerryError):
            planner.forget(-1)
        # what is accepted still works: torch and numpy ids, and the rows are the expert's
        slot = pool.ensure(1, torch.tensor([5]))[0]
        assert torch.equal(pool.slot_tensor(0)[slot], bank[8 + 5])
        assert pool.ensure(1, np.array([5], dtype=np.uint64)) == [slot]


def test_pool_bad_policy_names():
    bank = torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(TypeError, match="policy"):
        ferry.ExpertPool(2, 8, 4, [bank], policy=3)
    with pytest.raises(FerryError) as e:
        ferry.ExpertPool(2, 8, 4, [bank], policy="nope")
    assert e.value.code == -errno.EINVAL and "nope" in e.value.message
    with pytest.raises(FerryError) as e:
        ferry.Planner(2, 8, 0)
    assert e.value.code == -errno.EINVAL and "slots 0" in e.value.message
    with ferry.Planner(2, 8, 4) as p:
        with pytest.raises(FerryError) as e:
            p.ensure(0, list(range(5)))       # top_k above the slots
        assert e.value.name == "FERRY_ENOSPACE"


# -- integers ctypes would wrap --

def test_layout_and_config_refuse_negative_and_wrapping_sizes():
    for args in ((-1, 2, 64), (2**32, 2, 64), (2, -2, 64), (2, 2, 2**33)):
        with pytest.raises(FerryError) as e:
            ferry.Layout(*args)
        assert e.value.code == -errno.EINVAL
        assert str([a for a in args if not 0 <= a < 2**32][0]) in e.value.message
    for kw in ({"chunk_tokens": -1}, {"workers": -1}, {"tp_rank": 2**32}):
        with pytest.raises(FerryError) as e:
            store(**kw)
        assert e.value.code == -errno.EINVAL and str(list(kw.values())[0]) in e.value.message
    with pytest.raises(TypeError, match="ferry.Layout"):
        ferry.KVStore("first-hour", None, l1="16M")


# -- tensors --

def test_tensor_shapes_an_integrator_tries():
    with store() as s:
        toks = np.arange(64)
        x = kv(64)
        assert s.store(toks, x) == 64
        with pytest.raises(ValueError, match="holds no element"):
            s.store(toks, torch.zeros(2, 2, 0, 128, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="contiguous"):
            s.store(toks, kv(128)[:, :, ::2])
        with pytest.raises(ValueError, match="bf16"):
            s.store(toks, x.float())
        ro = np.zeros((2, 2, 64, 128), np.float16)
        with pytest.raises(ValueError):
            s.retrieve(toks, ro)
        # an axis of size 1 may have any stride (torch calls such a tensor contiguous)
        lay1 = ferry.Layout(num_layers=1, num_heads=2, head_dim=64, dtype="bf16")
        with ferry.KVStore("first-hour-1", lay1, l1="16M", chunk_tokens=16) as s1:
            src = torch.randn(1, 2, 32, 128).to(torch.bfloat16).transpose(0, 1)
            assert src.is_contiguous() and src.stride(1) != src.stride(0)
            assert s1.store(np.arange(32), src) == 32
            dst = torch.zeros(1, 2, 32, 128, dtype=torch.bfloat16).transpose(0, 1)
            assert s1.retrieve(np.arange(32), dst) == 32 and torch.equal(src, dst)


def test_token_inputs():
    with store() as s:
        toks = np.arange(64)
        s.store(toks, kv(64))
        assert s.lookup(list(range(64))) == s.lookup(toks) == s.lookup(torch.arange(64)) == 64
        assert s.lookup(np.arange(64, dtype=np.int32)[::1]) == 64
        with pytest.raises(FerryError) as e:
            s.lookup(np.array([1, 2**40], dtype=np.int64))
        assert e.value.code == -errno.EINVAL and str(2**40) in e.value.message
        with pytest.raises(FerryError) as e:
            s.lookup([3, -7])
        assert "-7" in e.value.message
        for empty in ([], np.zeros(0, np.int64)):
            with pytest.raises(ValueError, match="no token ids"):
                s.lookup(empty)
        for scalar in (5, np.int64(5), torch.tensor(5)):
            with pytest.raises(ValueError, match="sequence"):
                s.lookup(scalar)
        assert s.lookup(np.arange(1 << 20, dtype=np.int32)) == 64   # a huge prompt: the prefix


def test_buffer_moved_while_async_op_in_flight():
    with store() as s:
        toks = np.arange(2048)
        x = kv(2048)
        s.store(toks, x)
        # dropped: the op holds the storage, the bytes land and the count is right
        y = torch.zeros_like(x)
        keep = y.view(-1)
        op = s.retrieve_async(toks, y)
        del y
        gc.collect()
        assert op.wait() == 2048 and torch.equal(keep.view(x.shape), x)
        # re-pointed: the memory stays alive, but the tensor no longer holds the bytes
        y = torch.zeros_like(x)
        op = s.retrieve_async(toks, y)
        y.set_(torch.zeros(4, dtype=torch.bfloat16))
        with pytest.raises(FerryError) as e:
            op.wait()
        assert e.value.code == -errno.EFAULT and "moved" in e.value.message
        # untouched: exact
        y = torch.zeros_like(x)
        assert s.retrieve_async(toks, y).wait() == 2048 and torch.equal(x, y)


# -- the vLLM connector called out of order --

@pytest.mark.parametrize("layerwise", ["False", "True"])
def test_vllm_connector_out_of_order_and_mismatched(layerwise):
    from types import SimpleNamespace
    from ferry.adapters import unregister_store
    from test_adapter_vllm import CHUNK, NAME, Engine, Request, layer_names
    from tiny_llama import TinyLlama
    model = TinyLlama(seed=1)
    lay = ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype="f32")
    s = ferry.KVStore("tiny-llama", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK)
    try:
        eng = Engine(model, s, {"ferry.store": NAME, "ferry.layerwise": layerwise})
        w, sc = eng.worker, eng.sched
        fc = SimpleNamespace(attn_metadata={}, no_compile_layers={})
        names = layer_names(model)
        # no metadata bound (a step without the connector's plan): each call does nothing
        assert w.start_load_kv(fc) is None
        assert w.wait_for_layer_load(names[0]) is None
        assert w.save_kv_layer(names[0], eng.caches[0], SimpleNamespace()) is None
        assert w.wait_for_save() is None
        assert w.get_finished(set()) == (None, None)
        # another connector's metadata: a TypeError naming it, not an AttributeError
        w.bind_connector_metadata(object())
        with pytest.raises(TypeError, match="FerryConnectorMetadata"):
            w.start_load_kv(fc)
        w.clear_connector_metadata()
        # a negative computed count was answered with tokens ferry does not hold
        r = Request("r1", list(range(100)))
        with pytest.raises(ValueError, match="num_computed_tokens"):
            sc.get_num_new_matched_tokens(r, -5)
        assert sc.get_num_new_matched_tokens(r, 0) == (0, False)     # nothing stored yet
        assert sc.get_num_new_matched_tokens(r, 500) == (0, False)
        # finishing a request twice, or one never seen, releases nothing twice
        assert sc.request_finished(r, [0]) == (False, None)
        assert sc.request_finished(r, [0]) == (False, None)
        assert sc.request_finished(Request("never", [1, 2]), [1]) == (False, None)
        # caches that do not match the store are refused by name
        with pytest.raises(ValueError, match="Layout"):
            w.register_kv_caches({"only": eng.caches[0]})
        w.shutdown()
        w.shutdown()
    finally:
        unregister_store(NAME)
        s.close()


# -- the SGLang backend given host indices it cannot honour --

def test_sglang_host_indices_that_name_other_tokens_are_refused():
    from ferry.adapters import unregister_store
    from sglang_pools import MHAHost, create_backend, fill
    from test_adapter_sglang import MHA_LAYOUTS
    pool = MHAHost(MHA_LAYOUTS[0], page=4)
    fill(pool.kv_buffer, 1)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "8M"}, {"kv": pool})
    try:
        keys = ["k0", "k1"]
        # page 0 named by [0, 9, 2, 3]: ferry moves pages whole, so it stored 0..3
        with pytest.raises(ValueError, match="not one run"):
            b.batch_set_v1(keys, torch.tensor([0, 9, 2, 3, 4, 5, 6, 7]))
        with pytest.raises(TypeError, match="integers"):
            b.batch_set_v1(keys, torch.arange(8).float())
        with pytest.raises(ValueError, match="page boundary"):
            b.batch_set_v1(keys, torch.arange(1, 9))
        with pytest.raises(FerryError) as e:
            b.batch_set_v1(keys, torch.arange(-8, 0))
        assert e.value.code == -errno.EINVAL
        assert b.batch_exists(keys) == 0          # none of the refused sets stored a page
        assert b.batch_set_v1(keys, torch.arange(8)) == [True, True]
        assert b.batch_exists(keys) == 2
        b.close()
        b.close()
        with pytest.raises(FerryError) as e:
            b.batch_get_v1(keys, torch.arange(8))
        assert e.value.code == -errno.EBADF and "closed" in e.value.message
    finally:
        b.close()
        s = unregister_store("sgl")
        if s is not None:
            s.close()
