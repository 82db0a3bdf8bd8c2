"""One node of the Kubernetes lab: what runs in it and the files it is given.

A node is one of the network namespaces of the demos' lab (tabbyctl.demo.lab) plus a
*holder*: a ``sleep`` started in that network namespace with a mount namespace of its own
(``nsenter --net ... unshare --mount --propagation private``). Inside the holder's
namespaces (``nsenter -t HOLDER -m -n``) the node looks like a real one at its standard
paths, and nothing it writes reaches the machine:

* every namespace file (nsfs mount) copied from the machine, ``/run/netns`` first, is
  lazily unmounted, so the node's mount namespace pins no other network namespace (the
  machine's labs, other people's) beyond its life;
* ``/sys`` is the node's own sysfs (its network devices), with the machine's cgroup
  hierarchies moved back in;
* tmpfs over ``/run``, ``/var/lib``, ``/var/log``, ``/etc/cni/net.d`` and ``/opt/cni/bin``:
  containerd's root, state and socket, kubelet's root, pod logs and the device-plugin
  socket it hard-codes, libcni's cache, pod network namespaces, tabby's socket, state and
  logs all stay private; ``/opt/cni/bin`` holds symlinks to the installed ``tabby`` and
  ``tabby-ipam`` and Debian's ``loopback``;
* the kernel tunables kubelet sets machine-wide (vm.overcommit_memory, vm.panic_on_oom,
  kernel.panic, kernel.panic_on_oops, kernel.keys.root_maxkeys/root_maxbytes) are files
  bound over their /proc/sys entries, holding kubelet's values, so kubelet finds them set
  and the machine's stay as they are.

Then, as an operator would run them on a node: tabby-node (cluster mode, its default socket
``/run/tabby/node.sock`` and state ``/var/lib/tabby``, datastore from the conflist),
containerd (CRI, CNI from ``/opt/cni/bin`` and ``/etc/cni/net.d``) and kubelet (cgroupfs,
a cgroup root of its own).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabbyctl.demo.lab import LabNode
from tabbyctl.demo.proc import LabError, run

#: Directories each node gets a tmpfs of its own over.
PRIVATE_DIRS = ("/run", "/var/lib", "/var/log", "/etc/cni/net.d", "/opt/cni/bin")
CNI_BIN = "/opt/cni/bin"
CNI_CONF_DIR = "/etc/cni/net.d"
CONFLIST = f"{CNI_CONF_DIR}/10-tabby.conflist"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
KUBELET_ROOT = "/var/lib/kubelet"
NODENAME_FILE = "/var/lib/tabby/nodename"
DEBIAN_LOOPBACK = "/usr/lib/cni/loopback"

#: What kubelet 1.20 sets host-wide when protectKernelDefaults is off (its
#: setupKernelTunables), at kubelet's values: bound over /proc/sys inside the node.
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}

#: Where the conflist example is (the repository, or the bundle: packaging/tabby.spec).
EXAMPLE_CONFLIST = Path(__file__).resolve().parents[2] / "conf-examples" / "10-tabby.conflist"


@dataclass
class KubeNode:
    """A lab node's Kubernetes side: the holder and the daemons inside its namespaces."""

    node: LabNode
    cgroup_root: str  # "/<lab prefix>-<node>": kubelet's cgroupRoot, in every hierarchy
    holder: subprocess.Popen[bytes] | None = None
    mnt_ns: str = ""  # the holder's mount namespace, "mnt:[inode]"
    containerd: subprocess.Popen[bytes] | None = None
    kubelet: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def pid(self) -> int:
        if self.holder is None:
            raise LabError(f"{self.name} has no holder")
        return self.holder.pid

    def enter(self, mount: bool = True) -> list[str]:
        """The prefix that runs a command in this node (its network namespace, and its
        mount namespace unless ``mount`` is false: then the machine's files are seen)."""
        if not mount:
            return ["nsenter", f"--net=/run/netns/{self.node.netns}", "--"]
        return ["nsenter", "-t", str(self.pid), "-m", "-n", "--"]

    def path(self, inside: str) -> Path:
        """A path inside the node, as the machine reaches it (through the holder's root)."""
        return Path(f"/proc/{self.pid}/root{inside}")

    def read(self, inside: str, limit: int = 4000) -> str:
        try:
            return self.path(inside).read_text(errors="replace")[-limit:]
        except OSError:
            return ""


# -- the holder ----------------------------------------------------------------------------------


def holder_argv(netns: str) -> list[str]:
    return [
        *("nsenter", f"--net=/run/netns/{netns}", "--"),
        *("unshare", "--mount", "--propagation", "private", "--"),
        *("sleep", "infinity"),
    ]


def wait_holder(kn: KubeNode, timeout: float = 10) -> None:
    """Until the holder is ``sleep`` in a mount namespace other than ours."""
    own = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + timeout
    while True:
        assert kn.holder is not None
        if kn.holder.poll() is not None:
            raise LabError(f"the holder of {kn.name} exited ({kn.holder.returncode})")
        try:
            comm = Path(f"/proc/{kn.pid}/comm").read_text().strip()
            mnt = os.readlink(f"/proc/{kn.pid}/ns/mnt")
        except OSError:
            comm, mnt = "", own
        if comm == "sleep" and mnt != own:
            kn.mnt_ns = mnt
            return
        if time.monotonic() > deadline:
            raise LabError(f"the holder of {kn.name} did not come up")
        time.sleep(0.01)


def _unescape(field: str) -> str:
    """A mountinfo path (spaces and the like are octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts(pid: int | str = "self") -> list[tuple[str, str, str, str]]:
    """(mount point, filesystem type, source, root) of every mount process ``pid`` sees."""
    found = []
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 2:
                found.append((_unescape(fields[4]), tail[0], _unescape(tail[1]), fields[3]))
    return found


def namespace_mounts(pid: int) -> list[str]:
    """Mount points of namespace files (nsfs) in ``pid``'s mount namespace, and the
    machine's /run/netns (whose copies hold them), deepest first."""
    points = {p for p, fstype, _, _ in mounts(pid) if fstype == "nsfs" or p == "/run/netns"}
    return sorted(points, key=lambda p: (-p.count("/"), p))


def setup_script(kn: KubeNode, move_dir: str, private_opt: bool = False) -> str:
    """What the holder's namespaces get once (module docstring), as one shell script run
    inside them. ``move_dir``: an empty directory of the lab's to park the cgroup
    hierarchies in while /sys is replaced. ``-n`` everywhere: libmount would otherwise touch
    the machine's /run/mount/utab before the node has a /run of its own. ``private_opt``: a
    tmpfs over all of /opt too (a node whose tabby a DaemonSet installs into /opt/tabby must
    not reach the machine's)."""
    lines = ["set -e"]
    for point in namespace_mounts(kn.pid):
        lines.append(f"umount -n -l {shlex.quote(point)} 2>/dev/null || true")
    lines += [
        f"mount -n --rbind /sys/fs/cgroup {shlex.quote(move_dir)}",
        "umount -n -l /sys",
        "mount -n -t sysfs sysfs /sys",
        f"mount -n --move {shlex.quote(move_dir)} /sys/fs/cgroup",
    ]
    tag = f"tabby-lab-{kn.name}"
    if private_opt:
        lines.append(f"mount -n -t tmpfs -o mode=0755 {tag} /opt")
        lines += [f"mkdir -p {d}" for d in PRIVATE_DIRS if d.startswith("/opt/")]
    for d in PRIVATE_DIRS:
        lines.append(f"mount -n -t tmpfs -o mode=0755 {tag} {d}")
    lines.append("mkdir -p /run/kernel-tunables")
    for key, value in KERNEL_TUNABLES.items():
        name = key.replace("/", ".")
        lines += [
            f"echo {value} > /run/kernel-tunables/{name}",
            f"mount -n --bind /run/kernel-tunables/{name} /proc/sys/{key}",
        ]
    return "\n".join(lines) + "\n"


def prepare(
    kn: KubeNode, workdir: Path, conflist: dict[str, Any] | None, binaries: dict[str, str]
) -> None:
    """The holder's mounts (setup_script), then the node's files: the conflist, the node
    name for tabby, and /opt/cni/bin (``binaries``: name -> target, resolved on the machine
    before its /opt/cni/bin is hidden). ``conflist`` None: a node without a network (no
    conflist, no node name, a private /opt): what manifests/tabby.yaml installs on."""
    move_dir = workdir / "cgroup-move"
    move_dir.mkdir(mode=0o700)
    script = setup_script(kn, str(move_dir), private_opt=conflist is None)
    proc = run(
        [*kn.enter(), "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    try:
        move_dir.rmdir()
    except OSError:
        pass
    if proc.returncode != 0:
        raise LabError(f"preparing {kn.name}'s mount namespace failed: {proc.stderr.strip()}")
    for name, target in binaries.items():
        os.symlink(target, kn.path(f"{CNI_BIN}/{name}"))
    if conflist is None:
        return
    nodename = kn.path(NODENAME_FILE)
    nodename.parent.mkdir(parents=True, exist_ok=True)
    nodename.write_text(kn.name + "\n")
    kn.path(CONFLIST).write_text(json.dumps(conflist, indent=2) + "\n")


def loopback_binary() -> dict[str, str]:
    """The one plugin a node without a network has: Debian's loopback (a Kubernetes node's
    ``kubernetes-cni``); a CNI installer brings the rest."""
    if not os.access(DEBIAN_LOOPBACK, os.X_OK):
        raise LabError(f"{DEBIAN_LOOPBACK} is missing: apt-get install containernetworking-plugins")
    return {"loopback": DEBIAN_LOOPBACK}


def cni_binaries(cni_bin: str) -> dict[str, str]:
    """The plugins a node's /opt/cni/bin links to: the installed tabby and tabby-ipam (their
    real paths) and Debian's loopback, which containerd runs from the same directory."""
    out = {}
    for name in ("tabby", "tabby-ipam"):
        path = os.path.join(cni_bin, name)
        if not os.access(path, os.X_OK):
            raise LabError(f"{path} is missing: ./build.sh --no-demo installs it")
        out[name] = os.path.realpath(path)  # the link keeps the name: the role is argv[0]
    if not os.access(DEBIAN_LOOPBACK, os.X_OK):
        raise LabError(f"{DEBIAN_LOOPBACK} is missing: apt-get install containernetworking-plugins")
    out["loopback"] = DEBIAN_LOOPBACK
    return out


# -- configuration -------------------------------------------------------------------------------


def conflist(ipam: dict[str, Any]) -> dict[str, Any]:
    """conf-examples/10-tabby.conflist as docs/cluster.md's operator adapts it for a cluster:
    the cluster's datastore (``ipam``: its settings) instead of the file store, and
    ``"mtu": 0`` (each pod gets the MTU of the tabby-node serving its ADD: 1450 under VXLAN
    on the lab's 1500-byte underlay, where the example's fixed 1500 would not fit)."""
    try:
        doc: dict[str, Any] = json.loads(EXAMPLE_CONFLIST.read_text())
    except (OSError, ValueError) as e:
        raise LabError(f"cannot read the example conflist {EXAMPLE_CONFLIST}: {e}") from None
    plugin = next(p for p in doc["plugins"] if p.get("type") == "tabby")
    plugin["mtu"] = 0
    plugin["ipam"].pop("data_dir", None)
    plugin["ipam"].update(ipam)
    return doc


def containerd_config(sandbox_image: str, log_level: str = "warn") -> str:
    """containerd 1.6 at its standard paths (private to the node), CRI on, tabby as CNI.
    ``log_level`` "info" logs every CRI call with its time (kube_bench reads them)."""
    return f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[ttrpc]
  address = "{CONTAINERD_SOCKET}.ttrpc"

[debug]
  address = ""
  level = "{log_level}"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "/var/lib/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # root here lacks CAP_SYS_RESOURCE: a sandbox's oom_score_adj may not go below ours
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{CNI_CONF_DIR}"
    max_conf_num = 1
"""


def kubelet_config(kn: KubeNode, ca: Path, serving_cert: Path, serving_key: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": str(kn.node.ipv4.ip),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(serving_cert),
        "tlsPrivateKeyFile": str(serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        # PID 1 is not systemd; cgroup v1 (with cgroup2 beside it at /sys/fs/cgroup/unified)
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": kn.cgroup_root,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,  # no kube-proxy; iptables are not tabby's
        "protectKernelDefaults": False,  # the tunables it sets are bound inside the node
        "oomScoreAdj": 0,  # root here lacks CAP_SYS_RESOURCE
        "volumePluginDir": f"{KUBELET_ROOT}/volume-plugins",  # else /usr/libexec/kubernetes
        "clusterDomain": "cluster.local",
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusUpdateFrequency": "2s",  # Ready shows within seconds, not 10 s
        "nodeStatusReportFrequency": "20s",
        "imageGCHighThresholdPercent": 100,
        "evictionHard": {"memory.available": "100Mi"},
    }


def kubelet_argv(
    kn: KubeNode, binary: Path, config: Path, kubeconfig: Path, sandbox_image: str
) -> list[str]:
    return [
        *kn.enter(),
        str(binary),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{CONTAINERD_SOCKET}",
        f"--pod-infra-container-image={sandbox_image}",
        f"--hostname-override={kn.name}",
        f"--node-ip={kn.node.ipv4.ip}",
        f"--root-dir={KUBELET_ROOT}",
    ]


# -- cgroups ---------------------------------------------------------------------------------------


def hierarchies() -> list[str]:
    """Mount points of the machine's cgroup hierarchies (v1 and the cgroup2 beside them)."""
    return sorted(p for p, fstype, _, _ in mounts() if fstype in ("cgroup", "cgroup2"))


def make_cgroup_root(root: str) -> None:
    """kubelet's cgroupRoot in every hierarchy (kubelet wants it to exist); cpuset's gets
    its parent's CPUs and memory nodes (an empty cpuset takes no task)."""
    for h in hierarchies():
        path = Path(h + root)
        path.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            parent = Path(h) / name
            if parent.exists() and (path / name).exists():
                (path / name).write_text(parent.read_text())


def cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for h in hierarchies():
        for dirpath, _, files in os.walk(h + root):
            if "cgroup.procs" in files:
                try:
                    text = Path(dirpath, "cgroup.procs").read_text()
                except OSError:
                    continue
                pids |= {int(p) for p in text.split()}
    return pids


def kill_cgroup(root: str, timeout: float = 10) -> list[int]:
    """SIGKILL every process in the cgroup tree (the pods' containers and sandboxes), by
    PID; the PIDs that would not go."""
    deadline = time.monotonic() + timeout
    while pids := cgroup_pids(root):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return sorted(pids)
        time.sleep(0.05)
    return []


def remove_cgroup_root(root: str) -> list[str]:
    """rmdir the cgroup tree in every hierarchy, deepest first; what is left."""
    left = []
    for h in hierarchies():
        top = h + root
        if not os.path.isdir(top):
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            for _ in range(50):
                try:
                    os.rmdir(dirpath)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)  # a task still exiting
        if os.path.isdir(top):
            left.append(top)
    return left


def frozen_env() -> dict[str, str]:
    """The environment for the node's daemons: the machine's, without the library path a
    frozen bundle (tabbyctl demo) sets for itself."""
    env = dict(os.environ)
    if getattr(sys, "frozen", False):
        orig = env.pop("LD_LIBRARY_PATH_ORIG", None)
        env.pop("LD_LIBRARY_PATH", None)
        if orig:
            env["LD_LIBRARY_PATH"] = orig
    return env
