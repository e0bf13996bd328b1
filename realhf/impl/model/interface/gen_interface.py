"""Generation interface: prompts in, sampled continuations (token ids + log-probs) out.

Output keys per prompt sample (``n`` sequences each): ``packed_input_ids`` (prompt + answer),
``packed_logprobs`` (one per next-token position: 0 on prompt positions), ``prompt_mask`` (True on
prompt tokens), ``seq_no_eos_mask`` (one bool per sequence: hit max_new_tokens without a stop token), and,
when generation servers serve the model, ``packed_versions`` (the weight version behind each generated token;
-1 on prompt tokens).
With ``output_file`` set, rows ``{query_id, prompt, output_ids, output_text, logprobs}`` are written
to ``<output_file>.<rank>`` by the worker that owns the outputs: the file is started afresh at this
process's first write (so rows an earlier, unfinished run left there are not kept) and appended to
after that. A run that writes outputs therefore always starts from its first batch (``gen`` has no
recover checkpoints).

The prompts of a call are generated in micro-batches (``mb_spec``: at least ``n_mbs``, each within
``max_tokens_per_mb`` prompt tokens), one engine call each; as every sample draws from its own random
stream, the outputs do not depend on the cut.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters, Model, ModelInterface, register_interface
from realhf.impl.model.nn.generation import GenerationOutput


class GenerationInterface(ModelInterface):
    """``gconfig``: the sampling options as the experiment built them from its validated config
    (``SamplingConfig.to_hyperparameters``); the per-sample random streams derive from ``gconfig.seed``, or
    from the experiment's ``seed`` when that is None."""

    def __init__(self, gconfig: GenerationHyperparameters, seed: int = 1, output_file: Optional[str] = None):
        self.gconfig = gconfig
        self.seed = gconfig.seed if gconfig.seed is not None else seed
        self.output_file = output_file
        self._started_output = False  # this process has (re)started its part file

    @torch.no_grad()
    def generate(self, model: Model, data: SequenceSample, mb_spec) -> SequenceSample:
        prompts_flat = data.data["packed_prompts"]
        lens = data.flat_seqlens("packed_prompts")
        prompts: List[List[int]] = []
        off = 0
        for n in lens:
            prompts.append(prompts_flat[off : off + n].tolist())
            off += n
        # one random stream per sample, from (seed, model version, sample id): the same outputs in any layout
        seeds = [prompt_seed(self.seed, model.version, i) for i in data.ids]
        tok = model.tokenizer
        eos = tok.eos_token_id if tok is not None else None
        parts = data.mb_partition(mb_spec.max_tokens_per_mb, mb_spec.n_mbs, key="packed_prompts")
        outs = [model.engine.generate([prompts[i] for i in p], self.gconfig, eos_token_id=eos, seeds=[seeds[i] for i in p])
                for p in parts]
        out = GenerationOutput(tokens=[t for o in outs for t in o.tokens], logprobs=[lp for o in outs for lp in o.logprobs],
                               no_eos=[x for o in outs for x in o.no_eos],
                               versions=None if any(o.versions is None for o in outs) else
                               [v for o in outs for v in o.versions])
        n = self.gconfig.n
        ids, lps, pms, no_eos, seqlens, vers = [], [], [], [], [], []
        for i, p in enumerate(prompts):
            per_sample = []
            for j in range(n):
                k = i * n + j
                toks = out.tokens[k]
                seq = p + toks
                ids.append(torch.tensor(seq, dtype=torch.long))
                lp = torch.zeros(len(seq), dtype=torch.float32)
                lp[len(p) - 1 : len(seq) - 1] = torch.tensor(out.logprobs[k], dtype=torch.float32)
                lps.append(lp)
                pm = torch.zeros(len(seq), dtype=torch.bool)
                pm[: len(p)] = True
                pms.append(pm)
                if out.versions is not None:
                    v = torch.full((len(seq),), -1, dtype=torch.int32)
                    v[len(p):] = torch.tensor(out.versions[k], dtype=torch.int32)
                    vers.append(v)
                no_eos.append(out.no_eos[k])
                per_sample.append(len(seq))
            seqlens.append(per_sample)
        result = SequenceSample(
            keys={"packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask"},
            ids=list(data.ids),
            seqlens={"packed_input_ids": seqlens, "packed_logprobs": seqlens, "prompt_mask": seqlens,
                     "seq_no_eos_mask": [[1] * n for _ in prompts]},
            trailing_shapes={k: () for k in ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")},
            dtypes={"packed_input_ids": torch.long, "packed_logprobs": torch.float32, "prompt_mask": torch.bool,
                    "seq_no_eos_mask": torch.bool},
            data={"packed_input_ids": torch.cat(ids), "packed_logprobs": torch.cat(lps), "prompt_mask": torch.cat(pms),
                  "seq_no_eos_mask": torch.tensor(no_eos, dtype=torch.bool)},
        )
        if out.versions is not None:  # generation servers: the weight version behind every generated token
            result.keys.add("packed_versions")
            result.seqlens["packed_versions"] = seqlens
            result.trailing_shapes["packed_versions"] = ()
            result.dtypes["packed_versions"] = torch.int32
            result.data["packed_versions"] = torch.cat(vers)
        if self.output_file and model.module.is_last and model.grid.tp_rank == 0:
            self._write(model, data, prompts, out)
        return result

    def _write(self, model: Model, data: SequenceSample, prompts, out):
        n = self.gconfig.n
        qids = data.metadata.get("query_id", [str(i) for i in data.ids])
        texts = data.metadata.get("prompt", [None] * data.bs)
        path = f"{self.output_file}.{model.grid.global_rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        mode = "a" if self._started_output else "w"
        self._started_output = True
        with open(path, mode) as f:
            for i, p in enumerate(prompts):
                for j in range(n):
                    k = i * n + j
                    text = model.tokenizer.decode(out.tokens[k], skip_special_tokens=True) if model.tokenizer else None
                    f.write(json.dumps({"query_id": qids[i], "sample_idx": j, "prompt": texts[i],
                                        "output_ids": out.tokens[k], "output_text": text,
                                        "logprobs": [round(x, 6) for x in out.logprobs[k]],
                                        "no_eos": out.no_eos[k]}) + "\n")


def prompt_seed(seed: int, version: int, sample_id) -> int:
    """The seed of one prompt's samples: from the sampling seed, the weight version generating and the sample id
    (asynchronous rollouts seed their episodes the same way, see ``realhf.system.rollout.worker``)."""
    return (int(seed) * 1000003 + int(version) * 7919 + hash_id(sample_id)) % (2**62)


def hash_id(i) -> int:
    """A stable (process-independent) hash of a sample id."""
    import zlib

    return zlib.crc32(str(i).encode())


register_interface("generation", GenerationInterface)
