"""Headless Chromium for the page's tests (Debian's chromium and chromium-driver, driven by
Selenium), started by the test module that uses it and stopped by PID; sign-in, waiting on
the page's state, and screenshots to runs/screenshots (or $PSTAR_SCREENSHOT_DIR)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = Path(os.environ.get("PSTAR_SCREENSHOT_DIR", ROOT / "runs" / "screenshots"))


def browser_binaries() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        why = "Debian's chromium and chromium-driver are missing (scripts/test.sh installs them)"
        if os.environ.get("PSTAR_TESTS_WITHOUT_BROWSER") == "1":
            pytest.skip(why + " (PSTAR_TESTS_WITHOUT_BROWSER=1)")
        pytest.fail(why + ", or set PSTAR_TESTS_WITHOUT_BROWSER=1 to skip the browser tests")
    return chromium, driver


@contextlib.contextmanager
def chromium_session():
    """A Chrome WebDriver on headless Chromium, quit (and its driver killed by PID) after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = browser_binaries()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1400,2200")
    service = Service(driver_path)
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        pid = service.process.pid if service.process else None
        driver.quit()
        if pid is not None:  # chromedriver (and with it the browser) is gone, by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def sign_in(browser, serve, token: str) -> None:
    browser.get(f"{serve.url}/ui/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{serve.url}/ui/")
    wait_page(browser, "return !!document.querySelector('#token')", "the sign-in form")
    browser.find_element("css selector", "#token").send_keys(token)
    browser.find_element("css selector", "#signin button").click()


def wait_page(browser, script: str, what: str, timeout: float = 60):
    """Poll `script` until it returns something true. A script that throws counts as
    not yet: right after a navigation the element it reads may not be rendered (CI once
    read `#try` as null there); the last error is told if it never comes."""
    from selenium.common.exceptions import JavascriptException

    deadline = time.time() + timeout
    error = None
    while time.time() < deadline:
        try:
            got = browser.execute_script(script)
        except JavascriptException as e:
            got, error = None, e
        if got:
            return got
        time.sleep(0.25)
    said = f" (the script last failed: {error.msg})" if error is not None else ""
    raise AssertionError(f"the page never showed {what} in {timeout:.0f} s{said}")


def shot(browser, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    browser.save_screenshot(str(path))
    return path
