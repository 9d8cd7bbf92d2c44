"""Before the window opens on Linux: are the system libraries that Qt's xcb platform plugin needs installed?

Without them Qt aborts with "Could not load the Qt platform plugin 'xcb'" (and, since Qt 6.5, a hint that names
only libxcb-cursor0 whatever is missing). This check loads each library the plugin links against, the way the
dynamic loader will, and prints the one `apt-get install` line that fixes it, or what to do elsewhere.

    python -m app.platform_check      exit 0: go ahead; 1: something is missing (the message says what)

It imports neither Qt nor torch, so it answers in a few milliseconds; `make run` runs it before the app.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

# the libraries PySide6's libqxcb.so and libQt6XcbQpa.so link against beyond libxcb itself (ldd on Qt 6.11),
# with the Debian / Ubuntu package of each
XCB_LIBRARIES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
}
APT_LINE = "sudo apt-get install -y " + " ".join(dict.fromkeys(XCB_LIBRARIES.values()))
ELSEWHERE = (
    "On Fedora: sudo dnf install xcb-util-cursor xcb-util-wm xcb-util-keysyms xcb-util-image xcb-util-renderutil "
    "libxkbcommon-x11 mesa-libEGL\n"
    "On Arch: sudo pacman -S xcb-util-cursor xcb-util-wm xcb-util-keysyms xcb-util-image xcb-util-renderutil "
    "libxkbcommon-x11\n"
    "Elsewhere: install your distribution's packages that provide the files named above."
)
NO_DISPLAY = (
    "No display: neither DISPLAY nor WAYLAND_DISPLAY is set, so the window has nowhere to open.\n"
    "Run it from a desktop session, or over ssh with -X, or in a virtual display (xvfb-run make run);\n"
    "without a display `main.py chat` and `main.py bench` work, and QT_QPA_PLATFORM=offscreen renders off screen."
)


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def missing_libraries(loads: Callable[[str], bool] = _loads) -> list[str]:
    """The xcb plugin's libraries the dynamic loader cannot find."""
    return [name for name in XCB_LIBRARIES if not loads(name)]


def uses_xcb(env: Mapping[str, str]) -> bool:
    """Whether Qt will pick its xcb plugin: an X display, and neither another platform asked for nor Wayland."""
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(";")[0].split(":")[0] == "xcb"
    wayland = env.get("WAYLAND_DISPLAY") and env.get("XDG_SESSION_TYPE") == "wayland"
    return bool(env.get("DISPLAY")) and not wayland


def check(env: Mapping[str, str] = os.environ, platform: str = sys.platform,
          loads: Callable[[str], bool] = _loads) -> tuple[bool, str]:
    """(ok, message): message is empty when there is nothing to say."""
    if not platform.startswith("linux") or env.get("QT_QPA_PLATFORM", "").startswith(("offscreen", "minimal")):
        return True, ""
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY") and not env.get("QT_QPA_PLATFORM"):
        return False, NO_DISPLAY
    if not uses_xcb(env):
        return True, ""
    missing = missing_libraries(loads)
    if not missing:
        return True, ""
    packages = " ".join(XCB_LIBRARIES[name] for name in missing)
    return False, (
        f"Qt's xcb platform plugin needs system libraries that are not installed: {', '.join(missing)}.\n"
        f"On Debian or Ubuntu: sudo apt-get install -y {packages}\n"
        f"(or all of them at once: {APT_LINE})\n{ELSEWHERE}"
    )


def main() -> int:
    ok, message = check()
    if message:
        print(message, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
