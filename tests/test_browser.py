"""A learner's first session, in a real browser: JupyterLab + headless Chromium (Debian's), driven by selenium.

It opens the first session of notebook 00 -- its set-up cell, the first launch (ranks print from the
browser's kernel), the all-reduce across ranks and the failing rank caught as `RankFailed` -- with the
ZeRO memory calculator added as its last cell, runs every cell through JupyterLab's own command, and
asserts that the cells ran without an error, that the ranks' output reached the page, and that the
calculator renders as a widget (sliders and its table), not as `VBox(children=...)`.
The rest of notebook 00 (relaunch timings, the hang demos, the doctor) runs under nbval in every
suite run (`pytest --nbval-lax notebooks/00_launching_lecture.ipynb`), in a Jupyter kernel as here; the
browser adds the front end, which those cells use no differently from the first launch.
One notebook, one kernel: a second notebook would only start another kernel and import torch again.

Needs `chromium` and `chromedriver` (Debian packages `chromium`, `chromium-driver`; .ci/run
installs them) and selenium (a dev dependency). Without them the test is skipped, unless
DISTLAB_REQUIRE_BROWSER=1 (CI) makes that a failure.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
REQUIRED = os.environ.get("DISTLAB_REQUIRE_BROWSER") == "1"
NOTEBOOK = "00_launching.ipynb"
# The cells of notebook 00 the browser runs after its set-up cell, each found by a line of its source:
# the first launch, an all-reduce, a failing rank caught.
FIRST_SESSION = ("squares = distlab.launch(hello, N)", "def sum_of_ranks():", "def buggy():")
# ...after the cells that set it up: the machine line, then the imports and N.
SETUP = ("print(machine_line())", "N = int(os.environ")


def _missing() -> str:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    if not CHROMIUM or not DRIVER:
        return "chromium/chromedriver not found (apt-get install chromium chromium-driver)"
    return ""


if _missing():
    if REQUIRED:
        raise RuntimeError(f"DISTLAB_REQUIRE_BROWSER=1 but {_missing()}")
    pytest.skip(_missing(), allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a private folder holding notebook 00, the calculator added as its last cell."""
    folder = tmp_path_factory.mktemp("lab")
    nb = nbformat.read(ROOT / "notebooks" / "00_launching_lecture.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    nb.cells = [next(c for c in code if mark in c.source) for mark in SETUP + FIRST_SESSION]
    for cell in nb.cells:   # as a learner opens it after "Clear All Outputs": what shows, this run made
        cell.outputs, cell.execution_count = [], None
    nb.cells.append(nbformat.v4.new_code_cell("from distlab.viz.widgets import memory_calculator\nmemory_calculator()"))
    nbformat.write(nb, folder / NOTEBOOK)
    port, token = _free_port(), uuid.uuid4().hex
    env = dict(os.environ, DISTLAB_QUICK="1", JUPYTER_CONFIG_DIR=str(folder / ".jupyter"))
    env.pop("PYTEST_CURRENT_TEST", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}", "--LabApp.expose_app_in_browser=True",
         "--ServerApp.disable_check_xsrf=True", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    def serving() -> tuple[str, str]:
        """The server's address and token, once it accepts connections (the browser starts meanwhile)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return f"http://127.0.0.1:{port}", token
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("jupyter lab exited before it served a page")
                time.sleep(0.2)
        raise RuntimeError("jupyter lab served no page within 120 s")

    try:
        yield serving
    finally:
        from distlab.engine.procs import kill_tree
        kill_tree([server.pid], grace_s=10)   # the server, its kernels and their ranks
        server.wait()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


_STATE_JS = (
    "const a = window.jupyterapp; const w = a && a.shell.currentWidget;"
    "if (!(w && w.content && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel))"
    "  return null;"
    "const code = w.content.widgets.filter(c => c.model.type === 'code');"
    "return {path: w.context.path, kernel: w.sessionContext.session.kernel.status, cells: code.length,"
    "        ran: code.filter(c => c.model.executionCount !== null).length};")


def _open_and_run_all(driver, base: str, token: str, name: str, timeout: float = 600) -> None:
    """Open a notebook, run all its cells through JupyterLab's own command, wait until every cell ran.

    The command is sent again while nothing has started (on a loaded machine the first one can
    arrive before the notebook panel is ready and do nothing)."""
    driver.get(f"{base}/lab/tree/{name}?token={token}")
    deadline = time.monotonic() + 120
    state = None
    while time.monotonic() < deadline:
        state = driver.execute_script(_STATE_JS)
        if state and state["path"].endswith(name) and state["kernel"] == "idle":
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"{name}: the notebook and its kernel were not ready within 120 s ({state})")
    deadline, sent = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline:
        state = driver.execute_script(_STATE_JS)
        if state["cells"] and state["ran"] == state["cells"] and state["kernel"] == "idle":
            return
        if state["ran"] == 0 and state["kernel"] == "idle" and time.monotonic() - sent > 15:
            driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
            sent = time.monotonic()
        time.sleep(0.25)
    raise AssertionError(f"{name}: not every cell ran within {timeout:.0f} s ({state})")


def _outputs(driver) -> list[dict]:
    """Every output of the open notebook, from JupyterLab's model (the DOM holds only the cells
    in view: JupyterLab 4 renders a long notebook in windows)."""
    return driver.execute_script(
        "const w = window.jupyterapp.shell.currentWidget;"
        "return w.content.widgets.filter(c => c.model.type === 'code')"
        "  .flatMap(c => c.model.outputs.toJSON());")


def _text(outputs: list[dict]) -> str:
    parts = []
    for o in outputs:
        text = o.get("text") or (o.get("data") or {}).get("text/plain") or ""
        parts.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(parts)


@pytest.fixture(scope="module")
def ran(lab, browser) -> list[dict]:
    """Notebook 00's first session (and the calculator), run once in the browser: every output of it."""
    base, token = lab()
    _open_and_run_all(browser, base, token, NOTEBOOK)
    return _outputs(browser)


def test_notebook_00_runs_in_a_browser(ran):
    text = _text(ran)
    assert "[rank 0] I am rank 0 of 4" in text, text[-3000:]   # ranks launched from the browser's kernel replied
    assert "rank 3: before [4.0, 4.0, 4.0] -> after [10.0, 10.0, 10.0]" in text, text[-3000:]   # an all-reduce
    assert "caught RankFailed from rank 3 (ZeroDivisionError)" in text, text[-3000:]           # a failing rank
    errors = [o for o in ran if o.get("output_type") == "error"]
    assert not errors, [(e.get("ename"), e.get("evalue")) for e in errors]


def test_calculator_renders_as_a_widget(ran, browser):
    assert any("application/vnd.jupyter.widget-view+json" in (o.get("data") or {}) for o in ran), \
        "the calculator cell showed no widget output"
    # Its cell is the last: bring it into view (JupyterLab renders what is out of view lazily).
    browser.execute_script(
        "const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = nb.widgets.length - 1;"
        "return nb.scrollToItem(nb.widgets.length - 1);")
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(browser, 60).until(lambda d: d.find_elements("css selector", ".widget-slider"))
    sliders = browser.find_elements("css selector", ".widget-slider")
    assert len(sliders) >= 3
    text = browser.execute_script("const nb = window.jupyterapp.shell.currentWidget.content;"
                                  "return nb.widgets[nb.widgets.length - 1].node.innerText;")
    assert "VBox(children" not in text
    assert "per device (GB)" in text and "ZeRO-3 / FSDP" in text


def _wide_summary() -> dict:
    """A tour summary whose tables would overflow a narrow window: long names, many measured/theory pairs."""
    machine = {"device_count": 1, "device_kind": "cpu", "backend": "gloo", "torch_version": "x", "cpu_count": 2,
               "cpu_capability": "AVX2", "cpu_native_bf16": False, "bf16_over_fp32": 40.0}
    strategies = [{"name": f"strategy_with_a_rather_long_name_{k}", "world_size": n, "backend": "gloo",
                   "recipe": "bf16 weights + fp32 Adam", "model_state_bytes": {"params": 2e6 * k, "grads": 2e6,
                                                                                "optimizer_state": 12e6 / n},
                   "predicted_model_state_bytes": 2e6 * k + 2e6 + 12e6 / n, "comm_bytes_per_step": 3e6 * k,
                   "predicted_comm_bytes_per_step": 3e6 * k, "peak_bytes": 9e7, "predicted_peak_bytes": 8.5e7,
                   "samples_per_s": 10.0 * k} for k in (1, 2, 3) for n in (2, 4)]
    races = [{"name": f"race {k}", "baseline": "PyTorch's implementation", "ratio": 0.8 + 0.1 * k,
              "spread_lo": 0.6 + 0.1 * k, "spread_hi": 1.0 + 0.1 * k, "repeats": 21, "world_size": 2} for k in range(4)]
    wide = [{"name": "a 3-D layout", "world_size": 8, "backend": "gloo", **{f"{g}_bytes_{k}": 123456789.0 * k
            for g in ("tp", "pp", "dp") for k in range(1, 4)},
            **{f"predicted_{g}_bytes_{k}": 123456789.0 * k for g in ("tp", "pp", "dp") for k in range(1, 4)}}]
    collectives = [{"op": op, "impl": "library", "world_size": 4, "bytes": b, "seconds": 1e-3, "algbw_GBps": 0.1,
                    "busbw_GBps": 0.15} for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
                   for b in (2 ** 10, 2 ** 20, 2 ** 26)]
    return {"machine": machine, "mode": "quick", "strategies": strategies, "races": races, "mesh3d": wide,
            "collectives": collectives,
            "ring_ratio": [{"world_size": 4, "bytes": 2 ** 26, "ratio": 0.49}]}


def test_report_page_needs_no_sideways_scrolling(browser, tmp_path):
    """The tour's report as a dashboard: at a laptop's width nothing scrolls sideways, the strategies and races
    are charts, and the ring is the shipped solution's, not 'yours'. The screenshot's width is the window's."""
    import html
    import struct

    from distlab.viz.report import build
    page = build(_wide_summary(), []).html()
    assert page.count('class="chart"') == 3                      # memory, traffic, races
    assert "The shipped solution's ring all-reduce" in html.unescape(page) and "Your ring" not in page
    (tmp_path / "report.html").write_text(page)
    browser.set_window_size(900, 1000)
    try:
        browser.get((tmp_path / "report.html").as_uri())
        inner, scroll = browser.execute_script("return [window.innerWidth, document.documentElement.scrollWidth];")
        assert scroll <= inner, f"the page is {scroll} px wide in a {inner} px window: it scrolls sideways"
        shot = tmp_path / "report.png"
        assert browser.save_screenshot(str(shot))
        width = struct.unpack(">I", shot.read_bytes()[16:20])[0]  # the PNG header's width
        assert width == inner, (width, inner)
    finally:
        browser.set_window_size(1400, 1000)
