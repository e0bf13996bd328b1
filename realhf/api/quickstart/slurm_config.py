"""The ``slurm`` section of every experiment config: how ``mode=slurm`` asks Slurm for the run's resources."""
import dataclasses
import re
import shlex

from realhf.api.quickstart.options import check_int, option

_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(\d+-\d+)$|^$")


@dataclasses.dataclass
class SlurmConfig:
    """mode=slurm: one Slurm job per worker group (master, model workers, generation servers, rollout manager,
    rollout workers), each sized from the allocation; see realhf.scheduler.slurm."""

    partition: str = option("", "partition (sbatch --partition); empty: the cluster's default")
    account: str = option("", "account charged (sbatch --account); empty: your default")
    time: str = option("", "time limit of each job (sbatch --time, e.g. 3-00:00:00); empty: the partition's")
    gpus_per_slot: int = option(1, "GPUs per device slot (sbatch --gpus-per-task); 0 for CPU-only runs and clusters")
    mem_per_slot: str = option("", "memory per device slot (sbatch --mem-per-cpu is derived from it, e.g. 200G); "
                                   "empty: the partition's default")
    container_image: str = option("", "run every task in this container image (pyxis/enroot srun --container-image)")
    container_mounts: str = option("", "srun --container-mounts of the image (the shared fileroot, models, data)")
    sbatch_args: str = option("", "extra sbatch flags, shell-quoted (e.g. '--qos=high --exclude=node7')")
    srun_args: str = option("", "extra srun flags of every job step, shell-quoted")
    host_cmd: str = option("hostname -I | awk '{print $1}'", "shell command printing the address a task binds and "
                                                             "advertises on its node (e.g. the IP of ib0)")
    launcher_lease_secs: int = option(120, "a job's processes end when the launcher has not been seen for this many "
                                           "seconds (the launcher killed outright, its node lost)")

    def __post_init__(self):
        check_int("gpus_per_slot", self.gpus_per_slot, 0)
        check_int("launcher_lease_secs", self.launcher_lease_secs, 10)
        if not _TIME_RE.match(self.time):
            raise ValueError(f"time={self.time!r} is not a Slurm time limit; use minutes, MM:SS, HH:MM:SS, D-HH, "
                             "D-HH:MM or D-HH:MM:SS")
        if self.mem_per_slot and not re.fullmatch(r"\d+[KMGT]?", self.mem_per_slot):
            raise ValueError(f"mem_per_slot={self.mem_per_slot!r} is not a Slurm memory size; use e.g. 64000, 200G")
        for key in ("sbatch_args", "srun_args"):
            try:
                shlex.split(getattr(self, key))
            except ValueError as e:
                raise ValueError(f"{key}={getattr(self, key)!r} cannot be split as shell words: {e}") from None
