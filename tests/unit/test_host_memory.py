"""realhf/base/host_memory.py: the mode from the environment, and that "retain" really keeps freed large
blocks for reuse (a fresh process fills and frees a 128 MB tensor, then fills a 64 MB one; with the mode on,
the second one reuses the freed heap memory instead of a new mmap, seen as no new page faults)."""
import subprocess
import sys

import pytest

from realhf.base import host_memory

PROBE = r"""
import resource, sys, torch
from realhf.base import host_memory
applied = host_memory.retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(32 * 2**20); del x          # 128 MB, touched, freed
f0 = faults()
y = torch.ones(16 * 2**20)                 # 64 MB, touched
print(applied, faults() - f0)
"""


def _probe(mode):
    from realhf.base.process import env_with_source_path

    env = env_with_source_path()
    env[host_memory.ENV_VAR] = mode
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def test_mode_from_environment(monkeypatch):
    monkeypatch.delenv(host_memory.ENV_VAR, raising=False)
    assert host_memory.mode() == "retain"
    monkeypatch.setenv(host_memory.ENV_VAR, " Default ")
    assert host_memory.mode() == "default"
    monkeypatch.setenv(host_memory.ENV_VAR, "jemalloc")
    with pytest.raises(ValueError, match=r"REALHF_CPU_MALLOC='jemalloc'.*allowed: retain, default"):
        host_memory.mode()


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_retain_reuses_freed_large_blocks():
    applied, faults = _probe("retain")
    default_applied, default_faults = _probe("default")
    assert applied and not default_applied
    # 64 MB is 16384 pages of 4 KiB: with glibc's default every one faults in again; retained, almost none
    assert default_faults > 10000, default_faults
    assert faults < 1000, faults
