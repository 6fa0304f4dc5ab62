"""How soon a browser shows the ranks table of `ddtop --serve`: from opening the link to
the first rank's row on the page, in a real headless Chromium.

    .venv/bin/python bench/serve_page.py [--pages 6]

`ddtop --serve 127.0.0.1:0 --replay --speed 0` on the recorded run
(tests/fixtures/runs/recorded-ok) serves the page; each of --pages tabs opens the link
(one after another, each a session of its own: a `ddtop` process) and is timed to its
load event and to the first row of the ranks table in the terminal, then closed. The
first tab also pays the server's first page; the table says the median of the others
besides. Requests to another machine than the server are counted (the target: none).
Needs Debian's chromium and playwright (the test extra).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
RECORDED = HERE / "tests" / "fixtures" / "runs" / "recorded-ok"
DDTOP = str(Path(sys.executable).with_name("ddtop"))
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ROW = re.compile(r"^\s+0\s+\S+\s+\S+", re.MULTILINE)
# How the tests read the terminal of the page (tests/test_serve.py).
FIND_TERMINAL = """
window.__terminals = [];
Object.defineProperty(Object.prototype, '_core', {
  configurable: true,
  set(value) {
    Object.defineProperty(this, '_core', {value, writable: true, configurable: true,
                                          enumerable: true});
    if (typeof this.loadAddon === 'function') window.__terminals.push(this);
  },
});
"""
SCREEN_TEXT = """() => {
  const terminal = window.__terminals[0];
  if (!terminal) return '';
  const buffer = terminal.buffer.active, lines = [];
  for (let i = 0; i < buffer.length; i++) lines.push(buffer.getLine(i).translateToString(true));
  return lines.join('\\n');
}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=6)
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    server = subprocess.Popen([DDTOP, "--serve", "127.0.0.1:0", "--replay", "--speed", "0",
                               str(RECORDED)], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL)
    assert server.stdout is not None
    found = re.search(r"(http://\S+/)", server.stdout.readline())
    if found is None:
        server.terminate()
        raise SystemExit("ddtop --serve printed no link")
    url = found.group(1)
    origin = urllib.parse.urlsplit(url).netloc
    loads, tables, elsewhere = [], [], 0
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            for n in range(args.pages):
                page = browser.new_page(viewport={"width": 1600, "height": 900})
                page.add_init_script(FIND_TERMINAL)
                asked: list[str] = []
                page.on("request", lambda request, asked=asked: asked.append(request.url))
                started = time.monotonic()
                page.goto(url)
                loads.append(time.monotonic() - started)
                while not ROW.search(page.evaluate(SCREEN_TEXT) or ""):
                    if time.monotonic() - started > 60:
                        raise SystemExit(f"page {n + 1}: no table within 60 s")
                    time.sleep(0.02)
                tables.append(time.monotonic() - started)
                elsewhere += sum(1 for u in asked if urllib.parse.urlsplit(u).netloc != origin)
                page.close()
                print(f"page {n + 1} of {args.pages}: table in {tables[-1]:.2f} s",
                      file=sys.stderr)
            browser.close()
    finally:
        server.terminate()
        server.wait(10)
    print("ddtop --serve: a page opened to its first table row (s); requests to other hosts")
    print(f"{'pages':>6} {'load median':>12} {'table median':>13} {'table max':>10} "
          f"{'first table':>12} {'others median':>14} {'elsewhere':>10}")
    others = statistics.median(tables[1:] or tables)
    print(f"{len(tables):>6} {statistics.median(loads):>12.2f} "
          f"{statistics.median(tables):>13.2f} {max(tables):>10.2f} {tables[0]:>12.2f} "
          f"{others:>14.2f} {elsewhere:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
