"""Checkpoint state of a ``loom train`` run: each stage's file written, and resumed on another mesh or setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .config import ConfigError, config_to_dict
from .schedule import lr_at

__all__ = ["TrainerState"]


class TrainerState:
    """:class:`loom.train.trainer.Trainer`'s checkpoints: :meth:`save` and what ``resume=True`` runs.

    A mixin of the trainer, reading what it lays out: ``cfg``, ``comm`` and the mesh coordinates, the model, its
    parameters (``param_names``, ``params``), the optimizer, ZeRO's wrapper (``sdp``), the tp and ep groups and
    the compression policy. Checkpoints hold whole tensors (tp slices and ep experts gathered), so a run resumes
    on another dp, tp, ep or sequence setting; ZeRO 2-3's shards are resharded over dp.
    """

    def _resume(self) -> None:
        step = ckpt.latest(self.ckpt_dir, stages=self.stages)
        # Every rank must agree on the step (a shared file system is assumed; check it).
        steps = self.comm.allgather_object(step)
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks see different latest checkpoints in {self.ckpt_dir}: {steps}")
        if step is None:
            return
        state = ckpt.load(ckpt.stage_path(self.ckpt_dir, step, self.stage))
        why = ckpt.resume_refusal(state, config_to_dict(self.cfg), f"the newest checkpoint in {self.ckpt_dir} "
                                                                    f"(step {step})")
        if why:
            raise ConfigError(why)
        if state.get("stages", 1) != self.stages or list(state.get("params", self.param_names)) != self.param_names:
            raise ConfigError(f"checkpoint {self.ckpt_dir} step {step} was written with {state.get('stages')} "
                              f"pipeline stages and a different layer split; resume with the same mesh.pp")
        missing = [n for n in self.param_names if n not in state["model"]]
        if missing:
            raise ConfigError(f"checkpoint step {step} lacks parameters {missing[:3]}...; it is not from this model")
        if self.sdp is not None:
            self.sdp.load_sharded(self._zero_files(self.ckpt_dir / state["zero"]), self.opt)  # reshards
        else:
            self._load_full(state)
        self._restore_compression(state, step)
        ckpt.restore_rng(state["rng"], self.device)
        self.start_step = int(state["step"])
        self._keep_schedule(state)

    def _keep_schedule(self, state: dict[str, Any]) -> None:
        """The learning-rate schedule of a resumed run: the checkpoint's horizon (the first run's
        ``train.steps``, or its ``optim.decay_steps``) unless ``optim.decay_steps`` sets one, so a longer or
        shorter ``train.steps`` continues the rate instead of restarting the cosine. Where the two differ at the
        resume step, :attr:`schedule_note` says so in one line with both rates."""
        saved = state.get("lr_horizon") or state.get("config", {}).get("train", {}).get("steps")
        if not saved:  # written before the horizon was recorded, without a config: nothing to keep
            return
        cfg, step, wanted = self.cfg, self.start_step, self.cfg.optim.decay_steps
        kept = lr_at(step, cfg, int(saved))
        self.lr_horizon = wanted or int(saved)
        if cfg.optim.schedule == "constant" or wanted == saved or (not wanted and cfg.train.steps == saved):
            return
        if wanted:
            self.schedule_note = (f"learning rate: optim.decay_steps = {wanted} replaces the checkpoint's horizon of "
                                  f"{saved} steps: {kept:.2e} -> {lr_at(step, cfg, wanted):.2e} at step {step}")
        else:
            self.schedule_note = (f"learning rate: train.steps = {cfg.train.steps} but the schedule keeps the "
                                  f"checkpoint's horizon of {saved} steps, so it continues at {kept:.2e} (min_lr "
                                  f"{cfg.optim.min_lr:.2e} from step {saved}); --optim.decay_steps="
                                  f"{cfg.train.steps} would stretch it: {lr_at(step, cfg, cfg.train.steps):.2e} "
                                  f"at step {step}")

    def _load_full(self, state: dict[str, Any]) -> None:
        """Parameters and optimizer state from a one-file checkpoint (stages 0-1)."""
        named = dict(self.model.named_parameters())
        optim = state["optim"]
        with torch.no_grad():
            for n in self.param_names:
                named[n].copy_(self._my_shard(n, state["model"][n]))
        if self.ep is not None or self._tp_dims:  # checkpoints hold whole tensors: keep this rank's Adam moments
            order = self._opt_order()
            name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
            for idx, st in optim["state"].items():
                n = name_of[id(order[int(idx)])]
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        st[k] = self._my_shard(n, st[k])
        self.opt.load_state_dict(optim)

    def _opt_order(self) -> list[torch.nn.Parameter]:
        """The parameters in the order of the optimizer's (unsharded) state-dict indices."""
        if hasattr(self.opt, "inner"):  # ZeRO-1: ShardedOptimizer's groups hold flat masters
            return [p for ps in self.opt.params for p in ps]
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _compression_states(self) -> dict[int, Any] | None:
        """Every rank's compression state by world rank, gathered to its stage's checkpoint writer (``None`` on
        the other ranks and without compression). Error-feedback residuals differ from rank to rank."""
        if self.policy is None:
            return None
        writer = self.dp_rank == 0 and self.sp_rank == 0 and self.ep_rank == 0 and self.tp_rank == 0
        if self._stage_comm is None:
            self._stage_comm = self.comm.split(self.stage, 0 if writer else self.comm.rank + 1, name="stage")
        mine = {"policy": self.policy.state_dict(), "hook": self.hook.state_dict() if self.hook else {}}
        got = self._stage_comm.gather_object((self.comm.rank, mine), 0)
        return dict(got) if writer and got is not None else None

    def _restore_compression(self, state: dict[str, Any], step: int) -> None:
        saved = state.get("compress")
        if self.policy is None or saved is None:
            return
        mine = saved.get(self.comm.rank)
        if mine is None:
            raise ConfigError(f"checkpoint {self.ckpt_dir} step {step} has no compression state for rank "
                              f"{self.comm.rank}; resume on the same mesh, or with compress.policy = 'none'")
        self.policy.load_state_dict(mine["policy"])
        if self.hook is not None and mine["hook"]:
            self.hook.load_state_dict(mine["hook"])

    def _my_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This ep rank's experts of a full expert tensor (dim 0), this tp rank's slice of a tp-split one;
        other tensors unchanged."""
        if name in self._tp_dims:
            from ..parallel.tensor import shard_range

            d = self._tp_dims[name]
            lo, hi = shard_range(full.shape[d], self.tp.size, self.tp_rank)
            return full.narrow(d, lo, hi - lo).clone()
        if not self._is_expert(name):
            return full
        n = full.shape[0] // self.ep.size
        return full[self.ep_rank * n:(self.ep_rank + 1) * n]

    def _gather(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """All experts of an expert-sharded tensor (one allgather over ``ep``); others unchanged."""
        t = t.detach().cpu()
        if name in self._tp_dims:  # tp slices (uneven sizes allowed) along their split dim
            d = self._tp_dims[name]
            full, _ = self.tp.allgatherv(t.movedim(d, 0).contiguous())
            return full.movedim(0, d).contiguous()
        return self.ep.allgather(t.contiguous()) if self._is_expert(name) else t.clone()

    def save(self, step: int) -> Path | None:
        """Checkpoint after ``step`` optimizer steps: one file per pipeline stage, written by its (dp 0, sp 0,
        ep 0) rank; expert shards and their Adam moments are gathered over ``ep`` first, so the file holds
        the whole stage whatever the mesh."""
        path = None
        compress = self._compression_states()
        zero_dir = None
        if self.sdp is not None:  # one file per rank + manifest; the stage file then holds the full model only
            zero_dir = ckpt.zero_path(self.ckpt_dir, step)
            self.sdp.save_sharded(self._zero_files(zero_dir, write=True), self.opt)
            model = self.full_parameters()
            if self.tp is not None:  # whole tensors in the stage file (collective over tp)
                model = {n: self._gather(n, t) for n, t in model.items()}
            optim = None
        sharded = None
        if self.cfg.zero.stage == 1:  # collective over the zero axes, assembled on the group's writer only
            writer = self.opt.comm.allgather_object(self.dp_rank == 0 and self.sp_rank == 0)
            sharded = self.opt.state_dict(to=writer.index(True) if True in writer else 0)
        if self.dp_rank == 0 and self.sp_rank == 0 and self.sdp is None:
            named = dict(self.model.named_parameters())
            model = {n: self._gather(n, named[n]) for n in self.param_names}
            optim = sharded if sharded is not None else self.opt.state_dict()
            if self.ep is not None or self._tp_dims:
                order = self._opt_order()
                name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
                for idx, st in list(optim["state"].items()):
                    n = name_of[id(order[int(idx)])]
                    # state_dict() shares the live state dicts: build new ones instead of editing them
                    optim["state"][idx] = {k: (self._gather(n, v) if k in ("exp_avg", "exp_avg_sq") else v)
                                           for k, v in st.items()}
        if self.dp_rank == 0 and self.sp_rank == 0 and self.ep_rank == 0 and self.tp_rank == 0:
            if optim is not None:  # host copies: a checkpoint written on a GPU loads anywhere without map_location
                optim = {**optim, "state": {k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
                                            for k, st in optim["state"].items()}}
            payload = {
                "format": ckpt.FORMAT, "step": step, "config": config_to_dict(self.cfg),
                "stage": self.stage, "stages": self.stages, "params": list(self.param_names),
                "model": model, "optim": optim, "rng": ckpt.capture_rng(self.device),
                "lr_horizon": self.lr_horizon,
            }
            if compress is not None:
                payload["compress"] = compress
            if zero_dir is not None:
                payload["zero"] = zero_dir.name
            # Written after the sharded files: a complete stage file means a complete step.
            path = ckpt.save(ckpt.stage_path(self.ckpt_dir, step, self.stage), payload)
        self.comm.barrier()  # every stage file exists before anyone prunes or moves on
        if self.comm.rank == 0:
            ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep, self.stages, current=step)
            if hasattr(self.tm, "save_pretrained"):  # transformers models: also the save_pretrained layout
                merged = None
                if self.stages > 1 or self.sdp is not None:
                    merged = {}
                    for s in range(self.stages):
                        merged.update(ckpt.load(ckpt.stage_path(self.ckpt_dir, step, s))["model"])
                self.tm.save_pretrained(self.ckpt_dir / "hf", merged)
        return path

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's trained parameters (its pipeline stage's) by model name, whole: under ZeRO 2-3 gathered
        from the shards (collective over the zero axes), else copies of the live ones."""
        named = dict(self.model.named_parameters())
        if self.sdp is None:
            return {n: named[n].detach().cpu().clone() for n in self.param_names}
        full = self.sdp.state_dict()  # keys of the wrapped module (the model, or this stage's units)
        key = {id(p): n for n, p in self.sdp.module.named_parameters()}
        return {n: full[key[id(named[n])]].detach().cpu() for n in self.param_names}

    def _zero_files(self, zero_dir: Path, write: bool = False) -> Path:
        """Where this rank's ZeRO group keeps its files: ``zero_dir`` itself, or when sp ranks are separate groups
        (``zero.axes`` without sp) one subdirectory per sp rank: same blocks, but their own error feedback."""
        from ..parallel.zero import MANIFEST

        if self.stages > 1:  # one ZeRO layout per pipeline stage
            zero_dir = zero_dir / f"stage{self.stage}"
        if self.tp is not None:  # each tp rank shards its own slices over dp
            zero_dir = zero_dir / f"tp{self.tp_rank}"
        split = self.sp is not None and "sp" not in self.cfg.zero.axes
        if write:
            return zero_dir / f"sp{self.sp_rank}" if split else zero_dir
        for d in (zero_dir / f"sp{self.sp_rank}", zero_dir, zero_dir / "sp0"):  # saved by another split: replica 0
            if (d / MANIFEST).exists():
                return d
        return zero_dir  # load_sharded names what is missing
