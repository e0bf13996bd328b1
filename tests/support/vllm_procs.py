"""vLLM's processes below this test process (its engine core and workers), to check none outlives its engine."""
import time


def vllm_children():
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM") or "vllm" in " ".join(p.cmdline()).lower():
                out.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(before=(), timeout=30):
    """vLLM processes of this test process not in ``before`` that are still there after up to ``timeout`` s."""
    left = lambda: [c for c in vllm_children() if c[0] not in set(p for p, _ in before)]  # noqa: E731
    t0 = time.time()
    while left() and time.time() - t0 < timeout:
        time.sleep(0.2)
    return left()
