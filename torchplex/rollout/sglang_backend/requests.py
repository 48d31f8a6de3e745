"""What an SGLang request is made of, and what its answer becomes: both pure, so CI tests them without SGLang.

One request per sample. Seeded (rollout.sglang_deterministic), each has its own `sampling_seed`: SGLang's `n=G`
copies the parent's seed into every child (../shared/gpu/SGLANG.md), so G requests with G seeds are what gives G
distinct, reproducible samples; SGLang honours the seed in its deterministic mode. Unseeded (its fast
configuration, whose default sampler takes no per-request seed), SGLang draws each request from its own generator. The
G requests of a prompt share its prompt tokens, which SGLang's radix cache prefills once when they arrive in
the same batch after the first (it does not dedupe within the very first batch, per the smoke run).

Images go as the processor's output (`format: "processor_output"` with `pixel_values` and `image_grid_thw`), so
SGLang runs no second image preprocessing and the `<|image_pad|>` run already expanded in `input_ids` matches the
grid. Videos are not passed yet (raises): SGLang's video path for processor output was not run on the GPU.
"""

from __future__ import annotations

from typing import Sequence

from ..engine import SampleOutput
from ..sampling import SamplingParams


def sampling_params_for(params: SamplingParams, seed: int | None) -> dict:
    """SGLang's sampling-params dict for one sample (seed None: no `sampling_seed`). SGLang's log-prob is
    log_softmax(logits / T) taken before top-k/top-p, the native engine's after them: the two agree only with
    top_k = 0 and top_p = 1."""
    sp = {"max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
          "skip_special_tokens": False}
    if seed is not None:
        # SGLang packs the seeds of a batch into an int64 tensor (sampling_batch_info.py): a larger seed (the job
        # seed times the step's and the sample's multipliers can get there) fails in its scheduler; folded, it
        # stays distinct
        sp["sampling_seed"] = int(seed) % 2**63
    if params.greedy:
        sp["temperature"] = 0.0
    else:
        sp.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k else -1)
    return sp


def image_item(prompt) -> dict | None:
    """The prompt's images as one processor-output item (None for a text prompt)."""
    if getattr(prompt, "pixel_values_videos", None) is not None:
        raise NotImplementedError("rollout.backend = 'sglang' does not pass video prompts yet (use 'native')")
    if getattr(prompt, "pixel_values", None) is None:
        return None
    return {"format": "processor_output", "pixel_values": prompt.pixel_values,
            "image_grid_thw": prompt.image_grid_thw}


def build_requests(prompts: Sequence, params: SamplingParams, seeds: Sequence[Sequence[int]],
                   seeded: bool = True) -> list[dict]:
    """Keyword arguments of one single-request `Engine.async_generate` call per sample: prompt-major, sample-minor
    (request g * n + j); `seeded`: each with its seed as `sampling_seed`. One call per request, not one batched call:
    SGLang's batch path
    (`TokenizerManager._handle_batch_request`) sends request i, awaits the processing of request i + 1, and starts
    waiting for any answer only after the last is sent; a request that finishes in between (a stop token drawn
    first) has had its state removed by then and the whole batch fails with a KeyError of its rid (docs/sglang.md). A
    single request starts waiting as soon as it is sent."""
    if len(seeds) != len(prompts) or any(len(s) != params.n for s in seeds):
        raise ValueError(f"sample_seeds must hold {params.n} seeds for each of the {len(prompts)} prompts")
    requests = []
    for prompt, prompt_seeds in zip(prompts, seeds):
        ids = prompt.input_ids.tolist() if hasattr(prompt.input_ids, "tolist") else list(prompt.input_ids)
        item = image_item(prompt)
        for seed in prompt_seeds:
            request = {"input_ids": ids, "sampling_params": sampling_params_for(params, seed if seeded else None),
                       "return_logprob": True}
            if item is not None:
                request["image_data"] = [item]  # a single request's images: a list of items
            requests.append(request)
    return requests


def finish_reason(meta: dict) -> str:
    """SGLang's finish_reason ({"type": "stop" | "length" | "abort", ...}) as the native engine's word."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind
    raise RuntimeError(f"SGLang aborted a rollout request: {reason!r}")


def map_outputs(outputs: Sequence[dict], num_prompts: int, n: int) -> list[list[SampleOutput]]:
    """outputs[prompt][sample] from the answers to `build_requests`, in its order."""
    if len(outputs) != num_prompts * n:
        raise RuntimeError(f"SGLang answered {len(outputs)} requests, {num_prompts * n} were sent")
    result: list[list[SampleOutput]] = []
    for g in range(num_prompts):
        row = []
        for j in range(n):
            out = outputs[g * n + j]
            meta = out["meta_info"]
            tokens = [int(t) for t in out["output_ids"]]
            logprobs = [float(x[0]) for x in meta["output_token_logprobs"]]
            if len(logprobs) != len(tokens):
                raise RuntimeError(f"SGLang returned {len(logprobs)} log-probs for {len(tokens)} tokens")
            row.append(SampleOutput(g, j, tokens, logprobs, finish_reason(meta)))
        result.append(row)
    return result
