"""The built site in a real browser: headless Chromium renders the home page with its theme.

`make docs --strict` checks links, anchors and references, not what a reader sees: a stylesheet or theme asset
that fails to load leaves a page of unstyled text that no build check notices. This takes one screenshot of
site/index.html (under a second) and checks that the theme's header bar and the page's text are there.

It needs the built site (`make docs`) and Chromium (`apt-get install chromium`), and skips without either:
CI does not install Chromium (a few hundred MB of packages on every run for this one check); `make docs`
there builds with the strict checks.
"""

import shutil
import subprocess

import pytest

from loom.testing import ROOT

SITE = ROOT / "site" / "index.html"
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (apt-get install chromium)")
@pytest.mark.skipif(not SITE.exists(), reason="no built site: run `make docs`")
def test_home_page_renders_with_its_theme(tmp_path):
    image = pytest.importorskip("PIL.Image")
    shot = tmp_path / "home.png"
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=1280,900", SITE.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"Chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    png = image.open(shot).convert("RGB")
    width, _ = png.size
    # The header bar: the theme's primary colour (indigo), not the white of an unstyled page.
    r, g, b = png.getpixel((width // 2, 20))
    assert b > 120 and r < 120 and g < 120, f"header pixel {(r, g, b)}: the theme's stylesheet did not load"
    # The content: dark text on white in the middle of the page.
    body = png.crop((width // 4, 150, 3 * width // 4, 600)).getcolors(maxcolors=1 << 16) or []
    dark = sum(n for n, (r, g, b) in body if r + g + b < 200)
    assert dark > 500, f"{dark} dark pixels in the content area: the page shows no text"
