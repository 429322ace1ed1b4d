"""The ``loom`` command: ``loom <command> [args]``.

Each command lives in its own module exposing ``main(argv: list[str]) -> int`` (and usually an argparse
parser); this file only dispatches, so ``loom --help`` stays fast and capabilities stay decoupled.

``--ranks N`` / ``-n N`` (any command that communicates): when not already inside an MPI job, loom re-launches
itself under the bundled ``mpiexec -n N``; inside a job (``mpiexec -n N loom ...``) the flag is ignored. A
command module with ``OWN_RANKS = True`` parses ``--ranks`` in its own parser and launches its ranks itself
(``loom dask run``: the arguments of its script are not loom's). Shared flags and their one
meaning each come from :mod:`loom.cli_args`.

Ctrl-C (SIGINT) or SIGTERM stops a command with one line and exit code 130 / 143, never a traceback. With
``--ranks N`` this process stops the whole job (:func:`loom.comm.launch.run`) and prints the line; on a rank
(under ``--ranks N`` or a plain ``mpiexec``) the command unwinds (a run directory's lock is released; a
checkpoint being written is dropped, the last complete one stays), rank 0 of a plain ``mpiexec`` job prints the
line, and the rank leaves at once: finalizing MPI would wait on peers that may be inside a collective.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from . import settings
from .cli_args import UsageError, follower_wait, leave_now, offer_ranks, pop_ranks

__all__ = ["main", "COMMANDS", "pop_ranks"]

# name -> (module, one-line description). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("loom.tour", "the demo job on local ranks (what `make demo` runs)"),
    "bench": ("loom.bench.cli", "benchmarks: OMB-style comm tables and application benchmarks"),
    "train": ("loom.train.cli", "train a Llama-style model: long-context, hybrid-parallel, compressed"),
    "generate": ("loom.train.generate", "sample text from a trained checkpoint"),
    "plan": ("loom.multipath.cli", "plan multi-path routes for an all-to-all demand and compare baselines"),
    "testbed": ("loom.testbed.cli", "emulated multi-node, multi-rail cluster (needs root)"),
    "dask": ("loom.dask.cli", "run a Dask script over MPI (scheduler, client and workers as ranks)"),
    "run": ("loom.torchdist.cli", "run a torch.distributed script on MPI ranks (backend \"loom\"; torchrun's role)"),
}

def _inside_mpi() -> bool:
    """Whether this process is already a rank of an MPI job (a launcher's variables, or loom's own mark)."""
    from .comm import launch

    return launch.inside_job()


def relaunch(ranks: int, argv: list[str]) -> int:
    """Run ``loom argv`` on ``ranks`` local ranks with the bundled mpiexec; returns its exit code (128 + the
    signal when this process was interrupted: the job is stopped first)."""
    from .comm import launch

    env = {"LOOM_LAUNCHED": "1"}
    cores = os.cpu_count() or 1
    if ranks > cores:
        sys.stderr.write(f"loom {argv[0]}: {ranks} ranks on {cores} cores: ranks share cores (a waiting rank spins), "
                         f"so results are right but timings are oversubscribed\n")
    try:
        proc = launch.run(ranks, [sys.executable, "-m", "loom.cli", *argv], env=env)
    except launch.Interrupted as exc:
        sys.stderr.write(f"loom {argv[0]}: interrupted by {signal.Signals(exc.signum).name}; "
                         f"stopped its {ranks}-rank job\n")
        return 128 + exc.signum
    return proc.returncode


_caught: list[int] = []
_armed = [True]  # whether the next signal raises: only the first does, unless a finalizer swallowed it
_again: list[threading.Timer] = []  # a swallowed interrupt's re-raise, pending; cancelled when the command ends
_said = threading.Lock()  # taken by whichever thread writes the one interrupt line


def _on_signal(signum, frame):
    """SIGTERM (and, on a rank, SIGINT): the first unwinds the command as Ctrl-C does; later ones (a terminal's
    Ctrl-C reaches a rank both from the terminal and through the launcher) are noted, not raised again."""
    from .comm import launch

    _caught.append(signum)
    launch.note_stop(signum)
    if _armed[0]:
        _armed[0] = False
        raise KeyboardInterrupt


def _unraisable(previous):
    """``sys.unraisablehook`` while a command runs: a signal handler runs wherever the main thread is, and when
    that is a finalizer (``__del__``, a weakref callback) Python only reports the ``KeyboardInterrupt`` and
    carries on, so the command would go on running (a rank, while its peers stop). Such a lost interrupt is
    raised again, in silence, from a moment later (``_thread.interrupt_main`` from a timer thread: called here,
    the handler would run inside this hook and be lost the same way); one that lands in a finalizer again comes
    back here. A command that keeps Python's own SIGINT handler gets its Ctrl-C back the same way."""
    import _thread

    def hook(args):
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
            _armed[0] = True
            signum = _caught[0] if _caught else signal.SIGINT
            timer = threading.Timer(0.01, _thread.interrupt_main, args=(signum,))
            _again.append(timer)
            timer.start()
            return
        previous(args)

    return hook


def _say(name: str, signum: int) -> None:
    if _said.acquire(blocking=False):
        sys.stderr.write(f"loom {name}: interrupted by {signal.Signals(signum).name}; stopped\n")
        sys.stderr.flush()


def _watch(name: str, sock) -> None:
    """Rank 0's line as soon as the signal arrives: Python runs signal handlers on the main thread only when
    it gets control back, which a rank waiting inside an MPI call may never do (the launcher then kills it);
    the wake-up byte reaches this thread at once."""
    while True:
        try:
            data = sock.recv(1)
        except OSError:
            return
        if not data:
            return
        if data[0] in (signal.SIGINT, signal.SIGTERM):
            _say(name, data[0])
            return


def _run(name: str, module_name: str, rest: list[str]) -> int:
    """The command's ``main(rest)``, with SIGTERM unwinding it as Ctrl-C does (main thread only)."""
    from .comm import launch

    global _said
    previous: dict[int, object] = {}
    wake = unraisable = None
    _caught.clear()
    launch.note_stop(None)
    _armed[0] = True
    _said = threading.Lock()
    if threading.current_thread() is threading.main_thread():
        inside = launch.inside_job()
        for sig in (signal.SIGTERM, signal.SIGINT) if inside else (signal.SIGTERM,):
            previous[sig] = signal.signal(sig, _on_signal)
        unraisable = sys.unraisablehook
        sys.unraisablehook = _unraisable(unraisable)
        if inside and settings.launch_rank() == 0 and not settings.get("launched"):
            import socket

            reader, writer = socket.socketpair()
            writer.setblocking(False)
            wake = (signal.set_wakeup_fd(writer.fileno()), reader, writer)
            threading.Thread(target=_watch, args=(name, reader), daemon=True, name="loom-interrupt").start()
    try:
        return int(_module(module_name).main(rest) or 0)
    except KeyboardInterrupt as exc:  # a job the command launched itself reports its signal (launch.Interrupted)
        _armed[0] = False  # a lost interrupt raised again late must not cut the unwinding short
        return _interrupted(name, getattr(exc, "signum", None) or (_caught[0] if _caught else signal.SIGINT))
    except BaseException:
        _armed[0] = False
        if not _caught:
            raise
        # What fails once the job is being stopped (a collective whose peer has already left) is the signal's
        # doing, not a bug to report with a traceback and MPI_Abort.
        return _interrupted(name, _caught[0])
    finally:
        for timer in _again:  # the command has ended: a late re-raise would land in whatever runs next
            timer.cancel()
        _again.clear()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if unraisable is not None:
            sys.unraisablehook = unraisable
        launch.note_stop(None)  # a process that goes on (a caller of main()) is not being stopped
        if wake is not None:
            signal.set_wakeup_fd(wake[0])
            wake[2].close()  # the watcher sees the end of its socket and returns
            wake[1].close()


def _interrupted(name: str, signum: int) -> int:
    """One line (by rank 0, unless loom's launcher prints it), then exit code ``128 + signum``; a rank of a
    job leaves at once."""
    from .comm import launch

    code = 128 + signum
    inside = launch.inside_job()
    launched = bool(settings.get("launched"))
    if settings.launch_rank() == 0 and not launched:
        _say(name, signum)
    elif inside:
        # The launcher ends the job when the first rank leaves: let rank 0 write its line and release what it
        # holds (a run directory's lock) first.
        follower_wait(1.0)
    if not inside:
        return code
    leave_now(code)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: loom <command> [--ranks N] [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`loom <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"loom {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"loom: unknown command {name!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = _module(module_name)
    except SystemExit as exc:  # a command module missing from this build: one line
        print(exc.code, file=sys.stderr)
        return 1
    # A command that loom launches on --ranks N lists the flag in its --help (a command with its own --ranks,
    # or that never runs on ranks, does not).
    offer_ranks(getattr(module, "RELAUNCH", True) and not getattr(module, "OWN_RANKS", False))
    if "--help" not in rest and "-h" not in rest:
        try:
            rest = _dispatch_ranks(name, module, rest)
        except UsageError as exc:
            if settings.launch_rank() == 0:
                print(f"loom {name}: error: {exc}", file=sys.stderr)
            else:
                follower_wait()
            return 2
        if isinstance(rest, int):
            return rest
    try:
        return _run(name, module_name, rest)
    except SystemExit as exc:  # argparse's --help and usage errors: main() returns the exit code like the shell sees
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


def _dispatch_ranks(name: str, module, rest: list[str]) -> list[str] | int:
    """Handle ``--ranks``: relaunch on N ranks (an exit code), or the arguments left for the command."""
    if getattr(module, "OWN_RANKS", False):
        return rest  # the command's own parser reads --ranks
    tail: list[str] = []
    if getattr(module, "SCRIPT_ARGS", False):  # `loom run --ranks 2 x.py -n 5`: -n 5 is the script's
        rest, tail = _before_script(rest)
    ranks, rest_wo = pop_ranks(rest)
    rest_wo += tail
    if ranks is not None and not _inside_mpi() and getattr(module, "RELAUNCH", True):
        return relaunch(ranks, [name, *rest_wo])
    return rest_wo


def _before_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split at its first positional argument (a command's script): loom's options, then the script's."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--ranks", "-n"):
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            break
    return argv[:i], argv[i:]


def _module(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SystemExit(f"loom: command module {module_name} is not available in this build ({exc})") from exc
        raise


if __name__ == "__main__":
    sys.exit(main())
