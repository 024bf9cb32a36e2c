"""Cleave's own version, as installed (``hello.client_version``, the coordinator's build info)."""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def package_version() -> str:
    """The installed package's version, from its metadata; "unknown" in a checkout never installed."""
    try:
        return importlib.metadata.version("cleave")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
