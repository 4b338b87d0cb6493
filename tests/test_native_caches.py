"""The launcher bounds oneDNN's per-shape caches (RSS growth under load) unless the user set them."""

from __future__ import annotations

import subprocess
import sys

from tpserve.__main__ import NATIVE_CACHE_DEFAULTS, bound_native_caches


def test_defaults_fill_only_unset_names() -> None:
    env = {"LRU_CACHE_CAPACITY": "7"}
    bound_native_caches(env)
    assert env == {"LRU_CACHE_CAPACITY": "7",
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": NATIVE_CACHE_DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}


def test_set_before_torch_is_imported() -> None:
    """oneDNN reads the variables once, when torch loads: the entry point must not import it first."""
    code = "import sys, tpserve.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
