"""Packed documents in ``loom train`` (``data.pack``) on one rank: the batch, and the loss against each document
run on its own. The meshes against one rank: ``check_packed_documents_match_one_rank`` in tests/mpi/check_train.py."""

from __future__ import annotations

import pytest
import torch

from loom.train.config import ConfigError, config_from_dict
from loom.train.data import IGNORE, load_corpus, packed_windows
from loom.train.trainer import Trainer
from tests.jobs import train_config, uneven_documents

TOL = 1e-12  # fp64, one process: only the order of the sums differs


def _cfg(tmp_path, **sections):
    data = uneven_documents(str(tmp_path / "docs"))
    return train_config({"model": {"layers": 2, "hidden": 16, "heads": 2, "kv_heads": 1},
                         "data": {**data, "seq_len": 32, "batch": 3},
                         "train": {"steps": 1, "dtype": "float64", "eval_every": 0, "progress": "none",
                                   "plots": False}}, sections)


def test_packed_rows_start_at_documents_and_never_cross_a_boundary(tmp_path):
    cfg = _cfg(tmp_path)
    corpus = load_corpus(cfg.data)
    lengths = sorted({f.stat().st_size for f in (tmp_path / "docs").iterdir()})
    assert corpus.files == 60 and len(lengths) > 10  # uneven documents
    starts = corpus.train_docs
    for step in range(5):
        x, y, doc, pos = packed_windows(corpus.train, starts, seed=0, step=step, batch=3, seq_len=32)
        assert torch.isin(x[:, 0], corpus.train[starts].long()).all()
        for b in range(3):
            new = torch.nonzero(doc[b, 1:] != doc[b, :-1]).flatten() + 1  # each document's first token
            assert (pos[b, new] == 0).all() and pos[b, 0] == 0
            assert (y[b, new - 1] == IGNORE).all()  # the target that would predict the next document
            assert int((y[b, :-1] == IGNORE).sum()) == len(new)  # (the last target may cross out of the row)
            assert (torch.diff(doc[b]) >= 0).all() and (torch.diff(pos[b])[doc[b, 1:] == doc[b, :-1]] == 1).all()
        assert int((doc[:, -1] > 0).sum()) > 0, "rows hold several documents"


def _per_document_loss(model, x, y, doc, summed_loss=None):
    """Sum over every document of the loss of that document run alone (positions from 0, no mask), over the
    count of real targets: what packing must give. ``summed_loss(xs, ys)``: one document's summed loss (default:
    loom's model, whose ``loss`` is a mean)."""
    if summed_loss is None:
        def summed_loss(xs, ys):
            return model.loss(xs, ys) * int((ys != IGNORE).sum())
    total, count = 0.0, 0
    for b in range(x.shape[0]):
        for d in doc[b].unique():
            sel = doc[b] == d
            xs, ys = x[b, sel][None], y[b, sel][None]
            n = int((ys != IGNORE).sum())
            if n:
                total = total + summed_loss(xs, ys)
                count += n
    return total / count


@pytest.mark.parametrize("sequence", [{}, {"recompute": True, "offload_checkpoints": True}])
def test_packed_loss_is_the_mean_over_each_documents_own_targets(tmp_path, sequence):
    tr = Trainer(_cfg(tmp_path, sequence=sequence), out=tmp_path / "run", quiet=True)
    for step in range(3):
        x, y, packed = tr.local_batch(tr.corpus.train, step)
        assert packed is not None and packed.count == int((y != IGNORE).sum())
        loss = tr.tm.loss(x, y, packed)
        grads = torch.autograd.grad(loss, list(tr.model.parameters()))
        want = _per_document_loss(tr.model, x, y, packed.doc_ids)
        wgrads = torch.autograd.grad(want, list(tr.model.parameters()))
        assert abs(loss.item() - want.item()) <= TOL, (step, loss.item(), want.item())
        for g, w in zip(grads, wgrads):
            assert float((g - w).abs().max()) <= TOL


def _per_document_hf_loss(model, x, y, doc):
    """:func:`_per_document_loss` for a transformers model: each document alone, positions from 0, no mask."""
    def summed_loss(xs, ys):
        logits = model(input_ids=xs, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[0], ys[0], ignore_index=IGNORE, reduction="sum")
    return _per_document_loss(model, x, y, doc, summed_loss)


@pytest.mark.parametrize("sequence", [{}, {"algorithm": "fpdt", "chunks": 2, "offload": True}])
def test_packed_transformers_loss_is_the_mean_over_each_documents_own_targets(tmp_path, sequence):
    """A transformers Llama on one rank: transformers' own sdpa (documents found where the position ids
    restart), and FPDT on a one-rank group (loom's attention handed the document ids), each equal to every
    document run alone (loss and gradients, fp64)."""
    pytest.importorskip("transformers")
    from tests.jobs import tiny_hf_llama

    hf = tiny_hf_llama(None, str(tmp_path / "llama.json"))
    tr = Trainer(_cfg(tmp_path, model={"hf_config": hf}, sequence=sequence), out=tmp_path / "run", quiet=True)
    got = []
    for step in range(2):
        x, y, packed = tr.local_batch(tr.corpus.train, step)
        assert int(packed.doc_ids[:, -1].max()) > 0, "rows hold several documents"
        loss = tr.tm.loss(x, y, packed)
        got.append((x, y, packed, loss, torch.autograd.grad(loss, list(tr.model.parameters()))))
    if tr.tm.sp is not None:  # the documents alone run as transformers runs them (its sdpa, whole MLPs)
        tr.tm.sp.remove("sdpa")
    for step, (x, y, packed, loss, grads) in enumerate(got):
        want = _per_document_hf_loss(tr.model, x, y, packed.doc_ids)
        wgrads = torch.autograd.grad(want, list(tr.model.parameters()))
        assert abs(loss.item() - want.item()) <= TOL, (step, loss.item(), want.item())
        for g, w in zip(grads, wgrads):
            assert float((g - w).abs().max()) <= TOL


def test_pack_of_a_transformers_model_under_a_pipeline_is_refused_saying_why(tmp_path):
    pytest.importorskip("transformers")
    from tests.jobs import tiny_hf_llama

    hf = tiny_hf_llama(None, str(tmp_path / "llama.json"))
    with pytest.raises(ConfigError, match="data.pack = true with a transformers model .* mesh.pp = 2: its pipeline"):
        config_from_dict({"model": {"hf_config": hf}, "data": {"pack": True, "micro_batches": 2}, "mesh": {"pp": 2}})


def test_pack_and_checkpoint_offload_are_validated():
    # packed documents run under every sequence-parallel plan, FPDT x ring included (exact against one rank:
    # check_packed_documents_match_one_rank in tests/mpi/check_train.py)
    cfg = config_from_dict({"data": {"pack": True}, "model": {"heads": 2, "kv_heads": 1},
                            "mesh": {"sp": 4, "sp_ring": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2}})
    assert cfg.data.pack and cfg.mesh.sp_ring == 2 and cfg.sequence.algorithm == "fpdt"
    with pytest.raises(ConfigError, match="needs sequence.recompute = true"):
        config_from_dict({"sequence": {"offload_checkpoints": True}})
    # and under a pipeline and tp (check_train.py, check_tensor.py)
    assert config_from_dict({"data": {"pack": True, "micro_batches": 2}, "mesh": {"pp": 2, "tp": 2}}).data.pack
    with pytest.raises(ConfigError, match="offload_checkpoints with mesh.pp = 2"):
        config_from_dict({"sequence": {"recompute": True, "offload_checkpoints": True}, "mesh": {"pp": 2},
                          "data": {"micro_batches": 2}})
