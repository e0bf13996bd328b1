"""`gen`: batch generation over a JSONL of prompts; writes `generated.jsonl` (one row per prompt x sample)."""
from __future__ import annotations

import glob
import json
import os
from typing import List

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec
from realhf.api.quickstart.config import GenerationExpConfig
from realhf.base import logging
from realhf.base.topology import ProcessTopology
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, experiment_spec, replica_specs, single_layout

logger = logging.getLogger(__name__)


def build_gen(cfg: GenerationExpConfig) -> ExperimentSpec:
    from realhf.impl.dataset import PromptDataset, validate_jsonl
    from realhf.impl.dataset.jsonl import epoch_steps

    layout = single_layout(cfg, "gen")
    g = cfg.gen.to_hyperparameters()
    check_model_fits(cfg.model.path, layout, "model.path", tokenizer=True,
                     seqlen={"dataset.max_prompt_len": cfg.dataset.max_prompt_len, "gen.max_new_tokens": g.max_new_tokens})
    n_prompts = validate_jsonl(cfg.dataset.path, PromptDataset.REQUIRED, PromptDataset.OPTIONAL)
    # every prompt is generated for: the workers' EpochIterator (shuffle=False) keeps an epoch's last partial
    # batch, or folds it into the batch before when it has fewer prompts than data-parallel ranks
    if epoch_steps(n_prompts, cfg.dataset.train_bs_n_seqs, layout.dp, drop_last=False) == 0:
        raise ValueError(f"dataset.path={cfg.dataset.path!r} has {n_prompts} prompts, fewer than the {layout.dp} "
                         f"data-parallel ranks of allocation_mode={cfg.allocation_mode!r} that each need one")
    out = cfg.output_path()
    models = replica_specs("default", {"default": (layout, tuple(range(layout.world_size)))}, cfg.model.path, cfg.model)
    mfc = MFCDef(name="gen", model_name="default", interface_type="generate", interface_impl="generation",
                 interface_args=dict(gconfig=g, seed=cfg.seed, output_file=out + ".part"),
                 input_keys=("packed_prompts",), output_keys=("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask"),
                 mb_spec=cfg.mb_spec.to_spec())
    ds = DatasetSpec(kind="prompt", args=dict(path=cfg.dataset.path, max_prompt_len=cfg.dataset.max_prompt_len,
                                              use_chat_template=cfg.use_chat_template),
                     batch_size=cfg.dataset.train_bs_n_seqs, holder_model="default", shuffle=False)
    return experiment_spec(cfg, n_workers=layout.world_size, models=models, mfcs=[mfc], dataset=ds, total_train_epochs=1,
                           final_hook="gen_merge:" + out)


def _writer_ranks(spec: ExperimentSpec) -> List[int]:
    """Global ranks that write part files: tensor-rank 0 of the last pipeline stage of every dp rank."""
    m = spec.models[0]
    topo = ProcessTopology(m.layout)
    return [m.ranks[g] for g in topo.filter_match(pipe=m.layout.pp - 1, tensor=0)]


def merge_outputs(spec: ExperimentSpec, out: str):
    """Concatenate this run's part files into ``out`` in (query order of the dataset, sample index).

    Each writer rank starts its own ``<out>.part.<rank>`` afresh when it first writes in its process
    (see :class:`~realhf.impl.model.interface.gen_interface.GenerationInterface`); only the files of
    this layout's writer ranks are read, so files an earlier, unfinished run left behind under other
    ranks are ignored. Every part file is removed afterwards.
    """
    rows = []
    for r in _writer_ranks(spec):
        f = f"{out}.part.{r}"
        if os.path.exists(f):
            with open(f) as fh:
                rows.extend(json.loads(line) for line in fh if line.strip())
    order = {}
    from realhf.impl.dataset import read_jsonl

    path = spec.dataset.args["path"]
    for i, (_, row) in enumerate(read_jsonl(path, {"prompt": str}, {"query_id": (str, int)})):
        order[str(row["query_id"]) if row.get("query_id") is not None else str(i)] = i
    rows.sort(key=lambda r: (order.get(str(r["query_id"]), 1 << 30), r["sample_idx"]))
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, out)
    for f in glob.glob(out + ".part.*"):
        os.remove(f)
    logger.info(f"wrote {len(rows)} generated rows to {out}")


register_experiment("gen", GenerationExpConfig, build_gen)
