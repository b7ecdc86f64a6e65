"""Launch a distributed worker group with torch.distributed's own launcher (torchrun).

``python -m inference_service.worker.launch --nproc-per-node N --connect PATH``
runs ``torch.distributed.run`` with one node of N processes, each executing
``python -m inference_service.worker.main --connect PATH`` with ``LOCAL_RANK``,
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` set by
torchrun. The only addition is a rendezvous backend, registered through
torch's rendezvous handler registry as ``loopback``: torch's static TCP
rendezvous, but with its store listening on a socket bound to 127.0.0.1 on a
free port (torch's own store would listen on every interface).
``--max-restarts 0``: a rank that dies takes the group down; the server restarts
the group as a unit.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

_listen: socket.socket | None = None


def _bind_loopback() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _register_backend() -> None:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    class LoopbackRendezvous(StaticTCPRendezvous):
        """Static TCP rendezvous whose store listens on the pre-bound loopback socket."""

        def get_backend(self) -> str:
            return "loopback"

        def next_rendezvous(self) -> Any:
            if not self._store and self.rank == 0 and _listen is not None:
                self._store = TCPStore("127.0.0.1", self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=_listen.fileno(), use_libuv=False)
            return super().next_rendezvous()

    def create(params: RendezvousParameters) -> Any:
        params.config.setdefault("rank", 0)
        handler = create_rdzv_handler(params)
        handler.__class__ = LoopbackRendezvous
        return handler

    rendezvous_handler_registry.register("loopback", create)


def main(argv: list[str] | None = None) -> int:
    """Parse ``--nproc-per-node`` and ``--connect``, then run torchrun. Returns its exit status."""
    global _listen
    parser = argparse.ArgumentParser(prog="inference_service.worker.launch")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--connect", required=True, help="the frontend's Unix socket for this group")
    args = parser.parse_args(argv)
    _listen = _bind_loopback()
    port = _listen.getsockname()[1]
    _register_backend()
    from torch.distributed.run import main as torchrun

    torchrun([
        "--nnodes", "1", "--nproc-per-node", str(args.nproc_per_node),
        "--rdzv-backend", "loopback", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--max-restarts", "0", "--monitor-interval", "0.5",
        "--module", "inference_service.worker.main", "--connect", args.connect,
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
