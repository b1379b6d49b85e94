"""The dashboard used as a person uses it, in headless Chromium (the browser and the stub server of test_ui): a
server that stops answering, a clock that is not the server's, a hidden tab, a phone, hundreds of updates, and its
figures against a real server's /metrics. Every test listens to the page's console and errors, and stops the server
it starts."""
import re

import httpx
import pytest
import test_ui
from test_ui import StubApp

browser = test_ui.browser                    # the module's browser and a fresh page per test (console listened to)
page = test_ui.page


def polls(page) -> int:
    return int(page.evaluate("Number(document.body.dataset.polls || 0)"))


def test_a_server_that_stops_answering_is_not_shown_live(page):
    """The server takes the poll's connection but never answers (stopped, or its process frozen): within a few
    seconds the status says there is no answer, not "live" over the last figures; once it answers again, live."""
    stub = StubApp("ok")
    held = []
    try:
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        assert page.inner_text("#status") == "live"
        page.route("**/dashboard/data", lambda route: held.append(route))      # taken, never answered
        page.wait_for_selector("#status >> text=no answer", timeout=15_000)
        assert "trying again" in page.inner_text("#status")
        n = polls(page)
        page.unroute("**/dashboard/data")
        page.wait_for_function(f"() => Number(document.body.dataset.polls) > {n}", timeout=15_000)
        page.wait_for_selector("#status >> text=live")
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_a_key_entered_after_the_poll_timeout_still_lets_it_in(page):
    """With --api-key the poll waits for the key longer than a poll may take: the status says it waits for the key
    (not that the server is silent), and the key, entered then, makes the dashboard live."""
    stub = StubApp("ok", api_key="s3cret")
    try:
        page.goto(stub.url + "/dashboard")
        page.wait_for_selector("#keyform:not([hidden])")
        page.wait_for_selector("#status >> text=waiting for the API key", timeout=15_000)
        page.fill("#keyform input", "s3cret")
        page.click("#keyform button")
        page.wait_for_selector("#status >> text=live", timeout=15_000)
        assert polls(page) >= 1
        assert all("401" in e for e in page.errors), page.errors
    finally:
        stub.stop()


@pytest.mark.parametrize("skew_s", [600, -600])
def test_the_outage_gap_is_drawn_on_the_servers_clock(browser, skew_s):
    """The browser's clock is ten minutes off the server's (another machine): an outage still breaks the time
    charts' lines, and the points after it are drawn at once (not dropped until the browser's clock is passed)."""
    stub = StubApp("ok")
    ctx = browser.new_context()
    held = []
    try:
        ctx.add_init_script(f"{{ const now = Date.now; Date.now = () => now() + {skew_s * 1000}; }}")
        page = test_ui.listen(ctx.new_page())
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 2")
        page.route("**/dashboard/data", lambda route: held.append(route))
        page.wait_for_selector("#status >> text=no answer", timeout=15_000)
        page.unroute("**/dashboard/data")
        page.wait_for_selector("#status >> text=live", timeout=15_000)
        n = polls(page)
        page.wait_for_function(f"() => Number(document.body.dataset.polls) >= {n + 2}", timeout=15_000)
        running = page.evaluate("charts.reqs.data[1]")       # 0 at every answer (the stub runs nothing)
        assert None in running, running               # the gap
        assert running[-2:] == [0, 0], running        # the points since
        assert not page.errors, page.errors
    finally:
        ctx.close()
        stub.stop()


def test_the_last_figures_are_greyed_while_there_is_no_data(page):
    """While polls fail, the tiles still hold the last figures (the last known state): they are greyed out, so
    that a glance does not read them as now; the next answer brings them back."""
    stub = StubApp("ok")
    try:
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        opacity = "() => Number(getComputedStyle(document.querySelector('.tiles')).opacity)"
        assert page.evaluate(opacity) == 1
        page.route("**/dashboard/data", lambda route: route.abort())          # refused: the server is down
        page.wait_for_selector("#status >> text=no data")
        assert page.evaluate(opacity) < 0.6
        assert page.inner_text("#running") == "0"     # kept, greyed
        page.unroute("**/dashboard/data")
        page.wait_for_selector("#status >> text=live")
        assert page.evaluate(opacity) == 1
        assert all("ERR_FAILED" in e for e in page.errors), page.errors
    finally:
        stub.stop()


HIDE = """(hidden) => {
  Object.defineProperty(document, 'hidden', {configurable: true, get: () => hidden});
  Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => hidden ? 'hidden' : 'visible'});
  document.dispatchEvent(new Event('visibilitychange'));
}"""


def test_a_hidden_dashboard_stops_polling(page):
    """A dashboard tab in the background (another tab in front, the window minimised) asks for nothing, so the
    server's step recording, which each poll turns on, goes off; shown again, it polls at once."""
    stub = StubApp("ok")
    asked = []
    try:
        page.on("request", lambda r: "/dashboard/data" in r.url and asked.append(r.url))
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        page.evaluate(HIDE, True)
        page.wait_for_timeout(1500)                   # a poll already on its way may still go
        n = len(asked)
        page.wait_for_timeout(3000)
        assert len(asked) == n, "a hidden dashboard went on polling"
        shown = polls(page)
        page.evaluate(HIDE, False)
        page.wait_for_function(f"() => Number(document.body.dataset.polls) > {shown}", timeout=1_000)
        page.wait_for_function(f"() => Number(document.body.dataset.polls) > {shown + 1}", timeout=5_000)
        running = page.evaluate("charts.reqs.data[1]")
        assert None in running and running[-1] == 0, running        # no line drawn across the hidden time
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_hundreds_of_updates_grow_neither_the_page_nor_its_heap(page):
    """600 updates (ten minutes of polls, run at once through the page's own render(), with 120 recent steps
    each): the time charts keep their window, and the page's elements, listeners and JS heap stay as they were."""
    stub = StubApp("ok")
    try:
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        page.evaluate(HIDE, True)                     # the polls stop: the updates below are all there is
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")

        def metrics() -> dict:
            cdp.send("HeapProfiler.collectGarbage")
            m = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}
            return {k: m[k] for k in ("Nodes", "JSEventListeners", "JSHeapUsedSize")}
        updates = """(n) => fetch('/dashboard/data').then((r) => r.json()).then((d) => {
          for (let i = 0; i < n; i++) {
            d.time += 1;
            d.running = i % 4; d.output_tps = 100 + i % 50;
            d.steps.recent = Array.from({length: 120}, (_, k) => ({t: d.time - 5 + k * 0.04, tokens: 1 + k % 7,
              seqs: 1 + k % 3, kv_tokens: 100, wall_ms: 6 + k % 5, phase: k % 9 ? 'decode' : 'prefill'}));
            render(d);
          }
          return series.t.length;
        })"""
        page.evaluate(updates, 300)                   # warm: the charts made, the window full
        before = metrics()
        kept = page.evaluate(updates, 300)
        after = metrics()
        print("before", before, "after", after)
        assert kept <= 122                            # the 120 s window (and its edges)
        assert after["Nodes"] <= before["Nodes"] + 20, (before, after)
        assert after["JSEventListeners"] <= before["JSEventListeners"], (before, after)
        assert after["JSHeapUsedSize"] < before["JSHeapUsedSize"] + 1_000_000, (before, after)
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_the_status_is_announced_only_when_it_changes(page):
    """The header's status is a live region (role=status), so a screen reader says when the data stops and comes
    back; polls that change nothing leave its text alone (nothing is announced again every second)."""
    stub = StubApp("ok")
    try:
        page.goto(stub.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        assert page.get_by_role("status").inner_text() == "live"
        page.evaluate("""() => { window.__said = 0;
          new MutationObserver(() => window.__said++).observe(document.getElementById('status'),
                                                              {subtree: true, childList: true, characterData: true});
        }""")
        n = polls(page)
        page.wait_for_function(f"() => Number(document.body.dataset.polls) >= {n + 3}", timeout=10_000)
        assert page.evaluate("window.__said") == 0
        page.route("**/dashboard/data", lambda route: route.abort())
        page.wait_for_selector("#status >> text=no data")
        page.wait_for_timeout(2500)                   # more failed polls, the same words
        assert page.evaluate("window.__said") == 1
        assert all("ERR_FAILED" in e for e in page.errors), page.errors
    finally:
        stub.stop()


def test_a_ray_applications_replicas_fit_a_phone(browser):
    """A Ray application's dashboard has a table of its replicas, ten columns: on a phone it scrolls inside its
    own box, and the page does not scroll sideways."""
    from prometheus_client import CollectorRegistry, Counter, Gauge
    reg = CollectorRegistry()
    labels = ["model_name", "replica"]
    tokens = Counter("lumen:generation_tokens", "", labels, registry=reg)
    blocks = Gauge("lumen:kv_cache_total_blocks", "", labels, registry=reg)
    for r in ("replica-0123456789abcdef", "replica-fedcba9876543210"):
        tokens.labels("m", r).inc(1000)
        blocks.labels("m", r).set(512)
    stub = StubApp("ok", registry=reg)
    ctx = browser.new_context(viewport={"width": 375, "height": 667})
    try:
        pg = test_ui.listen(ctx.new_page())
        pg.goto(stub.url + "/dashboard")
        pg.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        assert pg.locator("#replicas tbody tr").count() == 2
        assert pg.evaluate("document.documentElement.scrollWidth") <= 375
        assert not pg.errors, pg.errors
    finally:
        ctx.close()
        stub.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? ([-\d.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(2))


def test_the_tiles_match_the_servers_metrics(smollm2_path, tmp_path, page):
    """After a few requests, once the server is idle, every tile that shows a count reads what GET /metrics says:
    tokens generated, running, waiting, KV blocks (and none held), threads. The recent steps' charts show the
    requests' steps, then, some seconds later, say that there has been no step lately (not an empty chart)."""
    s = test_ui.serve(smollm2_path, tmp_path / "server.log")
    try:
        page.goto(s.url + "/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
        for i in range(3):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"Count to {i + 5}."}], "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200
        m = httpx.get(s.url + "/metrics").text
        tokens = int(_metric(m, "lumen:generation_tokens_total"))
        page.wait_for_function(f"() => document.getElementById('generation_tokens').textContent === '{tokens}'",
                               timeout=10_000)
        m = httpx.get(s.url + "/metrics").text                  # idle: nothing moves between the two
        assert page.inner_text("#generation_tokens") == str(int(_metric(m, "lumen:generation_tokens_total")))
        assert page.inner_text("#running") == str(int(_metric(m, "lumen:num_requests_running"))) == "0"
        assert page.inner_text("#waiting") == str(int(_metric(m, "lumen:num_requests_waiting"))) == "0"
        blocks = int(_metric(m, "lumen:kv_cache_total_blocks"))
        assert page.inner_text("#kv_usage") == f"0.0 % of {blocks} blocks"
        assert _metric(m, "lumen:kv_cache_usage_perc") == 0
        assert page.inner_text("#threads") == \
            f"{int(_metric(m, 'lumen:compute_threads'))} of {int(_metric(m, 'lumen:compute_threads_max'))}"
        idle = "() => [...document.querySelectorAll('.steps-idle')].map((e) => e.textContent)"
        assert page.evaluate(idle) == ["", ""] and page.evaluate("charts.steps.data[0].length") > 0
        page.wait_for_function(f"() => ({idle})().every((t) => t.includes('no step lately'))", timeout=30_000)
        assert not page.errors, page.errors
    finally:
        s.stop()
