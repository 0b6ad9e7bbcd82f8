"""The package against a `ferry serve` daemon: the same model computation
as test_model (prefix stored, longer prompt prefilled from the retrieved
KV, bitwise), a lookup-only scheduler client, a daemon restart with a
persistent L2, and a dead daemon as an error, not a hang."""
import os
import signal
import subprocess
import time

import pytest
import torch

import ferry
from ferry import FerryError
from test_model import BLOCKS, BS, CHUNK, check_reuse, prefill_and_store, prompts
from tiny_llama import TinyLlama

HERE = os.path.dirname(os.path.abspath(__file__))


def cli():
    p = os.environ.get("FERRY_CLI") or os.path.join(HERE, "..", "..", "build", "ferry")
    if not os.path.exists(p):
        pytest.fail(f"the ferry command is not at {p} (set FERRY_CLI)")
    return p


class Daemon:
    """`ferry serve` for the tiny preset (2 layers, 2 KV heads, head_dim 64, bf16)."""

    def __init__(self, tmp, l2=None):
        self.sock = os.path.join(tmp, "ferry.sock")
        self.args = [cli(), "serve", "--socket", self.sock, "--l1", "16M", "--model", "tiny",
                     "--chunk-tokens", str(CHUNK)]
        if l2:
            self.args += ["--l2", l2]
        self.proc = None

    def start(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, text=True)
        for _ in range(500):
            if os.path.exists(self.sock):
                return self
            if self.proc.poll() is not None:
                pytest.fail(f"ferry serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
            time.sleep(0.02)
        pytest.fail("ferry serve did not create its socket in 10 s")

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    @property
    def url(self):
        return "unix:" + self.sock


@pytest.fixture(scope="module")
def model():
    # the daemon's tiny preset: 2 layers, 2 KV heads of 64, bf16
    return TinyLlama(dim=256, layers=2, heads=4, kv_heads=2, ffn=256, seed=4321,
                     dtype=torch.bfloat16)


def layout():
    return ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")


def store_per_backend(request, tmp_path_factory, name):
    """A KVStore of the daemon's tiny preset (layout(), CHUNK-token chunks):
    in process for request.param "local", else a client of a daemon of its
    own; a generator for module fixtures parametrized over both backends."""
    if request.param == "local":
        s = ferry.KVStore(name, layout(), l1="16M", chunk_tokens=CHUNK)
        yield s
        s.close()
        return
    d = Daemon(str(tmp_path_factory.mktemp(name))).start()
    s = ferry.KVStore(name, layout(), server=d.url, chunk_tokens=CHUNK, server_timeout_ms=3000)
    yield s
    s.close()
    d.stop()


def client(d, **kw):
    return ferry.KVStore("tiny-llama", layout(), server=d.url, chunk_tokens=CHUNK,
                         server_timeout_ms=3000, **kw)


def test_prefix_reuse_through_the_server(model, tmp_path):
    d = Daemon(str(tmp_path)).start()
    try:
        with client(d) as s:
            caches_a, table_a = prefill_and_store(model, s)
            # another process's view: a scheduler that only looks up
            with client(d, lookup_only=True) as sched:
                assert sched.lookup(prompts()[1]) == 32
                with pytest.raises(FerryError):
                    sched.store(prompts()[0], model.new_caches(BLOCKS, BS), list(range(16)))
            with client(d) as other:
                check_reuse(model, other, caches_a, table_a)
    finally:
        d.stop()


def test_prefix_reuse_across_a_daemon_restart(model, tmp_path):
    l2 = tmp_path / "l2"
    l2.mkdir()
    d = Daemon(str(tmp_path), l2=f"{l2}:32M").start()
    try:
        with client(d) as s:
            caches_a, table_a = prefill_and_store(model, s)
            s.sync()
        d.stop()  # SIGTERM: flush, sync, close; L1 is gone with the process
        d.start()
        with client(d) as s:
            hit, tiers = s.lookup_tiers(prompts()[1])
            assert hit == 32 and tiers[:2] == ["l2", "l2"]
            check_reuse(model, s, caches_a, table_a)
    finally:
        d.stop()


def test_a_dead_daemon_is_an_error_then_a_reconnect(model, tmp_path):
    d = Daemon(str(tmp_path)).start()
    try:
        with client(d) as s:
            prefill_and_store(model, s)
            d.stop(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(FerryError) as e:
                s.lookup(prompts()[1])
            assert e.value.name == "FERRY_ECONN"
            assert time.monotonic() - t0 < 10
            d.start()
            assert s.lookup(prompts()[1]) == 0  # reconnected; L1 died with the daemon
    finally:
        d.stop()


def test_skip_tokens_through_the_server_leaves_the_engines_prefix(model, tmp_path):
    d = Daemon(str(tmp_path)).start()
    try:
        with client(d) as s:
            caches_a, table_a = prefill_and_store(model, s)
            a = prompts()[0]
            for skip in (0, 5, CHUNK, 20, 32):
                dst = [torch.full_like(c, 7.0) for c in caches_a]
                table = list(range(63, 47, -1))
                assert s.retrieve(a[:32], dst, table, skip=skip) == 32
                got = model.kv_of(dst, table, 32)
                want = model.kv_of(caches_a, table_a, 32)
                assert torch.all(got[:, :, :skip] == 7.0)  # the engine's own: untouched
                assert torch.equal(got[:, :, skip:], want[:, :, skip:])
    finally:
        d.stop()
