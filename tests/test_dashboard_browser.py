"""The dashboard in a real browser: Debian's chromium, headless, driven by selenium.

A real `sluice serve` gets a few requests (two share a prefix, so the radix cache hits);
once it is idle the page must show exactly what /get_server_info reports, latency
percentiles for those requests, and a table row per request whose click draws that
request's timeline. The screenshot is kept under tests/artifacts/ (path printed).

The browser is installed when missing (`apt-get install chromium chromium-driver`, as
root); the test is skipped, saying why, only when that is impossible.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import REPO, ServerProcess, poll_until, start_traced_server

ARTIFACTS = REPO / "tests" / "artifacts"
BROWSER, DRIVER = "chromium", "chromedriver"
TIMEOUT_S = 30


def _browser() -> tuple[str, str]:
    """Paths of chromium and its driver, installing them (Debian, as root) when missing."""
    found = shutil.which(BROWSER), shutil.which(DRIVER)
    if None in found and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=900)
        found = shutil.which(BROWSER), shutil.which(DRIVER)
    browser, driver = found
    if browser is None or driver is None:
        reason = "the dashboard browser test needs chromium and chromium-driver, which could not be installed here"
        print(reason)
        pytest.skip(reason)
    return browser, driver


@pytest.fixture(scope="module")
def traced_server() -> ServerProcess:
    return start_traced_server()


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, chromedriver = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def test_the_dashboard_shows_the_servers_numbers_and_a_requests_timeline(traced_server: ServerProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = traced_server
    prefix = "The river rose slowly through the night, and by morning the low fields were under water. "
    with server.client() as http:
        for i, tail in enumerate(["What rose?", "When did it rise?", "Hi"]):
            text = (prefix + tail) if i < 2 else tail
            body = {"text": text, "rid": f"dash-{i}", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
            assert http.post("/generate", json=body).status_code == 200
    # Idle (nothing on the page may move any more), the prefix cache kept.
    info = poll_until(lambda: (i := server.server_info())["num_running_reqs"] == 0 and i["num_waiting_reqs"] == 0 and i,
                      timeout=60, what="the server to go idle")

    browser.get(f"{server.base_url}/dashboard#key={server.api_key}")
    shown: dict[str, Any] = {}

    def page_matches(driver: Any) -> bool:
        shown.clear()
        for el in driver.find_elements(By.CSS_SELECTOR, '[data-key^="server."]'):
            value = el.get_attribute("data-value")
            shown[el.get_attribute("data-key").removeprefix("server.")] = None if value is None else json.loads(value)
        return bool(shown) and all(_close(v, info[k]) for k, v in shown.items())

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    try:
        WebDriverWait(browser, TIMEOUT_S).until(page_matches)
        assert info["tree_cache_tokens"] > 0
        assert {"token_usage", "evictable_kv_tokens", "num_running_reqs", "num_waiting_reqs", "num_retracted_reqs_total",
                "cache_hit_rate", "tree_cache_tokens", "num_requests_total"} <= set(shown)
        assert info["cached_tokens_total"] > 0 and shown["cache_hit_rate"] > 0  # the shared prefix hit

        ttft_count = browser.find_element(By.CSS_SELECTOR, '[data-key="latency.ttft.count"]').get_attribute("data-value")
        assert json.loads(ttft_count) >= 3
        p50 = json.loads(browser.find_element(By.CSS_SELECTOR, '[data-key="latency.itl.p50"]').get_attribute("data-value"))
        assert p50 is not None and p50 > 0

        row = WebDriverWait(browser, TIMEOUT_S).until(lambda d: d.find_element(By.CSS_SELECTOR, 'tr[data-rid="dash-1"]'))
        row.click()
        WebDriverWait(browser, TIMEOUT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline rect.span-decode"))
        drawn = {r.get_attribute("data-name") for r in browser.find_elements(By.CSS_SELECTOR, "#timeline rect.span")}
        assert {"queue", "prefill", "decode"} <= drawn
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline line.chunk")  # its prefill chunk
        assert browser.find_element(By.ID, "trace-rid").text == "dash-1"
        assert browser.find_element(By.ID, "trace-state").text.startswith("finished (")
    finally:
        browser.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
    assert Path(shot).stat().st_size > 0
