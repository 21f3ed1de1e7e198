"""The documentation site as a reader sees it: built with ``mkdocs build --strict`` into a
temporary folder, served over HTTP, and read in headless Chromium through selenium.

Every page the build made loads without a console error (level SEVERE: a failed script,
a missing image, a refused request), the navigation links reach every one of them, and
the site's own search finds ``CheckpointWriter``. The browser comes from Debian's
``chromium`` and ``chromium-driver`` (``.ci/browser`` installs them); without chromium the
tests skip and say why.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BROWSER_STATE = REPO / ".cache" / "browser"


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The site, built strictly (a broken link, anchor or page fails) into a temp folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


@pytest.fixture(scope="session")
def base_url(site: pathlib.Path) -> Iterator[str]:
    """The built site served on 127.0.0.1 (search loads its index over HTTP)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _chromium() -> tuple[str, str]:
    """The chromium and chromedriver paths, or skip saying why they are missing."""
    ready = BROWSER_STATE / "ready"
    if ready.exists():
        chromium, driver = ready.read_text().split()[:2]
        if pathlib.Path(chromium).exists() and pathlib.Path(driver).exists():
            return chromium, driver
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    skipped = BROWSER_STATE / "skipped"
    why = skipped.read_text().strip() if skipped.exists() else ".ci/browser has not run"
    pytest.skip(f"docs tier: no chromium and chromedriver ({why})")


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium through selenium, keeping the console log of every page."""
    chromium, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _pages(site: pathlib.Path) -> set[str]:
    """Every page the build made, as its URL path ("" for the home page, "cli/", ...)."""
    pages = set()
    for index in site.rglob("index.html"):
        relative = index.parent.relative_to(site).as_posix()
        if relative.startswith(("assets", "search", "plots")):
            continue
        pages.add("" if relative == "." else relative + "/")
    return pages


def _severe(browser: Any) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def test_every_page_loads_without_console_errors(
    browser: Any, base_url: str, site: pathlib.Path
) -> None:
    pages = _pages(site)
    assert {"", "getting-started/", "reference/api/", "service/"} <= pages
    browser.get(base_url)
    _severe(browser)  # the log is per session: start from an empty one
    errors = {}
    for page in sorted(pages):
        browser.get(base_url + page)
        assert browser.find_element("css selector", "article h1").text, page
        if found := _severe(browser):
            errors[page] = found
    assert errors == {}


def test_navigation_reaches_every_page(browser: Any, base_url: str, site: pathlib.Path) -> None:
    browser.get(base_url)
    links = browser.find_elements("css selector", "nav.md-nav--primary a.md-nav__link[href]")
    reached = set()
    for link in links:
        href = link.get_attribute("href") or ""
        if href.startswith(base_url):
            reached.add(href[len(base_url) :].split("#", 1)[0])
    assert sorted(_pages(site) - reached) == []


def test_search_finds_checkpoint_writer(browser: Any, base_url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(base_url)
    browser.execute_script("document.querySelector('[data-md-toggle=search]').checked = true")
    box = browser.find_element("css selector", "input.md-search__input")
    box.send_keys("CheckpointWriter")

    def results(driver: Any) -> list[str]:
        items = driver.find_elements("css selector", ".md-search-result__item")
        return [item.get_attribute("textContent") or "" for item in items]

    found = WebDriverWait(browser, 20).until(results)
    assert any("CheckpointWriter" in text for text in found), found
    assert _severe(browser) == []
