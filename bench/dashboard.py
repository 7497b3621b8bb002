"""The dashboard during a `fastdecode bench` sweep, as issue 41 asks it to be checked: a `fastdecode serve` with an
API key, the speed lab's concurrency sweep against it, and the page in headless Chromium twice: with the key (two
screenshots a few seconds apart, which must differ, every chart drawn) and without it (nothing of the requests
shown). Writes the screenshots and a JSON summary with the commit.

    python bench/dashboard.py [--model smollm2-135m] [--out bench/results] [--gap 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fastdecode.agents.server import LaunchedServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.chromium import ARGS, chromium_path  # noqa: E402
from tests.server.test_dashboard import CHARTS, drawn, open_page  # noqa: E402

KEY = "dashboard-check"
def ink(page) -> dict:
    return {chart: {"points": points, "ink_share": dots / area} for chart, (points, dots, area) in drawn(page).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between the two screenshots")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = LaunchedServer(args.model, port, KEY, ["--threads", "2"], Path(tempfile.mkdtemp()) / "serve.log").start()
    endpoint = server.wait_ready()
    sweep = subprocess.Popen(
        [sys.executable, "-m", "fastdecode", "bench", "--endpoint", endpoint.url, "--model", endpoint.model,
         "--api-key-env", "DASHBOARD_KEY", "--mode", "sweep", "--concurrency", "1,2,4", "--per-category", "2",
         "--max-tokens", "96", "--json", str(args.out / "dashboard-sweep.json")],
        env={**os.environ, "DASHBOARD_KEY": KEY}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=ARGS)
            page = open_page(browser, endpoint.url, KEY)
            page.wait_for_function("() => +document.getElementById('c-decode').dataset.points >= 2", timeout=300_000)
            shots = [args.out / "dashboard-1.png", args.out / "dashboard-2.png"]
            page.screenshot(path=str(shots[0]), full_page=True)
            before = ink(page)
            time.sleep(args.gap)
            page.screenshot(path=str(shots[1]), full_page=True)
            after = ink(page)
            anonymous = open_page(browser, endpoint.url, None)
            anonymous.wait_for_function("() => document.getElementById('status').textContent === 'API key required'")
            time.sleep(2)
            anonymous.screenshot(path=str(args.out / "dashboard-no-key.png"), full_page=True)
            hidden = ink(anonymous)
            anonymous_text = anonymous.locator("body").inner_text()
            browser.close()
    finally:
        sweep.terminate()
        sweep.wait(60)
        metrics = httpx.get(f"{endpoint.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        server.stop()
    errors = [line for line in metrics.splitlines() if line.startswith("fastdecode_request_errors_total")
              and 'status="5' in line]
    result = {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": args.model, "gap_s": args.gap,
        "screenshots_differ": shots[0].read_bytes() != shots[1].read_bytes(),
        "charts_before": before, "charts_after": after, "charts_without_key": hidden,
        "page_statuses": sorted(set(page.statuses)), "server_5xx": errors,
        "without_key_shows_requests": any(v["points"] for v in hidden.values()),
        "without_key_status": anonymous_text.split("\n")[0][:200]}
    (args.out / "dashboard.json").write_text(json.dumps(result, indent=2))
    charts_drawn = [c for c in CHARTS if after[c]["points"] and after[c]["ink_share"] > 0.01]
    ok = result["screenshots_differ"] and not errors and not result["without_key_shows_requests"]
    print(f"screenshots differ: {result['screenshots_differ']}; charts drawn: {', '.join(charts_drawn)}; "
          f"5xx: {errors or 'none'}; without the key: {'requests shown' if result['without_key_shows_requests'] else 'nothing shown'}")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
