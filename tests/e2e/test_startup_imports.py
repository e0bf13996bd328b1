"""What a run's processes import before their first step: every launch pays it, on every process.

- The training workers' AdamW (``realhf.impl.model.backend.optim.AdamW``) updates exactly as ``torch.optim.AdamW``
  does, without importing ``torch._dynamo`` (torch's optimizer guards import it on first use: 1.7-2.5 s of CPU).
- The launcher checks a run's config, model folder, tokenizer and data rows without importing torch (2-3 s before
  any worker could start), and checks a tokenizer once per content of its files and library versions (transformers
  alone takes 1-2 s to import).
- A finished process leaves through ``exit_done``: the exit code, atexit handlers and flushed output as with
  ``sys.exit``, without the final garbage collections over torch's objects.

Each check runs in a fresh interpreter, so that nothing imported by this test process hides an import.
"""
import json
import os
import subprocess
import sys

import pytest

from realhf.base.process import env_with_source_path, source_root


def _python(code: str, env=None) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=source_root(), env=env_with_source_path(env),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_updates_like_torch_without_importing_dynamo(fused):
    code = f"""
import json, sys
import torch
from realhf.api.core.config import OptimizerConfig
from realhf.impl.model.backend import optim

FUSED = {fused}
if not FUSED:  # the foreach path, which build_adamw takes where the fused kernel is missing
    _real = optim.AdamW
    class _NoFused(_real):
        def __init__(self, *a, fused=None, **kw):
            if fused:
                raise RuntimeError("no fused kernel here")
            super().__init__(*a, **kw)
    optim.AdamW = _NoFused

torch.manual_seed(0)
shapes = [(40, 24), (24,), (3, 24)]
names = ["layers.0.w", "layers.0.bias", "layers.0.norm.weight"]
init = [torch.randn(s) for s in shapes]
grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
ours = [torch.nn.Parameter(t.clone()) for t in init]
cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
opt = optim.build_adamw(list(zip(names, ours)), cfg)
kind = type(opt).__mro__[1 if not FUSED else 0].__module__
for i, gs in enumerate(grads):
    for p, g in zip(ours, gs):
        p.grad = g.clone()
    opt.step()
    if i == 1:  # a recover checkpoint's round trip in the middle: a fresh optimizer loads the state
        sd = opt.state_dict()
        opt = optim.build_adamw(list(zip(names, ours)), cfg)
        opt.load_state_dict(sd)
    opt.zero_grad()
dynamo = "torch._dynamo" in sys.modules
state = opt.state_dict()

theirs = [torch.nn.Parameter(t.clone()) for t in init]
ref = torch.optim.AdamW([{{"params": theirs[:1], "weight_decay": 0.1}}, {{"params": theirs[1:], "weight_decay": 0.0}}],
                        lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                        **({{"fused": True}} if FUSED else {{"foreach": True}}))
for gs in grads:
    for p, g in zip(theirs, gs):
        p.grad = g.clone()
    ref.step()
    ref.zero_grad()
rs = ref.state_dict()
same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
same_state = all(torch.equal(state["state"][i][k], rs["state"][i][k]) for i in rs["state"] for k in rs["state"][i])
print(json.dumps(dict(kind=kind, dynamo=dynamo, same=same, same_state=same_state, groups=state["param_groups"] == rs["param_groups"],
                      grads_none=all(p.grad is None for p in ours))))
"""
    got = json.loads(_python(code))
    assert got["kind"] == "realhf.impl.model.backend.optim", got
    assert got["same"] and got["same_state"] and got["groups"], f"not the update of torch.optim.AdamW: {got}"
    assert got["grads_none"], "zero_grad must clear the gradients"
    assert not got["dynamo"], "building and stepping the optimizer imported torch._dynamo"


def _launcher_imports(args, cache) -> dict:
    code = f"""
import json, runpy, sys
sys.argv = ["realhf.apps.quickstart", *{args!r}, "--dry-run"]
try:
    runpy.run_module("realhf.apps.quickstart", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps(dict(code=code, torch="torch" in sys.modules, transformers="transformers" in sys.modules)))
"""
    return json.loads(_python(code, env={**os.environ, "REALHF_CACHE_DIR": str(cache)}))


def test_launcher_checks_a_run_without_importing_torch(tiny_sft, tiny_math_run, tmp_path):
    import shutil

    from realhf.testing import sft_cmd

    model, d = tiny_sft
    cache = tmp_path / "cache"  # a cache of its own: no tokenizer check kept from elsewhere
    sft = sft_cmd(model, str(d), str(tmp_path), "s", "allocation_mode=d2m1p1", "n_devices_per_node=2")
    got = _launcher_imports(sft, cache)  # a fresh cache: AutoTokenizer decides the class (and may import torch)
    assert got["code"] in (0, None) and got["transformers"], f"the launcher must load the tokenizer to check it: {got}"
    got = _launcher_imports(sft, cache)
    assert got["code"] in (0, None), got
    assert not got["transformers"] and not got["torch"], f"the passed tokenizer check was repeated: {got}"
    shutil.rmtree(cache / "tokenizer_checked")  # the class is kept, the check is not: loaded again, without torch
    got = _launcher_imports(sft, cache)
    assert got["code"] in (0, None) and got["transformers"], got
    assert not got["torch"], "the sft launcher imported torch"
    # a copy of the model with its tokenizer broken: its files differ, so the check runs again and names it
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text("{not json")
    p = subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *sft, f"model.path={broken}"],
                       cwd=source_root(), env=env_with_source_path({**os.environ, "REALHF_CACHE_DIR": str(cache)}),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"the tokenizer in {str(broken)!r} does not load" in p.stdout + p.stderr, \
        (p.stdout + p.stderr)[-2000:]
    model, d = tiny_math_run
    ppo = ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
           "group_size=4", "use_chat_template=false", "prompt_template={prompt}", f"fileroot={tmp_path}",
           "experiment_name=p", "allocation_mode=d2m1p1", "n_devices_per_node=2"]
    got = _launcher_imports(ppo, cache)
    assert got["code"] in (0, None) and not got["torch"], f"the ppo-math launcher imported torch: {got}"
    # a bad data row is still named by the launcher, before any process starts (the check needs no torch)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(os.path.join(d, "math.jsonl")).readline() + "{not json\n")
    p = subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *ppo[:2], f"dataset.path={bad}", *ppo[3:]],
                       cwd=source_root(), env=env_with_source_path(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"{bad}:2" in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]


def test_exit_done_keeps_the_exit_code_atexit_handlers_and_output(tmp_path):
    log = tmp_path / "run.log"
    code = f"""
import atexit, logging, sys
from realhf.base.process import exit_done
handler = logging.FileHandler({str(log)!r})
logging.getLogger("t").addHandler(handler)
logging.getLogger("t").warning("logged before the exit")
atexit.register(lambda: print("atexit ran", flush=False))
sys.stdout.write("buffered ")
exit_done(3)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=source_root(), env=env_with_source_path(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "buffered atexit ran\n", p.stdout
    assert log.read_text() == "logged before the exit\n"


def _rank_view(name):
    import torch.distributed as dist

    return dict(rank=dist.get_rank(), value=os.environ.get(name), cwd=os.getcwd(), pid=os.getpid(),
                ppid=os.getppid())


def test_run_distributed_ranks_see_the_callers_environment_and_folder(monkeypatch, tmp_path):
    """The ranks of ``run_distributed`` start from a forkserver (torch imported once), yet each sees the caller's
    environment variables and working folder as they are at the call, as spawned processes would."""
    from realhf.testing import run_distributed

    for value in ("first", "second"):  # the forkserver outlives the first call: the second value must still reach
        monkeypatch.setenv("REALHF_TEST_PROBE", value)
        monkeypatch.chdir(tmp_path)
        got = run_distributed(_rank_view, 2, "REALHF_TEST_PROBE", timeout=120)
        assert [g["rank"] for g in got] == [0, 1]
        assert all(g["value"] == value and g["cwd"] == str(tmp_path) for g in got), got
        assert all(g["pid"] != os.getpid() for g in got)
