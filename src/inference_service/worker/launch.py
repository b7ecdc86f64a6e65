"""Launch a distributed worker group with torch.distributed's own launcher (torchrun).

Runs ``torch.distributed.run`` with one node of N ranks of ``inference_service.worker.main``.
The one addition is the ``loopback`` rendezvous backend: torch's static TCP rendezvous with its
store bound to 127.0.0.1 (torch's own listens on every interface). ``--max-restarts 0``: the
server restarts the group as a unit.
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
