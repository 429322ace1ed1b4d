"""README.md is assembled from docs/readme/*.md; a hand edit to one copy only is caught here."""

import argparse
import re
import shlex
import subprocess
import sys

from loom.testing import ROOT


def test_readme_is_assembled_from_sections():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_readme.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# Inline `loom ...` spans in prose name whole commands (mostly benchmarks that run for minutes). Each must at
# least parse with today's flags; placeholders (N, NAME, DIR, ...), a bare command's name and quoted output lines
# are not commands.
_PLACEHOLDER = re.compile(r"\.\.\.|<|\b(N|B|CMD|NAME|DIR|DIR_OR_JSON|TOML)\b|^loom \w+:|\(pid|^loom [\w-]+$|--help")


class _Parsed(Exception):
    """Raised by the patched parser once a command's arguments parsed: nothing after parsing runs."""


def _inline_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    spans = sorted(set(re.findall(r"`(loom [^`]*)`", text)))
    return [s for s in spans if not _PLACEHOLDER.search(s) and not s.endswith("--ranks")]


def _check_rest(prog: str, rest: list[str]) -> None:
    """What a command's parser left over: loom train's ``--section.key=value`` overrides (validated as the
    run would), a Dask script's own arguments; anything else is an unknown flag."""
    if prog == "loom train":
        from loom.train.config import load_config

        load_config(None, rest)
    elif rest and prog != "loom dask run":
        raise ValueError(f"unrecognized arguments {rest}")


def test_inline_commands_in_the_prose_parse(monkeypatch):
    from loom import cli

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = parse(self, args, namespace)
        raise _Parsed(self.prog, rest)

    parse = argparse.ArgumentParser.parse_known_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setenv("LOOM_LAUNCHED", "1")  # inside a job already: --ranks is not a relaunch
    commands = _inline_commands()
    assert len(commands) >= 20, commands  # the filter must not hide the README's commands
    bad = []
    for command in commands:
        try:
            rc = cli.main(shlex.split(command)[1:])
        except _Parsed as parsed:
            prog, rest = parsed.args
            try:
                _check_rest(prog, rest)
            except Exception as exc:  # noqa: BLE001 - any rejection is reported with the command
                bad.append(f"{command} -> {exc}")
            continue
        except SystemExit as exc:  # argparse's usage error (2) or --help (0)
            rc = exc.code
            if rc == 0:
                continue
        bad.append(f"{command} -> exit {rc}")
    assert not bad, "README commands that do not parse:\n" + "\n".join(bad)
