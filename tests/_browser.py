"""Helpers of the browser checks: headless Chromium from Debian (never a downloaded one), a
`synctune ui` server stopped by its own process group, and waiting for text on a page."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import selenium  # noqa: F401 - a test dependency: a broken install fails, never skips

from _optional import optional_mark

from synctune.engine.local import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
#: Modules that import this skip, with the reason, where Chromium is missing (fail under CI).
pytestmark = optional_mark("Chromium with chromedriver",
                           None if CHROMIUM and CHROMEDRIVER else
                           "Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; "
                           ".ci/run does this)")


def browser():
    """A headless Chromium driven through its Debian chromedriver; console messages are kept
    (``driver.get_log("browser")``). Its profile folder goes away with ``driver.quit()``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="synctune-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1600,1000", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium must not try to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    quit_ = driver.quit

    def quit_and_clean():
        try:
            quit_()
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    driver.quit = quit_and_clean
    return driver


def wait_text(driver, text: str, timeout_s: float = 60.0) -> str:
    """Wait until the page's text contains ``text``; returns the page text."""
    from selenium.webdriver.common.by import By

    until = time.monotonic() + timeout_s
    body = ""
    while time.monotonic() < until:
        body = driver.find_element(By.TAG_NAME, "body").text
        if text in body:
            return body
        time.sleep(0.5)
    raise AssertionError(f"{text!r} did not appear within {timeout_s:g} s; page shows: {body[:800]!r}")


def wait_until_serving(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Wait until the `synctune ui` process ``proc`` answers on ``port``; fail the test if it
    exits or ``timeout_s`` passes first."""
    until = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > until:
            pytest.fail(f"synctune ui did not come up on port {port} (exit status {proc.poll()})")
        time.sleep(1)


@contextlib.contextmanager
def serve_ui(home: Path):
    """`synctune ui` on a free port of 127.0.0.1 for the data home ``home``; yields its URL and
    stops the server's whole process group afterwards."""
    port = free_port()
    env = dict(os.environ, SYNCTUNE_HOME=str(home))
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "ui", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_serving(proc, port, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_session(proc)


def stop_session(proc) -> None:
    """Stop the process session ``proc`` leads (the UI runs worker processes of its own): SIGTERM
    to the whole session, SIGKILL if it has not gone within 20 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
