"""README.md is assembled from docs/readme/*.md; a hand edit to one copy only is caught here."""

import subprocess
import sys


def test_readme_is_assembled_from_sections():
    proc = subprocess.run([sys.executable, "scripts/build_readme.py", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
