"""A stand-in for `sglang.Engine` in CPU tests (SGLang's runtime needs a GPU): the offline-engine methods the SGLang
backend calls, with SGLang's argument and answer formats, and SGLang's rules checked.

It loads the checkpoint folder it is given (as SGLang's scheduler does), accepts weights only under the names in
that checkpoint's safetensors file with their shapes (what SGLang's Qwen2.5-VL `load_weights` reads), refuses
to run on released memory, and samples each request with the native engine on its own copy of the model, keyed
on the request's `sampling_seed`, so its tokens and log-probs are a reference the backend's output mapping can
be checked against.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from safetensors import safe_open

from torchplex.data.processing import PromptInputs
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams


class FakeSGLangEngine:
    instances: list["FakeSGLangEngine"] = []

    def __init__(self, **settings):
        self.settings = settings
        path = Path(settings["model_path"])
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            self.checkpoint_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.get("dtype", "float32")]
        self.model = build_model(hf_dir=path, dtype=dtype).eval()
        self.adapter = Qwen2_5_VLStateDictAdapter(self.model.args)
        self.native = RolloutEngine(self.model, kv_pool_bytes=32 * 2**20, compile_decode=False)
        self.loop = asyncio.new_event_loop()
        self.released: set[str] = set()
        self.pushes: list[list[str]] = []  # names per update_weights_from_tensor call
        self.requests: list[dict] = []
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

    def release_memory_occupation(self, tags=None):
        self.released |= set(tags or ["kv_cache", "weights"])

    def resume_memory_occupation(self, tags=None):
        self.released -= set(tags or ["kv_cache", "weights"])

    async def async_generate(self, input_ids, sampling_params, image_data=None, return_logprob=False, **kw):
        if self.released:
            raise RuntimeError(f"fake sglang: generate with {sorted(self.released)} released")
        self.requests.append(dict(input_ids=input_ids, sampling_params=sampling_params, image_data=image_data))
        answers = []
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params)):
            item = image_data[i] if image_data is not None else None
            if item is not None and item.get("format") != "processor_output":
                raise ValueError("fake sglang: only processor_output items are modelled")
            prompt = PromptInputs(torch.tensor(ids), item and item["pixel_values"], item and item["image_grid_thw"])
            greedy = sp["temperature"] == 0
            params = SamplingParams(n=1, greedy=greedy, temperature=1.0 if greedy else sp["temperature"],
                                    top_p=sp.get("top_p", 1.0), top_k=max(sp.get("top_k", -1), 0),
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=sp["stop_token_ids"])
            [[s]] = self.native.generate([prompt], params, sample_seeds=[[sp["sampling_seed"]]])
            self.native.release()
            meta = {"output_token_logprobs": [(lp, t, None) for lp, t in zip(s.logprobs, s.token_ids)],
                    "finish_reason": {"type": s.finish_reason}}
            answers.append({"output_ids": list(s.token_ids), "meta_info": meta})
        return answers

    def shutdown(self):
        self.loop.close()


class SilentSGLangEngine(FakeSGLangEngine):
    """A scheduler that died without a word: requests are taken and never answered."""

    async def async_generate(self, *args, **kwargs):
        await asyncio.sleep(3600)
