"""Model text never reaches eval/exec; pathological answers are bounded in time and isolated."""
import os
import threading
import time
import uuid

import pytest

from realhf.reward import MathVerifier, WorkerPool, compare_answers, math_equal

TIMEOUT = 3.0


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=TIMEOUT, max_workers=2)
    v.pool.warmup()
    yield v
    v.close()


def _children(pool):
    with pool._cond:
        return [w.proc for w in pool._idle]


def test_malicious_strings_never_execute(verifier, tmp_path):
    marker = f"/tmp/pwned_{uuid.uuid4().hex}"
    attacks = [
        f"__import__('os').system('touch {marker}')",
        f"__import__(\"os\").system(\"touch {marker}\")",
        "().__class__.__bases__[0].__subclasses__()",
        'eval("1")',
        f"exec(\"open('{marker}','w')\")",
        "lambda: 0",
        "open('/etc/passwd').read()",
        f"Symbol('x').__class__.__init__.__globals__['os'].system('touch {marker}')",
    ]
    for attack in attacks:
        for ref in ["5", "x", attack]:
            if ref == attack:
                continue
            ok, status = verifier.verify(f"The answer is $\\boxed{{{attack}}}$", [ref])
            assert ok is False
            assert status in ("ok", "error", "timeout")
        # also as a reference solution
        assert verifier.verify(r"\boxed{5}", [attack])[0] is False
    time.sleep(0.2)
    assert not os.path.exists(marker)


@pytest.mark.parametrize(
    "answer",
    [
        "9**9**9**9",
        r"10^{10^{10^{10}}}",
        r"2^{2^{2^{2^{2^{2^{2}}}}}}",
        "1e999999999",
        "+".join(["(1+2*3)^2"] * 12_000),  # ~100 kB
        r"x^{10^{10^{10}}}",  # symbolic: only sympy (in the worker) can look at it
        r"(x+1)^{100000} - y",
    ],
)
def test_pathological_answers_are_bounded(verifier, answer):
    before = verifier.stats
    ok, status = verifier.verify(f"\\boxed{{{answer}}}", ["5"])
    assert ok is False
    assert status in ("timeout", "error")
    after = verifier.stats
    assert after["timeout"] + after["error"] == before["timeout"] + before["error"] + 1
    # the caller keeps working: the next verification is graded correctly
    assert verifier.verify(r"so \boxed{\frac{\sqrt{3}}{2}}", [r"\sqrt{3}/2"]) == (True, "ok")
    assert verifier.verify(r"\boxed{x^2-1}", ["(x-1)(x+1)"]) == (True, "ok")


def test_timeout_kills_and_replaces_worker():
    with WorkerPool(max_workers=1) as pool:
        pool.warmup()
        (proc,) = _children(pool)
        assert compare_answers(r"x^{10^{10^{10}}}", "x", timeout=1.0, pool=pool) == (False, "timeout")
        assert proc.poll() is not None  # the stuck worker was killed
        assert pool.n_killed == 1
        assert compare_answers(r"\sqrt{8}", r"2\sqrt{2}", pool=pool) == (True, "ok")
    assert pool._n_alive == 0


def test_batch_with_timeouts_and_threads(verifier):
    comps = [r"\boxed{x^{10^{10^{10}}}}", r"\boxed{\frac{1}{2}}", r"\boxed{2\sqrt{2}}", "no answer", r"\boxed{(x+1)^2}"]
    sols = [["x"], ["0.5"], [r"\sqrt{8}"], ["1"], ["x^2+2x+1"]]
    verifier.reset_stats()
    res = verifier.verify_batch(comps, sols, max_workers=3)
    assert [ok for ok, _ in res] == [False, True, True, False, True]
    assert res[0][1] == "timeout"
    st = verifier.stats
    assert st["total"] == 5 and st["timeout"] == 1 and st["correct"] == 3


def test_many_threads_share_the_default_pool():
    errors = []

    def work(i):
        try:
            assert math_equal(f"\\frac{{{i}}}{{2}}", str(i / 2))
            assert math_equal(f"{i}\\sqrt{{2}}", f"\\sqrt{{{2 * i * i}}}") or i == 0
        except AssertionError as e:
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_long_inputs_rejected_cheaply(verifier):
    ok, status = verifier.verify("\\boxed{" + "1" * 100_000 + "}", ["1"])
    assert (ok, status) == (False, "error")
