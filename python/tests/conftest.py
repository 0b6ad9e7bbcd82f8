import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/ (the package) before any installed copy

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


# the vLLM adapter's tests (test_adapter_vllm.py, test_vllm_*.py): the tiny
# model they run, and its in-process store (a module may define its own)
@pytest.fixture(scope="module")
def model():
    from tiny_llama import TinyLlama
    return TinyLlama(seed=4321)


@pytest.fixture
def store(model):
    import ferry
    from ferry.adapters import unregister_store
    from test_adapter_vllm import CHUNK, NAME
    lay = ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype="f32")
    s = ferry.KVStore("tiny-llama", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK)
    yield s
    unregister_store(NAME)
    s.close()


@pytest.fixture
def l2dir(tmp_path):
    d = tmp_path / "l2"
    return str(d)


def abi_dump_path():
    p = os.environ.get("FERRY_ABI_DUMP")
    if p:
        return p
    return os.path.join(ROOT, "build", "tests", "abi_dump")
