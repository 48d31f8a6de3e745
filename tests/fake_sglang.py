"""A stand-in for `sglang.Engine` in CPU tests (SGLang's runtime needs a GPU): the offline-engine methods the SGLang
backend calls, with SGLang's argument and answer formats, and SGLang's rules checked.

It loads the checkpoint folder it is given (as SGLang's scheduler does), accepts weights only under the names in
that checkpoint's safetensors file with their shapes (what SGLang's Qwen2.5-VL `load_weights` reads), refuses
to run on released memory, and samples each request with the native engine on its own copy of the model, keyed
on the request's `sampling_seed`, so its tokens and log-probs are a reference the backend's output mapping can
be checked against.

Its checks are SGLang 0.5.17's (python/sglang/srt/ in the wheel, file named at each): the sampling-params keys of
`sampling/sampling_params.py::SamplingParams` and its `verify`, the keyword names of
`entrypoints/engine.py::Engine.async_generate`, one processor-output dict per request whose `<|image_pad|>` run
already matches its grid (`multimodal/processors/base_processor.py`: the fast path keeps the given input_ids and
finds each image's tokens by that id), the memory-saver tags, and the finish-reason dicts of
`managers/schedule_batch.py`. It is stricter than SGLang in two places: SGLang's Qwen2.5-VL `load_weights` skips
a name it does not know without a word, the fake refuses it, so a naming defect shows up here; and it refuses a
request's `sampling_seed` unless the engine runs deterministic inference (the seed is honoured only there, and
the FlashInfer sampler of the fast configuration takes none). An unseeded request draws from the fake's own
sequence of seeds, as SGLang draws from its generator.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from safetensors import safe_open

from torchplex.data.processing import PromptInputs
from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams


# sampling/sampling_params.py: the API fields of SamplingParams (msgspec Struct, kw_only: any other key is a TypeError)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params"})
# entrypoints/engine.py: Engine.async_generate's keyword arguments (besides prompt, sampling_params, input_ids,
# image_data, return_logprob, which the fake names)
GENERATE_KEYS = frozenset({
    "audio_data", "video_data", "mm_hashes", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "lora_path", "custom_logit_processor", "require_reasoning", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "stream", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "external_trace_header", "rid", "session_params", "priority",
    "session_id"})
MEMORY_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})  # torch_memory_saver regions of the scheduler


def check_sampling_params(sp: dict) -> None:
    """SamplingParams(**sp) and its verify(): unknown keys and out-of-range values are errors in SGLang."""
    unknown = set(sp) - SAMPLING_KEYS
    if unknown:
        raise TypeError(f"fake sglang: SamplingParams has no field(s) {sorted(unknown)}")
    top_k, top_p, temperature = sp.get("top_k", -1), sp.get("top_p", 1.0), sp.get("temperature", 1.0)
    if not (top_k == -1 or top_k >= 1):
        raise ValueError(f"fake sglang: top_k must be -1 (disable) or at least 1, got {top_k}")
    if not 0.0 < top_p <= 1.0 or temperature < 0:
        raise ValueError(f"fake sglang: top_p {top_p} / temperature {temperature} out of range")
    seed = sp.get("sampling_seed", 0)
    if not isinstance(seed, int) or not -2**63 <= seed < 2**63:  # sampling_batch_info.py: an int64 tensor
        raise TypeError(f"fake sglang: sampling_seed must be an int64, got {seed!r}")


def check_image_item(item, ids: list[int], image_token_id: int, merge: int) -> None:
    """One processor-output dict per request (a list of several is refused by validate_mm_data), with
    (patches, C*T*p*p) pixel values, an (images, 3) grid, and as many image tokens in input_ids as the grid
    merges into (SGLang keeps the given input_ids and takes each image's tokens from that run)."""
    if isinstance(item, list):
        if len(item) != 1:
            raise ValueError("fake sglang: a processor_output must be the request's only image item")
        item = item[0]
    if not isinstance(item, dict) or item.get("format") != "processor_output":
        raise ValueError(f"fake sglang: only processor_output dicts are modelled, got {type(item).__name__}")
    pixels, grid = item.get("pixel_values"), item.get("image_grid_thw")
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 2:
        raise ValueError("fake sglang: pixel_values must be a 2-D (patches, C*T*p*p) tensor")
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError("fake sglang: image_grid_thw must be an (images, 3) tensor")
    if int(grid.prod(-1).sum()) != pixels.shape[0]:
        raise ValueError("fake sglang: pixel_values rows differ from the grid's patches")
    if ids.count(image_token_id) != int(grid.prod(-1).sum()) // merge ** 2:
        raise ValueError(f"fake sglang: {ids.count(image_token_id)} image tokens in input_ids for a grid of "
                         f"{int(grid.prod(-1).sum()) // merge ** 2} merged patches")


class FakeSGLangEngine:
    instances: list["FakeSGLangEngine"] = []

    def __init__(self, **settings):
        self.settings = settings
        path = Path(settings["model_path"])
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.get("dtype", "float32")]
        if settings.get("load_format") == "dummy":  # SGLang's random init from config.json: no weight files read
            self.model = build_model(ModelArgs.from_hf_dir(path), dtype=dtype, seed=123).eval()
            self.adapter = Qwen2_5_VLStateDictAdapter(self.model.args)
            self.checkpoint_shapes = {k: tuple(v.shape) for k, v in self.adapter.to_hf(self.model.state_dict()).items()}
        else:
            with safe_open(str(path / "model.safetensors"), "pt") as f:
                self.checkpoint_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            self.model = build_model(hf_dir=path, dtype=dtype).eval()
            self.adapter = Qwen2_5_VLStateDictAdapter(self.model.args)
        self.native = RolloutEngine(self.model, kv_pool_bytes=32 * 2**20, compile_decode=False)
        self.loop = asyncio.new_event_loop()
        self.released: set[str] = set()
        self.pushes: list[list[str]] = []  # names per update_weights_from_tensor call
        self.requests: list[dict] = []
        self.unseeded = 0  # requests drawn without a sampling_seed so far
        FakeSGLangEngine.instances.append(self)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if "weights" in self.released:
            raise RuntimeError("fake sglang: weights pushed into released memory (resume first)")
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if self.checkpoint_shapes.get(name) != tuple(tensor.shape):
                return False, f"unknown weight {name} {tuple(tensor.shape)}"
            with torch.no_grad():
                params[self.adapter.hf_to_native_key(name)].copy_(tensor)
        self.pushes.append([name for name, _ in named_tensors])
        return True, "Success"

    def release_memory_occupation(self, tags=None):  # SGLang answers None
        self.released |= self._tags(tags)

    def resume_memory_occupation(self, tags=None):
        self.released -= self._tags(tags)

    @staticmethod
    def _tags(tags) -> set:
        tags = set(tags or MEMORY_TAGS)
        if not tags <= MEMORY_TAGS:
            raise ValueError(f"fake sglang: unknown memory tags {sorted(tags - MEMORY_TAGS)}")
        return tags

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             return_logprob=False, **kw):
        unknown = set(kw) - GENERATE_KEYS
        if unknown:
            raise TypeError(f"fake sglang: Engine.async_generate() got unexpected keyword(s) {sorted(unknown)}")
        single = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], int)  # io_struct.py
        if single:  # one request: a flat id list, a sampling-params dict, its images (one item or a list of them)
            if not isinstance(sampling_params, dict):
                raise ValueError("fake sglang: a single request takes one sampling-params dict")
            images = None if image_data is None else image_data if isinstance(image_data, list) else [image_data]
            input_ids, sampling_params, image_data = [input_ids], [sampling_params], None if images is None else [images]
        elif prompt is not None or not (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
            raise ValueError("fake sglang: only input_ids (one list of ids, or a batch of them) are modelled")
        if not (isinstance(sampling_params, list) and len(sampling_params) == len(input_ids)):
            raise ValueError("fake sglang: one sampling-params dict per request")
        if image_data is not None and len(image_data) != len(input_ids):
            raise ValueError("The length of image_data should be equal to the batch size.")  # io_struct.py
        if self.released & {"kv_cache", "weights"}:
            raise RuntimeError(f"fake sglang: generate with {sorted(self.released)} released")
        self.requests.append(dict(input_ids=input_ids, sampling_params=sampling_params, image_data=image_data))
        answers = []
        args = self.model.args
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params)):
            check_sampling_params(sp)
            item = image_data[i] if image_data is not None else None
            if item is not None:
                check_image_item(item, ids, args.image_token_id, args.vision.spatial_merge_size)
                item = item[0] if isinstance(item, list) else item
            prompt = PromptInputs(torch.tensor(ids), item and item["pixel_values"], item and item["image_grid_thw"])
            greedy = sp["temperature"] == 0
            params = SamplingParams(n=1, greedy=greedy, temperature=1.0 if greedy else sp["temperature"],
                                    top_p=sp.get("top_p", 1.0), top_k=max(sp.get("top_k", -1), 0),
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=list(sp.get("stop_token_ids") or []))
            [[s]] = self.native.generate([prompt], params, sample_seeds=[[self._seed(sp)]])
            self.native.release()
            # schedule_batch.py: FINISH_MATCHED_TOKEN / FINISH_LENGTH .to_json(); the stop token stays in output_ids
            reason = ({"type": "stop", "matched": s.token_ids[-1]} if s.finish_reason == "stop"
                      else {"type": "length", "length": len(s.token_ids)})
            meta = {"id": f"fake-{len(self.requests)}-{i}", "finish_reason": reason, "prompt_tokens": len(ids),
                    "completion_tokens": len(s.token_ids), "cached_tokens": 0}
            if return_logprob:  # (logprob, token id, text: None unless return_text_in_logprobs)
                meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(s.logprobs, s.token_ids)]
            answers.append({"output_ids": list(s.token_ids), "meta_info": meta})
        return answers[0] if single else answers

    def _seed(self, sp: dict) -> int:
        if "sampling_seed" in sp:
            if not self.settings.get("enable_deterministic_inference"):
                raise ValueError("fake sglang: sampling_seed without enable_deterministic_inference")
            return sp["sampling_seed"]
        self.unseeded += 1
        return self.settings.get("random_seed", 0) * 1_000_003 + self.unseeded

    def shutdown(self):
        self.loop.close()


class SilentSGLangEngine(FakeSGLangEngine):
    """A scheduler that died without a word: requests are taken and never answered."""

    async def async_generate(self, *args, **kwargs):
        await asyncio.sleep(3600)


class StuckSGLangEngine(FakeSGLangEngine):
    """A scheduler that hangs on a control call: SGLang's synchronous update_weights_from_tensor waits on it."""

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        time.sleep(15)  # long past any test's timeout_s; finite, so a test without the deadline fails, not hangs
        return True, "Success"
