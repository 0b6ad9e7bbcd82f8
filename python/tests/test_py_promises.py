"""What the docstrings of ferry.kv promise, held as an outside user sees
it: public API only, bytes compared bitwise, in process and through a
`ferry serve` daemon (the tiny preset: 2 layers, 2 KV heads of 64, bf16,
16-token chunks) wherever the docstring speaks of both."""
import asyncio
import errno
import itertools
import os
import subprocess

import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError
from test_server import CHUNK, Daemon

LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
_base = itertools.count(1)


def toks(n):
    """Tokens no other test of the module uses (a daemon is shared)."""
    b = next(_base) * 100_000
    return np.arange(b, b + n, dtype=np.int32)


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)


def same(a, b):
    """Bitwise equality of bf16 tensors (NaN-safe, -0 != +0)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module", params=["local", "server"])
def opener(request, tmp_path_factory):
    """A function opening a fresh KVStore: in process, or a new client of
    one daemon for the module."""
    if request.param == "local":
        yield lambda **kw: ferry.KVStore("promises", LAY, l1="16M", chunk_tokens=CHUNK, **kw)
        return
    d = Daemon(str(tmp_path_factory.mktemp("promises"))).start()
    yield lambda **kw: ferry.KVStore("tiny", LAY, server=d.url, chunk_tokens=CHUNK,
                                     server_timeout_ms=5000, **kw)
    d.stop()


@pytest.fixture
def s(opener):
    st = opener()
    yield st
    st.close()


# -- store / retrieve / lookup ---------------------------------------------

def test_store_counts_tokens_already_present_and_keeps_the_first_bytes(s):
    t = toks(64)
    a = kv(64, 1)
    assert s.store(t[:32], a[:, :, :32].contiguous()) == 32
    # the longer store: its first two chunks are present, all 64 count
    assert s.store(t, a) == 64
    assert s.lookup(t) == 64
    dst = torch.zeros_like(a)
    assert s.retrieve(t, dst) == 64
    assert same(dst, a)


def test_lookup_counts_whole_chunks_only(s):
    t = toks(64)
    assert s.store(t, kv(64, 2)) == 64
    for n in (1, 15, 16, 17, 40, 63, 64):
        assert s.lookup(t[:n]) == n // CHUNK * CHUNK


def test_retrieve_leaves_chunks_it_did_not_load_as_they_were(s):
    t = toks(64)
    src = kv(64, 3)
    assert s.store(t[:32], src[:, :, :32].contiguous()) == 32
    dst = torch.full_like(src, 7.0)
    n, st = s.retrieve(t, dst, statuses=True)
    assert n == 32
    assert st == [0, 0, ferry.errors.ENOTFOUND, ferry.errors.ENOTFOUND]
    assert same(dst[:, :, :32], src[:, :, :32])
    assert torch.all(dst[:, :, 32:] == 7.0)
    hit, tiers = s.lookup_tiers(t)
    assert hit == 32 and tiers == ["l1", "l1", "none"]


@pytest.mark.parametrize("skip", [0, 5, CHUNK, 20, 32])
def test_retrieve_skip_writes_nothing_below_it(s, skip):
    t = toks(32)
    src = kv(32, 4)
    assert s.store(t, src) == 32
    dst = torch.full_like(src, 7.0)
    assert s.retrieve(t, dst, skip=skip) == 32
    assert torch.all(dst[:, :, :skip] == 7.0)
    assert same(dst[:, :, skip:], src[:, :, skip:])
    # the async and layerwise forms take skip as well
    dst = torch.full_like(src, 7.0)
    assert s.retrieve_async(t, dst, skip=skip).wait(timeout=30) == 32
    assert torch.all(dst[:, :, :skip] == 7.0) and same(dst[:, :, skip:], src[:, :, skip:])
    dst = torch.full_like(src, 7.0)
    assert s.retrieve_layers(t, dst, skip=skip).wait(timeout=30) == 32
    assert torch.all(dst[:, :, :skip] == 7.0) and same(dst[:, :, skip:], src[:, :, skip:])


def test_a_str_salt_is_its_utf8_bytes_and_other_types_are_refused(s):
    t = toks(32)
    src = kv(32, 5)
    assert s.store(t, src, salt="tenant-é") == 32
    assert s.lookup(t, salt="tenant-é".encode()) == 32
    assert s.lookup(t, salt=bytearray("tenant-é".encode())) == 32
    assert s.lookup(t) == 0 and s.lookup(t, salt="tenant-e") == 0
    dst = torch.zeros_like(src)
    assert s.retrieve(t, dst, salt=memoryview("tenant-é".encode())) == 32
    assert same(dst, src)
    for bad in (0, 3, [1, 2]):
        with pytest.raises(TypeError):
            s.lookup(t, salt=bad)


# -- pin / unpin / delete / clear / prefetch / flush / sync ----------------

def test_pin_keeps_chunks_from_delete_until_unpin(s):
    t = toks(48)
    src = kv(48, 6)
    assert s.store(t, src) == 48
    assert s.pin(t[:32]) == 32
    with pytest.raises(FerryError) as e:
        s.delete(t)            # the unpinned third chunk goes, the pinned two stay
    assert e.value.name == "FERRY_ELOCKED"
    assert s.lookup(t) == 32
    dst = torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16)
    assert s.retrieve(t[:32], dst) == 32 and same(dst, src[:, :, :32])   # pinned: readable
    assert s.unpin(t[:32]) == 32
    assert s.delete(t) == 2
    assert s.lookup(t) == 0


def test_delete_returns_the_chunks_deleted_and_retrieve_copies_what_is_left(s):
    """retrieve copies every chunk that is present, past a miss too, and
    returns the leading tokens loaded: after deleting the first two chunks
    it returns 0, leaves those two as they were and loads the last two
    (statuses say which)."""
    t = toks(64)
    src = kv(64, 7)
    assert s.store(t, src) == 64
    assert s.delete(t[:32]) == 2
    assert s.lookup(t) == 0
    dst = torch.full_like(src, 7.0)
    n, st = s.retrieve(t, dst, statuses=True)
    assert n == 0
    assert st == [ferry.errors.ENOTFOUND, ferry.errors.ENOTFOUND, 0, 0]
    assert torch.all(dst[:, :, :32] == 7.0)
    assert same(dst[:, :, 32:], src[:, :, 32:])


def test_prefetch_flush_sync_clear(s):
    t = toks(32)
    assert s.store(t, kv(32, 8)) == 32
    assert s.prefetch(t) == 32          # in L1 already
    assert s.flush() >= 0
    assert s.sync() == 0                # no persistent L2
    assert s.clear() >= 2
    assert s.lookup(t) == 0


def test_stats_is_a_dict_with_the_tiers_nested(s):
    t = toks(32)
    s.store(t, kv(32, 9))
    st = s.stats()
    assert isinstance(st, dict)
    assert set(st["tier"]) == {"l1", "l2", "remote"}
    assert st["tier"]["l1"]["chunks"] >= 2
    assert "ferry_kv" in s.prometheus()


# -- named chunks -------------------------------------------------------------

def test_retrieve_named_loads_every_cached_chunk_and_counts_the_leading(s):
    """store_named puts chunk i under names[i]; retrieve_named loads every
    cached chunk of the names (not only the leading ones) and returns the
    leading chunks loaded."""
    tag = next(_base)
    names = [f"page-{tag}-{i}" for i in range(4)]
    src = kv(64, 10)
    assert s.store_named(names[1:3], src[:, :, CHUNK:3 * CHUNK].contiguous()) == 2
    dst = torch.full_like(src, 7.0)
    rc, st = s.retrieve_named(names, dst, statuses=True)
    assert rc == 0
    assert st == [ferry.errors.ENOTFOUND, 0, 0, ferry.errors.ENOTFOUND]
    assert torch.all(dst[:, :, :CHUNK] == 7.0) and torch.all(dst[:, :, 3 * CHUNK:] == 7.0)
    assert same(dst[:, :, CHUNK:3 * CHUNK], src[:, :, CHUNK:3 * CHUNK])
    assert s.lookup_named(names[1:]) == 2
    assert s.lookup_named([names[1], "x" * 3, names[2]]) == 1   # the array form
    assert s.delete_named(names) == 2
    assert s.lookup_named(names[1:3]) == 0


def test_store_named_refuses_a_name_given_twice_and_stores_nothing(s):
    tag = next(_base)
    names = [f"dup-{tag}-a", f"dup-{tag}-b", f"dup-{tag}-a"]
    with pytest.raises(ValueError, match="twice"):
        s.store_named(names, kv(48, 11))
    assert s.lookup_named(names[:2]) == 0


def test_lookup_named_packed_refusals(s):
    with pytest.raises(TypeError):
        s.lookup_named_packed("abcd", 2, 2)
    with pytest.raises(ValueError):
        s.lookup_named_packed(b"abc", 2, 2)


# -- async ops --------------------------------------------------------------

def test_async_round_trip_bitwise_and_await(s):
    t = toks(64)
    src = kv(64, 12)
    op = s.store_async(t, src)
    assert op.wait(timeout=30) == 64
    assert op.done() and op.wait() == 64        # the kept result, again
    assert op.cancel() is False                 # finished anyway

    async def main():
        dst = torch.zeros_like(src)
        n = await s.retrieve_async(t, dst)
        return n, dst
    n, dst = asyncio.run(main())
    assert n == 64 and same(dst, src)


def test_an_op_answers_wait_and_done_after_its_store_closed(opener, request):
    """An op outlives its store's close: wait() and done() still answer. In
    process the ops close finishes run to their end; through a daemon one
    still awaiting the daemon's answer to its retrieve or store ends
    ECANCELED (close does not wait for the daemon), a retrieve then never
    reporting a chunk loaded that is not whole: each is its bytes or as it
    was (zeros here)."""
    server = "server" in request.node.callspec.id
    for _ in range(10):
        s = opener()
        t = toks(64)
        src = kv(64, 13)
        assert s.store(t, src) == 64
        dst = torch.zeros_like(src)
        op = s.retrieve_async(t, dst)
        t2 = toks(32)
        st_op = s.store_async(t2, kv(32, 14))
        s.close()
        try:
            assert op.wait(timeout=30) == 64 and same(dst, src)
        except FerryError as e:
            assert server and e.code == -errno.ECANCELED, e
            for c in range(4):
                got = dst[:, :, c * CHUNK:(c + 1) * CHUNK]
                want = src[:, :, c * CHUNK:(c + 1) * CHUNK]
                assert same(got, want) or torch.all(got == 0)
        assert op.done()
        try:
            assert st_op.wait(timeout=30) == 32
        except FerryError as e:
            assert server and e.code == -errno.ECANCELED, e
        assert st_op.done()
        s.close()                                   # again: safe
        with pytest.raises(FerryError) as e:
            s.lookup(t)
        assert e.value.code == -errno.EBADF


# -- layerwise --------------------------------------------------------------

def test_store_layers_visible_only_after_the_last_layer_bitwise(s):
    t = toks(48)
    src = kv(48, 15)
    op = s.store_layers(t, src)
    assert not op.done()
    with pytest.raises(FerryError):             # lacking layers: an error, not a hang
        op.wait()
    for layer in range(LAY.num_layers):
        assert s.lookup(t) == 0
        op.layer_done(layer)
    assert op.wait(timeout=30) == 48
    assert s.lookup(t) == 48
    dst = torch.zeros_like(src)
    op = s.retrieve_layers(t, dst)
    for layer in range(LAY.num_layers):
        assert op.wait_layer(layer, timeout=30) == 48
        assert same(dst[:, layer], src[:, layer])
    assert op.wait() == 48 and same(dst, src)


@pytest.mark.parametrize("how", ["cancel", "free"])
def test_store_layers_ended_before_its_last_layer_stores_nothing(s, how):
    t = toks(32)
    op = s.store_layers(t, kv(32, 16))
    op.layer_done(0)
    if how == "cancel":
        assert op.cancel() is True
        with pytest.raises(FerryError) as e:
            op.wait()
        assert e.value.code == -errno.ECANCELED
    else:
        op.free()
    assert s.lookup(t) == 0
    # the slots it reserved are given back: the same tokens store whole
    src = kv(32, 17)
    assert s.store(t, src) == 32
    dst = torch.zeros_like(src)
    assert s.retrieve(t, dst) == 32 and same(dst, src)


def test_wait_layer_async(s):
    t = toks(32)
    src = kv(32, 18)
    assert s.store(t, src) == 32
    dst = torch.zeros_like(src)

    async def main():
        op = s.retrieve_layers(t, dst)
        got = [await op.wait_layer_async(layer) for layer in range(LAY.num_layers)]
        return got, await op
    got, n = asyncio.run(main())
    assert got == [32, 32] and n == 32 and same(dst, src)


def test_layer_index_out_of_range_is_refused(s):
    t = toks(32)
    op = s.store_layers(t, kv(32, 19))
    with pytest.raises(FerryError) as e:
        op.layer_done(LAY.num_layers)
    assert e.value.code == -errno.EINVAL
    with pytest.raises(TypeError):
        op.layer_done(True)
    op.cancel()


# -- construction -----------------------------------------------------------

def test_constructor_refusals(tmp_path):
    with pytest.raises(ValueError):
        ferry.KVStore("m", LAY)                                  # no l1
    with pytest.raises(ValueError):
        ferry.KVStore("m", LAY, l1="16M", server="unix:/nonexistent")
    with pytest.raises(ValueError):
        ferry.KVStore("m", LAY, l1="16M", lookup_only=True)
    with pytest.raises(TypeError):
        ferry.KVStore("m", (2, 2, 64), l1="16M")
    with pytest.raises(ValueError):
        ferry.KVStore("m", LAY, l1="16M", eviction="fifo")
    with pytest.raises(ValueError):
        ferry.KVStore("m", LAY, l1="16M", l2="no-size")
    with pytest.raises(ValueError):
        ferry.parse_size(-1)


def test_layout_from_model_and_equality():
    mla = ferry.Layout.from_model(4, 8, 512, "bf16", mla=True)
    assert (mla.kv, mla.num_heads, mla.head_dim, mla.num_layers) == (1, 1, 512, 4)
    lay = ferry.Layout.from_model(2, 2, 64, "bf16")
    assert lay == LAY and lay.token_bytes == 2 * 2 * 2 * 64 * 2
    assert eval(repr(lay), {"Layout": ferry.Layout}) == lay


def test_named_forms_take_every_salt_the_token_forms_take(s):
    """A salt is str or bytes, bytearray or memoryview (any of them, the
    same tenant for the same bytes) in the named forms as in the token
    forms: a memoryview over a bytearray (unhashable) was refused there
    with "cannot hash writable memoryview object"."""
    tag = next(_base)
    names = [f"salted-{tag}-{i}" for i in range(2)]
    src = kv(32, 20)
    for salt in (memoryview(bytearray(b"tenant-mv")), bytearray(b"tenant-mv")):
        assert s.store_named(names, src, salt=salt) == 2
        assert s.lookup_named(names, salt=salt) == 2
        assert s.lookup_named([names[0], "z"], salt=salt) == 1          # the array form
        assert s.lookup_named_packed("".join(names).encode(), len(names[0]), 2,
                                     salt=salt) == 2
        assert s.lookup_named(names, salt=b"tenant-mv") == 2
        assert s.lookup_named(names) == 0
        dst = torch.zeros_like(src)
        assert s.retrieve_named(names, dst, salt=salt) == 2 and same(dst, src)
        assert s.delete_named(names, salt=salt) == 2
        assert s.lookup_named(names, salt=b"tenant-mv") == 0


def test_a_wait_that_times_out_leaves_the_op_running_to_its_bytes(opener):
    """wait(timeout) raises TimeoutError while the op runs and does not stop
    it; asyncio.wait_for(op, t) timing out does not either: a later wait()
    or await gives the tokens, and the destination holds their bytes. (The
    op is queued behind others on the store's one worker.)"""
    s = opener(workers=1)
    try:
        n = 64 * CHUNK
        t = toks(n)
        src = kv(n, 21)
        assert s.store(t, src) == n
        sink = torch.zeros_like(src)
        timed_out = waited_out = 0

        async def behind_others():
            nonlocal waited_out
            ahead = [s.retrieve_async(t, sink) for _ in range(16)]
            dst = torch.zeros_like(src)
            op = s.retrieve_async(t, dst)
            try:
                await asyncio.wait_for(op, timeout=0.0001)
            except asyncio.TimeoutError:
                waited_out += 1
            assert await op == n and same(dst, src)
            for b in ahead:
                assert await b == n

        for _ in range(20):
            if timed_out >= 2 and waited_out >= 2:
                break
            ahead = [s.retrieve_async(t, sink) for _ in range(16)]
            dst = torch.zeros_like(src)
            op = s.retrieve_async(t, dst)
            try:
                op.wait(timeout=0)
            except TimeoutError:
                timed_out += 1
            assert op.wait(timeout=60) == n and same(dst, src)
            for b in ahead:
                assert b.wait(timeout=60) == n
            asyncio.run(behind_others())
        assert timed_out and waited_out
    finally:
        s.close()


def test_layer_calls_on_an_ended_op_answer_from_its_end(s):
    """wait_layer after the op ended answers its result (-ECANCELED after a
    cancel); layer_done on a store that took every layer, or on a
    retrieve, is FERRY_ESTATE; on a store cancelled short, -ECANCELED."""
    t = toks(32)
    src = kv(32, 22)
    assert s.store(t, src) == 32
    dst = torch.zeros_like(src)
    op = s.retrieve_layers(t, dst)
    assert op.wait(timeout=30) == 32 and same(dst, src)
    assert [op.wait_layer(layer) for layer in range(LAY.num_layers)] == [32, 32]
    with pytest.raises(FerryError) as e:
        op.layer_done(0)
    assert e.value.name == "FERRY_ESTATE"
    st = s.store_layers(toks(32), kv(32, 23))
    with pytest.raises(FerryError) as e:
        st.wait_layer(0, timeout=1)
    assert e.value.name == "FERRY_ESTATE"
    st.layer_done(0)
    with pytest.raises(FerryError) as e:
        st.layer_done(0)                        # done already
    assert e.value.name == "FERRY_ESTATE"
    st.layer_done(1)
    assert st.wait(timeout=30) == 32
    with pytest.raises(FerryError) as e:
        st.layer_done(1)
    assert e.value.name == "FERRY_ESTATE"
    short = s.store_layers(toks(32), kv(32, 24))
    short.layer_done(0)
    assert short.cancel() is True
    with pytest.raises(FerryError) as e:
        short.layer_done(1)
    assert e.value.code == -errno.ECANCELED


def test_clear_leaves_pinned_chunks_and_says_so(s):
    t = toks(32)
    other = toks(32)
    src = kv(32, 25)
    assert s.store(t, src) == 32 and s.store(other, kv(32, 26)) == 32
    assert s.pin(t) == 32
    with pytest.raises(FerryError) as e:
        s.clear()
    assert e.value.name == "FERRY_ELOCKED"
    assert s.lookup(other) == 0 and s.lookup(t) == 32
    dst = torch.zeros_like(src)
    assert s.retrieve(t, dst) == 32 and same(dst, src)
    assert s.unpin(t) == 32
    assert s.clear() >= 2 and s.lookup(t) == 0


def test_a_hash_seed_outside_64_bits_is_refused():
    """hash_seed is a uint64 two stores must agree on: -1 was taken as
    2^64-1 and 2^64 as 0 (ctypes wraps), a float raised ctypes' own
    TypeError. Refused naming it; 0 and 2^64-1 open."""
    lay = ferry.Layout(num_layers=2, num_heads=2, head_dim=8, dtype="f32")
    for bad in (-1, 1 << 64):
        with pytest.raises(ferry.FerryError, match="hash_seed"):
            ferry.KVStore("seed", lay, l1="1M", hash_seed=bad)
    for bad in (1.5, "7", True):
        with pytest.raises(TypeError, match="hash_seed"):
            ferry.KVStore("seed", lay, l1="1M", hash_seed=bad)
    for good in (0, (1 << 64) - 1, np.uint64(5)):
        ferry.KVStore("seed", lay, l1="1M", hash_seed=good).close()


def test_a_layouts_fields_read_as_it_was_made():
    """Layout's dtype reads as the name it was made with (and repr shows),
    not ferry's internal code: lay.dtype == "bf16", and a Layout made again
    from its own fields is the same layout."""
    for dt in ("bf16", "f16", "fp8", "f32", "u8"):
        lay = ferry.Layout(3, 4, 64, dt)
        assert lay.dtype == dt
        assert (lay.num_layers, lay.num_heads, lay.head_dim, lay.kv) == (3, 4, 64, 2)
        again = ferry.Layout(lay.num_layers, lay.num_heads, lay.head_dim, lay.dtype, kv=lay.kv)
        assert again == lay and repr(again) == repr(lay)
    assert ferry.Layout.from_model(2, 1, 512, "bf16", mla=True).kv == 1


def test_an_l1_larger_than_the_hosts_memory_is_refused(tmp_path):
    """An L1 that could never be backed is refused when the store opens,
    naming both sizes, in process and in a `ferry serve` daemon; a daemon's
    shared pool was faulted in by its thread until the kernel's OOM killer
    took the host's largest process (the engine, or a bystander)."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    lay = ferry.Layout(2, 2, 64)
    with pytest.raises(FerryError) as e:
        ferry.KVStore("too-big", lay, l1=2 * host)
    assert e.value.code == -errno.ENOMEM
    assert "memory this process may have" in str(e.value), e.value
    cli = os.environ.get("FERRY_CLI") or os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "build", "ferry")
    sock = tmp_path / "s.sock"
    r = subprocess.run([cli, "serve", "--socket", str(sock), "--model", "tiny",
                        "--l1", str(2 * host)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "memory this process may have" in r.stderr, r.stderr
    assert not sock.exists()
