"""A catalogue of common accelerators: what CUDA (or ROCm) lets PyTorch allocate, the architecture, and the figures
a time model needs — dense peak throughput per dtype, memory bandwidth, the host link and the GPU-to-GPU link.

**Capacity.** ``memory`` is what ``torch.cuda.get_device_properties(i).total_memory`` reports (``totalGlobalMem``),
the most PyTorch can ever allocate, as published in deviceQuery output and in PyTorch's own out-of-memory messages
("GPU 0 has a total capacity of 79.21 GiB") on recent drivers. ``nvidia-smi`` shows more (``reported``): on current
drivers its total is the board's full size, which includes memory the driver keeps for itself (0.4–3 % of it: a T4
reads 15,360 MiB there and 14,918 MiB to CUDA). Every "fits" verdict compares with ``memory``. The figure moves a
little between driver generations (a T4 allowed 15,109 MiB on drivers of the R410–R470 era); each entry says
where its figure comes from.

**Throughput.** Dense peaks (no structured sparsity) in TFLOP/s per dtype, from the vendors' datasheets and
architecture whitepapers: ``fp32`` on the CUDA cores (PyTorch's default for fp32 matmuls, since
``torch.backends.cuda.matmul.allow_tf32`` is off), ``tf32`` on the tensor cores, ``fp16``/``bf16`` on the tensor cores
with fp32 accumulation (what PyTorch's GEMMs use; GeForce cards run it at half their fp16-accumulate rate), ``int8``.
A dtype a GPU has no fast path for is absent: Turing, Volta and Pascal have no bf16. ``bandwidth`` is the memory's
peak in bytes/s; ``pcie`` the host link's generation (x16); ``link`` the GPU-to-GPU link's bandwidth per direction
(NVLink, or AMD's Infinity Fabric between two devices), ``None`` where GPUs talk over PCIe.

AMD's MI250X is two devices to PyTorch (two GCDs of 64 GB each): its entry is one of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

MiB = 1024**2
GB = 10**9
#: PCIe x16 bandwidth per direction by generation, bytes/s (PCI-SIG: 2.5, 5, 8, 16, 32 GT/s per lane, 128b/130b
#: coding from gen 3): 4, 8, 15.75, 31.5, 63 GB/s
PCIE_X16 = {1: 4.0 * GB, 2: 8.0 * GB, 3: 15.75 * GB, 4: 31.5 * GB, 5: 63.0 * GB}


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes PyTorch can allocate: total_memory (totalGlobalMem)
    arch: str  # "turing", "ampere", "ada", "hopper", "cdna3", ...
    capability: tuple[int, int] | None = None  # CUDA compute capability; None for AMD GPUs
    peaks: Mapping[str, float] = field(default_factory=dict)  # dense peak TFLOP/s: fp32, tf32, fp16, bf16, int8
    bandwidth: float = 0.0  # memory bandwidth, bytes/s
    pcie: int = 4  # the host link's PCIe generation (x16)
    link: float | None = None  # GPU-to-GPU bandwidth per direction (NVLink, Infinity Fabric), bytes/s
    reported: int | None = None  # nvidia-smi's total (bytes), which includes memory the driver reserves
    aliases: tuple[str, ...] = ()
    source: str = ""  # where ``memory`` comes from

    def peak(self, dtype: str) -> float | None:
        """Dense peak FLOP/s for ``dtype`` (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"int8"``), ``None`` where
        the GPU has no fast path for it."""
        tflops = self.peaks.get(dtype)
        return tflops * 1e12 if tflops else None

    @property
    def has_bf16(self) -> bool:
        return "bf16" in self.peaks

    @property
    def host_link(self) -> float:
        """The host link's bandwidth per direction (PCIe x16 of the GPU's generation), bytes/s."""
        return PCIE_X16[self.pcie]


def _peaks(fp32: float, fp16: float, bf16: float | None = None, tf32: float | None = None,
           int8: float | None = None) -> dict[str, float]:
    out = {"fp32": fp32, "fp16": fp16}
    for name, value in (("bf16", bf16), ("tf32", tf32), ("int8", int8)):
        if value:
            out[name] = value
    return out


_DEVICE_QUERY = "deviceQuery's totalGlobalMem"
_TORCH = "torch.cuda.get_device_properties().total_memory"

GPUS: tuple[GPU, ...] = (
    GPU("T4", 15642329088, "turing", (7, 5), _peaks(8.1, 65, int8=130), 320 * GB, pcie=3, reported=15360 * MiB,
        aliases=("t4-16gb", "tesla-t4"), source=f"{_DEVICE_QUERY}, driver 12.5 (15,109 MiB on R410–R470 drivers)"),
    GPU("V100-16GB", 16160 * MiB, "volta", (7, 0), _peaks(15.7, 125), 900 * GB, pcie=3, link=150 * GB,
        reported=16160 * MiB, aliases=("v100", "v100-sxm2-16gb"), source=f"{_TORCH}, driver 460"),
    GPU("V100-32GB", 34072559616, "volta", (7, 0), _peaks(15.7, 125), 900 * GB, pcie=3, link=150 * GB,
        reported=32768 * MiB, aliases=("v100-sxm2-32gb",), source=f"{_DEVICE_QUERY}, driver 12.9"),
    GPU("P100", 16280 * MiB, "pascal", (6, 0), _peaks(9.3, 18.7), 732 * GB, pcie=3, reported=16280 * MiB,
        aliases=("p100-pcie-16gb",), source=f"{_TORCH} (Colab)"),
    GPU("L4", 23612293120, "ada", (8, 9), _peaks(30.3, 121, 121, tf32=60, int8=242.5), 300 * GB, pcie=4,
        reported=23034 * MiB, source=f"{_DEVICE_QUERY}, driver 12.0"),
    GPU("A10", 23696375808, "ampere", (8, 6), _peaks(31.2, 125, 125, tf32=62.5, int8=250), 600 * GB, pcie=4,
        reported=23028 * MiB, aliases=("a10g", "a10-24gb"),
        source=f"{_DEVICE_QUERY}, driver 12.8 (an A10G: 22,587 MiB)"),
    GPU("RTX-3090", 24259 * MiB, "ampere", (8, 6), _peaks(35.6, 71, 71, tf32=35.6, int8=284), 936 * GB, pcie=4,
        link=56.25 * GB, reported=24576 * MiB, aliases=("3090", "rtx3090", "geforce-rtx-3090"), source=_TORCH),
    GPU("RTX-4090", 25756696576, "ada", (8, 9), _peaks(82.6, 165.2, 165.2, tf32=82.6, int8=660.6), 1008 * GB,
        pcie=4, reported=24564 * MiB, aliases=("4090", "rtx4090", "geforce-rtx-4090"),
        source=f"{_DEVICE_QUERY}, driver 12.1, Linux (Windows' WDDM leaves 23,028 MiB)"),
    GPU("RTX-A6000", 51160023040, "ampere", (8, 6), _peaks(38.7, 154.8, 154.8, tf32=77.4, int8=309.7), 768 * GB,
        pcie=4, link=56.25 * GB, reported=49140 * MiB, aliases=("a6000",), source=f"{_DEVICE_QUERY}, driver 12.7"),
    GPU("L40S", 45589 * MiB, "ada", (8, 9), _peaks(91.6, 362.05, 362.05, tf32=183, int8=733), 864 * GB, pcie=4,
        reported=46068 * MiB, aliases=("l40s-48gb",), source=_TORCH),
    GPU("A100-40GB", 42405855232, "ampere", (8, 0), _peaks(19.5, 312, 312, tf32=156, int8=624), 1555 * GB, pcie=4,
        link=300 * GB, reported=40960 * MiB, aliases=("a100-40", "a100-sxm4-40gb", "a100"),
        source=f"{_DEVICE_QUERY} (OOM messages: 39.50 GiB)"),
    GPU("A100-80GB", 85100068864, "ampere", (8, 0), _peaks(19.5, 312, 312, tf32=156, int8=624), 2039 * GB, pcie=4,
        link=300 * GB, reported=81920 * MiB, aliases=("a100-80", "a100-sxm4-80gb"),
        source=f"{_DEVICE_QUERY}, driver 12.5 (OOM messages: 79.15–79.25 GiB)"),
    GPU("H100-80GB", 85017755648, "hopper", (9, 0), _peaks(66.9, 989.4, 989.4, tf32=494.7, int8=1978.9), 3350 * GB,
        pcie=5, link=450 * GB, reported=81559 * MiB, aliases=("h100", "h100-sxm", "h100-sxm5", "h100-80gb-hbm3"),
        source=f"{_DEVICE_QUERY}, driver 13.0 (OOM messages: 79.18–79.21 GiB); the SXM5 board"),
    GPU("H100-PCIe", 81008 * MiB, "hopper", (9, 0), _peaks(51, 756, 756, tf32=378, int8=1513), 2000 * GB, pcie=5,
        reported=81559 * MiB, aliases=("h100-pcie-80gb",), source=_TORCH),
    GPU("H200", 143156 * MiB, "hopper", (9, 0), _peaks(67, 989.4, 989.4, tf32=494.7, int8=1978.9), 4800 * GB,
        pcie=5, link=450 * GB, reported=143771 * MiB, aliases=("h200-141gb", "h200-sxm"),
        source=f"{_TORCH} (OOM messages: 139.80 GiB)"),
    GPU("MI250X", 65520 * MiB, "cdna2", None, _peaks(23.95, 191.5, 191.5, int8=191.5), 1600 * GB, pcie=4,
        link=50 * GB, aliases=("mi250",), source=f"{_TORCH}, one of the package's two GCDs"),
    GPU("MI300X", 196592 * MiB, "cdna3", None, _peaks(163.4, 1307.4, 1307.4, tf32=653.7, int8=2614.9), 5300 * GB,
        pcie=5, link=64 * GB, aliases=("mi300",), source=f"{_TORCH}, ROCm 6.2"),
)
#: Where the figures come from. Capacities: deviceQuery output and PyTorch's out-of-memory messages as users posted
#: them (e.g. mbzuai-oryx/GeoPixel#5 for a T4 on driver 535, PrimeIntellect-ai/prime-rl benchmarks for H100/H200,
#: ROCm/ROCm#4203 for MI300X). Throughput and bandwidth: NVIDIA's T4, V100, L4, A10, L40S, A100 and H100/H200
#: datasheets, the GA102 and Ada architecture whitepapers (appendix tables) for the RTX cards, AMD's MI250X and MI300X
#: pages; link speeds per direction: NVLink 2 150 GB/s, NVLink 3 300 GB/s, NVLink 4 450 GB/s, the GA102 bridge
#: 112.5 GB/s both ways; Infinity Fabric 50 GB/s (MI250X) and 64 GB/s (MI300X) per peer and direction.


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").replace("nvidia-", "")


def find_gpu(name: str) -> GPU:
    """``find_gpu("a100-80gb")``; case, spaces and an ``NVIDIA`` prefix do not matter."""
    if not isinstance(name, str):
        raise TypeError(f"gpu must be a name such as 'A100-80GB', not {type(name).__name__}")
    key = _key(name)
    for gpu in GPUS:
        if key == _key(gpu.name) or key in gpu.aliases:
            return gpu
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS)} (or give budget='24GiB')")
