"""The /dashboard page in headless Chromium against a running app (tiny models,
an API key, a draft model pool that autoscales beside a suffix pool): it asks
for the key, then shows the same figures as /v1/spec/stats (acceptance per
draft and per position, coverage, K, tokens/s, TTFT/TPOT, replicas per pool,
autoscaling decisions, each pool's kind as a badge), and a screenshot is
saved (also to out/dashboard.png for people to look at). Requests without
the key, or with a wrong one, get a 401 (/healthz stays open). /metrics
carries every specserve_* metric the Grafana dashboard of the Helm chart
queries, and the replica counts per pool; a real Prometheus (Debian's
package, `make prometheus`) scrapes it, every dashboard expression over the
router's metrics returns data, and the figures agree with /v1/spec/stats.
Without an app (a stub serving the page and written figures): the panel per
adapting draft pool with its swap and rollback markers, and a real Prometheus
reading every catalogued family, the adapt ones included."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import SLOW_TARGET_ENV
from dashboard_stub import StubStats
from specserve.tools.serveproc import ServeProcess, get, post
from test_serve import tiny_config

pytestmark = pytest.mark.slow

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def app(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models, [("same", "target")])
    # min < max: the draft policy runs and its decisions reach the stats; the
    # long delays keep Serve from acting on them (no second engine here).
    config["drafts"][0]["replicas"] = {"min_replicas": 1, "max_replicas": 2,
                                       "upscale_delay_s": 600, "downscale_delay_s": 600}
    # A suffix pool (no model) beside it: every view shows each pool's kind.
    config["drafts"].append({"name": "sfx", "kind": "suffix",
                             "replicas": {"min_replicas": 1, "max_replicas": 1},
                             "resources": {"cpus_per_worker": 0.25}})
    # Every request drafts at full K: this module checks the figures the page,
    # /metrics and Prometheus show, not the K choice (tests/deployments/test_serve.py),
    # which on a busy CPU may hold a slow draft at K = 0 and leave nothing to show.
    config["speculation"]["k_control"] = {"min_drafted_tokens": 10**9, "min_requests": 10**9,
                                          "min_steps": 10**9}
    # The key from an environment variable, as the Helm chart passes its Secret.
    config["http"] = {"api_key_env": "SPECSERVE_TEST_API_KEY"}
    server = ServeProcess(config, tmp_path_factory.mktemp("dashboard"),
                          env={**SLOW_TARGET_ENV, "SPECSERVE_TEST_API_KEY": KEY})
    try:
        deadline = time.monotonic() + 600
        while "specserve: serving" not in server.tail(10**7):
            assert server.proc.poll() is None, server.tail()
            assert time.monotonic() < deadline, server.tail()
            time.sleep(2)
        # Figures to show: requests until the model pool has 4 requests and has
        # drafted (a CPU draft that also pre-drafts branches can miss the first
        # short ones). The two pools take turns while both are measured.
        for i in range(48):
            status, body = post(f"{server.url}/v1/completions",
                                {"model": "tiny", "prompt": f"Dashboard {i}", "max_tokens": 24,
                                 "temperature": 0, "ignore_eos": True}, AUTH)
            assert status == 200, body
            if i >= 7:
                _, snap = get(f"{server.url}/v1/spec/stats", AUTH)
                same = {m["model"]: m for m in snap["draft_models"]}.get("same", {})
                if same.get("requests", 0) >= 4 and same.get("draft_tokens", 0) > 0:
                    break
        server.remember_children()
        yield server
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()


def stats(app) -> dict:
    status, body = get(f"{app.url}/v1/spec/stats", AUTH)
    assert status == 200, body
    return body


def test_page_is_public_and_stats_need_the_key(app):
    import urllib.request

    with urllib.request.urlopen(f"{app.url}/dashboard", timeout=30) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        page = r.read().decode()
    assert "/v1/spec/stats" in page
    # Nothing is loaded from elsewhere: no absolute URLs in src/href attributes.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert get(f"{app.url}/v1/spec/stats")[0] == 401


def test_completions_need_the_key(app):
    """No key or a wrong key gets a 401 with an OpenAI-style body; /healthz
    stays open; the right key is served."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in (None, {"Authorization": "Bearer wrong"}):
        status, err = post(f"{app.url}/v1/completions", body, headers)
        assert status == 401 and err["error"]["type"] == "authentication_error", err
        assert set(err["error"]) >= {"message", "type", "code"}
    assert get(f"{app.url}/healthz")[0] == 200
    status, ok = post(f"{app.url}/v1/completions", body, AUTH)
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_stats_have_pools_and_autoscaling_decisions(app):
    deadline = time.monotonic() + 60
    while True:  # figures from Serve and the autoscaler may come late on a busy node
        s = stats(app)
        ready = (isinstance(s["autoscaling"], list) and s["autoscaling"]
                 and isinstance(s["pools"], list)
                 and any(p["pool"] == "target" and p["running"] == 1 for p in s["pools"]))
        if ready or time.monotonic() > deadline:
            break
        time.sleep(1)
    pools = {p["pool"]: p for p in s["pools"]}
    assert {p: row["kind"] for p, row in pools.items()} == {
        "target": "target", "same": "model", "sfx": "suffix"}
    assert pools["target"]["running"] == 1 and pools["target"]["max_replicas"] == 1
    assert pools["same"]["running"] == 1
    assert (pools["same"]["min_replicas"], pools["same"]["max_replicas"]) == (1, 2)
    assert s["autoscaling"], "the draft policy's decisions never reached the router"
    d = s["autoscaling"][0]
    assert d["pool"] == "same" and d["replicas"] in (1, 2) and d["reason"]
    models = {m["model"]: m for m in s["draft_models"]}
    assert models["same"]["requests"] >= 4 and models["same"]["draft_tokens"] > 0


def test_metrics_carry_what_grafana_queries(app):
    from grafana import exposed_names, grafana_metric_names

    status, text = get(f"{app.url}/metrics", AUTH)
    assert status == 200
    assert re.search(r'^specserve_pool_replicas\{pool="target",kind="target"\} 1$', text, re.M)
    assert re.search(r'^specserve_pool_replicas\{pool="same",kind="model"\} 1$', text, re.M)
    assert re.search(r'^specserve_pool_replicas\{pool="sfx",kind="suffix"\} 1$', text, re.M)
    exported = exposed_names(text)
    wanted = {m for m in grafana_metric_names() if not m.startswith("ray_")}
    assert wanted and wanted <= exported, sorted(wanted - exported)


FIGURES = ("draft_models", "pools", "autoscaling", "end_to_end", "last_choice")

SNAPSHOT = """
const cards = {};
for (const id of ["tokens-per-s", "goodput", "ttft", "tpot", "requests", "load"])
  cards[id] = document.getElementById(id).dataset.value;
const cells = [...document.querySelectorAll("td")].map((td) =>
  ({table: td.closest("tbody").id, value: td.dataset.value, ...td.dataset}));
const badges = [...document.querySelectorAll("td .badge")].map((b) =>
  ({table: b.closest("tbody").id, text: b.textContent, shown: b.offsetWidth > 0,
    ...b.closest("td").dataset}));
return {stats: window.specserveStats, cards, cells, badges};
"""


def _browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: `make browser` installs "
                    "the Debian packages chromium and chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1400",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _wait(driver, condition, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(condition)
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"the page never showed {what}")


def test_dashboard_shows_the_figures_of_the_stats(app, tmp_path):
    from selenium.webdriver.common.by import By

    driver = _browser(tmp_path)
    try:
        driver.get(f"{app.url}/dashboard?interval=0.5")
        # With an API key configured the page asks for it ...
        _wait(driver, "return document.getElementById('keybox').classList.contains('shown')",
              "the API key box")
        assert "API key" in driver.find_element(By.ID, "error").text
        driver.find_element(By.ID, "apikey").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#keybox button").click()
        # ... then polls with it. Wait for a poll that saw the decisions.
        _wait(driver, "return (window.specserveStats || {autoscaling: []}).autoscaling.length"
                      " && document.querySelectorAll('#decisions-table tr').length",
              "autoscaling decisions")
        time.sleep(2)  # a few more polls, so the plots have a line to show
        # One snapshot of the page (a script runs between two polls): the stats
        # it drew from and every figure it shows. Retried until no decision or
        # window change fell between the page's poll and ours.
        for _ in range(20):
            page = driver.execute_script(SNAPSHOT)
            want = stats(app)
            if all(page["stats"][k] == want[k] for k in FIGURES):
                break
            time.sleep(0.3)
        for k in FIGURES:
            assert page["stats"][k] == want[k], k
        cards, cells = page["cards"], page["cells"]

        def num(v):
            return None if v in ("", None) else float(v)

        e2e = want["end_to_end"]
        assert num(cards["tokens-per-s"]) == pytest.approx(e2e["output_tokens_per_s"])
        assert num(cards["goodput"]) == pytest.approx(e2e["goodput_tokens_per_s"])
        assert num(cards["ttft"]) == pytest.approx(e2e["ttft_p50_s"])
        assert num(cards["tpot"]) == pytest.approx(e2e["tpot_p50_s"])
        assert num(cards["requests"]) == e2e["requests"] >= 4
        assert e2e["ttft_p50_s"] > 0 and e2e["output_tokens_per_s"] > 0

        assert want["draft_models"], "no draft figures to compare"
        for m in want["draft_models"]:
            for field in ("acceptance_rate", "coverage", "k", "mean_accepted_length",
                          "draft_tokens", "requests"):
                shown = [c for c in cells if c.get("model") == m["model"]
                         and c.get("field") == field and c["table"] == "drafts-table"]
                assert len(shown) == 1 and num(shown[0]["value"]) == pytest.approx(m[field]), field
            per_position = [c for c in cells if c.get("model") == m["model"] and "position" in c]
            assert [c["position"] for c in per_position] == [
                str(i) for i in range(len(m["accepted_per_position"]))] != []
            assert [num(c["value"]) for c in per_position] == pytest.approx(
                [a / m["steps_with_drafts"] for a in m["accepted_per_position"]])
        same = {m["model"]: m for m in want["draft_models"]}["same"]
        assert same["acceptance_rate"] > 0.5  # the draft is the target itself

        for p in want["pools"]:
            for field in ("running", "min_replicas", "max_replicas"):
                shown = [c for c in cells if c.get("pool") == p["pool"] and c.get("field") == field]
                assert len(shown) == 1 and num(shown[0]["value"]) == p[field], (p["pool"], field)
        # Each pool's kind, as a visible badge, in the pools and draft tables.
        badges = page["badges"]
        assert all(b["shown"] and b["text"] == b["value"] for b in badges), badges
        assert {b["pool"]: b["text"] for b in badges if b["table"] == "pools-table"} == {
            p["pool"]: p["kind"] for p in want["pools"]} == {
            "target": "target", "same": "model", "sfx": "suffix"}
        assert {b["model"]: b["text"] for b in badges if b["table"] == "drafts-table"} == {
            m["model"]: m["kind"] for m in want["draft_models"]}
        reasons = [c["value"] for c in cells
                   if c["table"] == "decisions-table" and c.get("field") == "reason"]
        assert reasons == [d["reason"] for d in want["autoscaling"]] != []

        # The plots are drawn: the acceptance chart's canvas has coloured pixels.
        assert driver.execute_script("""
            const c = document.getElementById('chart-acceptance');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            for (let i = 0; i < d.length; i += 4)
              if (d[i+3] > 0 && Math.abs(d[i] - d[i+2]) > 80) return true;
            return false;""")
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        (REPO / "out").mkdir(exist_ok=True)
        shutil.copy(shot, REPO / "out" / "dashboard.png")
    finally:
        driver.quit()


def test_prometheus_scrapes_the_router_and_the_dashboard_queries_agree(app, tmp_path):
    from grafana import as_promql, grafana_expressions
    from prometheus_server import scraping

    with scraping(app.url, tmp_path, bearer=KEY) as prom:
        _query = prom.query
        deadline = time.monotonic() + 60
        # A first sample of the counters before the traffic below (rates need a
        # start; a scrape of a busy router can take longer than a fixed sleep).
        series = 'sum(specserve_draft_tokens_total{draft_model="same"})'
        prom.wait_for(series, 60, "Prometheus scraped the router")

        def drafted() -> int:
            return sum(m["draft_tokens"] for m in stats(app)["draft_models"])

        # Traffic with drafts in it (the rate panel below divides by them): at
        # least 4 requests, more while the CPU draft has not got ahead once.
        drafted_before = drafted()
        for i in range(20):
            status, body = post(f"{app.url}/v1/completions",
                                {"model": "tiny", "prompt": f"Prometheus {i}", "max_tokens": 24,
                                 "temperature": 0, "ignore_eos": True}, AUTH)
            assert status == 200, body
            if i >= 3 and drafted() > drafted_before:
                break
        assert drafted() > drafted_before, "the draft pool drafted nothing in 20 requests"
        # ... and a sample after it: Prometheus holds what /v1/spec/stats says.
        s = stats(app)
        model = {m["model"]: m for m in s["draft_models"]}["same"]  # the series' pool
        # (no sample: a failed scrape of the busy router marks the series stale)
        while [float(r["value"][1]) for r in _query(series)] != [model["draft_tokens"]]:
            assert time.monotonic() < deadline + 120, "Prometheus lags /v1/spec/stats"
            time.sleep(1)
        time.sleep(2)
        (up,) = _query('up{job="specserve"}')
        assert up["value"][1] == "1"

        # Every expression of the dashboard over the router's metrics has data.
        # (ray_* series come from Ray's metrics agents, another scrape job.)
        for expr in grafana_expressions():
            if "ray_" in expr:
                continue
            assert _query(as_promql(expr)), expr

        # The counters Prometheus holds are /v1/spec/stats' totals.
        for name, key in (("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens")):
            (got,) = _query(f'sum(specserve_{name}_total{{draft_model="same"}})')
            assert float(got["value"][1]) == model[key], (name, model)
        # ... and the acceptance-rate panel over the whole run is their ratio.
        rate_expr = next(e for e in grafana_expressions() if e.startswith(
            "sum by (draft_model, kind) (rate(specserve_accepted_tokens_total"))
        whole = as_promql(rate_expr).replace("[30s]", "[10m]")
        (panel,) = [p for p in _query(whole) if p["metric"]["draft_model"] == "same"]
        assert panel["metric"]["kind"] == "model"
        before = _query('sum(specserve_accepted_tokens_total{draft_model="same"} offset 10m)')
        assert not before  # the window holds every sample since the first scrape
        first = {n: float(_query(f'min_over_time(sum(specserve_{n}_total'
                                 f'{{draft_model="same"}})[10m:1s])')[0]["value"][1])
                 for n in ("accepted_tokens", "draft_tokens")}
        want = ((model["accepted_tokens"] - first["accepted_tokens"])
                / (model["draft_tokens"] - first["draft_tokens"]))
        assert float(panel["value"][1]) == pytest.approx(want, rel=1e-6)
        # TTFT quantiles come from the router's histogram.
        (p50,) = _query("histogram_quantile(0.5, sum by (le) "
                        "(specserve_ttft_seconds_bucket))")
        assert 0 < float(p50["value"][1]) <= 10


# ---- the adaptation panel, from stats the test writes (no app: tests/dashboard_stub.py)


def adapt_stats(adapt) -> dict:
    """/v1/spec/stats with a target, an adapting pool `same` (its `adapt`:
    specserve.adapt.figures, or why it is missing) and a pool with adapt off."""
    def pool(name, kind, **more):
        return {"pool": name, "kind": kind, "deployment": name, "states": {"RUNNING": 1},
                "running": 1, "min_replicas": 1, "max_replicas": 1, **more}
    return {"end_to_end": {}, "draft_models": [], "branches": {}, "autoscaling": [],
            "pools": [pool("target", "target"), pool("same", "model", adapt=adapt),
                      pool("plain", "model", adapt=None)]}


def figures(version, serving, candidate=None, swaps=0, rollbacks=0, rounds=0, last=None):
    return {"version": version, "heldout_alpha_serving": serving,
            "heldout_alpha_candidate": candidate, "buffer_tokens": 1200 + 100 * rounds,
            "heldout_tokens": 300, "swaps": swaps, "rollbacks": rollbacks, "rounds": rounds,
            "train_seconds": 2.5 if rounds else 0.0, "last_round": last}


PANEL = """
const section = document.getElementById('adapt-section');
const pools = [...document.querySelectorAll('.adapt-pool')].map((div) => ({
  pool: div.dataset.pool,
  cells: Object.fromEntries([...div.querySelectorAll('td')].map(
    (td) => [td.dataset.field, td.dataset.value])),
  events: [...div.querySelectorAll('.adapt-event')].map((li) => ({...li.dataset})),
  why: (div.querySelector('.adapt-why') || {}).textContent || null}));
return {shown: section.offsetHeight > 0, pools,
        polls: Number(document.getElementById('updated').dataset.polls || 0)};
"""

SWAP_PIXELS = """
const c = document.querySelector('.adapt-pool canvas');
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;  // the swap marker's green (#109618)
for (let i = 0; i < d.length; i += 4)
  if (d[i+3] > 200 && d[i] < 60 && d[i+1] > 120 && d[i+2] < 60) n++;
return n;
"""


def test_dashboard_draws_each_adapting_pool_with_its_swaps_and_rollbacks(tmp_path):
    """The adaptation panel: hidden while no pool adapts; then per adapting
    pool its current figures, and a marker where the serving version changed
    (a swap) or a rollback was counted between two polls."""
    stub = StubStats()
    driver = _browser(tmp_path)

    def shown_after(stats):  # the panel once the page has polled `stats` twice
        stub.stats = stats
        polls = driver.execute_script(PANEL)["polls"]
        _wait(driver, f"return Number(document.getElementById('updated').dataset.polls"
                      f" || 0) >= {polls + 2}", "two more polls")
        return driver.execute_script(PANEL)

    try:
        stub.stats = adapt_stats(None)
        driver.get(f"{stub.url}/dashboard?interval=0.5")
        panel = shown_after(adapt_stats(None))
        assert not panel["shown"] and panel["pools"] == []  # no pool adapts

        panel = shown_after(adapt_stats(figures("v0", 0.5)))
        (same,) = panel["pools"]
        assert panel["shown"] and same["pool"] == "same" and same["events"] == []
        assert same["cells"] == {"version": "v0", "heldout_alpha_serving": "0.5",
                                 "heldout_alpha_candidate": "", "buffer_tokens": "1200",
                                 "heldout_tokens": "300", "rounds": "0", "swaps": "0",
                                 "rollbacks": "0", "train_seconds": "0", "last_round": ""}

        # A round promotes its candidate: the version changes, a swap is counted.
        panel = shown_after(adapt_stats(figures("v1", 0.62, 0.62, swaps=1, rounds=1,
                                                last="promoted v1")))
        (same,) = panel["pools"]
        assert same["events"] == [{"event": "swap", "from": "v0", "to": "v1"}]
        assert same["cells"]["version"] == "v1" and same["cells"]["last_round"] == "promoted v1"
        assert same["cells"]["heldout_alpha_candidate"] == "0.62"
        assert driver.execute_script(SWAP_PIXELS) > 20  # the marker is drawn

        # A rollback to v0, then a version change alone (another replica's
        # store answered): a rollback marker, then a swap marker.
        shown_after(adapt_stats(figures("v0", 0.5, 0.62, swaps=1, rollbacks=1, rounds=2,
                                        last="rolled back to v0")))
        panel = shown_after(adapt_stats(figures("v2", 0.55, 0.62, swaps=1, rollbacks=1,
                                                rounds=2)))
        assert [e for p in panel["pools"] for e in p["events"]] == [
            {"event": "swap", "from": "v0", "to": "v1"},
            {"event": "rollback", "from": "v1", "to": "v0"},
            {"event": "swap", "from": "v0", "to": "v2"}]
        driver.execute_script("document.getElementById('adapt-section').scrollIntoView()")
        shot = tmp_path / "dashboard-adapt.png"
        assert driver.save_screenshot(str(shot))
        (REPO / "out").mkdir(exist_ok=True)
        shutil.copy(shot, REPO / "out" / "dashboard-adapt.png")

        # Figures that did not come: the pool's panel says why.
        panel = shown_after(adapt_stats("unavailable: TimeoutError"))
        assert panel["shown"] and panel["pools"][0]["why"] == "unavailable: TimeoutError"
    finally:
        driver.quit()
        stub.close()


def test_prometheus_reads_every_catalogued_family_with_the_adapt_figures(tmp_path):
    """What /metrics writes with every family filled (an adapting pool's
    figures too), scraped by a real Prometheus: each catalogued family
    arrives, the adapt ones with their labels."""
    sys.path.insert(0, str(REPO / "tests" / "acceptance"))
    from prometheus_server import scraping
    from test_catalogue import full_metrics_text

    from specserve.acceptance import catalogue

    stub = StubStats()
    stub.metrics = full_metrics_text()
    try:
        with scraping(stub.url, tmp_path) as prom:
            prom.wait_for('up{job="specserve"} == 1', 60, "Prometheus scraped the stub")
            names = set(prom.names())
            want = {n for m in catalogue.BY_NAME.values() for n in m.series}
            assert want <= names, sorted(want - names)
            (info,) = prom.query("specserve_adapt_version_info")
            assert {k: v for k, v in info["metric"].items() if k not in ("job", "instance")} \
                == {"__name__": "specserve_adapt_version_info", "pool": "d", "kind": "suffix",
                    "version": "v1"}
            (alpha,) = prom.query("specserve_adapt_heldout_alpha_candidate")
            assert float(alpha["value"][1]) == 0.55
    finally:
        stub.close()
