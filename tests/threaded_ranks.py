"""Many ranks in one process: torch's threaded process group, one thread per rank, real
collectives (the values every rank sends reach every other), real ints for ranks, so the
engine plans and runs each rank exactly as it would on a cluster.

`run(world, fn)` calls `fn(rank)` on `world` threads, each in a process group of its own
rank, and returns `{rank: result}`; the first rank's exception fails the call with its
traceback. The process's own distributed state is left as it was.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def run(world: int, fn: Callable[[int], Any], timeout: float = 600.0) -> dict[int, Any]:
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    store = dist.HashStore()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # every rank's failure is kept; the others are woken
            errors[rank] = traceback.format_exc()
            threaded.ProcessLocalGroup.exception_handle(e)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if alive:
            raise AssertionError(f"ranks {alive[:8]} of {world} did not finish in {timeout} s")
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        first = min(errors)
        raise AssertionError(f"rank {first} of {world} failed:\n{errors[first]}")
    return out


def block(x: torch.Tensor, mesh: Any, placements: list) -> DTensor:
    """This rank's block of the whole tensor `x` placed by `placements` on `mesh` (no collective)."""
    from purestep.core import _compat as compat

    size, offset = compat.local_box(x.shape, mesh.mesh.shape, mesh.get_coordinate(), placements)
    local = x[tuple(slice(o, o + n) for o, n in zip(offset, size))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())


def whole_block(x: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of the whole tensor `x` that this rank's block of `like` holds."""
    from purestep.core import _compat as compat

    mesh = like.device_mesh
    size, offset = compat.local_box(x.shape, mesh.mesh.shape, mesh.get_coordinate(), like.placements)
    return x[tuple(slice(o, o + n) for o, n in zip(offset, size))]
