"""The live dashboard in a real browser: JupyterLab on a loopback port, headless Debian Chromium driven by Playwright,
tests/browser/live_dashboard.ipynb run from the Run menu; the widgets render and the curves grow while training runs.

Needs Debian's Chromium (`apt-get install -y chromium`: /usr/bin/chromium) and, from PyPI, `jupyterlab` and `playwright`
(without `playwright install`); skipped when one is missing. The screenshot goes to the test's tmp dir, or to
$JETRL_BROWSER_ARTIFACTS (a folder) when that is set."""
import json, os, re, shutil, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import pytest

CHROMIUM = "/usr/bin/chromium"
NOTEBOOK = Path(__file__).parent / "browser" / "live_dashboard.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SERVER_START_S = 60      # JupyterLab answering /api/status
KERNEL_IDLE_MS = 60_000  # the notebook open and its kernel idle
RENDER_MS = 90_000       # the cells run: jetrl imported, the dashboard's widgets drawn
TRAIN_MS = 120_000       # both runs done (about 15 s on an idle 2-core machine)


def _notebook_steps() -> int:
    "The notebook's STEPS (the steps each strategy trains), read from its source so the two cannot drift apart."
    source = "\n".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"])
    found = re.search(r"^STEPS = (\d+)", source, re.M)
    assert found, f"{NOTEBOOK} sets no `STEPS = N`: the test reads it to know how many points the curves end with"
    return int(found.group(1))


POINTS = 2 * _notebook_steps()   # the reward curves' points at the end: two strategies of STEPS steps each


def _requirements():
    """Skip (with the reason) when the browser, Playwright, JupyterLab or the widget front-ends are missing;
    fail instead where JETRL_REQUIRE_BROWSER=1 (CI sets it: there the test must run)."""
    if os.environ.get("JETRL_REQUIRE_BROWSER") == "1":
        assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)"
        import playwright.sync_api, jupyterlab, ipykernel, anywidget, jupyterlab_widgets, psutil  # noqa: F401  fail loudly
    if not os.access(CHROMIUM, os.X_OK): pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright; no `playwright install`)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install jupyterlab)")
    for module in ("ipykernel", "anywidget", "jupyterlab_widgets", "psutil"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install jupyterlab ipywidgets anywidget)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _stop(proc: subprocess.Popen, log):
    "End the server, its kernels (their own sessions) and anything else it started: SIGTERM, then SIGKILL after 15 s."
    import psutil
    try: family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess: family = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try: os.killpg(proc.pid, sig)                      # the server's process group (start_new_session)
        except ProcessLookupError: pass
        for p in family:                                   # kernels run in sessions of their own
            try: p.send_signal(sig)
            except psutil.NoSuchProcess: pass
        alive = psutil.wait_procs(family, timeout=15)[1]
        try: proc.wait(timeout=15); server_done = True
        except subprocess.TimeoutExpired: server_done = False
        if server_done and not alive: break
    log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    "JupyterLab on 127.0.0.1 (a free port, no token) serving a copy of the notebook; its URL. Always shut down."
    _requirements()
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    home = tmp_path_factory.mktemp("jupyter-home")           # no user settings, workspaces or kernels leak in
    kernel = home / "data" / "kernels" / "python3"
    kernel.mkdir(parents=True)
    news = home / "settings" / "@jupyterlab" / "apputils-extension"   # no "official Jupyter news?" toast over the plots
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    (kernel / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                                    "display_name": "Python 3 (ipykernel)", "language": "python"}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), IPYTHONDIR=str(home / "ipython"),
               JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    port = _free_port()
    log_path = root.parent / "jupyterlab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             "--ServerApp.port_retries=0", "--ServerApp.token=", "--ServerApp.password=", "--allow-root",
                             f"--ServerApp.root_dir={root}"],
                            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2): break
            except OSError: pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        _stop(proc, log)


# Sampled in the page every 50 ms: the points of the reward curves in plotly's data and the markers drawn in the SVG,
# with the dashboard's status line, so that the test sees the intermediate states of a run that takes seconds.
SAMPLER = """() => {
  window.__jetrl = [];
  const t0 = performance.now();
  window.__jetrlTimer = setInterval(() => {
    const gd = document.querySelector('.jp-NotebookPanel .js-plotly-plot');
    const status = document.querySelector('.jp-NotebookPanel .widget-hbox .widget-html-content');
    if (!gd || !gd.data) return;
    const reward = gd.data.filter(t => t.meta && t.meta.series === 'reward');
    const last = window.__jetrl[window.__jetrl.length - 1];
    const sample = {t: Math.round(performance.now() - t0), traces: reward.length,
                    points: reward.reduce((n, t) => n + (t.x ? t.x.length : 0), 0),
                    markers: gd.querySelectorAll('g.trace.scatter path.point').length,
                    status: status ? status.textContent : ''};
    if (!last || last.points !== sample.points || last.markers !== sample.markers || last.status !== sample.status)
      window.__jetrl.push(sample);
  }, 50);
}"""


def _wait_kernel_settled(page, idle_s: float = 2.0):
    """The toolbar's kernel indicator idle for `idle_s` in a row. Just after a notebook opens, JupyterLab reconnects
    to its new kernel once; cells run in that moment were seen to be dropped (left at [ ])."""
    indicator = ".jp-NotebookPanel .jp-Notebook-ExecutionIndicator"
    page.wait_for_selector(f"{indicator}[data-status='idle']", timeout=KERNEL_IDLE_MS)
    deadline, since = time.monotonic() + KERNEL_IDLE_MS / 1000, time.monotonic()
    while time.monotonic() - since < idle_s:
        if time.monotonic() > deadline: pytest.fail(f"the kernel did not stay idle for {idle_s} s")
        if page.get_attribute(indicator, "data-status") != "idle": since = time.monotonic()
        page.wait_for_timeout(200)


def _run_all_cells(page, attempts: int = 3):
    "Run > Run All Cells; again (at most `attempts` in all) when the code cells were not even queued ([*]) in 15 s."
    queued = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
                        .every(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""
    for attempt in range(attempts):
        page.locator(".lm-MenuBar-item:has(.lm-MenuBar-itemLabel:text-is('Run'))").click()
        page.locator(".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('Run All Cells'))").click()
        try: page.wait_for_function(queued, timeout=15_000); return
        except Exception:
            if attempt == attempts - 1: raise
            print(f"Run All Cells: the cells were not queued (attempt {attempt + 1}); again")
            _wait_kernel_settled(page)


def _shot(page, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.screenshot(path=str(path), full_page=True, timeout=30_000)
    print(f"screenshot: {path}")
    return path


def test_live_dashboard_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright
    shots = Path(os.environ.get("JETRL_BROWSER_ARTIFACTS") or tmp_path)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=CHROMIUM,
                                                        headless=True, args=CHROMIUM_ARGS,
                                                        viewport={"width": 1500, "height": 1100}, timeout=60_000)
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(30_000)
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            try:
                page.goto(f"{lab}/lab/tree/{NOTEBOOK.name}", wait_until="domcontentloaded", timeout=60_000)
                # The notebook open, its kernel started and idle (the toolbar's kernel indicator).
                page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=KERNEL_IDLE_MS)
                _wait_kernel_settled(page)
                page.evaluate(SAMPLER)
                _run_all_cells(page)
                # The dashboard's widgets: its Stop button (ipywidgets) and the FigureWidget (plotly via anywidget).
                stop = page.locator(".jp-NotebookPanel .widget-button", has_text="Stop")
                stop.wait_for(state="visible", timeout=RENDER_MS)
                page.wait_for_selector(".jp-NotebookPanel .js-plotly-plot .main-svg", timeout=RENDER_MS)
                # Two moments during the run: points drawn, then more points drawn.
                first = page.wait_for_function("() => window.__jetrl.find(s => s.points > 0)", timeout=TRAIN_MS).json_value()
                second = page.wait_for_function(f"() => window.__jetrl.find(s => s.points > {first['points']})",
                                                timeout=TRAIN_MS).json_value()
                page.wait_for_function("() => /^(done|error|stopped)/.test(window.__jetrl.at(-1).status)", timeout=TRAIN_MS)
                page.wait_for_timeout(500)                  # the last redraw
                samples = page.evaluate("() => { clearInterval(window.__jetrlTimer); return window.__jetrl; }")
                page.locator(".jp-NotebookPanel .js-plotly-plot").first.scroll_into_view_if_needed()
                shot = _shot(page, shots, "live_dashboard.png")
            except Exception:
                try: _shot(page, shots, "live_dashboard-failure.png")
                except Exception as e: print(f"no failure screenshot: {e!r}")
                raise
        finally:
            browser.close()

    print(json.dumps(samples))
    assert shot.stat().st_size > 10_000
    final = samples[-1]
    assert final["status"] == "done", f"the run did not finish cleanly: {final['status']!r}"
    assert not errors, f"JavaScript errors in the page: {errors}"
    # Both strategies' reward curves, every step of both runs in plotly's data and drawn as markers.
    assert final["traces"] == 2 and final["points"] == POINTS, final
    assert final["markers"] > 0
    # The plot changed while training ran: a partial curve was drawn in the SVG before the status said done, and
    # redrawn with more points after. How many partial states the page catches depends on how much CPU the browser
    # gets beside the kernel (on a 2-core CI runner it caught one); a dashboard that draws only at the end fails here.
    assert 0 < first["points"] < second["points"] <= POINTS and first["t"] < second["t"], (first, second)
    assert first["status"] != "done", first
    during = [s for s in samples if 0 < s["points"] < final["points"] and not s["status"].startswith("done")]
    assert during and all(s["markers"] > 0 for s in during), samples
    assert max(s["markers"] for s in during) < final["markers"], samples   # the SVG redrawn with more markers
    counts = [s["points"] for s in samples]
    assert counts == sorted(counts), samples                                # the curves only grow
