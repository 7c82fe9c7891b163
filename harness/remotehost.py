"""A second host on this machine, reached over a real ssh: for group tests.

Every address in 127.0.0.0/8 reaches this machine, and `mlx.launch` runs a
rank without ssh only for the host `127.0.0.1`. So a private `sshd`
listening on 127.0.0.2, reached through a host alias (`mlxhost2`), is a
real second host: ranks there are started by `ssh -tt mlxhost2 ...` from a
fresh environment, their session ends when the ssh client goes, and a
packet filter can cut them off (`partition`).

Nothing of the machine's own ssh set-up is read or touched (~/.ssh,
/etc/ssh, a system sshd): the server runs from a private folder with its
own sshd_config, host key, authorized_keys and pid file; the client side is
a private ssh config (the alias, its port, the key, a private known_hosts)
and an `ssh` wrapper that adds `-F <that config>`, put first on PATH for
whatever runs `ssh` by name (mlx.launch does). The one thing outside the
folder: sshd (as root) needs its privilege-separation directory /run/sshd,
made here when missing, as Debian's own service does.

Processes of the second host are found two ways: by ancestry (every
session is a descendant of our sshd) and by a marker that our sshd sets in
every session's environment (`SetEnv`), which a rank keeps after its
session ended and it was re-parented: so a left-over rank is found too.

Needs root (sshd that logs in as the current user, iptables) and Debian's
`openssh-server` and `iptables` (.ci/run installs them). Not shipped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import psutil

from harness import SHIM_DIR

ALIAS = "mlxhost2"
ADDRESS = "127.0.0.2"
# This host's address for the ring, as a Mac has one on its Thunderbolt
# network besides the one clients use. Not 127.0.0.1: the kernel sends from
# 127.0.0.1 to any loopback address, so rank 1's ring connection to a rank 0
# listening on 127.0.0.1 would run 127.0.0.1 -> 127.0.0.1, past a partition
# that drops only 127.0.0.2 (rank 1 would see rank 0 go at once).
RING_ADDRESS_HERE = "127.0.0.3"
MARKER = "MLX_TEST_SECOND_HOST"  # set in every session by our sshd (SetEnv)
SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")


class SecondHostUnavailable(RuntimeError):
    """The second host cannot run here; the message says what is missing."""


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def _cmdline(proc: psutil.Process) -> List[str]:
    try:
        return proc.cmdline()
    except (psutil.Error, OSError):
        return []


def is_rank(proc: psutil.Process) -> bool:
    """A server rank started by mlx.launch (MLX_RANK in its environment)."""
    command = " ".join(_cmdline(proc))
    return "mlx_lm" in command and "server" in command and "MLX_RANK" in _environ(proc)


class SecondHost:
    """The private sshd on 127.0.0.2 and the client side that reaches it."""

    alias = ALIAS
    address = ADDRESS

    def __init__(self, folder: Path, *, sshd_options: Sequence[str] = ()):
        self.folder = Path(folder)
        self.sshd_options = list(sshd_options)  # more sshd_config lines (ClientAliveInterval 5)
        self.port = 0
        self.token = secrets.token_hex(8)
        self.proc: Optional[subprocess.Popen] = None
        self.bin_dir = self.folder / "bin"
        self.client_config = self.folder / "ssh_config"
        self.log_path = self.folder / "sshd.log"
        # The shim as installed on the second host: a copy at another path,
        # so that --remote-shim-path is what puts it there.
        self.shim_dir = self.folder / "remote-shim"

    # -- set-up ---------------------------------------------------------------------

    def start(self) -> "SecondHost":
        for tool in (SSHD, shutil.which("ssh-keygen"), shutil.which("ssh")):
            if not tool or not os.path.exists(tool):
                raise SecondHostUnavailable(
                    "the second host needs Debian's openssh-server and openssh-client "
                    "(apt-get install openssh-server; .ci/run installs it)")
        if os.geteuid() != 0:
            raise SecondHostUnavailable("the second host's sshd runs as root (as in CI)")
        self.folder.mkdir(parents=True, exist_ok=True)
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        self.port = _free_port(self.address)
        host_key = self.folder / "host_ed25519"
        client_key = self.folder / "client_ed25519"
        for key in (host_key, client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mlx-test",
                            "-f", str(key)], check=True, capture_output=True)
        (self.folder / "authorized_keys").write_text(
            Path(f"{client_key}.pub").read_text())
        host_public = Path(f"{host_key}.pub").read_text().split()
        (self.folder / "known_hosts").write_text(f"{self.alias} {' '.join(host_public[:2])}\n")
        user = psutil.Process().username()
        sshd_config = self.folder / "sshd_config"
        sshd_config.write_text("\n".join([
            f"ListenAddress {self.address}:{self.port}",
            f"HostKey {host_key}",
            f"PidFile {self.folder / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}",
            f"AllowUsers {user}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the private folder lives under a world-writable /tmp
            "PrintMotd no",
            "PrintLastLog no",
            # The second host's own user report folder: a rank there (no
            # MLX_HOTFIX_REPORT_DIR reaches it over ssh) must not write into
            # this machine's real one.
            f"SetEnv {MARKER}={self.token} MLX_HOTFIX_REPORT_DIR={self.folder / 'reports'}",
            "LogLevel VERBOSE",
            *self.sshd_options,
            "",
        ]))
        self.client_config.write_text("\n".join([
            f"Host {self.alias}",
            f"    HostName {self.address}",
            f"    Port {self.port}",
            f"    User {user}",
            f"    IdentityFile {client_key}",
            "    IdentitiesOnly yes",
            f"    HostKeyAlias {self.alias}",
            f"    UserKnownHostsFile {self.folder / 'known_hosts'}",
            "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking yes",
            "    BatchMode yes",
            "",
        ]))
        self.bin_dir.mkdir(exist_ok=True)
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text("#!/bin/sh\n"
                           f"exec {shutil.which('ssh')} -F {self.client_config} \"$@\"\n")
        wrapper.chmod(0o755)
        if self.shim_dir.exists():
            shutil.rmtree(self.shim_dir)
        shutil.copytree(SHIM_DIR, self.shim_dir,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.clear_partition()  # a rule left by an earlier run that was killed
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(sshd_config)],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise SecondHostUnavailable(f"sshd exited {self.proc.returncode}: "
                                            + self.log_path.read_text()[-2000:])
            if self.ssh("true", timeout=10).returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise SecondHostUnavailable("ssh to the second host does not work:\n"
                                            + self.log_path.read_text()[-2000:])
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop our sshd and everything of the second host (sessions, left-over ranks)."""
        self.clear_partition()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    # -- the client side ------------------------------------------------------------

    def env(self, base: Optional[dict] = None) -> dict:
        """base (default os.environ) with our ssh wrapper first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join([str(self.bin_dir), env.get("PATH", os.defpath)])
        return env

    def ssh(self, command: str, *, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run command on the second host (through the wrapper, as mlx.launch would)."""
        try:
            return subprocess.run([str(self.bin_dir / "ssh"), "-o", "ConnectTimeout=5",
                                   self.alias, command], capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 255, "", "timed out")

    def hostfile(self, path: Path, *, rank0_remote: bool = False) -> Path:
        """mlx.launch's hostfile for a group of this machine and the second host."""
        import json

        hosts = [{"ssh": "127.0.0.1", "ips": [RING_ADDRESS_HERE]},
                 {"ssh": self.alias, "ips": [self.address]}]
        if rank0_remote:
            hosts.reverse()
        path.write_text(json.dumps(hosts) + "\n")
        return path

    # -- the second host's processes ------------------------------------------------

    def sessions(self) -> List[psutil.Process]:
        """Our sshd's descendants: every session and what runs in it."""
        if self.proc is None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def processes(self) -> List[psutil.Process]:
        """Everything of the second host, in a session or left behind by one."""
        found = {p.pid: p for p in self.sessions()}
        for proc in psutil.process_iter():
            if proc.pid not in found and _environ(proc).get(MARKER) == self.token:
                found[proc.pid] = proc
        return [p for p in found.values() if alive(p)]

    def ranks(self) -> List[psutil.Process]:
        """The server ranks running on the second host (in a session or not)."""
        return [p for p in self.processes() if is_rank(p)]

    def session_of(self, proc: psutil.Process) -> Optional[psutil.Process]:
        """The sshd child (of our listener) that carries proc's session."""
        for parent in proc.parents():
            if parent.ppid() == (self.proc.pid if self.proc else None):
                return parent
        return None

    # -- partition ------------------------------------------------------------------

    _RULES = tuple([way, address] for address in (ADDRESS, RING_ADDRESS_HERE)
                   for way in ("-d", "-s"))

    @contextlib.contextmanager
    def partition(self) -> Iterator[None]:
        """Drop every packet to and from the second host until the block ends:
        to and from its address, and this host's ring address (the way back)."""
        try:
            for rule in self._RULES:
                _iptables("-A", rule)
            yield
        finally:
            self.clear_partition()

    def clear_partition(self) -> None:
        for rule in self._RULES:
            while _iptables("-C", rule, check=False) == 0:
                _iptables("-D", rule)


def _iptables(action: str, rule: List[str], *, check: bool = True) -> int:
    iptables = shutil.which("iptables") or "/usr/sbin/iptables"
    if not os.path.exists(iptables):
        if not check:
            return 1
        raise SecondHostUnavailable("a partition needs iptables (apt-get install iptables; "
                                    ".ci/run installs it)")
    run = subprocess.run([iptables, "-w", action, "OUTPUT", *rule, "-j", "DROP"],
                         capture_output=True, text=True)
    if check and run.returncode != 0:
        raise SecondHostUnavailable(f"iptables {action} OUTPUT {' '.join(rule)} failed: "
                                    f"{run.stderr.strip()}")
    return run.returncode


def alive(proc: psutil.Process) -> bool:
    """proc still runs (the same process, not a reused pid; not a zombie)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
