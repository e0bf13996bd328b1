"""Entry point of a grading worker process: ``python -m realhf.reward._worker``.

Reads one JSON request per line on stdin, writes one JSON reply per line on stdout. Only the
tasks in ``_TASKS`` can be run, with JSON arguments: no pickle, nothing executable crosses the
pipe. The process caps its address space, exits when its parent dies (a watchdog thread) and
on EOF. See ``safe.py`` for the parent side.
"""
from __future__ import annotations

import json
import os
import sys

from realhf.base.process import exit_when_parent_dies


def _harden(mem_limit_mb: int):
    try:
        import resource

        if mem_limit_mb > 0:
            lim = mem_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    except Exception:
        pass
    exit_when_parent_dies(exit_code=0)
    sys.set_int_max_str_digits(10_000)
    sys.setrecursionlimit(5_000)


CPU_BACKSTOP_S = 120  # no single task may use more CPU than this, even if the parent is gone


def _arm_cpu_backstop():
    """SIGXCPU (default action: terminate) after CPU_BACKSTOP_S more seconds of CPU time."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(ru.ru_utime + ru.ru_stime) + CPU_BACKSTOP_S
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
    except Exception:
        pass


def _compare(kind, a, b, rel_tol, pct):
    from realhf.reward.symbolic import compare

    return bool(compare(kind, a, b, float(rel_tol), bool(pct)))


def _ping():
    return True


_TASKS = {"compare": _compare, "ping": _ping}


def main():
    _harden(int(os.environ.get("REALHF_REWARD_WORKER_MEM_MB", "4096")))
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the protocol
    import realhf.reward.symbolic  # noqa: F401  (warm up sympy + the LaTeX parser)

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            fn = _TASKS[req["task"]]
            _arm_cpu_backstop()
            reply = {"id": rid, "status": "ok", "value": fn(*req.get("args", []))}
        except MemoryError:
            reply = {"id": rid, "status": "error", "value": None, "msg": "MemoryError"}
        except BaseException as e:  # noqa: BLE001 - any failure is reported, never raised
            reply = {"id": rid, "status": "error", "value": None, "msg": f"{type(e).__name__}: {e}"[:300]}
        try:
            out.write(json.dumps(reply) + "\n")
            out.flush()
        except Exception:
            break


if __name__ == "__main__":
    main()
