"""Errors a user meets around recover checkpoints, said whole and safely.

* A damaged recover file (cut short, overwritten with other bytes, a planted pickle, the state of something else)
  is refused naming the file, without torch's advice to load it with ``weights_only=False`` (which would let a
  planted file run code), and a planted pickle runs nothing.
* On a full disk (a real tmpfs filled up, in a private mount namespace), a process that fails writing there cannot
  write its error into its log either: the launcher's failure report still says "no space left on device" and names
  the folder, and a JSON file written atomically names itself in the error and leaves no partial temporary behind.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

from realhf.base.recover import RecoverError, load_state_file


class Planted:
    """Unpickling it would create the file ``path``: the proof that a planted recover file ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_damaged_recover_files_are_named_and_nothing_unsafe_is_advised(tmp_path):
    good = tmp_path / "worker_rank0.pt"
    torch.save({"rng": torch.get_rng_state(), "py": [1, 2], "np": [0]}, good)
    assert set(load_state_file(str(good), keys=("rng", "py", "np"))) == {"rng", "py", "np"}
    data = good.read_bytes()
    marker = tmp_path / "code-ran"
    cases = {
        "cut.pt": lambda p: p.write_bytes(data[: len(data) // 2]),
        "noise.pt": lambda p: p.write_bytes(bytes(range(256)) * 4),
        "text.pt": lambda p: p.write_text("not a checkpoint"),
        "empty.pt": lambda p: p.write_bytes(b""),
        "planted.pt": lambda p: torch.save({"rng": Planted(str(marker))}, p),
    }
    for name, make in cases.items():
        path = tmp_path / name
        make(path)
        with pytest.raises(RecoverError) as e:
            load_state_file(str(path), keys=("rng",))
        shown = "".join(traceback.format_exception(e.value))  # what a worker sends the master and the log shows
        assert f"recover file {path} is damaged or is not a realhf recover file (" in str(e.value), (name, str(e.value))
        assert "weights_only" not in shown and "Weights only" not in shown, (name, shown)
        assert "recover_mode=disabled" in str(e.value)
    assert not marker.exists(), "the planted recover file ran code"
    other = tmp_path / "engine_rank0.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(RecoverError, match=rf"recover file {other} is not a realhf recover file of this kind: it "
                                           r"lacks \['version'\]"):
        load_state_file(str(other), keys=("version",))
    with pytest.raises(RecoverError, match=rf"recover file {tmp_path / 'gone.pt'} is missing"):
        load_state_file(str(tmp_path / "gone.pt"))


# Runs in a private mount namespace on a small tmpfs at argv[1]: fills it, then a process of the run fails writing
# there (its traceback cannot reach its log on that disk) and the launcher reports the failure.
FULL_DISK = textwrap.dedent("""
    import json, os, sys
    from realhf.base.plain_json import write_json_atomic
    from realhf.scheduler.local import JobFailure, LocalScheduler, python_cmd

    root = sys.argv[1]
    logs, ckpt = os.path.join(root, "logs"), os.path.join(root, "recover")
    os.makedirs(ckpt)
    sched = LocalScheduler(logs)
    fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError:
        pass
    os.close(fd)
    info = os.path.join(ckpt, "recover_info.json")
    try:
        write_json_atomic(info, {"files": "x" * 100000})
    except OSError as e:
        print("WRITE ERROR:", e)
    print("LEFT IN RECOVER:", sorted(os.listdir(ckpt)))
    code = "from realhf.base.plain_json import write_json_atomic; write_json_atomic(%r, {'x': 'y' * 100000})" % info
    sched.submit("master", [sys.executable, "-c", code], env={}, worker=False)
    try:
        sched.wait("master", timeout=120)
    except JobFailure as e:
        print("REPORT:", e)
    finally:
        sched.stop_all()
""")


def _namespace_cmd():
    """How to get a private mount namespace here (root: plain; otherwise a user namespace), or None."""
    if shutil.which("unshare") is None:
        return None
    base = ["unshare", "--mount", "--propagation", "private"]
    return base if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]


def test_a_full_disk_is_reported_whole_by_the_launcher(tmp_path):
    from realhf.base.process import env_with_source_path

    ns = _namespace_cmd()
    if ns is None:
        pytest.skip("unshare is not installed: no private tmpfs can be made to fill")
    root = tmp_path / "small"
    root.mkdir()
    script = f"mount -t tmpfs -o size=256k tmpfs {root} || exit 77; exec {sys.executable} -c \"$1\" {root}"
    p = subprocess.run([*ns, "sh", "-c", script, "sh", FULL_DISK], capture_output=True, text=True, timeout=180,
                       env=env_with_source_path())
    if p.returncode == 77 or "unshare:" in p.stderr:
        pytest.skip(f"no tmpfs can be mounted here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    # the error of a JSON file written atomically names the file, and nothing partial is left
    assert f"WRITE ERROR: [Errno 28] No space left on device: '{root}/recover/recover_info.json'" in out, out
    assert "LEFT IN RECOVER: []" in out, out
    # the process's own traceback could not reach its log; the launcher's report says why, naming the folder
    report = out[out.index("REPORT:"):]
    assert "master exited with code 1" in report, out
    assert f"(no space left on device: the file system of {root}/logs has 0 bytes free" in report, out
