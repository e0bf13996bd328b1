"""The recover-checkpoint store: a process killed at any moment of a commit leaves a complete checkpoint
current; damaged checkpoints are refused by name."""
import json
import os
import subprocess
import sys

import pytest

from realhf.base.process import env_with_source_path
from realhf.base.recover import LATEST, RecoverError, RecoverStore

_COMMIT = """
import os, sys
from realhf.base.recover import RecoverStore
root, step = sys.argv[1], int(sys.argv[2])
s = RecoverStore(root)
p = s.begin(step)
os.makedirs(os.path.join(p, "actor"))
with open(os.path.join(p, "actor", "weights.bin"), "wb") as f:
    f.write(bytes([step]) * (1000 * step))
s.commit(p, {"run_id": "r1", "fingerprint": "f", "global_step": step})
"""


def _commit(root, step, failpoint=""):
    env = dict(env_with_source_path(), REALHF_FAILPOINTS=failpoint)
    return subprocess.run([sys.executable, "-c", _COMMIT, root, str(step)], env=env, capture_output=True, text=True,
                          timeout=60)


def _check(store, step):
    info = store.latest()
    assert info is not None and info["global_step"] == step and info["run_id"] == "r1"
    with open(os.path.join(info["path"], "actor", "weights.bin"), "rb") as f:
        assert f.read() == bytes([step]) * (1000 * step)


@pytest.mark.parametrize("point,expect", [("recover.before_swap", 1), ("recover.after_swap", 2)])
def test_a_crash_during_commit_keeps_a_complete_checkpoint(tmp_path, point, expect):
    root = str(tmp_path / "recover")
    store = RecoverStore(root)
    assert store.latest() is None
    assert _commit(root, 1).returncode == 0
    _check(store, 1)
    p = _commit(root, 2, failpoint=point)
    assert p.returncode == -9, p.stderr  # killed at the failpoint, mid-commit
    _check(store, expect)  # the previous checkpoint (before the swap) or the new one (after it), complete
    assert _commit(root, 3).returncode == 0
    _check(store, 3)
    assert sorted(n for n in os.listdir(root) if n.startswith("ckpt-")) == [os.path.basename(store.latest()["path"])], \
        "a later commit removes the folders of earlier and interrupted checkpoints"


def test_damaged_checkpoints_are_refused_by_name(tmp_path):
    root = str(tmp_path / "recover")
    assert _commit(root, 2).returncode == 0
    store = RecoverStore(root)
    path = os.path.join(store.latest()["path"], "actor", "weights.bin")
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(RecoverError, match=r"weights\.bin has 10 bytes, 2000 were written"):
        store.latest()
    os.remove(path)
    with pytest.raises(RecoverError, match=r"weights\.bin is missing"):
        store.latest()
    with open(os.path.join(root, LATEST), "w") as f:
        f.write("{not json")
    with pytest.raises(RecoverError, match="LATEST cannot be read"):
        store.latest()
    with open(os.path.join(root, LATEST), "w") as f:
        json.dump({"dir": "../../etc"}, f)
    with pytest.raises(RecoverError, match="names no checkpoint folder"):
        store.latest()


def test_finished_and_archived(tmp_path):
    root = str(tmp_path / "recover")
    assert _commit(root, 4).returncode == 0
    store = RecoverStore(root)
    assert store.latest()["finished"] is False
    store.mark_finished()
    assert store.latest()["finished"] is True and store.latest()["global_step"] == 4
    dest = store.archive("test")
    assert not store.exists() and store.latest() is None
    assert os.path.basename(dest).startswith("recover.stale-") and RecoverStore(dest).latest()["global_step"] == 4


def test_a_reader_during_a_run_gets_the_checkpoint_that_replaced_the_one_it_found(tmp_path, monkeypatch):
    """A reader (a monitor, a test) that finds checkpoint 2 current while the run commits checkpoint 3, which removes
    2, reads 3 rather than failing on 2's missing files; a checkpoint damaged while still current is refused."""
    from realhf.base import recover

    root = str(tmp_path / "recover")
    assert _commit(root, 2).returncode == 0
    store = RecoverStore(root)
    real = recover._read_json
    raced = []

    def racing(path, what):
        if what == "recover checkpoint info" and not raced:  # the run commits 3 after the pointer was read
            raced.append(path)
            assert _commit(root, 3).returncode == 0
        return real(path, what)

    monkeypatch.setattr(recover, "_read_json", racing)
    _check(store, 3)
    assert raced and "ckpt-00000002" in raced[0] and not os.path.exists(os.path.dirname(raced[0]))
    monkeypatch.setattr(recover, "_read_json", real)
    os.remove(os.path.join(store.latest()["path"], "actor", "weights.bin"))
    with pytest.raises(RecoverError, match=r"weights\.bin is missing"):
        store.latest()
