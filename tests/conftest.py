import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    skip_root = pytest.mark.skip(reason="needs root for network namespaces and tc (CI runs as root)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        for item in items:
            if "root" in item.keywords:
                item.add_marker(skip_root)
    cuda = [item for item in items if "cuda" in item.keywords]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            skip_cuda = pytest.mark.skip(reason="needs a CUDA device (torch sees none): the GPU tier, make test-gpu")
            for item in cuda:
                item.add_marker(skip_cuda)
