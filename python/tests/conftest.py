import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/ (the package) before any installed copy

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
def l2dir(tmp_path):
    d = tmp_path / "l2"
    return str(d)


def abi_dump_path():
    p = os.environ.get("FERRY_ABI_DUMP")
    if p:
        return p
    return os.path.join(ROOT, "build", "tests", "abi_dump")
