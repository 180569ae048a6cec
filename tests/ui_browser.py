"""Debian's Chromium, headless, driven by selenium through Debian's chromedriver (no browser or driver is
downloaded): open a page of Prefect's UI, wait for what it renders, read each image's natural width and alt
text, take a screenshot. `.ci/run` installs the two packages where they are missing."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# As root on a machine without a network: no sandbox, no GPU, none of Chromium's background connections
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1800")


def missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            return f"{path} is missing: apt-get install chromium chromium-driver (.ci/run does it)"
    return None


@contextlib.contextmanager
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="loraflow-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


IMAGES_JS = "return Array.from(document.images).map(i => [i.alt, i.naturalWidth, i.complete, i.src.slice(0, 22)])"


def wait_for_images(driver, url: str, count: int, alt_contains: str = "", timeout: float = 90) -> list[dict]:
    """Opens `url` and waits until `count` images whose alt text contains `alt_contains` have loaded (or the
    time is up); returns every image of the page as {alt, natural_width, complete, src}."""
    driver.get(url)
    deadline = time.monotonic() + timeout
    while True:
        images = [{"alt": a, "natural_width": w, "complete": c, "src": s} for a, w, c, s in driver.execute_script(IMAGES_JS)]
        loaded = [i for i in images if alt_contains in i["alt"] and i["complete"] and i["natural_width"] > 0]
        if len(loaded) >= count or time.monotonic() > deadline:
            return images
        time.sleep(0.5)


def wait_for_text(driver, url: str, text: str, timeout: float = 90) -> str:
    """Opens `url` and waits until the rendered page shows `text`; returns the page's text."""
    driver.get(url)
    deadline = time.monotonic() + timeout
    while text not in (shown := page_text(driver)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return shown


def page_text(driver) -> str:
    return driver.execute_script("return document.body.innerText")


def screenshot(driver, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    return path
