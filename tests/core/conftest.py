"""Fixtures the core tests share."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, in this process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
