"""Unit tests of loom.train: config, data, checkpoints, schedule, plan, plots and generation (one process)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loom.testing import ROOT
from loom.train import checkpoint as ckpt
from loom.train.config import Config, ConfigError, config_from_dict, config_to_dict, load_config, parse_overrides
from loom.models.tokenizer import decode, encode
from loom.train.data import batch_windows, load_corpus
from loom.train.trainer import lr_at, sp_layout


def test_overrides_parse_types_and_apply(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 7\n[model]\nhidden = 48\nheads = 4\n")
    cfg = load_config(p, ["--train.steps=9", "--optim.lr", "1e-3", "--sequence.algorithm=fpdt",
                          "--sequence.offload=true", "--data.path=some/dir", "--mesh.dp=1"])
    assert cfg.train.steps == 9 and cfg.model.hidden == 48
    assert cfg.optim.lr == 1e-3 and cfg.sequence.offload is True and cfg.data.path == "some/dir"
    assert parse_overrides(["--train.out=runs/x"]) == {"train": {"out": "runs/x"}}


@pytest.mark.parametrize("data, words", [
    ({"model": {"hiden": 3}}, ["unknown key model.hiden", "layers, hidden, heads"]),
    ({"modle": {}}, ["unknown config section [modle]", "model, mesh"]),
    ({"train": {"steps": "ten"}}, ["train.steps = 'ten' must be an integer"]),
    ({"model": {"hidden": 30, "heads": 4}}, ["model.hidden = 30 is not divisible by model.heads = 4"]),
    ({"mesh": {"sp": 8, "sp_ring": 1}}, ["model.heads = 4 over mesh.sp = 8 ranks", "no split exists",
                                         "--mesh.sp_ring=2"]),
    ({"mesh": {"sp": 8, "sp_ring": 1}, "sequence": {"algorithm": "fpdt"}}, ["model.heads = 4 over mesh.sp = 8",
                                                                           "--mesh.sp_ring=2"]),
    ({"mesh": {"sp": 8, "sp_ring": 2}, "model": {"heads": 2, "kv_heads": 1, "hidden": 16}},
     ["model.heads = 2 over sp / sp_ring = 4 ranks", "--mesh.sp_ring=4"]),
    ({"mesh": {"sp": 4, "sp_ring": 3}}, ["mesh.sp_ring = 3 does not divide mesh.sp = 4", "[1, 2, 4]"]),
    ({"mesh": {"sp": 4, "sp_ring": 2, "pp": 2}}, ["composes with dp and ZeRO only"]),
    ({"data": {"batch": 3}, "mesh": {"dp": 2}}, ["data.batch = 3 is not divisible by mesh.dp = 2"]),
    ({"sequence": {"chunks": 2}}, ["needs sequence.algorithm = 'fpdt'"]),
    ({"sequence": {"offload": True}, "mesh": {"sp": 2}}, ["sequence.offload = true needs sequence.algorithm = 'fpdt'",
                                                          "--sequence.offload_checkpoints=true"]),
    ({"sequence": {"algorithm": "fpdt"}, "mesh": {"tp": 2}}, ["mesh.tp = 2 with sequence.algorithm = 'fpdt'"]),
    ({"mesh": {"ep": 2}}, ["mesh.ep = 2 needs model.ffn = 'moe'"]),
    ({"mesh": {"ep": 2}, "model": {"ffn": "moe", "experts": 3, "top_k": 1}}, ["experts = 3 is not divisible"]),
    ({"data": {"seq_len": 30}, "mesh": {"sp": 4, "pp": 2}}, ["data.seq_len = 30", "use data.seq_len = 32"]),
])
def test_config_errors_name_value_rule_fix(data, words):
    with pytest.raises(ConfigError) as exc:
        config_from_dict(data)
    for w in words:
        assert w in str(exc.value)


def test_unknown_override_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"valid keys in \[optim\]: lr, min_lr"):
        load_config(None, ["--optim.learning_rate=1"])
    with pytest.raises(ConfigError, match="overrides look like --section.key=value"):
        load_config(None, ["steps=3"])


def test_sp_ring_chosen_from_the_heads():
    assert config_from_dict({"mesh": {"sp": 4}}).mesh.sp_ring == 1  # 4 heads split over 4 ranks
    assert config_from_dict({"mesh": {"sp": 8}}).mesh.sp_ring == 2  # Ulysses 4 x ring 2
    assert config_from_dict({"mesh": {"sp": 8}, "model": {"heads": 2, "kv_heads": 1}}).mesh.sp_ring == 4
    assert config_from_dict({"mesh": {"sp": 4, "sp_ring": 4}}).mesh.sp_ring == 4
    assert config_from_dict({"mesh": {"sp": 3}}).mesh.sp_ring == 1  # 4 heads over 3 ranks: 2, 1, 1
    assert config_from_dict({"mesh": {"sp": 8}, "sequence": {"algorithm": "fpdt"}}).mesh.sp_ring == 2


def test_any_length_is_padded_to_the_layout():
    assert config_from_dict({"mesh": {"sp": 4}, "data": {"seq_len": 31}}).padded_seq_len == 32
    assert config_from_dict({"mesh": {"sp": 8}, "data": {"seq_len": 36}}).padded_seq_len == 40  # ring 2: lcm(8, 4)
    assert config_from_dict({"mesh": {"sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 3},
                             "data": {"seq_len": 31}}).padded_seq_len == 36
    assert config_from_dict({"mesh": {"sp": 8}, "sequence": {"algorithm": "fpdt", "chunks": 3},
                             "data": {"seq_len": 31}}).padded_seq_len == 48  # lcm(8 x 3, 2 x 2)


def test_help_shows_every_declared_default():
    """``loom train --help`` lists every key with the default its section declares (a resolved ``Config()``
    shows mesh.sp_ring = 1 for the default heads, hiding the automatic 0)."""
    import dataclasses

    from loom.train.cli import parser
    from loom.train.config import _SECTIONS

    text = parser().format_help()
    lines = {ln.split("] ", 1)[0].strip() + "]": ln.split("] ", 1)[1] for ln in text.splitlines()
             if ln.strip().startswith("[") and "] " in ln}
    for name, cls in _SECTIONS.items():
        shown = dict(kv.split("=", 1) for kv in _split_top(lines[f"[{name}]"]))
        for f in dataclasses.fields(cls):
            want = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert shown.get(f.name) == repr(want), (name, f.name, shown.get(f.name), want)
    assert "sp_ring=0" in text


def _split_top(text: str) -> list[str]:
    """``a=1, b=['x', 'y']`` -> ``["a=1", "b=['x', 'y']"]``: commas inside brackets or quotes kept."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def test_odd_length_of_a_transformers_model_is_refused_saying_why(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}))
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"model": {"hf_config": str(path)}, "mesh": {"sp": 2}, "data": {"seq_len": 31}})
    for words in ("data.seq_len = 31", "transformers models are not padded", "use data.seq_len = 32"):
        assert words in str(exc.value), exc.value


def test_fpdt_on_one_rank_runs_its_chunks_and_offload(tmp_path):
    """sequence.algorithm = fpdt at mesh.sp = 1 is FPDT on a one-rank group (chunked attention, its chunk store
    in host memory), not plain attention with the settings ignored: bytes go to the host, and the losses and
    parameters equal plain attention's (fp64, 1e-9)."""
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    base = {"model": {"layers": 2, "hidden": 16, "heads": 2, "kv_heads": 1},
            "data": {"seq_len": 32, "batch": 2, "max_bytes": 20_000},
            "train": {"steps": 2, "dtype": "float64", "eval_every": 0, "progress": "none", "plots": False}}
    plain = Trainer(config_from_dict(base), out=tmp_path / "plain", quiet=True)
    want = plain.run()
    fpdt = {**base, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}}
    tr = Trainer(config_from_dict(fpdt), out=tmp_path / "fpdt", quiet=True)
    assert tr.model.cfg.sequence_parallel == "fpdt" and tr.model.cfg.chunks == 2 and tr.model.cfg.offload
    got = tr.run()
    assert all(r["offload_bytes"] > 0 for r in got), [r["offload_bytes"] for r in got]
    for r, w in zip(got, want, strict=True):
        assert math.isclose(r["loss"], w["loss"], rel_tol=1e-9), (r["loss"], w["loss"])
    ref = dict(plain.model.named_parameters())
    for n, p in tr.model.named_parameters():
        assert float((p.detach() - ref[n].detach()).abs().max()) < 1e-9, n


def test_mesh_must_match_world():
    cfg = config_from_dict({"mesh": {"dp": 2, "sp": 2}})
    cfg.validate_world(4)
    with pytest.raises(ConfigError, match="= 4 ranks but the job has 3"):
        cfg.validate_world(3)


def test_config_roundtrip():
    cfg = config_from_dict({"model": {"layers": 3}, "mesh": {"pp": 3}})
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_default_corpus_is_stdlib_and_split():
    cfg = Config().data
    cfg.max_bytes = 300_000
    corpus = load_corpus(cfg)
    assert "standard library" in corpus.description and corpus.files > 1
    assert len(corpus.train) + len(corpus.heldout) > 250_000
    assert len(corpus.heldout) == pytest.approx(0.05 * (len(corpus.train) + len(corpus.heldout)), rel=0.01)
    assert b"import" in bytes(corpus.train[:100_000].tolist())


def test_data_path_file_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 200)
    cfg = config_from_dict({"data": {"path": str(f), "seq_len": 16}}).data
    corpus = load_corpus(cfg)
    assert corpus.files == 1 and decode(corpus.train[:11]) == "hello world"
    with pytest.raises(ConfigError, match="neither a file nor a directory"):
        load_corpus(config_from_dict({"data": {"path": str(tmp_path / "nope")}}).data)
    with pytest.raises(ConfigError, match="too small"):
        load_corpus(config_from_dict({"data": {"path": str(f), "seq_len": 2000}}).data)


def test_batches_depend_only_on_seed_and_step():
    stream = torch.arange(1000, dtype=torch.int64) % 256
    a = batch_windows(stream, seed=1, step=5, batch=3, seq_len=8)
    b = batch_windows(stream, seed=1, step=5, batch=3, seq_len=8)
    c = batch_windows(stream, seed=1, step=6, batch=3, seq_len=8)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one
    assert decode(encode("héllo")) == "héllo"


def test_sp_layout_matches_fpdt_layout():
    for p, chunks in [(1, 1), (2, 1), (2, 2), (4, 2)]:
        got = torch.cat([sp_layout(32, p, r, chunks) for r in range(p)])
        assert sorted(got.tolist()) == list(range(32))
        if chunks == 1:
            assert sp_layout(32, p, 1 % p, 1).tolist() == list(range(32 // p * (1 % p), 32 // p * (1 % p + 1)))
    try:
        from loom.parallel.sequence import local_positions
    except ImportError:
        return

    class _C:
        def __init__(self, r, p):
            self.rank, self.size = r, p

    for p, chunks, ring in [(2, 2, 1), (4, 2, 1), (4, 1, 2), (4, 2, 2), (4, 2, 4)]:
        for r in range(p):
            assert torch.equal(sp_layout(32, p, r, chunks, ring),
                               local_positions(32 // p, _C(r, p), chunks=chunks, ring=ring))


def test_lr_schedule():
    cfg = config_from_dict({"optim": {"lr": 1.0, "min_lr": 0.1, "warmup": 4}, "train": {"steps": 14}})
    assert lr_at(0, cfg) == 0.25 and lr_at(3, cfg) == 1.0
    assert lr_at(4, cfg) == pytest.approx(1.0) and lr_at(14, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(0.55)


def test_checkpoint_atomic_weights_only_latest_prune(tmp_path):
    payload = {"format": ckpt.FORMAT, "step": 3, "model": {"w": torch.ones(2)}, "rng": ckpt.capture_rng()}
    for step in (2, 4, 6):
        ckpt.save(ckpt.stage_path(tmp_path, step, 0), {**payload, "step": step})
    ckpt.save(ckpt.stage_path(tmp_path, 8, 1), payload)  # stage 0 of step 8 missing: incomplete (in flight)
    ckpt.save(ckpt.stage_path(tmp_path, 1, 1), payload)  # an old incomplete step: pruned
    assert ckpt.latest(tmp_path, stages=1) == 6
    assert ckpt.latest(tmp_path, stages=2) is None
    assert not list(tmp_path.glob(".*tmp*"))
    loaded = torch.load(ckpt.stage_path(tmp_path, 6, 0), weights_only=True)
    assert loaded["step"] == 6 and torch.equal(loaded["model"]["w"], torch.ones(2))
    ckpt.restore_rng(loaded["rng"])
    ckpt.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000006.stage0.pt", "step_000008.stage1.pt"]
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing.pt")


def test_checkpoint_save_failure_leaves_nothing(tmp_path):
    class Bad:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        ckpt.save(tmp_path / "x.pt", {"bad": Bad()})
    assert list(tmp_path.iterdir()) == []


def test_dry_run_plan(tmp_path, capsys):
    from loom.train.cli import main

    assert main(["--config", str(ROOT / "configs" / "demo.toml"), f"--train.out={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for w in ("mesh", "stages", "memory", "bytes per step", "dp", "sp"):
        assert w in out
    assert "occupied" not in out and list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_dry_run_after_the_demo_filled_its_run_directory(tmp_path, capsys):
    """`make demo` then `make test`: the demo's run directory holds a finished run (checkpoints, metrics,
    plots; made here as a run leaves them, without the slow demo), and a dry run of the demo config still
    plans: it writes nothing, so it says the directory is occupied instead of refusing."""
    from loom import tour
    from loom.train.cli import main

    run = tmp_path / "demo"
    ckpt.save(ckpt.stage_path(run / "checkpoints", 200, 0), {"format": ckpt.FORMAT, "step": 200, "stages": 1})
    (run / "metrics.jsonl").write_text('{"kind": "step", "step": 200}\n')
    (run / "plots").mkdir()
    (run / "plots" / "loss.png").write_bytes(b"png")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    argv = ["--config", str(tour.demo_config()), *tour.mesh_for(4), f"--train.out={run}"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory" in out and "run directory: occupied" in out and "step 200" in out, out
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert main([*argv, "--mesh.dp=1", "--mesh.sp=1"]) == 2  # the run itself (here one rank) still refuses it
    assert "already holds another run" in capsys.readouterr().err


def test_cli_bad_config_returns_2(capsys):
    from loom.train.cli import main

    assert main(["--config", str(ROOT / "configs" / "train-tiny.toml"), "--model.nope=1"]) == 2
    assert "unknown key model.nope" in capsys.readouterr().err


def test_single_rank_run_writes_metrics_plots_checkpoint_and_generates(tmp_path, capsys):
    from loom.train import generate

    torch.set_num_threads(1)
    from loom.train.cli import main

    rc = main(["--config", str(ROOT / "configs" / "train-tiny.toml"), f"--train.out={tmp_path}", "--train.steps=4",
               "--train.progress=lines"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "final loss" in out
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in recs)
    for name in ("loss.png", "bytes.png", "step_time.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    model, cfg, step = generate.load_model(str(tmp_path / "checkpoints"))
    assert step == 4 and cfg.model.layers == 2
    assert generate.load_model(str(tmp_path))[2] == 4  # the run directory finds its checkpoints/
    a = generate.sample(model, "def ", tokens=20, seed=3)
    b = generate.sample(model, "def ", tokens=20, seed=3)
    assert a == b and a.startswith("def ") and len(a.encode()) >= 20
    assert generate.main(["--checkpoint", str(tmp_path / "nope")]) == 2


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_demo_config_fits_any_rank_count(n, monkeypatch, capsys, tmp_path):
    from loom import tour
    from loom.train.cli import main

    monkeypatch.setenv("PMI_SIZE", str(n))
    monkeypatch.setenv("PMI_RANK", "0")
    assert main(["--config", str(tour.demo_config()), *tour.mesh_for(n), f"--train.out={tmp_path}", "--dry-run"]) == 0
    assert f"= {n} ranks" in capsys.readouterr().out


def test_resume_refuses_another_model(tmp_path):
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    base = {"model": {"layers": 1, "hidden": 16, "heads": 2, "kv_heads": 1},
            "data": {"seq_len": 16, "batch": 2, "max_bytes": 20_000},
            "train": {"steps": 1, "eval_every": 0, "progress": "none", "plots": False}}
    Trainer(config_from_dict(base), out=tmp_path, quiet=True).run()
    assert ckpt.latest(tmp_path / "checkpoints") == 1
    other = {**base, "model": {**base["model"], "hidden": 32}}
    with pytest.raises(ConfigError, match="model.hidden: checkpoint 16 vs config 32"):
        Trainer(config_from_dict(other), out=tmp_path, resume=True, quiet=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_reads_nothing_on_the_host_at_any_zero_stage(stage, tmp_path, monkeypatch):
    """On CUDA a host read in the clip waits for the whole backward, once per step before the step's one read of
    loss and norm: the clipped norm stays a device tensor at every ZeRO stage, and the gradients are scaled as
    torch's ``clip_grad_norm_`` scales them."""
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = config_from_dict({"model": {"layers": 1, "hidden": 16, "heads": 2, "kv_heads": 1},
                            "data": {"seq_len": 16, "batch": 2, "max_bytes": 20_000},
                            "optim": {"grad_clip": 1e-3}, "zero": {"stage": stage},
                            "train": {"steps": 1, "eval_every": 0, "progress": "none", "plots": False}})
    tr = Trainer(cfg, out=tmp_path, quiet=True)
    x, y, _ = tr.local_batch(tr.corpus.train, 0)
    tr.opt.zero_grad(set_to_none=True)
    tr.forward_backward(x, y)
    tr.sync_grads()
    grads = ([sh.grad for sh in tr.sdp.shards] if tr.sdp is not None else
             [m.grad for m in tr.opt.masters()] if stage == 1 else [p.grad for p in tr.params])
    before = [g.clone() for g in grads]
    want = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in before]))

    def host_read(self, *args):
        raise AssertionError("the clip read a tensor on the host")

    for name in ("item", "tolist", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    norm = tr.clip()
    monkeypatch.undo()
    assert isinstance(norm, torch.Tensor) and norm.numel() == 1
    assert float(norm) == pytest.approx(float(want), rel=1e-6) and float(want) > 1e-3  # it clipped
    for g, b in zip(grads, before):
        torch.testing.assert_close(g, b * (1e-3 / (want + 1e-6)).to(b.dtype), rtol=1e-6, atol=0)
