"""A real single-node SLURM for the tests: Debian's slurm-wlm (22.05) and munge, run from a temp dir.

Test fixture, not project code. `SlurmCluster.start()` installs the packages with apt when they
are missing (as root; otherwise the caller skips with the reason), writes a munge key and a
slurm.conf into its own directory, and starts munged, slurmctld and slurmd there with PID files,
ports of their own and no systemd or cgroups (proctrack/linuxproc, task/none). The node
advertises a fake `gpu:8` gres (placeholder device files, AutoDetect=off), so a job may ask for
`--gpus-per-node=8` as the sbatch header does, or for `--gpus-per-node=0` as CPU users do. A
requeued job may start again 30 s after its requeue (`cred_expire`; SLURM's default is 120 s).
`stop()` cancels what is left and ends the three daemons; every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
FAKE_GPUS = 8


def install_reason() -> str | None:
    """None once SLURM and munge are installed (installing them when possible), else why not."""
    if all(Path(d).exists() for d in DAEMONS) and shutil.which("sbatch"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed and cannot be (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} not ready within {timeout_s:.0f} s\n{tail}")
        time.sleep(0.5)


class SlurmCluster:
    """One node (this machine, named by `hostname -s`), one partition `debug`."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self.node = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
        self.cpus = os.cpu_count() or 1

    def start(self) -> SlurmCluster:
        try:
            self._write_config()
            self._start_munge()
            for daemon in ("slurmctld", "slurmd"):
                subprocess.run(
                    [f"/usr/sbin/{daemon}", "-f", str(self.dir / "slurm.conf")],
                    env=self.env,
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
            _wait("the SLURM node", self._node_idle, 90, self.dir / "slurmd.log")
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir()
        gpus = [d / f"gpu{i}" for i in range(FAKE_GPUS)]
        for path in gpus:
            path.touch()
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 3 // 4
        (d / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.node} Name=gpu File={d}/gpu[0-{FAKE_GPUS - 1}]\n")
        (d / "slurm.conf").write_text(
            "\n".join(
                [
                    "ClusterName=moerltest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire also delays a requeued job's next start (default 120 s)
                    f"AuthInfo=socket={d}/munge/munge.socket,cred_expire=30",
                    f"StateSaveLocation={d}/state",
                    f"SlurmdSpoolDir={d}/spool",
                    f"SlurmctldPidFile={d}/slurmctld.pid",
                    f"SlurmdPidFile={d}/slurmd.pid",
                    f"SlurmctldLogFile={d}/slurmctld.log",
                    f"SlurmdLogFile={d}/slurmd.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "KillWait=10",
                    "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
                    "GresTypes=gpu",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb} "
                    f"Gres=gpu:{FAKE_GPUS} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start_munge(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.dir / "munge"
        m.chmod(0o700)
        subprocess.run(
            [
                "/usr/sbin/munged",
                "--force",
                f"--key-file={key}",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait("munged", (m / "munge.socket").exists, 30, m / "munged.log")

    def _node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
        return out == "idle"

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=check, timeout=timeout, **kwargs)

    def sbatch(self, args: list[str], **kwargs) -> int:
        """Submit (the job inherits this environment plus kwargs' env); the job id."""
        out = self.run(["sbatch", "--parsable", *args], **kwargs).stdout.strip()
        return int(out.split(";")[0])

    def job_state(self, job: int) -> str:
        return self.job_field(job, "JobState")

    def job_field(self, job: int, name: str) -> str:
        """One field of `scontrol show job` (JobState, Restarts, ExitCode, ...); UNKNOWN if absent."""
        out = self.run(["scontrol", "show", "job", str(job)], check=False).stdout
        for field in out.split():
            if field.startswith(f"{name}="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: int, timeout_s: float) -> str:
        """Block until `job` has ended (bounded); its final state."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        _wait(f"job {job}", lambda: self.job_state(job) in ended, timeout_s, self.dir / "slurmd.log")
        # the job has ended when slurmctld says so; its processes are gone once the node is idle again
        _wait(f"the node after job {job}", self._node_idle, 60, self.dir / "slurmd.log")
        return self.job_state(job)

    def stop(self) -> None:
        self.run(["scancel", "--full", "--user=root"], check=False, timeout=30)
        for name in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            _kill(self.dir / name)
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill(pid_file: Path, timeout_s: float = 30) -> None:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
