"""A device_empty() tensor of a store on the "host" device, used after the
store's close(), from the thread that closed it or from another one: the
close freed its memory (ferry_device_close frees the device's allocations),
so a read answered what the allocator put there and a write, for a tensor
of 16 MiB (unmapped at the free), was a segfault. Now the tensor keeps its
memory as an ExpertPool's slot_tensor view does: the device closes with
the last such tensor, and the tensor holds its last bytes until then.
Each case in a child process (a crash is its exit status)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import gc, sys, threading, weakref
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
def store(**kw):
    return ferry.KVStore("devempty", LAY, l1="16M", chunk_tokens=16, **kw)
N = 16384                                   # 16 MiB of bf16: unmapped when freed
"""


def run_child(body, timeout=60):
    code = PRELUDE.format(pkg=PKG) + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child hung past {timeout} s\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "ok" in p.stdout, p.stdout


def test_a_device_empty_tensor_read_and_written_after_close():
    run_child("""
        s = store(device="host")
        t = s.device_empty((2, 2, N, 128), torch.bfloat16)
        t.fill_(1.5)
        hold = getattr(s, "_devhold", None)     # what the tensor holds (checked below)
        s.close()
        assert bool((t == 1.5).all())           # its last bytes
        t.fill_(2.5)                            # (was a segfault)
        assert bool((t == 2.5).all())
        # another store (no device) takes it as host memory, both ways
        toks = np.arange(64, dtype=np.int32)
        with store() as o:
            assert o.store(toks, t) == 64
            y = torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16)
            assert o.retrieve(toks, y) == 64 and bool((y == 2.5).all())
        hold = weakref.ref(hold)
        v = t[0, 1]                             # a view holds it too
        del t
        gc.collect()
        assert hold() is not None and bool((v == 2.5).all())
        del v
        gc.collect()
        assert hold() is None                   # the device closed with the last tensor
        s.close()
        print("ok")
    """)


def test_a_device_empty_tensor_written_by_a_thread_while_another_closes():
    # an engine thread fills its buffer while a shutdown thread closes the
    # store: every write lands in memory that is still there
    run_child("""
        for rnd in range(6):
            s = store(device="host")
            t = s.device_empty((2, 2, N, 128), torch.bfloat16)
            started, stop, errs = threading.Event(), threading.Event(), []
            def writer():
                k = 0
                while not stop.is_set():
                    t.fill_(float(k % 7))
                    started.set()
                    k += 1
                try:
                    t.add_(1)
                    assert bool((t == t[0, 0, 0, 0]).all())
                except Exception as e:
                    errs.append(e)
            w = threading.Thread(target=writer)
            w.start()
            started.wait()
            s.close()
            stop.set()
            w.join()
            assert not errs, errs
            del t
        print("ok")
    """)


def test_a_store_without_device_empty_tensors_closes_its_device_at_close():
    run_child("""
        s = store(device="host")
        hold = weakref.ref(s._devhold)
        s.close()
        assert hold() is None
        s.close()
        print("ok")
    """)
