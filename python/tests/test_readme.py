"""README's Python section, run as printed.

Each ```python block between "## Python" and "## Measured figures" is
taken from README.md and executed as it stands, with only what a reader
supplies: the engine's objects the text names (vLLM's per-layer caches,
the prompt's token ids, its block table), and the machine's places and
sizes (the /nvme directory and its 512G, the daemon's socket, an 8G L1,
which takes seconds to set up) turned into this test's. A block
that raises, or uses a name the reader was not told to have, fails here.

- the KVStore block, twice: a first run on an empty persistent L2 (a
  lookup that finds nothing: the retrieve of no tokens raised ValueError
  before README guarded it), then a second run that reopens the L2 and
  retrieves the stored prompt bitwise into zeroed caches; its daemon part
  against a real `ferry serve` of the same model, the scheduler client
  seeing what the worker client stored;
- the vLLM secondary tier block: its `secondary_tiers` entry loaded the
  way TieringOffloadingSpec loads an out-of-tree tier, then a slot stored
  and promoted back through it.
"""
import importlib
from types import SimpleNamespace
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from test_server import Daemon  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index("\n## Python\n")
    end = text.index("\n## Measured figures", start)
    return re.findall(r"^```python\n(.*?)^```$", text[start:end], re.S | re.M)


def block_with(needle):
    found = [b for b in python_blocks() if needle in b]
    assert len(found) == 1, f"README's Python section: {len(found)} blocks with {needle!r}"
    return found[0]


def run(src, names):
    g = dict(names)
    exec(compile(src, "README.md", "exec"), g)
    return g


@pytest.fixture
def llama_daemon(tmp_path):
    """`ferry serve` of the model the block names (llama3-8b: 32 layers of
    8 KV heads x 128, bf16; 32 MiB chunks of 256 tokens)."""
    d = Daemon(str(tmp_path))
    d.args[d.args.index("--model") + 1] = "llama3-8b"
    d.args[d.args.index("--l1") + 1] = "96M"
    d.args[d.args.index("--chunk-tokens") + 1] = "256"
    d.start()
    yield d
    d.stop()


def test_the_kvstore_block_runs_as_printed(tmp_path, llama_daemon):
    src = block_with("ferry.KVStore(")
    for place in ("/nvme/ferry:512G", "unix:/run/ferry/ferry.sock", 'l1="8G"'):
        assert place in src
    l2 = tmp_path / "nvme"
    l2.mkdir()
    src = src.replace("/nvme/ferry:512G", f"{l2}:256M")
    src = src.replace("unix:/run/ferry/ferry.sock", llama_daemon.url)
    src = src.replace('l1="8G"', 'l1="96M"')
    # what the reader has: vLLM's caches [2, blocks, block_size, heads, head_dim]
    # per layer (llama3-8b's 32 layers of 8 KV heads x 128), a prompt of 256
    # tokens and its 16 blocks of 16
    gen = torch.Generator().manual_seed(7)
    caches = [torch.randn(2, 16, 16, 8, 128, generator=gen).to(torch.bfloat16)
              for _ in range(32)]
    tokens = list(range(1000, 1256))
    table = list(range(16))
    first = run(src, {"kv_caches": caches, "token_ids": tokens, "block_table": table})
    assert first["hit"] == 0
    # the layout found in the caches, printed as the call that makes it
    lay = first["layout"]
    assert repr(lay) == "Layout(num_layers=32, num_heads=8, head_dim=128, dtype='bf16', kv=2)"
    assert eval(repr(lay), {"Layout": ferry.Layout}) == lay
    # through the daemon: the worker's store is the scheduler's hit
    store, sched = first["store"], first["sched"]
    assert sched.lookup(tokens) == 0
    store.store(tokens, caches, table)
    assert sched.lookup(tokens) == 256
    store.close()
    sched.close()
    # again, as after a restart: the persistent L2 has the prompt
    back = [torch.zeros_like(c) for c in caches]
    second = run(src, {"kv_caches": back, "token_ids": tokens, "block_table": table})
    assert second["hit"] == 256
    assert all(torch.equal(a, b) for a, b in zip(back, caches))
    assert second["sched"].lookup(tokens) == 256  # the daemon still holds it
    second["store"].close()
    second["sched"].close()


def test_the_vllm_secondary_tier_block_runs_as_printed(tmp_path):
    from ferry.adapters import _vllm_base as base

    src = block_with("FerrySecondaryTier")
    assert "/nvme/ferry:512G" in src and '"l1": "8G"' in src
    l2 = tmp_path / "nvme"
    l2.mkdir()
    src = src.replace("/nvme/ferry:512G", f"{l2}:8M").replace('"l1": "8G"', '"l1": "16M"')

    class KVTransferConfig:  # vLLM's, which is not installed here: its keywords
        def __init__(self, kv_connector=None, kv_role=None, kv_connector_extra_config=None,
                     **kw):
            assert kv_connector and kv_role in ("kv_producer", "kv_consumer", "kv_both")
            self.kv_connector, self.kv_role = kv_connector, kv_role
            self.kv_connector_extra_config = kv_connector_extra_config or {}

    g = run(src, {"KVTransferConfig": KVTransferConfig})
    extra = g["kv_transfer_config"].kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (conf,) = extra["secondary_tiers"]
    # TieringOffloadingSpec's creation of an out-of-tree tier
    conf = dict(conf)
    cls = getattr(importlib.import_module(conf.pop("module_path")), conf.pop("type"))
    assert issubclass(cls, base.SecondaryTierManager)
    slot = 64 * 1024
    primary = np.zeros((4, slot), np.uint8)
    primary[0] = np.arange(slot, dtype=np.uint64).astype(np.uint8)
    vllm_config = SimpleNamespace(   # (the fields of vLLM's the tier reads)
        model_config=SimpleNamespace(model="org/model", revision=None, dtype="torch.bfloat16"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16))
    tier = cls(vllm_config=vllm_config, primary_kv_view=memoryview(primary),
               tier_type="FerrySecondaryTier", **conf)
    ctx = base.ReqContext(req_id="r")
    key = b"k" * 36

    def finish(jid):
        import time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = list(tier.get_finished_jobs())
            if done:
                assert [(r.job_id, r.success) for r in done] == [(jid, True)]
                return
            time.sleep(0.001)
        raise AssertionError(f"job {jid} did not finish")

    tier.submit_store(base.TransferJob(job_id=1, keys=[key], chunk_ids=np.array([0]),
                                       is_promotion=False, req_context=ctx))
    finish(1)
    assert tier.lookup(key, ctx) == base.LookupResult.HIT
    tier.submit_load(base.TransferJob(job_id=2, keys=[key], chunk_ids=np.array([3]),
                                      is_promotion=True, req_context=ctx))
    finish(2)
    assert np.array_equal(primary[3], primary[0])
    tier.shutdown()


# ---- the command's examples: the configuration file and the quoted errors ----
def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_serve_yaml_block_serves_as_printed(tmp_path):
    """README's /etc/ferry/serve.yaml, with the machine's places and sizes
    made this test's (its drives, socket, group, Redis and port; 64G of L1
    and 2T of L2 made 64M): every key is taken, the daemon serves, `serve
    status` reads the file's socket, and SIGTERM stops it cleanly."""
    import grp
    import shutil
    import socket
    import subprocess
    import time
    from test_server import cli

    m = re.search(r"^    # /etc/ferry/serve\.yaml\n((?:    .*\n)+)", readme(), re.M)
    assert m, "README: no serve.yaml block"
    text = re.sub(r"^    ", "", m.group(1), flags=re.M)
    keys = re.findall(r"^(\w+):", text, re.M)
    assert keys == ["model", "chunk_tokens", "l1_bytes", "l2_dirs", "l2_bytes", "remote_url",
                    "workers", "socket", "group", "allow_uids", "metrics"], keys

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in drives:
        d.mkdir()
    sock = tmp_path / "ferry.sock"
    redis = None
    if shutil.which("redis-server"):
        rport = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(rport), "--save", ""],
                                 stdout=subprocess.DEVNULL)
        time.sleep(0.3)
        text = text.replace("redis://cache:6379/0", f"redis://127.0.0.1:{rport}/0")
    else:
        text = re.sub(r"^remote_url:.*\n", "", text, flags=re.M)
    for old, new in (("64G", "64M"), ("2T ", "64M"), ("/nvme0/ferry", str(drives[0])),
                     ("/nvme1/ferry", str(drives[1])), ("/run/ferry/ferry.sock", str(sock)),
                     ("group: ferry ", f"group: {grp.getgrgid(os.getgid()).gr_name} "),
                     ("127.0.0.1:9400", f"127.0.0.1:{free_port()}")):
        assert old in text, old
        text = text.replace(old, new)
    conf = tmp_path / "serve.yaml"
    conf.write_text(text)
    proc = subprocess.Popen([cli(), "serve", "--config", str(conf)], stderr=subprocess.PIPE,
                            text=True)
    try:
        for _ in range(500):
            if sock.exists() or proc.poll() is not None:
                break
            time.sleep(0.02)
        assert sock.exists(), f"ferry serve exited {proc.poll()}: {proc.stderr.read()}"
        st = subprocess.run([cli(), "serve", "status", "--config", str(conf)],
                            capture_output=True, text=True, timeout=30)
        assert st.returncode == 0 and f"ferry serve on {sock}" in st.stdout, st
    finally:
        if proc.poll() is None:
            proc.terminate()
        rc = proc.wait(timeout=30)
        if redis:
            redis.terminate()
            redis.wait(timeout=30)
    assert rc == 0 and not sock.exists(), (rc, proc.stderr.read())


def test_the_quoted_errors_are_what_ferry_says(tmp_path):
    """The two error lines README quotes, each from the input it names."""
    import subprocess
    from test_server import cli

    text = readme()
    want = re.search(r"\(`(ferry bench io: --size 0: [^`]*?) \.\.\.`\)", text.replace("\n", " "))
    assert want, "README: no quoted --size 0 error"
    r = subprocess.run([cli(), "bench", "io", "--size", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith(want.group(1)), r.stderr
    m = re.search(r"^    \$ ferry serve --config serve\.yaml\n    (ferry serve: .*)$", text, re.M)
    assert m, "README: no quoted serve.yaml error"
    conf = tmp_path / "serve.yaml"
    conf.write_text("model: llama3-8b\nchunk_tokens: 256\nl1_bytes: 64 G\n")
    r = subprocess.run([cli(), "serve", "--config", "serve.yaml"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == m.group(1), r.stderr
