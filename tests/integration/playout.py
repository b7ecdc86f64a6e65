"""A Kubernetes cluster's network played out with namespaces of the test's own (``unshare``,
``nsenter``, ``ip``), for tests/integration/test_kubernetes.py and test_kserve_cluster.py.

- the cluster network: a namespace holding a Service address (:data:`REPOSITORY_IP`, on its
  loopback) and the node's end (:data:`NODE_IPS`) of a veth link to each pod; the kubelet's
  probes, the Services' traffic and Prometheus' scrapes come from here (``cluster_client.py``);
- each pod: a namespace of its own (network and mounts) with its address (:data:`POD_IPS`) on
  ``eth0``, on a subnet of its own as a node's pod CIDR, and an ``/etc/hosts`` naming the
  cluster's Services as cluster DNS would.
"""

from __future__ import annotations

import json
import selectors
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLUSTER_CLIENT = Path(__file__).resolve().parent / "cluster_client.py"

POD_IPS = ("10.244.0.10", "10.244.1.10")  #: each pod's address on its eth0
NODE_IPS = ("10.244.0.1", "10.244.1.1")  #: the cluster's end of each pod's link
REPOSITORY_IP = "10.96.0.20"  #: a Service's cluster IP (the model repository's)


def read_line(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """The next line ``proc`` writes on stdout, waiting at most ``timeout`` s."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise AssertionError(f"{what}: no output within {timeout}s")
    line = proc.stdout.readline()
    assert line, f"{what}: exited ({proc.wait(5)}) before it was ready"
    return line


def namespaces_usable() -> bool:
    """Whether this machine lets the test make user, network and mount namespaces and veth links."""
    if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip")):
        return False
    try:
        return subprocess.run(["unshare", "-rnm", "sh", "-c", "ip link add v0 type veth peer name v1"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


#: Why a test that needs :func:`namespaces_usable` fails where it is not.
NAMESPACES_NEEDED = ("needs network and mount namespaces of its own (unshare -rnm, nsenter, ip, veth); "
                     "scripts/install --dev installs iproute2 and util-linux")


@dataclass
class Cluster:
    """The cluster network and ``pods`` pods in it (see the module docstring); :meth:`close` ends all."""

    tmp: Path
    hosts: dict[str, str]  #: the pods' /etc/hosts entries: name -> address
    pods: int = 1
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert 1 <= self.pods <= len(POD_IPS)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self.network = self._pause(["unshare", "-rn", "sh", "-c",
                                    f"ip link set lo up && ip addr add {REPOSITORY_IP}/32 dev lo "
                                    "&& echo ready && exec cat >/dev/null"], "cluster network")
        hosts = self.tmp / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in self.hosts.items()))
        self.pod_procs = []
        for index in range(self.pods):
            link = f"veth-pod{index}"
            pod_setup = (f"ip link set lo up && ip link add eth0 type veth peer name {link} netns {self.network.pid} "
                         f"&& ip addr add {POD_IPS[index]}/24 dev eth0 && ip link set eth0 up "
                         f"&& ip route add default via {NODE_IPS[index]} && mount --bind {hosts} /etc/hosts "
                         "&& echo ready && exec cat >/dev/null")
            self.pod_procs.append(self._pause(self._enter(self.network, ["unshare", "-nm", "sh", "-c", pod_setup]),
                                              f"pod {index}"))
            subprocess.run(self._enter(self.network, ["sh", "-c", f"ip addr add {NODE_IPS[index]}/24 dev {link} "
                                                                  f"&& ip link set {link} up"]),
                           check=True, timeout=30, capture_output=True)

    def _pause(self, cmd: list[str], what: str) -> subprocess.Popen[str]:
        """A process holding namespaces (Kubernetes' pause container) until its stdin closes."""
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert read_line(proc, 30, what).strip() == "ready"
        return proc

    @staticmethod
    def _enter(target: subprocess.Popen[str], cmd: list[str], mounts: bool = False, cwd: Path | None = None,
               ) -> list[str]:
        return ["nsenter", "-t", str(target.pid), "-U", "-n", *(["-m"] if mounts else []),
                "--preserve-credentials", *([f"--wd={cwd}"] if cwd else []), *cmd]

    def in_pod(self, cmd: list[str], cwd: Path, index: int = 0) -> list[str]:
        """``cmd`` run in pod ``index`` (its network and mounts), in ``cwd``."""
        return self._enter(self.pod_procs[index], cmd, mounts=True, cwd=cwd)

    def in_container(self, cmd: list[str], cwd: Path, index: int = 0) -> list[str]:
        """``cmd`` run in pod ``index`` as a container's main process: pid 1 of a pid namespace of
        its own, with its own /proc (the process ``Popen`` returns is ``unshare``; it waits for it,
        and kills it should it die first)."""
        return self.in_pod(["unshare", "--pid", "--mount-proc", "--kill-child", *cmd], cwd, index)

    def in_network(self, cmd: list[str]) -> list[str]:
        """``cmd`` run in the cluster network."""
        return self._enter(self.network, cmd)

    def start(self, cmd: list[str], **popen: Any) -> subprocess.Popen[str]:
        """Start ``cmd`` (from :meth:`in_pod` / :meth:`in_network`); it is killed by :meth:`close`."""
        proc: subprocess.Popen[str] = subprocess.Popen(cmd, text=True, **popen)
        self.procs.append(proc)
        return proc

    def calls(self, calls: list[dict[str, Any]], *, from_pod: Path | None = None, index: int = 0,
              ) -> list[dict[str, Any]]:
        """Make ``calls`` with cluster_client.py from the cluster network (or from inside pod
        ``index``, in ``from_pod``); returns their results."""
        cmd = [sys.executable, str(CLUSTER_CLIENT)]
        cmd = self.in_pod(cmd, from_pod, index) if from_pod else self.in_network(cmd)
        proc = subprocess.run(cmd, input=json.dumps(calls), capture_output=True, text=True, timeout=180,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        results: list[dict[str, Any]] = json.loads(proc.stdout)
        return results

    def close(self) -> None:
        """Kill what is still running, then let the pause processes go (their namespaces with them)."""
        for proc in reversed(self.procs):
            if proc.poll() is None and proc.stdin is None:
                proc.kill()
            elif proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
