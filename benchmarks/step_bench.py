"""Serial vs decomposed GRPO scoring+training, side by side in one process.

    python benchmarks/step_bench.py --geometry debug --prompts 2 --prompt-tokens 1024 --group 8 --response 64  # CPU
    python benchmarks/step_bench.py --geometry 3B --dtype bfloat16 --prompts 4 --group 8 --response 64       # H200

Random weights with the named Qwen2.5-VL geometry, image-heavy prompts (one square image sized so the prompt has
about --prompt-tokens tokens), G sampled responses of --response random tokens per prompt. Both modes run the same
phases on the same Experience: reference log-probs (a frozen second model) and one PPO training step of the actor
(forward + backward + AdamW), alternating serial and decomposed runs --repeats times; the median of each is reported
with the token-forwards each mode ran. Rollout is the same in both modes and is not timed here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import faulthandler
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.models import fusion  # noqa: E402
from torchplex.models.qwen2_5_vl.args import get_flavor  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.rl.advantages import compute_advantages  # noqa: E402
from torchplex.rl.losses import PolicyLossConfig  # noqa: E402
from torchplex.runtime.decomposition import DecomposedScorer  # noqa: E402
from torchplex.runtime.experience import Experience, reference_phase  # noqa: E402
from torchplex.runtime.training import train_phase  # noqa: E402
from torchplex.runtime.scoring import SerialScorer  # noqa: E402

VS, IMG, VE = 151652, 151655, 151653


def make_prompt(args, prompt_tokens: int, seed: int):
    """Chat-like prompt: a few text tokens, one square image, a question: at least prompt_tokens tokens (the
    smallest square grid of merged patches that reaches it; 1024 -> 1050)."""
    v = args.vision
    side = max(2, math.ceil((prompt_tokens - 26) ** 0.5)) * v.spatial_merge_size  # patches per side
    grid = torch.tensor([[1, side, side]])
    g = torch.Generator().manual_seed(seed)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    pixels = torch.randn(side * side, patch_dim, generator=g)
    text = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()
    merged = side * side // v.spatial_merge_size ** 2
    ids = text(12) + [args.vision_start_token_id] + [args.image_token_id] * merged + [args.vision_end_token_id] + text(12)
    return SimpleNamespace(input_ids=torch.tensor(ids), pixel_values=pixels, image_grid_thw=grid,
                           pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None)


def make_experience(prompts, group: int, response: int, vocab: int, device, lengths=None) -> Experience:
    """G random responses per prompt of `response` tokens each, or of `lengths` (one per sample, at most
    `response`; the rest of each row padded with 0)."""
    n = len(prompts) * group
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(10, vocab, (n, response), generator=g)
    lengths = torch.full((n,), response) if lengths is None else lengths
    tokens[torch.arange(response)[None] >= lengths[:, None]] = 0
    rewards = torch.rand(n, generator=g)
    return Experience(prompts=prompts, answers=[""] * len(prompts), group_size=group, tokens=tokens.to(device),
                      lengths=lengths.to(device), sampling_logprobs=torch.zeros(n, response),
                      finish_reasons=["length"] * n, texts=[""] * n, rewards=rewards, reward_parts={},
                      correct=[False] * n, advantages=compute_advantages(rewards, group).to(device),
                      keep_groups=torch.ones(len(prompts), dtype=torch.bool))


def build(args, dtype, device, seed):
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model


def build_policy(args, dtype, device, freeze_vision: bool, fused: str = "auto"):
    """Actor, reference (the frozen tower shared) and an AdamW at lr 0: it does all its work but leaves the weights,
    so every mode, repeat and row samples from the same policy. `fused`: model.fused_elementwise for both (the
    serial baseline runs the same kernels)."""
    fusion.enable(fusion.wanted(fused, device))
    actor = build(args, dtype, device, 0)
    reference = build(args, dtype, device, 1).eval().requires_grad_(False)
    if freeze_vision:
        actor.visual.requires_grad_(False)
        reference.visual = actor.visual
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=0.0,
                                  foreach=device.type != "cuda", fused=device.type == "cuda")
    return actor, reference, optimizer


def bench_flavor(geometry: str, vision_depth: int = 0):
    """ModelArgs of a named flavor for benchmarks: the debug flavor gets token ids inside its small vocabulary, and
    `vision_depth` > 0 cuts the vision tower to that many blocks (the last one full-attention)."""
    args = get_flavor(geometry)
    if geometry == "debug":
        args = args.with_token_ids(image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                   vision_end_token_id=2003)
    if vision_depth:
        args.vision.depth = vision_depth
        args.vision.fullatt_block_indexes = (vision_depth - 1,)
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(scorer, actor, reference, optimizer, exp, mbs, whole_groups, device):
    """(reference seconds, train seconds, peak GiB, the experience with its ref/old log-probs) for one scorer."""
    exp = copy.copy(exp)
    exp.ref_logprobs = exp.old_logprobs = None
    if hasattr(scorer, "new_step"):
        scorer.new_step()
    sync(device)
    t0 = time.perf_counter()
    reference_phase(reference, scorer, exp, 1.0, mbs, whole_groups)
    sync(device)
    t1 = time.perf_counter()
    train_phase(actor, scorer, exp, optimizer, None, PolicyLossConfig(kl_coef=0.01), temperature=1.0,
                micro_batch_size=mbs, whole_groups=whole_groups, ppo_epochs=1, grad_clip=1.0,
                max_len=exp.tokens.shape[1])
    sync(device)
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return t1 - t0, t2 - t1, peak, exp


def long_tail_stops(vocab: int, mean_response: int) -> list[int]:
    """Stop tokens that make random-weight responses end after a roughly geometric number of tokens with the given
    mean (most short, a tail running to max_new_tokens), like RL rollouts where a few samples set the step's
    length. 0: no stop tokens, every response runs to max_new_tokens."""
    if mean_response <= 0:
        return []
    count = max(1, round(vocab / mean_response))
    return list(range(vocab - count, vocab))


class NullTokenizer:
    """Random-weight models produce no answers worth scoring: every reward is 0 (the KL term still trains)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [""] * len(ids)


def full_steps(a, args, dtype, device, prompts):
    """Whole steps (rollout included) through the executor in serial, decomposed and overlapped modes."""
    from torchplex.rollout.engine import RolloutEngine
    from torchplex.rollout.sampling import SamplingParams
    from benchmarks.bench_runtime import bench_config
    from torchplex.runtime.build import build_step_runtime
    from torchplex.runtime.timeline import draw_timelines

    # the same policy in every mode and repeat, so the token check below compares like with like
    actor, reference, optimizer = build_policy(args, dtype, device, a.freeze_vision, a.fused)
    engine = RolloutEngine(actor, kv_pool_bytes=int(a.kv_pool_gib * 2**30), compile_decode=device.type == "cuda")
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.response, seed=0,
                            stop_token_ids=long_tail_stops(args.text.vocab_size, a.mean_response))
    step = lambda mode, **kw: bench_config(mode, micro_batch=a.micro_batch, **kw)
    configs = {"serial": step("serial"), "decomposed": step("decomposed"), "overlapped": step("overlapped")}
    if a.window:  # the reference prefixes and finished samples' reference log-probs on the window thread
        configs["overlapped_window"] = step("overlapped", window=True, window_sample_batch=a.window_sample_batch)
        if a.decode_priority:  # the same, with decode steps on a high-priority stream
            configs["overlapped_window_prio"] = configs["overlapped_window"]
    if a.ref_prefix_graphs:  # both prefix modes again with the bucketed reference prefix: its gain in each
        configs["decomposed_graphs"] = step("decomposed", ref_prefix_graphs=True)
        configs["overlapped_graphs"] = step("overlapped", window=a.window, ref_prefix_graphs=True)
    runners = {m: build_step_runtime(cfg, actor, reference, engine, optimizer, None, NullTokenizer())
               for m, cfg in configs.items()}
    phases = ("vision", "rollout", "ref", "train")
    window_counts = {m: [] for m in runners}  # (reference prefix jobs, reference sample jobs) in the window
    times = {m: {k: [] for k in phases + ("step_s",)} for m in runners}
    rollout_split = {m: [] for m in runners}
    last = {}
    order = list(runners)
    for rep in range(a.repeats + 1):
        # Each timed round starts one mode later: a mode's place in the round (what ran just before it, how the
        # allocator was left) moves through the repeats instead of always favouring or penalising the same mode.
        for m in order[rep % len(order):] + order[:rep % len(order)]:
            runner = runners[m]
            engine.decode_priority = m.endswith("_prio")
            before = dataclasses.replace(engine.stats)
            t = time.perf_counter()
            out = runner.run(prompts, [""] * len(prompts), params)
            sync(device)
            step_s = time.perf_counter() - t
            st = engine.stats
            if rep:
                rollout_split[m].append({"prefill_s": st.prefill_s - before.prefill_s,
                                         "decode_s": st.decode_s - before.decode_s,
                                         "decode_steps": st.decode_steps - before.decode_steps,
                                         "capture_s": st.capture_s - before.capture_s})
            print(f"[step_bench {time.strftime('%H:%M:%S')}] {'timed' if rep else 'warm-up'} {m} step: {step_s:.2f}s "
                  + " ".join(f"{k} {out.timeline.total_s(k):.2f}" for k in phases)
                  + f" | rollout: prefill {st.prefill_s - before.prefill_s:.2f} decode {st.decode_s - before.decode_s:.2f}"
                  f" ({st.decode_steps - before.decode_steps} steps, graph capture {st.capture_s - before.capture_s:.2f})",
                  flush=True)
            window_spans = [sp for sp in out.timeline.spans if sp.lane == "window"]
            in_window = [sp.name for sp in window_spans]
            if in_window:
                busy_s = sum(sp.end_s - sp.start_s for sp in window_spans)
                print(f"  window: {in_window.count('ref_prefix')} reference prefixes, {in_window.count('ref_suffix')} "
                      f"reference sample batches (GPU-complete spans {busy_s:.2f}s)", flush=True)
            if rep:
                window_counts[m].append((in_window.count("ref_prefix"), in_window.count("ref_suffix")))
                times[m]["step_s"].append(step_s)
                for k in phases:
                    times[m][k].append(out.timeline.total_s(k))
            last[m] = out
    result = {m: {k: statistics.median(v) for k, v in times[m].items()} for m in runners}
    lengths = sorted(last["serial"].experience.lengths.tolist())
    result["response_lengths"] = {"mean": statistics.mean(lengths), "p50": lengths[len(lengths) // 2],
                                  "p90": lengths[int(0.9 * (len(lengths) - 1))], "max": lengths[-1],
                                  "at_cap": sum(x >= a.response for x in lengths), "count": len(lengths)}
    for m in runners:  # the same seeds in every mode: on-policy rollouts must agree
        result[m]["same_tokens_as_serial"] = bool(torch.equal(last[m].experience.tokens.cpu(),
                                                              last["serial"].experience.tokens.cpu()))
    result["speedup_vs_serial"] = {m: result["serial"]["step_s"] / result[m]["step_s"] for m in runners}
    result["overlapped_vs_decomposed"] = result["decomposed"]["step_s"] / result["overlapped"]["step_s"]
    mask = last["decomposed"].experience.mask
    if a.window:
        for m in [m for m in runners if m.startswith("overlapped_window")]:
            diff = last[m].experience.ref_logprobs - last["decomposed"].experience.ref_logprobs
            result[m]["ref_logprobs_max_abs_diff_vs_decomposed"] = diff[mask].abs().max().item()
            result[m]["window_prefix_and_sample_jobs"] = window_counts[m]
            result[f"{m}_vs_decomposed"] = result["decomposed"]["step_s"] / result[m]["step_s"]
    for m in runners:
        result[m]["rollout_split"] = rollout_split[m]
    if a.ref_prefix_graphs:
        result["overlapped_graphs_vs_decomposed"] = result["decomposed"]["step_s"] / result["overlapped_graphs"]["step_s"]
        for m in ("decomposed_graphs", "overlapped_graphs"):  # compiled kernels: equal up to rounding, not bitwise
            diff = last[m].experience.ref_logprobs - last["decomposed"].experience.ref_logprobs
            result[m]["ref_logprobs_max_abs_diff_vs_decomposed"] = diff[mask].abs().max().item()
    result["schedule_overlapped"] = str(last["overlapped"].schedule)
    if a.timeline_dir:
        for m, out in last.items():
            out.timeline.to_chrome_trace(Path(a.timeline_dir) / f"timeline_{m}.json")
            out.timeline.draw(Path(a.timeline_dir) / f"timeline_{m}.png", title=f"{m} step ({a.geometry})")
        draw_timelines({m: out.timeline for m, out in last.items()}, Path(a.timeline_dir) / "timeline_modes.png",
                       title=f"one step per mode, last timed round ({a.geometry})")
    return result


def write_mfu_results(a, args, dtype, device, prompts) -> None:
    """--mfu: the phase MFU measurement of phase_mfu.py as a results file (../shared/RESULTS.md, topic mfu)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import transformers
    from phase_mfu import run_mfu

    def results_file(measured: dict) -> dict:
        result = {"topic": "mfu", "command": "python " + " ".join(sys.argv),
                  "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "gpus": 1, "torch": torch.__version__, "transformers": transformers.__version__,
                  "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), **measured}
        if a.out:  # after every timed round: a run stopped at its time limit keeps what it measured
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=2))
        return result

    result = results_file(run_mfu(a, args, dtype, device, prompts, build,
                                  long_tail_stops(args.text.vocab_size, a.mean_response), progress=results_file))
    for row in result["rows"]:
        print(json.dumps({k: row.get(k) for k in ("mode", "ok", "error", "step_s", "phases_s", "mfu",
                                                  "logprob_mismatch", "peak_gib")}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="debug")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--mean-response", type=int, default=0, help="with --full-step: stop tokens that end responses "
                    "after ~this many tokens on average (geometric, capped at --response); 0: all run to --response")
    ap.add_argument("--kv-pool-gib", type=float, default=24.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--full-step", action="store_true", help="whole steps through the executor, rollout included, "
                                                               "in serial, decomposed and overlapped modes")
    ap.add_argument("--timeline-dir", default="", help="with --full-step: write timeline PNG + Chrome trace here")
    ap.add_argument("--window", action="store_true", help="with --full-step: one more overlapped row with the "
                    "reference prefixes and the reference log-probs of finished samples in the decode window (a "
                    "second host thread; the planner's default keeps them after rollout)")
    ap.add_argument("--window-sample-batch", type=int, default=0, help="with --window: finished samples of a prompt "
                    "scored per window job (0: half a group; 1: every sample as soon as it is seen finished)")
    ap.add_argument("--decode-priority", action="store_true", help="with --window: one more row, the window row "
                    "with decode steps on a high-priority CUDA stream")
    ap.add_argument("--ref-prefix-graphs", action="store_true", help="with --full-step: also run decomposed and "
                    "overlapped with the reference prefix as bucketed compiled graphs (CUDA graphs on a GPU)")
    ap.add_argument("--mfu", action="store_true", help="MFU of each compute phase (prefill, vision, reference, "
                    "train) on real rollouts, per mode; --out writes a results file of topic mfu (phase_mfu.py)")
    ap.add_argument("--modes", nargs="+", default=["serial", "decomposed"], help="with --mfu: the modes to run (serial, "
                    "decomposed; NAME-padded runs that mode on padded rows, packing's before side)")
    ap.add_argument("--workload", default="img", help="with --mfu: the workload name in the results rows")
    ap.add_argument("--profile-dir", default="", help="with --mfu: one more round under torch.profiler per mode, "
                    "its kernel categories in the rows")
    ap.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                    help="model.fused_elementwise for both models (auto: on a GPU; models/fusion.py)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="with --mfu: the actor's decoder and "
                    "vision blocks recompute their activations in backward (the trainer's activation_checkpointing)")
    ap.add_argument("--compile", action="store_true", help="with --mfu: torch.compile each decoder layer of both "
                    "models (parallelize.apply_compile, the trainer's compile option)")
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=540, help="dump stacks and exit if still running")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    args = bench_flavor(a.geometry)
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]
    if a.mfu:
        write_mfu_results(a, args, dtype, device, prompts)
        return
    if not a.full_step:
        actor = build(args, dtype, device, 0)
        reference = build(args, dtype, device, 1).eval().requires_grad_(False)
        if a.freeze_vision:
            actor.visual.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-6,
                                      foreach=device.type != "cuda", fused=device.type == "cuda")
    if a.full_step:
        result = full_steps(a, args, dtype, device, prompts)
        result["info"] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), **vars(a)}
        print(json.dumps(result, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
        return
    exp = make_experience(prompts, a.group, a.response, min(args.text.vocab_size, 150000), device)
    modes = {"serial": (SerialScorer(), False), "decomposed": (DecomposedScorer(), True)}
    times = {m: {"ref": [], "train": [], "peak_gib": []} for m in modes}
    for rep in range(a.repeats + 1):  # the first round warms up allocators and kernels
        for name, (scorer, whole) in modes.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ref_s, train_s, peak, _ = run_mode(scorer, actor, reference, optimizer, exp, a.micro_batch, whole,
                                               device)
            if rep:
                times[name]["ref"].append(ref_s)
                times[name]["train"].append(train_s)
                times[name]["peak_gib"].append(peak)
    P = sum(len(p.input_ids) for p in prompts)
    R = int(exp.lengths.sum())
    result = {"info": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "geometry": a.geometry,
                       "dtype": a.dtype, "prompts": a.prompts, "prompt_tokens_each": P // a.prompts, "group": a.group,
                       "response": a.response, "micro_batch": a.micro_batch, "freeze_vision": a.freeze_vision,
                       "fused_elementwise": fusion.enabled(),
                       "repeats": a.repeats},
              "token_forwards_per_model": {"serial": a.group * P + R, "decomposed": P + R,
                                           "saving_x": (a.group * P + R) / (P + R)}}
    for name in modes:
        t = {k: statistics.median(v) for k, v in times[name].items()}
        t["step_s"] = t["ref"] + t["train"]
        result[name] = t
    result["speedup"] = {k: result["serial"][k] / result["decomposed"][k] for k in ("ref", "train", "step_s")}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
