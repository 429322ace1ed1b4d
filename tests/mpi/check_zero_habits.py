"""The DDP / FSDP2 habits on ShardedDataParallel, as a table: each habit x stage 0-3 x progress mode (hooks,
thread), every cell either "exact" (3 Adam steps, fp64, every parameter and buffer within 1e-10 of one process
on the same global batch, on every rank) or "raises <error>" naming the fix, as the table EXPECTED says.

The model has a LayerNorm (a weight its backward reads), a BatchNorm (running statistics: buffers that a
forward changes; the reference keeps rank 0's, which every rank holds after each forward), a root parameter
and a branch some steps do not use. Rank 0 prints the table; a cell that differs from EXPECTED fails the check
with the whole table."""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from loom.comm import ProgressThread
from loom.parallel.zero import ShardedDataParallel
from loom.testing import mpi_checks, seeded
from tests.mpi.check_zero_deep import watchdog

TOL = 1e-10
ROWS = 12  # global batch, divisible by 1-4 ranks
STEPS = 3
LR = 0.05
MAX_NORM = 0.05  # below every step's gradient norm here: the clip engages (checked on the reference)
SMALL = 0.0015  # MiB: several buckets (a 13x13 fp64 Linear is 1.3 KiB)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.bn = nn.BatchNorm1d(7)  # first: a per-feature affine before it would get an exactly-zero gradient,
        # whose fp64 rounding Adam (dividing by its root mean square) would blow up to ~1e-8
        self.mid = nn.Linear(13, 13)
        self.sometimes = nn.Linear(13, 13)
        self.head = nn.Linear(13, 5)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 13))
        self.extra = nn.Parameter(torch.linspace(-0.2, 0.2, 13))

    def forward(self, x, use: bool = True, half: bool = False):
        h = self.norm(torch.tanh(self.inp(self.bn(x)))) * self.gain
        h = h + torch.tanh(self.mid(h))
        if use:
            h = h + torch.tanh(self.sometimes(h))
        if use or not half:  # half: the root module's `extra` follows the branch, its `gain` does not
            h = h + self.extra
        return self.head(h)


def _model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def _always(step: int, rank: int) -> bool:
    return True


def _sometimes(step: int, rank: int) -> bool:
    """Step 1: no rank uses the branch; step 2: rank 0 only."""
    return not (step == 1 or step == 2 and rank)


class Habit:
    """One row: how the loop trains (``train(cell)``), what the reference does alike, and per stage what the
    cell must give (``expect``: "exact" or the error's class name) with a word its message must contain."""

    def __init__(self, name: str, train: Callable, *, expect: dict[int, str] | None = None, says: str = "",
                 uses: Callable = _always, micro: int = 1, clip: bool = False, skip: bool = False,
                 half: bool = False, per_rank_seed: bool = False, load: bool = False, **sdp_kw):
        self.name, self.train, self.expect, self.says = name, train, expect or {}, says
        self.uses, self.micro, self.clip, self.skip, self.half = uses, micro, clip, skip, half
        self.per_rank_seed, self.load, self.sdp_kw = per_rank_seed, load, sdp_kw

    def wants(self, stage: int) -> str:
        return self.expect.get(stage, "exact")


def _rows(t, rank, size):
    n = ROWS // size
    return t[rank * n:(rank + 1) * n]


def _local_losses(fwd, habit, x, y, step, rank, size):
    """This rank's share of the global mean loss, one tensor per micro-batch (they sum to the rank's mean)."""
    xs, ys = _rows(x, rank, size), _rows(y, rank, size)
    return [((fwd(xm, habit.uses(step, rank), habit.half) - ym) ** 2).sum() / ys.numel()
            for xm, ym in zip(xs.chunk(habit.micro), ys.chunk(habit.micro))]


def _reference(habit: Habit, seed: int, data, size: int) -> dict[str, torch.Tensor]:
    """One process over the global batch: the mean of the virtual ranks' losses; BatchNorm's statistics as rank
    0 leaves them (each virtual rank starts the step from them); missing gradients zero (or, with ``skip``,
    None: torch's optimizer skips the parameter)."""
    model = _model(seed)
    if habit.load:
        model.load_state_dict(_model(seed + 1).state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=LR)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=habit.skip)
        start = {k: v.clone() for k, v in model.named_buffers()}
        after0 = None
        for r in range(size):
            for k, v in model.named_buffers():
                v.copy_(start[k])
            for loss in _local_losses(model, habit, x, y, step, r, size):
                (loss / size).backward()
            if r == 0:
                after0 = {k: v.clone() for k, v in model.named_buffers()}
        for k, v in model.named_buffers():
            v.copy_(after0[k])
        if habit.clip:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            assert norm > MAX_NORM, f"the reference's clip does not engage ({float(norm)}): lower MAX_NORM"
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Cell:
    """What one loop needs: the wrapper, the wrapped model, the data, this rank."""

    def __init__(self, habit, sdp, model, data, comm):
        self.habit, self.sdp, self.model, self.data, self.comm = habit, sdp, model, data, comm

    def losses(self, step, fwd=None):
        x, y = self.data[step]
        return _local_losses(self.sdp if fwd is None else fwd, self.habit, x, y, step, self.comm.rank, self.comm.size)

    def state(self) -> dict[str, torch.Tensor]:
        return self.sdp.state_dict()


# ---------------------------------------------------------------------------------------------- the loops
def _plain(c: Cell, *, fwd=None, zero=None, opt=None, scaler=None):
    """``opt.zero_grad(); loss.backward() per micro-batch; [clip]; opt.step()``: the DDP / FSDP2 loop."""
    opt = opt or torch.optim.Adam(c.sdp.parameters(), lr=LR)
    for step in range(STEPS):
        if zero is not None:
            zero()
        else:  # a missing gradient is None (skipped) or zeros (stepped), as the reference's
            opt.zero_grad(set_to_none=c.habit.skip)
        for loss in c.losses(step, fwd):
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if c.habit.clip:
            torch.nn.utils.clip_grad_norm_(c.sdp.parameters(), MAX_NORM)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def _no_sync(c: Cell):
    opt = torch.optim.Adam(c.sdp.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        first, *rest = c.losses(step)
        with c.sdp.no_sync():
            first.backward()
        for loss in rest:
            loss.backward()
        opt.step()


def _inner_forward(c: Cell):
    _plain(c, fwd=c.model)


def _inner_forward_after_error(c: Cell):
    """A forward that raises (a 1-D input, refused by the BatchNorm before it counts a batch) leaves nothing
    behind: the next ones are whole again."""
    try:
        c.model(torch.randn(7, dtype=torch.float64))
    except ValueError:
        pass
    else:
        raise AssertionError("a 1-D input to BatchNorm1d was accepted")
    _plain(c, fwd=c.model)


def _inner_zero_grad(c: Cell):
    opt = torch.optim.Adam(c.sdp.parameters(), lr=LR)
    _plain(c, zero=c.model.zero_grad, opt=opt)


def _inner_optimizer(c: Cell):
    _plain(c, opt=torch.optim.Adam([p for p in c.model.parameters() if p.requires_grad], lr=LR))


def _inner_state_dict(c: Cell):
    _plain(c)
    c.state = lambda: {k: v.clone() for k, v in c.model.state_dict().items()}


def _load(c: Cell):
    c.sdp.load_state_dict(_model(c.habit.seed + 1).state_dict())
    _plain(c)


def _inner_load(c: Cell):
    c.model.load_state_dict(_model(c.habit.seed + 1).state_dict())
    _plain(c)


def _scaler(c: Cell):
    _plain(c, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))


def _compiled(c: Cell):
    _plain(c, fwd=torch.compile(c.sdp, backend="eager"))


HABITS = [
    Habit("backward; clip_grad_norm_(sdp.parameters()); step", _plain, clip=True),
    Habit("2 backward() per step (no micro_batches=)", _plain, micro=2),
    Habit("no_sync() for the first of 2 backward()", _no_sync, micro=2),
    Habit("each rank builds its own model (seeded by rank)", _plain, per_rank_seed=True),
    Habit("BatchNorm + unused branch, one bucket", _plain, uses=_sometimes, bucket_mb=64),
    Habit("forward through the wrapped module", _inner_forward),
    Habit("forward through the wrapped module after one raised", _inner_forward_after_error),
    Habit("wrapped module's zero_grad()", _inner_zero_grad),
    Habit("optimizer over the wrapped module's parameters", _inner_optimizer,
          expect={1: "ValueError", 2: "ValueError", 3: "ValueError"}, says="sdp.parameters()"),
    Habit("wrapped module's state_dict() after training", _inner_state_dict, expect={3: "ValueError"},
          says="sdp.state_dict()"),
    Habit("sdp.load_state_dict(), then train", _load, load=True),
    Habit("wrapped module's load_state_dict(), then train", _inner_load, load=True, expect={3: "ValueError"},
          says="sdp.load_state_dict("),
    Habit("missing_grad='skip', one bucket", _plain, uses=_sometimes, skip=True, clip=True, bucket_mb=64,
          missing_grad="skip"),
    Habit("missing_grad='skip', a module half used", _plain, uses=_sometimes, skip=True, half=True,
          missing_grad="skip", expect={1: "ValueError", 2: "ValueError", 3: "ValueError"}, says="'extra'"),
    Habit("GradScaler: unscale_, clip, step, update", _scaler, clip=True),
    Habit("torch.compile(sdp) (stage 3: runs uncompiled)", _compiled),
]


def _run_cell(habit: Habit, stage: int, mode: str, seed: int, data, comm) -> str:
    model = _model(seed + 1000 * comm.rank if habit.per_rank_seed else seed)
    kw = {"bucket_mb": SMALL, **habit.sdp_kw}
    sdp = ShardedDataParallel(model, comm, stage=stage, progress=mode, **kw)
    cell = Cell(habit, sdp, model, data, comm)
    try:
        try:
            habit.train(cell)
            got = cell.state()
        except Exception as exc:  # the habit's refusal: every rank raises it at the same point
            kind = type(exc).__name__
            if type(exc).__module__.startswith("torch._dynamo") and "ValueError: " in str(exc):
                kind = "ValueError"  # dynamo re-raises an error of the traced code as its own, "ValueError: text"
            named = not habit.says or habit.says in str(exc)
            return f"raises {kind}" + ("" if named else " (not naming the fix)")
        err = max(float((got[k].double() - v.double()).abs().max()) if v.numel() else 0.0
                  for k, v in habit.want.items()) if got.keys() == habit.want.keys() else float("inf")
        for name, p in [*model.named_parameters(), *model.named_buffers()]:  # what the module computes with
            if stage < 3 or not p.requires_grad:
                err = max(err, float((p.detach().double() - habit.want[name].double()).abs().max()))
        err = comm.allreduce(torch.tensor([err], dtype=torch.float64), op="max").item()
        return "exact" if err < TOL else f"differs {err:.1e}"
    finally:
        sdp.remove()


def check_habit_table(comm):
    """Every habit x stage 0-3 x progress mode, against EXPECTED (each cell's answer, or the error it raises)."""
    g = seeded(comm, 33)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = [(torch.randn(ROWS, 7, generator=g, dtype=torch.float64),
             torch.randn(ROWS, 5, generator=g, dtype=torch.float64)) for _ in range(STEPS)]
    modes = ("hooks", "thread") if comm.size > 1 and ProgressThread.available() else ("hooks",)
    table, wrong = [], []
    with watchdog(comm):
        for habit in HABITS:
            habit.seed = seed
            habit.want = _reference(habit, seed, data, comm.size)
            row = []
            for stage in (0, 1, 2, 3):
                for mode in modes:
                    got = _run_cell(habit, stage, mode, seed, data, comm)
                    want = habit.wants(stage)
                    if got != (want if want == "exact" else f"raises {want}"):
                        wrong.append(f"{habit.name} @ stage {stage} ({mode}): {got}, expected {want}")
                    row.append(got)
            table.append((habit.name, row))
    if comm.rank == 0:
        cols = [f"{s}/{m[0]}" for s in range(4) for m in modes]
        print(f"  habit x stage/progress (h: hooks, t: thread) at {comm.size} ranks, fp64 vs one process, "
              f"tolerance {TOL}:", file=sys.stderr, flush=True)
        print("  " + f"{'habit':52s}" + "".join(f"{c:>20s}" for c in cols), file=sys.stderr, flush=True)
        for name, row in table:
            print("  " + f"{name[:52]:52s}" + "".join(f"{c:>20s}" for c in row), file=sys.stderr, flush=True)
    assert not wrong, "habits that differ from the expected table:\n" + "\n".join(wrong)


if __name__ == "__main__":
    mpi_checks(globals())
