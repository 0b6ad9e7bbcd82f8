"""ferry's SGLang backend under an older SGLang than the one it follows.

The reference index's newest stored python/sglang/srt/mem_cache/
hicache_storage.py of sgl-project/sglang is at commit
bb424de23a4659f89cfd97dcad3aa1935a1e1d3e, and it is OLDER than the
001067fffe33427bee0ed2f007fb7551a1d76b44 the backend follows: its
HiCacheStorageConfig has six fields (tp_rank, tp_size, is_mla_model,
is_page_first_layout, model_name, extra_config: no pp, attention-CP, DP,
metrics or split-heads field), HiCacheStorageExtraInfo's prefix_keys
defaults to (None,), and HiCacheStorage has register_mem_pool_host,
batch_get_v1 / batch_set_v1 (bodies `pass`), the abstract get / batch_get
/ set / batch_set / exists, batch_exists(keys, extra_info), clear and
get_stats; no PoolName, PoolHitPolicy, PoolTransfer, PoolTransferResult,
register_mem_host_pool_v2 or v2 batch calls.

Each test installs a package `sglang` with that module's surface (names,
fields, defaults and signatures; no behaviour) in a fresh interpreter,
then does what SGLang does with a dynamic backend:
mem_cache/storage/backend_factory.py (at 001067ff; _load_backend_class:
import module_path, getattr class_name, refuse it unless it subclasses
HiCacheStorage; _create_dynamic_backend: backend_class(storage_config,
kwargs)), then the controller's register_mem_pool_host(mem_pool_host)
and its storage calls (managers/cache_controller.py: _page_backup with
batch_set_v1(keys, host_indices, extra_info), _storage_hit_query with
batch_exists(keys, extra_info), _page_get_zero_copy with
batch_get_v1(keys, host_indices, extra_info), the generic batch_get /
batch_set of flat pages) as tests/sglang_pools.Controller mirrors them.
"""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

# the surface of hicache_storage.py at bb424de (see the module's note)
OLD_HICACHE_STORAGE = '''
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    is_mla_model: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = (None,)
    extra_info: Optional[dict] = None


class HiCacheStorage(ABC):
    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        pass

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        pass

    @abstractmethod
    def get(self, key, target_location=None, target_sizes=None): ...

    @abstractmethod
    def batch_get(self, keys, target_locations=None, target_sizes=None): ...

    @abstractmethod
    def set(self, key, value=None, target_location=None, target_sizes=None): ...

    @abstractmethod
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...

    @abstractmethod
    def exists(self, key): ...

    def batch_exists(self, keys, extra_info=None):
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def clear(self):
        pass

    def get_stats(self):
        return None
'''

PRELUDE = '''
import importlib
import torch
import sglang.srt.mem_cache.hicache_storage as old
from sglang_pools import (Controller, MHAHost, MLAHost, MambaHost, fill, indices,
                          page_hashes)

def dynamic_backend(extra, pool, **cfg):
    """_create_dynamic_backend, then register_mem_pool_host."""
    extra = dict({"backend_name": "ferry", "module_path": "ferry.adapters.sglang",
                  "class_name": "FerryHiCacheStorage"}, **extra)
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    if not issubclass(cls, old.HiCacheStorage):
        raise TypeError(f"Backend class {cls.__name__} must inherit from HiCacheStorage")
    conf = dict(tp_rank=0, tp_size=1, is_mla_model=False,
                is_page_first_layout=pool.layout == "page_first", model_name="tiny",
                extra_config=extra)
    conf.update(cfg)
    b = cls(old.HiCacheStorageConfig(**conf), {})
    b.register_mem_pool_host(pool)
    return b

def canon(pool, start):
    return pool.get_data_page(start, flat=False).contiguous().view(torch.uint8).clone()
'''


def run_old(tmp_path, body):
    """body, after PRELUDE, in a fresh interpreter that imports the old
    SGLang surface as sglang.srt.mem_cache.hicache_storage."""
    pkg = tmp_path / "oldsgl" / "sglang" / "srt" / "mem_cache"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "hicache_storage.py").write_text(OLD_HICACHE_STORAGE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "oldsgl"), os.path.dirname(HERE), HERE,
                                         env.get("PYTHONPATH", "")])
    script = PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_older_sglang_takes_its_base_class_and_config(tmp_path):
    """The factory accepts the backend (it subclasses the installed SGLang's
    HiCacheStorage; the v2 names missing there are ferry's stand-ins) and
    a six-field config builds it: pp, dp and cp read as their defaults."""
    run_old(tmp_path, '''
        import ferry.adapters._sglang_base as base
        from ferry.adapters.sglang import FerryHiCacheStorage
        assert base.SGLANG and base.HiCacheStorage is old.HiCacheStorage
        assert base.FROM_SGLANG == ("HiCacheStorage", "HiCacheStorageConfig",
                                    "HiCacheStorageExtraInfo"), base.FROM_SGLANG
        assert base.PoolName.__module__ == "ferry.adapters._sglang_base"
        assert not FerryHiCacheStorage.__abstractmethods__
        b = dynamic_backend({"ferry_store": "s", "ferry_l1": "4M"}, MHAHost("page_first", 4))
        assert b._salts("kv") == ["sglang/kv/pp0/1/dp0/1/tp0/1"], b._salts("kv")
        assert b.get_stats() is None     # no enable_storage_metrics field: off, as SGLang's base
        b.close()
    ''')


def test_older_sglang_controller_round_trips_bitwise(tmp_path):
    """Backup, hit query and fetch through the v1 and the generic paths,
    each host layout that SGLang had then, MHA and MLA: every page loads
    bitwise into other host slots; an MLA model's TP rank 1 writes
    nothing and reads rank 0's pages."""
    run_old(tmp_path, '''
        for mla in (False, True):
            for layout in ("layer_first", "page_first", "page_first_direct"):
                for v1 in (True, False):
                    pool = MLAHost(layout, 4) if mla else MHAHost(layout, 4)
                    b = dynamic_backend({"ferry_store": "s", "ferry_l1": "4M"}, pool,
                                        is_mla_model=mla)
                    fill(pool.kv_buffer, 3)
                    ctl = Controller(b, pool, v1)
                    h = page_hashes(list(range(5 * 4)), 4)
                    assert ctl.hit_query(h) == 0
                    assert ctl.backup(h, indices(1, 5, 4)) == 5
                    assert ctl.hit_query(h) == 5
                    want = [canon(pool, (1 + i) * 4) for i in range(5)]
                    pool.kv_buffer.zero_()
                    assert ctl.fetch(h, indices(9, 5, 4)) == 5
                    for i in range(5):
                        assert torch.equal(canon(pool, (9 + i) * 4), want[i]), (layout, v1, i)
                    if mla:
                        other = MLAHost(layout, 4)
                        fill(other.kv_buffer, 4)
                        r1 = dynamic_backend({"ferry_store": "s"}, other, is_mla_model=True,
                                             tp_rank=1, tp_size=2)
                        h2 = page_hashes(list(range(100, 108)), 4)
                        assert r1.batch_set_v1(h2, indices(0, 2, 4)) == [True, True]
                        assert b.batch_exists(h2) == 0
                        assert r1.batch_get_v1(h[:2], indices(2, 2, 4)) == [True, True]
                        assert torch.equal(canon(other, 8), want[0])
                    b.close()
    ''')


def test_older_sglang_base_still_takes_v2_pools(tmp_path):
    """An older base class has no register_mem_host_pool_v2: ferry's own
    keeps the pool table (registered_pools) and the pool's pages move."""
    run_old(tmp_path, '''
        import ferry.adapters._sglang_base as base
        b = dynamic_backend({"ferry_store": "s", "ferry_l1": "4M"}, MHAHost("page_first", 4))
        m = MambaHost()
        m.fill(5)
        b.register_mem_host_pool_v2(m, base.PoolName.MAMBA)
        assert b.registered_pools == {base.PoolName.MAMBA: m}
        want = m.get_data_page(2).clone()
        t = base.PoolTransfer(name=base.PoolName.MAMBA, host_indices=torch.tensor([2]),
                              keys=["k" * 64])
        assert b.batch_set_v2([t]) == {base.PoolName.MAMBA: [True]}
        m.fill(9)
        t.host_indices = torch.tensor([6])
        assert b.batch_get_v2([t]) == {base.PoolName.MAMBA: [True]}
        assert torch.equal(m.get_data_page(6), want)
        b.close()
    ''')
