"""The app on a real X server (Xvfb), through Qt's xcb platform plugin, not `offscreen`: what users on a Linux
desktop run. And the check `make run` does first, which names the missing system libraries instead of letting Qt
abort with "Could not load the Qt platform plugin 'xcb'".

The Xvfb tests are skipped, with the reason, where Xvfb is not installed (apt-get install xvfb). Where it is, a
missing xcb library fails them with the apt-get line that fixes it: that is what they are there to catch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from app.platform_check import APT_LINE, NO_DISPLAY, XCB_LIBRARIES, check, uses_xcb

ROOT = Path(__file__).resolve().parent.parent
XVFB = shutil.which("Xvfb")
needs_xvfb = pytest.mark.skipif(XVFB is None, reason="Xvfb is not installed (apt-get install xvfb): the app is not "
                                                     "started on a real X server here")


# --- the check before the window opens --------------------------------------------------------------------------
def test_missing_xcb_libraries_are_named_with_the_apt_line_that_installs_them():
    absent = {"libxcb-cursor.so.0", "libxcb-icccm.so.4"}

    ok, message = check({"DISPLAY": ":0"}, "linux", loads=lambda name: name not in absent)

    assert not ok
    assert "libxcb-cursor.so.0" in message and "libxcb-icccm.so.4" in message
    assert "sudo apt-get install -y libxcb-cursor0 libxcb-icccm4\n" in message
    assert APT_LINE in message and "dnf install" in message  # everything at once, and other systems


def test_with_every_library_present_the_check_is_silent():
    assert check({"DISPLAY": ":0"}, "linux", loads=lambda name: True) == (True, "")


@pytest.mark.parametrize("env, platform", [({"QT_QPA_PLATFORM": "offscreen"}, "linux"), ({}, "darwin"),
                                           ({}, "win32"), ({"WAYLAND_DISPLAY": "wayland-0",
                                                           "XDG_SESSION_TYPE": "wayland", "DISPLAY": ":0"}, "linux")])
def test_where_qt_will_not_use_xcb_nothing_is_checked(env, platform):
    assert check(env, platform, loads=lambda name: False) == (True, "")


def test_without_any_display_the_check_says_what_to_do_instead():
    ok, message = check({}, "linux", loads=lambda name: True)

    assert not ok and message == NO_DISPLAY
    assert "xvfb-run" in message and "main.py chat" in message


@pytest.mark.parametrize("env, expected", [({"DISPLAY": ":1"}, True), ({"QT_QPA_PLATFORM": "xcb"}, True),
                                           ({"DISPLAY": ":1", "QT_QPA_PLATFORM": "wayland"}, False),
                                           ({"DISPLAY": ":1", "QT_QPA_PLATFORM": "xcb;wayland"}, True)])
def test_which_platform_qt_will_pick(env, expected):
    assert uses_xcb(env) is expected


def test_every_library_maps_to_one_debian_package():
    assert len(XCB_LIBRARIES) == len(set(XCB_LIBRARIES.values()))
    assert all(name.startswith("lib") and ".so." in name for name in XCB_LIBRARIES)


# --- a real X server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def x_display():
    """A private Xvfb server; yields the environment that points the app at it (and not at `offscreen`)."""
    read, write = os.pipe()
    server = subprocess.Popen([XVFB, "-displayfd", str(write), "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
                              pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as pipe:
        number = pipe.readline().strip()  # Xvfb writes its display number once it accepts connections
    if not number:
        server.kill()
        pytest.fail("Xvfb did not start")
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env.update(DISPLAY=f":{number}", QT_QPA_PLATFORM="xcb", OMP_NUM_THREADS="1")
    yield env
    server.terminate()
    server.wait(timeout=10)


@needs_xvfb
def test_the_platform_check_passes_on_this_x_server(x_display):
    result = subprocess.run([sys.executable, "-m", "app.platform_check"], cwd=ROOT, env=x_display,
                            capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr


@needs_xvfb
def test_qt_loads_its_xcb_plugin_on_the_x_server(x_display):
    probe = ("from PySide6.QtWidgets import QApplication; app = QApplication([]); "
             "print(app.platformName(), app.primaryScreen().size().width(), app.primaryScreen().size().height())")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=x_display, capture_output=True, text=True,
                            timeout=60)

    assert result.returncode == 0, f"{result.stderr}\n{check(x_display)[1]}"
    assert result.stdout.split() == ["xcb", "1600", "1000"]


@needs_xvfb
def test_the_app_starts_replies_and_draws_on_a_real_x_server(x_display, tmp_path, tiny_model_folder):
    """`main.py gui --demo` on a model folder (the tiny random Llama, so that it takes seconds): the whole app
    (theme, window, loader, worker thread, plots) on xcb."""
    config = tmp_path / "config"
    (config / "kvscope").mkdir(parents=True)
    (config / "kvscope" / "kvscope.conf").write_text(  # the user's settings stay untouched
        "[sampling]\nmax_new_tokens=16\ntemperature=0\n[engine]\ncache=paged\n")
    shot = tmp_path / "xvfb-window.png"
    env = dict(x_display, XDG_CONFIG_HOME=str(config), XDG_DATA_HOME=str(tmp_path / "data"))  # the demo's
    # conversation is saved there, not into the user's history

    result = subprocess.run([sys.executable, "main.py", "gui", "--model", str(tiny_model_folder), "--demo",
                             "What is a KV cache?", "--screenshot", str(shot)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "screenshot saved" in result.stdout
    image = QImage(str(shot))
    assert (image.width(), image.height()) == (1440, 900)
    assert image.pixelColor(10, 450).lightness() < 60  # the dark theme, drawn by the X server's window
    assert "qt.qpa" not in result.stderr  # no platform plugin complaints


def run_scenario(x_display: dict, tmp_path, scenario: str, *args: str) -> dict:
    """Run a scenario script in its own process on the X server (xcb), with its data and settings under tmp_path;
    it must exit 0 and print a JSON report as its last line, which is returned."""
    script = tmp_path / "scenario.py"
    script.write_text(scenario)
    env = dict(x_display, XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "qt.qpa" not in result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])

