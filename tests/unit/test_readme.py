"""README.md is assembled from docs/readme/*.md; a hand edit to one copy only is caught here."""

import subprocess
import sys

from loom.testing import ROOT


def test_readme_is_assembled_from_sections():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_readme.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
