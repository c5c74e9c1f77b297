"""What the tests share: running cells in a real shell, the torch release's gaps, models and their real measured
steps (``zoo.py``, ``generate_zoo.py``, ``llama.py``, ``models.py``), real gloo jobs (``parallel_runs.py``, its decoders
cut into pipeline stages in ``decoder_pipelines.py``), a real
Jupyter server (``lab_server.py``) and kernel (``kernel.py``), CUDA's answers in PyTorch's shapes
(``cuda_shapes.py``). The benchmarks import them from here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: the checkout's root
ROOT = Path(__file__).resolve().parents[2]

TORCH_BEFORE_2_6 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6)


def run(sh, source: str):
    """Run a cell like a notebook does; return the ExecutionResult."""
    return sh.run_cell(source, store_history=True)


def run_ok(sh, source: str):
    result = run(sh, source)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result


def skip_module_without_transformers_5() -> None:
    """Skip the calling test module on a PyTorch older than 2.6, where transformers 5 refuses to build its models
    (the CI's torch-floor stage), saying so; and where transformers is not installed."""
    if TORCH_BEFORE_2_6:
        pytest.skip("transformers 5 needs PyTorch 2.6 or later", allow_module_level=True)
    pytest.importorskip("transformers")
