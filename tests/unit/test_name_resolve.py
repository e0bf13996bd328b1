"""The file-based name_resolve store, with real concurrent processes."""
import multiprocessing as mp
import time

import pytest

from realhf.base import name_resolve
from realhf.base.name_resolve import FileNameResolve, NameEntryExistsError, NameEntryNotFoundError, names
from realhf.base.network import find_free_port, find_free_ports, gethostip, is_loopback


def _add_later(root, key, value, delay):
    time.sleep(delay)
    FileNameResolve(root).add(key, value)


def _add_many(root, prefix, n, tag):
    repo = FileNameResolve(root)
    for i in range(n):
        repo.add(f"{prefix}/{tag}/{i}", f"{tag}-{i}")
        repo.add(f"{prefix}/shared", f"{tag}-{i}", replace=True)
        try:  # both processes race for the same key: exactly one may win
            repo.add(f"race/{i}", tag)
        except NameEntryExistsError:
            continue
        repo.add(f"wins/{tag}/{i}", "1")


def _run_procs(procs, timeout=30):
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
            assert p.exitcode == 0, f"process {p.name} exit code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture
def repo(tmp_path):
    return FileNameResolve(str(tmp_path / "nr"))


def test_add_get_replace(repo):
    repo.add("exp/t/a", "1")
    assert repo.get("exp/t/a") == "1"
    with pytest.raises(NameEntryExistsError, match="exp/t/a"):
        repo.add("exp/t/a", "2")
    assert repo.get("exp/t/a") == "1"
    repo.add("exp/t/a", "2", replace=True)
    assert repo.get("exp/t/a") == "2"
    with pytest.raises(NameEntryNotFoundError, match="exp/t/missing"):
        repo.get("exp/t/missing")
    # a key may have both a value and sub-keys
    repo.add("exp/t/a/b", "3")
    assert repo.get("exp/t/a") == "2" and repo.get("exp/t/a/b") == "3"
    repo.delete("exp/t/a")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("exp/t/a")
    assert repo.get("exp/t/a/b") == "3"
    with pytest.raises(NameEntryNotFoundError):
        repo.delete("exp/t/a")
    # values with newlines and unicode survive
    repo.add("exp/t/u", "tcp://127.0.0.1:1\nπ")
    assert repo.get("exp/t/u") == "tcp://127.0.0.1:1\nπ"


def test_wait_for_another_process(tmp_path):
    root = str(tmp_path / "nr")
    repo = FileNameResolve(root)
    p = mp.get_context("spawn").Process(target=_add_later, args=(root, "exp/t/late", "hello", 0.5))
    p.start()
    try:
        assert repo.wait("exp/t/late", timeout=20) == "hello"
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_wait_timeout_names_key(repo):
    with pytest.raises(TimeoutError, match="exp/t/never"):
        repo.wait("exp/t/never", timeout=0.3, poll=0.05)


def test_subtree_and_clear(repo):
    root = names.trial_root("exp", "t1")
    for w in ["model_worker/1", "model_worker/0", "master"]:
        repo.add(names.worker_address("exp", "t1", w), f"addr-{w}")
    repo.add(names.master_heartbeat("exp", "t1"), "hb")
    repo.add(names.trial_root("exp", "t2") + "/x", "other trial")
    prefix = names.worker_root("exp", "t1")
    assert repo.find_subtree(prefix) == [
        f"{prefix}/master",
        f"{prefix}/model_worker/0",
        f"{prefix}/model_worker/1",
    ]
    assert repo.get_subtree(prefix) == ["addr-master", "addr-model_worker/0", "addr-model_worker/1"]
    assert repo.find_subtree(prefix + "/model_worker") == [f"{prefix}/model_worker/0", f"{prefix}/model_worker/1"]
    assert repo.find_subtree("nothing/here") == []
    repo.clear_subtree(root)
    assert repo.find_subtree(root) == []
    assert repo.get("exp/t2/x") == "other trial"
    # the same keys can be added again by a new run
    repo.add(names.master_heartbeat("exp", "t1"), "hb2")
    assert repo.get(names.master_heartbeat("exp", "t1")) == "hb2"
    repo.clear_subtree("nothing/here")  # no error


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/b/", "", "a/./b", "a/.value", "a\x00b", ".."])
def test_path_escape_rejected(repo, key):
    with pytest.raises(ValueError):
        repo.add(key, "v")
    with pytest.raises(ValueError):
        repo.get(key)


def test_names_reject_bad_parts():
    with pytest.raises(ValueError, match="experiment_name"):
        names.trial_root("a/b", "t")
    with pytest.raises(ValueError, match="trial_name"):
        names.trial_root("e", "..")


def test_make_repository(tmp_path):
    r = name_resolve.make_repository("file", root=str(tmp_path / "x"))
    assert isinstance(r, FileNameResolve)
    with pytest.raises(ValueError, match="file"):
        name_resolve.make_repository("etcd")


def test_concurrent_adds_from_two_processes(tmp_path):
    root = str(tmp_path / "nr")
    ctx = mp.get_context("spawn")
    n = 50
    procs = [ctx.Process(target=_add_many, args=(root, "exp/t", n, tag)) for tag in ("p0", "p1")]
    _run_procs(procs)
    repo = FileNameResolve(root)
    keys = repo.find_subtree("exp/t")
    assert len(keys) == 2 * n + 1
    assert sorted(repo.get_subtree("exp/t/p0")) == sorted(f"p0-{i}" for i in range(n))
    assert repo.get("exp/t/shared") in (f"p0-{n - 1}", f"p1-{n - 1}")
    winners = [k.split("/")[-1] for k in repo.find_subtree("wins")]
    assert sorted(winners, key=int) == [str(i) for i in range(n)], "each raced key must have exactly one winner"
    assert all(repo.get(f"race/{i}") == ("p0" if f"wins/p0/{i}" in repo.find_subtree("wins/p0") else "p1") for i in range(n))


def test_network_helpers():
    ports = find_free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)
    assert 0 < find_free_port() < 65536
    assert isinstance(gethostip(), str) and gethostip().count(".") == 3
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.1.2.3")
