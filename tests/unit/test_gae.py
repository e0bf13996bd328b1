"""GAE over packed sequences: the C++ kernel and the PyTorch fallback against the reference loop."""
import os
import subprocess
import sys
import time

import pytest
import torch

from realhf.base.process import source_root
from realhf.impl.model.utils import gae

REPO = source_root()


@pytest.fixture(scope="module")
def cpp_ext():
    """Build (first run, ~30-60 s on 2 cores) or load the cached extension. A compiler exists on this
    machine, so a failed build is a test failure with the compiler's message, never a skip."""
    t0 = time.perf_counter()
    mod = gae.load_extension(strict=True)
    dt = time.perf_counter() - t0
    print(f"\n[test_gae] realhf_gae C++ extension ready in {dt:.1f} s (build dir {gae.build_directory()})")
    assert gae.cpp_available()
    return mod


def random_batch(lengths, dtype, seed, bootstrap=None):
    g = torch.Generator().manual_seed(seed)
    n, T = len(lengths), sum(lengths)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    rewards = torch.randn(T, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(T + n, generator=g, dtype=torch.float64).to(dtype)
    if bootstrap is None:
        bootstrap = torch.rand(n, generator=g) < 0.5
    else:
        bootstrap = torch.full((n,), bootstrap, dtype=torch.bool)
    return rewards, values, cu, bootstrap


def test_hand_computed_example():
    # one sequence of 2 rewards r = [0, 1], values v = [0.5, 0.2 | bootstrap 0.9], gamma 0.9, lam 0.8
    # bootstrap=True:  delta_1 = 1 + 0.9*0.9 - 0.2 = 1.61 ; delta_0 = 0 + 0.9*0.2 - 0.5 = -0.32
    #                  A_1 = 1.61 ; A_0 = -0.32 + 0.72*1.61 = 0.8392 ; R = A + v = [1.3392, 1.81]
    # bootstrap=False: delta_1 = 1 - 0.2 = 0.8 ; A_1 = 0.8 ; A_0 = -0.32 + 0.72*0.8 = 0.256 ; R = [0.756, 1.0]
    r = torch.tensor([0.0, 1.0], dtype=torch.float64)
    v = torch.tensor([0.5, 0.2, 0.9], dtype=torch.float64)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    for boot, exp_a, exp_r in [(True, [0.8392, 1.61], [1.3392, 1.81]), (False, [0.256, 0.8], [0.756, 1.0])]:
        b = torch.tensor([boot])
        for fn in (gae.gae_reference, gae.gae_torch):
            a, ret = fn(r, v, cu, b, 0.9, 0.8)
            torch.testing.assert_close(a, torch.tensor(exp_a, dtype=torch.float64), atol=1e-12, rtol=0)
            torch.testing.assert_close(ret, torch.tensor(exp_r, dtype=torch.float64), atol=1e-12, rtol=0)


LENGTH_SETS = [
    [1],
    [1, 1, 1],
    [5, 1, 17, 2, 1, 64],
    [3, 0, 4],  # an empty sequence still owns one (bootstrap) value
    [200],
    list(range(1, 40)),
]
GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5), (1.0, 0.9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("boot", [True, False, None])
def test_cpp_and_torch_match_reference(cpp_ext, dtype, boot):
    for k, lengths in enumerate(LENGTH_SETS):
        for gamma, lam in GAMMA_LAM:
            r, v, cu, b = random_batch(lengths, dtype, seed=k * 31 + int(gamma * 100) + int(lam * 7), bootstrap=boot)
            ref_a, ref_r = gae.gae_reference(r, v, cu, b, gamma, lam)
            for impl in ("cpp", "torch", "auto"):
                a, ret = gae.gae_packed(r, v, cu, b, gamma, lam, impl=impl)
                assert a.dtype == dtype and ret.dtype == dtype, impl
                ctx = f"impl={impl} lengths={lengths} gamma={gamma} lam={lam} dtype={dtype}"
                torch.testing.assert_close(a, ref_a, atol=1e-6, rtol=0, msg=lambda m: f"{ctx}: {m}")
                torch.testing.assert_close(ret, ref_r, atol=1e-6, rtol=0, msg=lambda m: f"{ctx}: {m}")


def test_returns_are_advantages_plus_values(cpp_ext):
    lengths = [4, 1, 6]
    r, v, cu, b = random_batch(lengths, torch.float64, seed=3)
    a, ret = gae.gae_packed(r, v, cu, b, 0.97, 0.9, impl="cpp")
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    v_tok = v[torch.arange(sum(lengths)) + seq]  # drop each sequence's trailing bootstrap value
    torch.testing.assert_close(ret, a + v_tok)


def test_terminal_sequence_ignores_bootstrap_value(cpp_ext):
    r, v, cu, _ = random_batch([5, 3], torch.float64, seed=5)
    b = torch.tensor([False, False])
    v2 = v.clone()
    v2[5] += 100.0  # bootstrap value of sequence 0
    v2[-1] -= 100.0  # bootstrap value of sequence 1
    for impl in ("cpp", "torch"):
        a1, _ = gae.gae_packed(r, v, cu, b, 0.99, 0.95, impl=impl)
        a2, _ = gae.gae_packed(r, v2, cu, b, 0.99, 0.95, impl=impl)
        torch.testing.assert_close(a1, a2)


def test_torch_impl_never_touches_extension(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("impl='torch' must not use the C++ extension")

    monkeypatch.setattr(gae, "gae_cpp", boom)
    monkeypatch.setattr(gae._KERNEL, "load", boom)
    monkeypatch.setattr(gae._KERNEL, "load_or_warn", boom)
    r, v, cu, b = random_batch([3, 1, 4], torch.float32, seed=1)
    a, ret = gae.gae_packed(r, v, cu, b, 0.99, 0.95, impl="torch")
    ref_a, ref_r = gae.gae_reference(r, v, cu, b, 0.99, 0.95)
    torch.testing.assert_close(a, ref_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, ref_r, atol=1e-6, rtol=0)


def test_bad_inputs():
    r, v, cu, b = random_batch([3, 2], torch.float32, seed=0)
    with pytest.raises(AssertionError, match="T \\+ n"):
        gae.gae_packed(r, v[:-1], cu, b, 0.9, 0.9, impl="torch")
    with pytest.raises(ValueError, match="impl"):
        gae.gae_packed(r, v, cu, b, 0.9, 0.9, impl="cuda")


def _run_py(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)


def test_auto_falls_back_with_one_warning():
    code = (
        "import torch\n"
        "from realhf.impl.model.utils import gae\n"
        "r=torch.randn(5); v=torch.randn(7); cu=torch.tensor([0,2,5]); b=torch.tensor([True,False])\n"
        "assert not gae.cpp_available()\n"
        "for _ in range(3):\n"
        "    a, ret = gae.gae_packed(r, v, cu, b, 0.9, 0.8)\n"
        "    ra, rr = gae.gae_reference(r, v, cu, b, 0.9, 0.8)\n"
        "    torch.testing.assert_close(a, ra, atol=1e-6, rtol=0)\n"
        "print('OK')\n"
    )
    p = _run_py(code, REALHF_NO_CPP_EXT="1")
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr
    assert p.stderr.count("GAE C++ extension unavailable") == 1, p.stderr


def test_cached_extension_is_reused_by_a_new_process(cpp_ext):
    """A new process loads the extension built before without building it again (no file of the build folder
    is rewritten)."""
    build = gae.build_directory()

    def files():
        return {f: os.stat(os.path.join(build, f)).st_mtime_ns for f in os.listdir(build)
                if os.path.isfile(os.path.join(build, f))}

    before = files()
    assert any(f.endswith(".so") for f in before), before
    code = "from realhf.impl.model.utils import gae\nassert gae.cpp_available()\nprint(gae.extension_load_seconds())\n"
    p = _run_py(code)
    assert p.returncode == 0, p.stderr
    print(f"\n[test_gae] cached extension import in a new process: {float(p.stdout.split()[-1]):.2f} s")
    assert files() == before, "the new process rebuilt the extension instead of reusing the build cache"


def test_another_checkout_of_the_same_code_reuses_the_build(cpp_ext, tmp_path):
    """The build cache is keyed by the sources' content, not their path: a second checkout of the same code (here a
    copy of realhf/ and csrc/) imports the extension built from this one instead of compiling it again (before, the
    ninja file named the sources by absolute path, and each checkout rebuilt every kernel: about a minute)."""
    import shutil

    for d in ("realhf", "csrc"):
        shutil.copytree(os.path.join(REPO, d), str(tmp_path / d), ignore=shutil.ignore_patterns("__pycache__"))
    build = gae.build_directory()
    before = {f: os.stat(os.path.join(build, f)).st_mtime_ns for f in os.listdir(build)}
    code = ("from realhf.impl.model.utils import gae\nimport realhf\nassert gae.cpp_available()\n"
            "print(realhf.__file__, gae.build_directory(), gae.extension_load_seconds())\n")
    e = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=e, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    where, other_build, _ = p.stdout.split()
    assert where.startswith(str(tmp_path)), where  # the copy's package, with the copy's csrc
    assert other_build == build
    after = {f: os.stat(os.path.join(build, f)).st_mtime_ns for f in os.listdir(build)}
    assert after == before, "the other checkout rebuilt the extension"
    assert "Compiling" not in p.stderr, p.stderr
