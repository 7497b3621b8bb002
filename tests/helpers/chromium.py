"""Headless Chromium for tests that render pages: Debian's /usr/bin/chromium driven by playwright (no browser
download); the test skips where either is missing."""
import contextlib
import shutil

import pytest

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def chromium_path():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def headless_chromium():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not chromium_path():
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
