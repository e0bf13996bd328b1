"""Which GPU of its node each device slot of a run uses (``n_devices_per_node`` slots a node, ``gpus_per_node`` GPUs
they share), and the launcher's check that they exist. No torch here: the launcher runs it before importing torch."""
from __future__ import annotations

import os


def gpu_of_slot(slot: int, devices_per_node: int, gpus_per_node: int = 0) -> int:
    """The node-local GPU of device slot ``slot``: its slot on the node, ``slot % devices_per_node``, or where the
    node's slots share fewer GPUs (``gpus_per_node`` > 0, the option of that name) that slot modulo
    ``gpus_per_node``."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
    local = slot % devices_per_node
    return local % gpus_per_node if gpus_per_node > 0 else local


def check_slot_gpus(n_slots: int, devices_per_node: int, gpus_per_node: int, device_count: int) -> None:
    """Before a local launch on a machine with ``device_count`` visible CUDA devices: ValueError when a device slot
    of the run would land on a GPU this machine does not have (a generation server would otherwise be shown no GPU
    and fall back to the CPU without a word). Nothing to check without CUDA devices."""
    if device_count <= 0:
        return
    need = 1 + max(gpu_of_slot(s, devices_per_node, gpus_per_node) for s in range(min(n_slots, devices_per_node)))
    if need > device_count:
        share = (f"set gpus_per_node={device_count} so that the slots share them (slot s on GPU s % {device_count}; "
                 "model workers still need one each), or " if not gpus_per_node else
                 f"lower gpus_per_node to {device_count}, or ")
        raise ValueError(f"the run's {n_slots} device slot(s) (n_devices_per_node={devices_per_node}"
                         f"{f', gpus_per_node={gpus_per_node}' if gpus_per_node else ''}) use {need} GPU(s) on this "
                         f"node, but {device_count} CUDA device(s) are visible: {share}lower n_devices_per_node or the "
                         "allocation's device count")


def visible_cuda_devices() -> int:
    """The CUDA devices this process can use: 0 at once where the machine has no NVIDIA driver device (``/dev/nvidiactl``,
    or ``/dev/dxg`` under WSL), so that a CPU launcher never imports torch for this; else what torch counts."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
