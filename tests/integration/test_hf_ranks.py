"""transformers decoders (Llama, Qwen2, Mistral) under loom's Ulysses/FPDT against one process, at sp = 1, 2, 4."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytest.importorskip("transformers", reason="loom[hf] extra not installed")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 4])
def test_hf_sequence_parallel_exact(n):
    script = "tests/mpi/check_hf.py"
    assert_all_checks_passed(run_ranks(n, script, timeout=400), script)
