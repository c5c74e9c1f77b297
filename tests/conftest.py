from __future__ import annotations

import atexit
import gc
import os
import sys

import pytest
import torch

from tests.support import TORCH_BEFORE_2_6


@pytest.fixture
def shell():
    """A real IPython shell with the extension loaded; cleaned up (and unloaded) after the test."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance(colors="nocolor")
    sh.run_cell("%load_ext vram_magic", store_history=True)
    yield sh
    sh.run_cell("%unload_ext vram_magic")
    sh.reset(new_session=True)
    InteractiveShell.clear_instance()
    # each shell registers its exit handler, which keeps it alive to the end and runs a full garbage collection
    # then: a few hundred shells' collections made the suite's exit take minutes
    atexit.unregister(sh.atexit_operations)
    sh.history_manager.end_session()
    gc.collect()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip without a CUDA GPU. Tests guarded by ``skipif(... reason="needs a CUDA
    GPU")`` count as cuda tests too, so ``pytest -m cuda`` (benchmarks/gpu_check.py) runs every GPU test."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    available = torch.cuda.is_available()
    floor = _FLOOR_SKIPS if TORCH_BEFORE_2_6 else {}
    for item in items:
        for prefix, reason in floor.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"not yet on PyTorch < 2.6: {reason}"))
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
        if not available and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


#: What the torch floor (2.5.1) does not run yet, and why; each is a known gap on that release (README's limits)
_FLOOR_SKIPS = {
    "tests/estimator/parallel/": "tensor/pipeline-parallel estimates build c10d's ProcessGroup as 2.6 on does",
    "tests/ranks/test_tp_pp.py::test_one_f_one_b_holds_fewer_micro_batches_than_gpipe": "2.5.1's 1F1B on gloo",
    "tests/estimator/device/test_autocast.py": "CUDA's autocast lists were read for 2.13 and 2.15",
    "tests/estimator/device/test_sdpa_autocast.py": "transformers 5's Llama needs 2.6",
    "tests/estimator/device/test_sdpa.py::test_dropout_and_rms_norm_keep_what_cuda_keeps":
        "2.5.1 has no fused rms_norm op",
    "tests/estimator/test_inputs.py::test_a_builder_that_raises_is_named_for_a_step_and_for_generate": "generate= "
    "needs transformers 5",
    "tests/engine/test_stderr_filter.py::test_without_the_filter_the_line_reaches_the_user": "2.5.1's profiler prints "
    "no unknown-block line in this case",
    "tests/estimator/test_moe.py": "transformers 5's MoE models need 2.6 (their grouped GEMM, torch._grouped_mm, "
    "2.9)",
    "tests/estimator/test_fake_kernels.py::test_the_grouped_mm_kernel": "torch._grouped_mm is 2.9's",
    "tests/estimator/test_fake_kernels.py::test_an_fp32_moe_model": "transformers 5's MoE models need 2.6",
    "tests/estimator/test_fake_kernels.py::test_a_builder_leaves_the_initialisers": "transformers 5 needs 2.6",
    "tests/estimator/test_fake_kernels.py::test_layerdrop_keeps_every_layer": "transformers 5's wav2vec2 needs 2.6",
    "tests/estimator/test_fake_kernels.py::test_swin_is_estimated": "transformers 5's Swin needs 2.6",
    "tests/estimator/test_recipes.py": "the recipes' real steps are transformers 5's Llama, which needs 2.6",
    "tests/estimator/test_fsdp2.py": "FSDP2's public fully_shard and its policies are 2.6's (estimates refuse them "
    "below)",
    "tests/estimator/test_optimizers.py::test_torchao": "torchao 0.18 needs a newer torch (torch.int1)",
    "tests/estimator/test_optimizers.py::test_state_is_counted_by_hand[torchao": "torchao 0.18 needs a newer torch "
    "(torch.int1)",
    "tests/estimator/plan/test_layouts.py::test_a_plan_refuses_bad_layouts": "transformers 5's Llama needs 2.6",
    "tests/estimator/plan/test_layouts.py::test_a_plan_across_hosts": "transformers 5's Llama needs 2.6",
    "tests/estimator/plan/test_layouts.py::test_tensor_parallelism_of_a_llama": "transformers 5's Llama needs 2.6",
    "tests/estimator/planning/test_recipes_plan.py": "transformers 5's Llama needs 2.6",
    "tests/ranks/test_tp_pp.py::test_tensor_parallel_mlp_per_rank_by_hand": "2.5.1's DTensor leaves a 1-byte tensor "
    "made after the forward alive, which the step's loss phase counts as an activation",
}


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    """With ``VRAM_TESTS_EXIT_AFTER_REPORT=1`` (the CI's torch-version stage) the process ends as soon as pytest
    has reported, skipping interpreter shutdown: on torch 2.5.1 the garbage collection that IPython's exit
    handlers run took more than ten minutes after a passing suite."""
    if os.environ.get("VRAM_TESTS_EXIT_AFTER_REPORT") == "1" and _EXIT_STATUS \
            and not os.environ.get("PYTEST_XDIST_WORKER"):  # a worker ends when its controller says so
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
