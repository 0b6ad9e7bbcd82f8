"""KVStore as an engine team misuses it in its first hour, in process and
through a `ferry serve` daemon (test_misuse.py, test_first_hour*.py cover
close races, ids, moved buffers and a rewritten block table):

- salts of odd types: an int tenant id is refused, not turned into that
  many zero bytes (salt=0 read the unsalted tenant's chunks, salt=3 the
  chunks of salt b"\\0\\0\\0"); bytearray and memoryview salts work on
  every call, the named ones too;
"""
import numpy as np
import pytest
import torch

import ferry
from test_server import Daemon

LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")


@pytest.fixture(scope="module", params=["local", "server"])
def url(request, tmp_path_factory):
    if request.param == "local":
        yield ""
        return
    d = Daemon(str(tmp_path_factory.mktemp("kvthreads"))).start()
    yield d.url
    d.stop()


def open_store(url, **kw):
    if url:
        return ferry.KVStore("kvthreads", LAY, server=url, chunk_tokens=16,
                             server_timeout_ms=5000, **kw)
    return ferry.KVStore("kvthreads", LAY, l1="16M", chunk_tokens=16, **kw)


@pytest.fixture
def s(url):
    st = open_store(url)
    st.clear()
    yield st
    st.close()


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)


# -- salts --

@pytest.mark.parametrize("salt", [0, 3, True, 2.5, [1, 2], np.int64(7)])
def test_a_salt_that_is_not_str_or_bytes_is_refused(s, salt):
    # bytes(3) is b"\0\0\0": an int tenant id was the salt of 3 zero bytes,
    # and tenant 0 the unsalted tenant, whose chunks it then read
    toks = np.arange(32, dtype=np.int32)
    s.store(toks, kv(32))                       # an unsalted tenant's chunks
    for call in (lambda: s.lookup(toks, salt=salt),
                 lambda: s.retrieve(toks, torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16),
                                    salt=salt),
                 lambda: s.store(toks + 100, kv(32), salt=salt),
                 lambda: s.lookup_named([b"page"], salt=salt),
                 lambda: s.store_named([b"page"], kv(16), salt=salt)):
        with pytest.raises(TypeError, match="salt"):
            call()
    assert s.lookup(toks + 100) == 0 and s.lookup(toks + 100, salt=b"\0\0\0") == 0


def test_bytes_like_salts_work_on_every_call(s):
    # bytearray and memoryview are bytes: the same tenant as the bytes,
    # on the named calls too (whose per-salt cache needs a hashable key)
    toks = np.arange(32, dtype=np.int32) + 7000
    x = kv(32, 1)
    assert s.store(toks, x, salt=bytearray(b"tenant")) == 32
    assert s.lookup(toks, salt=b"tenant") == 32 and s.lookup(toks) == 0
    assert s.store_named([b"p0", b"p1"], x, salt=memoryview(b"tenant")) == 2
    assert s.lookup_named([b"p0", b"p1"], salt=bytearray(b"tenant")) == 2
    assert s.lookup_named([b"p0"], salt=memoryview(b"tenant")) == 1
    assert s.lookup_named([b"p0"], salt="tenant") == 1 and s.lookup_named([b"p0"]) == 0
    y = torch.zeros_like(x)
    assert s.retrieve_named([b"p0", b"p1"], y, salt=bytearray(b"tenant")) == 2
    assert torch.equal(x, y)
    assert s.delete_named([b"p0"], salt=bytearray(b"tenant")) == 1
