"""Hand-made PPO/GRPO training samples for tests that call ``PPOActorInterface.train_step`` directly."""
from typing import List, Optional

import torch


def grpo_sample(vocab: int, rewards: List[float], group: int, seed: int = 3, versions: Optional[List[int]] = None):
    """One sample per prompt, each with ``group`` answers of random tokens; ``rewards`` per answer (prompt-major).
    Behaviour log-probs are random in (-3, -2]. With ``versions`` (per answer), ``packed_versions`` is added: the
    answer's weight version on its tokens, -1 on the prompt's."""
    from realhf.api.core.data_api import SequenceSample

    g = torch.Generator().manual_seed(seed)
    n_prompts = len(rewards) // group
    ids, lps, pms, vers, seqlens = [], [], [], [], []
    for p in range(n_prompts):
        P = 4 + p
        prompt = torch.randint(3, vocab, (P,), generator=g)
        per = []
        for a in range(group):
            A = 3 + (p + a) % 4
            ids.append(torch.cat([prompt, torch.randint(3, vocab, (A,), generator=g)]))
            lp = torch.zeros(P + A)
            lp[P - 1 : P + A - 1] = -2.0 - torch.rand(A, generator=g)
            lps.append(lp)
            pm = torch.zeros(P + A, dtype=torch.bool)
            pm[:P] = True
            pms.append(pm)
            if versions is not None:
                v = torch.full((P + A,), -1, dtype=torch.int32)
                v[P:] = versions[p * group + a]
                vers.append(v)
            per.append(P + A)
        seqlens.append(per)
    data = {"packed_input_ids": torch.cat(ids), "packed_logprobs": torch.cat(lps), "prompt_mask": torch.cat(pms),
            "seq_no_eos_mask": torch.zeros(len(rewards), dtype=torch.bool),
            "rewards": torch.tensor(rewards, dtype=torch.float32)}
    if versions is not None:
        data["packed_versions"] = torch.cat(vers)
    per_token = [k for k in data if k.startswith("packed_") or k == "prompt_mask"]
    return SequenceSample(
        keys=set(data), ids=list(range(n_prompts)),
        seqlens={**{k: seqlens for k in per_token}, "seq_no_eos_mask": [[1] * group] * n_prompts,
                 "rewards": [[1] * group] * n_prompts},
        trailing_shapes={k: () for k in data}, dtypes={k: v.dtype for k, v in data.items()}, data=data)
