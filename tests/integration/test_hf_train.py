"""``loom train`` on a transformers Llama from a config: a short job under sp (FPDT) or pp, the loss falls, and
the ``save_pretrained`` export loads back with ``AutoModelForCausalLM.from_pretrained`` with the same logits
as loom's own checkpoint; ``loom generate`` samples with the model's ``generate``."""

from __future__ import annotations

import json
import os
import sys

import pytest

from loom.comm import launch

pytest.importorskip("transformers", reason="loom[hf] extra not installed")
pytestmark = pytest.mark.mpi


def _config(tmp_path) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      tie_word_embeddings=True)
    path = tmp_path / "llama.json"
    cfg.to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize("mesh", [
    ["--mesh.sp=2", "--sequence.algorithm=fpdt", "--sequence.chunks=2"],
    ["--mesh.pp=2", "--data.micro_batches=2"],
])
def test_train_hf_config_exports_save_pretrained(tmp_path, mesh, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from loom.train.generate import load_model, main as generate

    out = tmp_path / "run"
    args = [sys.executable, "-m", "loom.cli", "train", f"--model.hf_config={_config(tmp_path)}", *mesh,
            "--train.steps=16", "--data.seq_len=32", "--data.batch=4", "--data.max_bytes=60000", "--optim.warmup=2",
            "--train.eval_every=0", "--train.plots=false", "--train.progress=none", f"--train.out={out}"]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = launch.run(2, args, timeout=400, env=env, capture=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "step"]
    assert len(losses) == 16 and sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses

    hf = AutoModelForCausalLM.from_pretrained(str(out / "checkpoints" / "hf"), local_files_only=True)
    mine, _, step = load_model(str(out / "checkpoints"))
    assert step == 16
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mine(input_ids=x, use_cache=False).logits
        got = hf(input_ids=x, use_cache=False).logits
    assert torch.equal(got, want)

    assert generate(["--checkpoint", str(out / "checkpoints"), "--tokens", "8", "--temperature", "0"]) == 0
    assert "# checkpoint" in capsys.readouterr().err


def test_readme_example_trains_with_sequence_parallelism(tmp_path):
    """The transformers guide's example, run as written on 2 ranks: the printed loss falls."""
    import re
    from pathlib import Path

    text = Path("docs/guides/transformers.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    script = tmp_path / "sp_llama.py"
    script.write_text(code)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = launch.run(2, [sys.executable, str(script)], timeout=300, env=env, capture=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, proc.stdout


def test_bench_seqlen_hf_config(tmp_path):
    """`loom bench seqlen --hf-config` on 2 ranks: every row within the budget, FPDT >= Ulysses > sdpa."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 500, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "head_dim": 16, "max_position_embeddings": 4096}))
    out = tmp_path / "seqlen.json"
    cmd = [sys.executable, "-m", "loom.cli", "bench", "seqlen", "--ranks", "2", "--hf-config", str(path),
           "--budget", "1M", "--chunk", "16", "--attn-chunk", "32", "--repeats", "1", "--max-seq", "1024",
           "--json", str(out)]
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["meta"]["results"]
    sdpa, uly, fpdt = (res[k] for k in ("transformers sdpa", "loom ulysses", "loom fpdt"))
    assert all(r["peak"] <= 1 << 20 for r in (sdpa, uly, fpdt)), res
    assert fpdt["max_seq"] >= uly["max_seq"] > sdpa["max_seq"], res
