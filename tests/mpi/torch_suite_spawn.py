"""torch's suite through torch's own runner: ``TestDistBackend`` spawns fresh processes for every test
(``torch.multiprocessing`` spawn, ``file://`` init with rank and world size), which on loom form their MPI world
through the store (loom.comm.pmi). Collected by pytest from tests/integration/test_torch_suite.py; gated as gloo
(``BACKEND=gloo``), with ``init_process_group``/``new_group`` mapped to ``"loom"`` in every process when
``SUITE_BACKEND=loom`` (this module is imported anew in each spawned process, so the mapping is too)."""

import os
import tempfile

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="loom-torch-spawn-"))

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if os.environ.get("SUITE_BACKEND") == "loom":
    import loom  # noqa: F401 - registers the backend

    _init, _new = dist.init_process_group, dist.new_group

    def _mapped(backend):
        return "loom" if backend is None or str(backend).lower() == "gloo" else backend

    def init_process_group(*args, backend=None, **kwargs):
        return _init(*args, backend=_mapped(backend), **kwargs)

    def new_group(*args, backend=None, **kwargs):
        return _new(*args, backend=_mapped(backend), **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


class TestSpawned(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
