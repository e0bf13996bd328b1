"""The request and the report of ``check_cluster``: what the run needs (``Request``, from the command line or read
from the run's own config), what the nodes answered (``Report``), the verdict (``judge``: one sentence per problem,
saying what to fix) and the table printed for it (``format_report``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from realhf.base import network
from realhf.scheduler.slurm import srun_step_args


# ----------------------------------------------------------------------------- what the run needs
@dataclasses.dataclass
class Request:
    mode: str = "local"
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: 0 unless the config asks for GPUs (see needed_gpus)
    fileroot: str = ""
    ray_address: str = ""
    partition: str = ""
    account: str = ""
    host_cmd: str = ""
    srun_args: List[str] = dataclasses.field(default_factory=list)
    devices_per_node: Optional[int] = None  # from a config: n_devices_per_node (GPUs, or worker processes on CPU)
    timeout: float = 60.0
    alloc_timeout: float = 60.0
    connect_timeout: float = 30.0
    notes: List[str] = dataclasses.field(default_factory=list)  # about the request itself (how it was read)


@dataclasses.dataclass
class Report:
    request: Request
    nodes: List[dict] = dataclasses.field(default_factory=list)
    errors: List[str] = dataclasses.field(default_factory=list)  # the cluster could not be probed (whole sentences)
    notes: List[str] = dataclasses.field(default_factory=list)
    problems: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)
    stuck: bool = False  # a client call (ray.init) is still blocked in a thread: the CLI exits with os._exit

    @property
    def ok(self) -> bool:
        return not self.errors and not self.problems

    def to_json(self) -> dict:
        return dict(ok=self.ok, request=dataclasses.asdict(self.request), nodes=self.nodes, errors=self.errors,
                    problems=self.problems, warnings=self.warnings, notes=self.notes)


def request_from_config(exp: str, config_file: str, overrides: List[str]) -> Request:
    """The run's options (mode, n_nodes, n_devices_per_node, fileroot, ray_address, the slurm section) as a request;
    GPUs per node are required where the config reserves them (``ray_gpus_per_worker``, ``slurm.gpus_per_slot``).

    A config that does not validate on this machine (e.g. model paths that exist only on the cluster) is still read
    for these options, with a note saying why the run would be refused here."""
    from omegaconf import OmegaConf

    from realhf.api.quickstart.entry import ConfigError, load_config
    from realhf.experiments import config_class

    cls, note = config_class(exp), None
    try:
        cfg = load_config(cls, [config_file], overrides)
    except ConfigError as e:
        try:  # the same sources, merged without the experiment's checks
            cfg = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.load(config_file),
                                  OmegaConf.from_dotlist(list(overrides)))
        except Exception:
            raise e from None
        note = (f"the config does not validate on this machine ({e}); its cluster options were read anyway "
                "(a run launched from here would be refused).")
    req = _request_from(cfg)
    if note:
        req.notes.append(note)
    return req


def _request_from(cfg) -> Request:
    req = Request(mode=cfg.mode, nodes=cfg.n_nodes, fileroot=cfg.fileroot, ray_address=cfg.ray_address,
                  devices_per_node=cfg.n_devices_per_node)
    slurm = getattr(cfg, "slurm", None)
    if slurm is not None:
        req.partition = getattr(slurm, "partition", "") or ""
        req.account = getattr(slurm, "account", "") or ""
        req.host_cmd = getattr(slurm, "host_cmd", "") or ""
        req.srun_args = srun_step_args(cfg)
    if cfg.mode == "ray" and cfg.ray_gpus_per_worker > 0:
        req.gpus_per_node = math.ceil(cfg.n_devices_per_node * cfg.ray_gpus_per_worker - 1e-9)
    elif cfg.mode == "slurm" and slurm is not None and getattr(slurm, "gpus_per_slot", 0) > 0:
        req.gpus_per_node = cfg.n_devices_per_node * slurm.gpus_per_slot
    return req


# ----------------------------------------------------------------------------- verdict
def judge(rep: Report) -> Report:
    """Fill ``rep.problems`` (each a sentence saying what to fix) and ``rep.warnings``."""
    req, nodes = rep.request, [n for n in rep.nodes if not n.get("failed")]
    probs, warns = rep.problems, rep.warnings
    if not nodes and not rep.errors:
        rep.errors.append("no node answered the probe.")
    if nodes and len(rep.nodes) < req.nodes:
        if req.mode == "local" or (req.mode == "ray" and not req.ray_address):
            what = ("mode=local runs every process on this machine" if req.mode == "local" else
                    "ray_address is empty, so the run starts a one-node Ray on this machine")
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but {what}: use mode=slurm, or mode=ray with "
                         "ray_address=<head>:<port> of a cluster (scripts/ray_cluster.sh start), or set n_nodes=1.")
        elif req.mode == "ray":
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but the Ray cluster at {req.ray_address} has "
                         f"{len(rep.nodes)} alive: add workers (scripts/ray_cluster.sh start --workers ...) or lower "
                         "n_nodes.")
        else:
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but only {len(rep.nodes)} answered the probe: "
                         "see the srun output above and the nodes' health (sinfo -N).")
    need = req.gpus_per_node or 0
    any_gpu = any(n.get("gpus", 0) for n in nodes)
    if req.gpus_per_node is None and any_gpu and req.devices_per_node:
        need = req.devices_per_node  # a GPU run: one model worker per GPU
    for n in nodes:
        where = f"node {n['index']} ({n.get('hostname')}, {n.get('ip')})"
        if n.get("gpus", 0) < need:
            probs.append(f"{where} has {n.get('gpus', 0)} GPU(s) but the run needs {need} per node: use nodes with "
                         f"{need} GPU(s) (check the driver with nvidia-smi) or lower n_devices_per_node.")
        elif "ray_gpus" in n and n["ray_gpus"] < need:
            probs.append(f"Ray on {where} offers {n['ray_gpus']:g} GPU(s) but the run needs {need}: restart that "
                         f"node's Ray with --num-gpus={need} (scripts/ray_cluster.sh start --num-gpus {need}).")
        if not n.get("fileroot_ok"):
            probs.append(f"fileroot={req.fileroot!r} is not writable on {where} ({n.get('fileroot_error')}): choose a "
                         "folder every node can write (fileroot=... or $REALHF_FILEROOT).")
        if n.get("listen_error"):
            probs.append(f"{where} cannot open a TCP port: {n['listen_error']}; set REALHF_HOST to an address of "
                         "this node.")
    by_index = {n["index"]: n for n in nodes}
    for n in nodes:
        if not n.get("fileroot_ok"):
            continue
        where = f"node {n['index']} ({n.get('hostname')})"
        for j, status in sorted(n.get("shared", {}).items(), key=lambda kv: int(kv[0])):
            other = by_index.get(int(j))
            if status != "ok" and other is not None and other.get("fileroot_ok"):
                probs.append(f"a file written under fileroot on node {j} is not visible on {where} ({status}): "
                             "fileroot must be one shared file system (NFS, Lustre, ...) mounted at the same path on "
                             "every node.")
        for j, status in sorted(n.get("ports", {}).items(), key=lambda kv: int(kv[0])):
            if status == "ok" or status.startswith("not checked"):
                continue
            other = by_index.get(int(j), {})
            hint = (f" (node {j} published a loopback address: set REALHF_HOST to its network IP)"
                    if other.get("ip") and network.is_loopback(other["ip"]) and len(nodes) > 1 else "")
            probs.append(f"{where} cannot reach node {j}'s port: {status}{hint}: open TCP ports between the nodes "
                         "(firewall, security groups) or bind another interface (REALHF_HOST).")
    if nodes and not any_gpu and not req.gpus_per_node and req.devices_per_node:
        rep.notes.append(f"no GPU on any node: the run uses CPU worker processes ({req.devices_per_node} per node); "
                         "pass --gpus-per-node G to require GPUs.")
    for key in ("python", "torch", "realhf"):
        seen = {}
        for n in nodes:
            seen.setdefault(str(n.get(key)), []).append(str(n["index"]))
        if len(seen) > 1:
            detail = "; ".join(f"{v} on node(s) {','.join(ix)}" for v, ix in seen.items())
            warns.append(f"{key} differs across nodes ({detail}): install one environment everywhere (e.g. the image "
                         "of docker/Dockerfile).")
    return rep


# ----------------------------------------------------------------------------- output
def _cell(v) -> str:
    return "-" if v is None else str(v)


def format_report(rep: Report) -> str:
    req = rep.request
    lines = [f"check_cluster: mode={req.mode} nodes={req.nodes} gpus/node={req.gpus_per_node or 0} "
             f"fileroot={req.fileroot}" + (f" ray_address={req.ray_address}" if req.mode == "ray" else "")
             + (f" partition={req.partition}" if req.partition else "") + (f" account={req.account}" if req.account
                                                                            else "")]
    header = ["node", "hostname", "ip (REALHF_HOST)", "cpus", "gpus", "mem free GiB", "python", "torch", "realhf",
              "fileroot", "shared dir", "ports"]
    diff = {k for k in ("python", "torch", "realhf") if len({str(n.get(k)) for n in rep.nodes if not n.get("failed")}) > 1}
    rows = []
    for n in rep.nodes:
        if n.get("failed"):
            rows.append([str(n.get("index")), _cell(n.get("hostname")), _cell(n.get("ip"))] + ["?"] * 6 +
                        ["no answer", "-", "-"])
            continue
        total = len(n.get("shared", {})) or 1
        shared_ok = sum(v == "ok" for v in n.get("shared", {}).values())
        ports_ok = sum(v == "ok" for v in n.get("ports", {}).values())
        gpus = str(n.get("gpus", 0)) + (f" (ray {n['ray_gpus']:g})" if "ray_gpus" in n else "")
        cpus = str(n.get("cpus")) + (f" (ray {n['ray_cpus']:g})" if "ray_cpus" in n else "")
        rows.append([str(n["index"]), _cell(n.get("hostname")), _cell(n.get("ip")), cpus, gpus,
                     f"{_cell(n.get('mem_free_gib'))}/{_cell(n.get('mem_total_gib'))}"]
                    + [_cell(n.get(k)) + (" *" if k in diff else "") for k in ("python", "torch", "realhf")]
                    + ["writable" if n.get("fileroot_ok") else "NOT writable", f"{shared_ok}/{total} ok",
                       f"{ports_ok}/{total} ok"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows if rows else []:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not rows:
        lines.append("(no node answered)")
    for n in rep.nodes:
        if n.get("gpu_names"):
            lines.append(f"node {n['index']} GPUs ({n.get('gpu_source')}): {', '.join(n['gpu_names'])}")
    if diff:
        lines.append("* differs across nodes")
    for note in rep.notes:
        lines.append(f"note: {note}")
    for w in rep.warnings:
        lines.append(f"warning: {w}")
    issues = rep.errors + rep.problems
    if issues:
        lines.append(f"NOT READY: {len(issues)} problem(s)")
        lines += [f"  - {p}" for p in issues]
    else:
        n_nodes = len(rep.nodes)
        lines.append(f"READY: {n_nodes} node(s) answered; fileroot is writable and shared, ports are reachable"
                     + (f", {req.gpus_per_node} GPU(s) per node" if req.gpus_per_node else "") + ".")
    return "\n".join(lines)
