"""The estimator's CUDA model: the cuBLAS workspace PyTorch picks by GPU (``parseChosenWorkspaceSize`` in
``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``4096 * 8 * 1024`` when the compute capability's major is 9, 10, 11
or 12, else ``4096 * 1024 * 2 + 16 * 1024 * 8``; hipBLASLt on ROCm 32 MiB, 128 MiB on gfx94x), and a traced step
replayed through the caching allocator's rules (``c10/cuda/CUDACachingAllocator.cpp``), worked by hand."""

from __future__ import annotations

import torch
from torch import nn

import vram_magic
from vram_magic.estimator.device.cuda_model import CudaModel, allocator_layout, cublas_workspace
from vram_magic.estimator.device.gpus import find_gpu

KiB, MiB = 1024, 1024**2
DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"


def test_cublas_workspace_is_chosen_by_compute_capability():
    assert cublas_workspace(find_gpu("H100"))[0] == 32 * MiB  # 9.0
    assert cublas_workspace(find_gpu("H200"))[0] == 32 * MiB
    for name in ("T4", "V100", "A100-80GB", "L4", "RTX-4090", "A10"):  # 7.5, 7.0, 8.0, 8.9, 8.9, 8.6
        assert cublas_workspace(find_gpu(name))[0] == DEFAULT == 8.125 * MiB
    assert cublas_workspace(find_gpu("MI300X"))[0] == 128 * MiB and cublas_workspace(find_gpu("MI250X"))[0] == 32 * MiB
    size, note = cublas_workspace(None)
    assert size == DEFAULT and "assumed" in note and "gpu=" in note


def test_blackwell_capabilities_take_32_mib():
    from vram_magic.estimator.device.gpus import GPU

    for cap in ((10, 0), (11, 0), (12, 0)):
        gpu = GPU("future", 32 * 1024 * MiB, "blackwell", capability=cap)
        assert cublas_workspace(gpu)[0] == 32 * MiB


def test_a_step_replayed_through_the_allocator():
    # serial 1: a 16 MiB weight alive throughout; 2: an 11 MiB activation (its own 12 MiB segment, 1 MiB unsplit);
    # 3: a 100-byte scalar; 2 and 3 freed, then 4: 19 MiB, which fits no cached block (12 MiB) -> a 20 MiB segment
    # with 1 MiB left: not split
    sizes = {1: 16 * MiB, 2: 11 * MiB, 3: 100, 4: 19 * MiB}
    layout = allocator_layout([1], [2, 3, -2, -3, 4], sizes)
    assert layout.blocks == {1: 16 * MiB, 2: 12 * MiB, 3: 512, 4: 20 * MiB}
    assert layout.peak_allocated == 16 * MiB + 20 * MiB
    assert layout.peak_reserved == 16 * MiB + 12 * MiB + 2 * MiB + 20 * MiB


def test_workspaces_take_their_blocks_from_the_segments():
    # two 8.125 MiB cuBLAS workspaces share one 20 MiB segment: the first leaves 11.875 MiB, split again
    assert allocator_layout([], [], {}, persistent=[DEFAULT, DEFAULT]).peak_reserved == 20 * MiB
    # after a 4 MiB weight (20 MiB segment, 16 MiB left) the first takes 8.125 of the 16 MiB, the second does not
    # fit the 7.875 MiB left: a second 20 MiB segment
    layout = allocator_layout([1], [], {1: 4 * MiB}, persistent=[DEFAULT, DEFAULT])
    assert (layout.peak_reserved, layout.peak_allocated) == (40 * MiB, 4 * MiB + 2 * DEFAULT)
    # 32 MiB workspaces (compute capability 9+) are their own 32 MiB segments
    assert allocator_layout([], [], {}, persistent=[32 * MiB, 32 * MiB]).peak_reserved == 64 * MiB


def test_a_window_of_collective_buffers_is_held_between_two_events():
    sizes = {1: 2 * MiB, 2: 2 * MiB}
    layout = allocator_layout([], [1, 2, -1, -2], sizes, window=(1, 2, 30 * MiB))
    assert layout.peak_allocated == 30 * MiB + 4 * MiB
    assert layout.peak_reserved == 20 * MiB + 30 * MiB


def test_a_spike_after_an_event_is_allocated_and_freed():
    layout = allocator_layout([], [1, -1], {1: 2 * MiB}, spikes={1: 64 * MiB})
    assert layout.peak_allocated == 2 * MiB + 64 * MiB
    assert layout.peak_reserved == 20 * MiB + 64 * MiB


def test_estimate_reserves_what_the_simulated_allocator_reserves():
    torch.manual_seed(0)
    model, x = nn.Linear(1024, 4096), torch.randn(8, 1024)
    est = vram_magic.estimate(model, x, gpu="A100-80GB")
    # segments: weight 16 MiB; bias, input, small temporaries 2 MiB; two 8.125 MiB workspaces one 20 MiB;
    # weight gradient 16; AdamW's two moments 16 + 16; foreach's parameter-sized temporary 16
    assert est.reserved == (16 + 2 + 20 + 16 + 16 + 16 + 16) * MiB
    assert est.needed == est.reserved + CudaModel().context
    on_h100 = vram_magic.estimate(model, x, gpu="H100")
    assert on_h100.peak.details("other")["cuBLAS workspaces (modelled)"] == 2 * 32 * MiB
    assert not any("assumed" in n for n in est.notes)
    assert any("8.125 MiB per cuBLAS handle assumed" in n for n in vram_magic.estimate(model, x).notes)


def test_capacities_are_what_cuda_can_allocate_not_nvidia_smi_totals():
    """A catalogued GPU's capacity is totalGlobalMem as published for current drivers (deviceQuery, PyTorch's own
    out-of-memory messages), below nvidia-smi's total, which includes memory the driver keeps; the estimate says so."""
    from vram_magic.estimator.device.gpus import GPUS, find_gpu

    t4 = find_gpu("T4")
    assert t4.memory == 15642329088 and round(t4.memory / MiB) == 14918 and t4.reported == 15360 * MiB
    assert find_gpu("A100-80GB").memory == 85100068864 and find_gpu("H200").memory == 143156 * MiB
    for gpu in GPUS:
        assert gpu.source and (gpu.reported is None or gpu.memory <= gpu.reported), gpu.name
    est = vram_magic.estimate(torch.nn.Linear(64, 64), torch.randn(4, 64), gpu="T4")
    assert est.capacity == t4.memory
    assert any(n.startswith("capacity: what CUDA lets PyTorch allocate on a T4, 14.6 GiB")
               and "nvidia-smi shows 15.0 GiB" in n for n in est.notes)
