"""Where a client keeps its config and caches, by operating system's convention."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# (Windows variable, Windows fallback under home, macOS folder under home, XDG variable, XDG fallback)
_KINDS = {
    "config": ("APPDATA", "AppData/Roaming", "Library/Application Support", "XDG_CONFIG_HOME", ".config"),
    "cache": ("LOCALAPPDATA", "AppData/Local", "Library/Caches", "XDG_CACHE_HOME", ".cache"),
}


def user_dir(kind: str) -> Path:
    """``<the OS's config or cache folder>/cleave``."""
    win_var, win_default, mac, xdg_var, xdg_default = _KINDS[kind]
    system = platform.system()
    if system == "Windows":
        base = Path(os.environ.get(win_var, Path.home() / win_default))
    elif system == "Darwin":
        base = Path.home() / mac
    else:
        base = Path(os.environ.get(xdg_var, Path.home() / xdg_default))
    return base / "cleave"
