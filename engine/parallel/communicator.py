"""The tensor-parallel process group: set up over a localhost TCP store, gloo on CPU and NCCL on CUDA, with a
timeout so that a dead peer becomes an exception; and the one collective the model uses."""

import datetime
import socket
import time

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120.0  # a peer silent this long fails the collective (a dead one fails it at once on gloo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Communicator:
    """rank of size; all_reduce sums a tensor over the ranks in place (nothing to do when size is 1).
    With `timed`, the seconds spent in collectives are added up (synchronizing CUDA around each one)."""

    def __init__(self, *, rank: int = 0, size: int = 1, timed: bool = False) -> None:
        self.rank, self.size = rank, size
        self.timed = timed
        self.seconds = 0.0
        self.calls = 0
        self._group = self._store = None

    def connect(self, *, port: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Join the group (every rank calls this; it returns once all have). On CPU the gloo group is private
        to this communicator, so a process may hold several (tests); on CUDA NCCL is the process's default
        group, one tensor-parallel engine per process."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            if dist.is_initialized():
                raise RuntimeError("this process already runs a tensor-parallel engine on CUDA")
            device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                    world_size=self.size, timeout=timeout, device_id=device)
            self._group = None
            return
        self._store = dist.TCPStore("127.0.0.1", port, self.size, self.rank == 0, timeout, wait_for_workers=False)
        self._group = dist.ProcessGroupGloo(self._store, self.rank, self.size, timeout)

    def _all_reduce(self, x: torch.Tensor) -> None:
        if self._group is None:
            dist.all_reduce(x)
        else:
            self._group.allreduce([x]).wait()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if not self.timed:
            self._all_reduce(x)
            return x
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        self._all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return x

    def close(self) -> None:
        if self._group is None and dist.is_initialized():
            dist.destroy_process_group()
        self._group = self._store = None
