import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    skip_root = pytest.mark.skip(reason="needs root for network namespaces and tc (CI runs as root)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        for item in items:
            if "root" in item.keywords:
                item.add_marker(skip_root)
