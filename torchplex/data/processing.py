"""One prompt record -> Qwen2.5-VL model inputs, through the checkpoint's own HF processor.

Resizing, normalisation, patchifying and the expansion of each `<|image_pad|>` / `<|video_pad|>`
into one token per merged patch all happen inside transformers' processor; this module only builds
the chat messages and unpacks the result into a typed `PromptInputs`.

Video without torchvision. transformers 5 implements Qwen's video processor on torchvision only,
and `AutoProcessor.from_pretrained` on a Qwen2.5-VL folder raises ImportError when torchvision is
absent (it always loads the video processor; upstream issue huggingface/transformers#48558). Then
`load_processor` builds the same `Qwen2_5_VLProcessor` by hand with `FramesVideoProcessor` in the
video slot. That adapter runs the checkpoint's (PIL) image processor on each frame -- the same
smart-resize, rescale, normalise and patch order as the video processor -- and only regroups the
time axis: the image processor fills both temporal slots of a patch with the same frame, the video
layout wants frames (2k, 2k+1) there, padding an odd-length video by repeating its last frame like
`Qwen2VLVideoProcessor` does. Pixel values can differ slightly from the torchvision processor
(PIL vs torch bicubic resize); grids, token counts and layout are identical.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, BatchFeature
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available
from transformers.video_utils import VideoMetadata

DEFAULT_VIDEO_FPS = 2.0  # frames per second of pre-sampled frame lists (qwen-vl-utils' default)


@dataclass
class PromptInputs:
    """Model inputs for one prompt; vision fields are None when the prompt has no such media."""

    input_ids: torch.LongTensor  # (L,), chat template applied, vision pads expanded
    pixel_values: torch.Tensor | None = None  # (sum of t*h*w over images, C*T*p*p)
    image_grid_thw: torch.LongTensor | None = None  # (n_images, 3) in patches
    pixel_values_videos: torch.Tensor | None = None  # (sum of t*h*w over videos, C*T*p*p)
    video_grid_thw: torch.LongTensor | None = None  # (n_videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (n_videos,) seconds spanned by one temporal grid step


class FramesVideoProcessor:
    """Qwen2-VL video processing (for pre-decoded frame lists) built on the image processor.

    Exposes what `Qwen2_5_VLProcessor` reads from its video processor: `merge_size`,
    `temporal_patch_size`, `patch_size`, `size`, and a call returning `pixel_values_videos`,
    `video_grid_thw` and `video_metadata`.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, image_processor, min_pixels: int, max_pixels: int,
                 temporal_patch_size: int | None = None) -> None:
        self.image_processor = image_processor
        self.patch_size = image_processor.patch_size
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = temporal_patch_size or image_processor.temporal_patch_size
        if self.temporal_patch_size != image_processor.temporal_patch_size:
            raise ValueError(f"video temporal_patch_size {self.temporal_patch_size} != image processor's "
                             f"{image_processor.temporal_patch_size}; the frame regrouping needs them equal")
        self.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | Path, image_processor) -> "FramesVideoProcessor":
        """Read pixel budgets from `video_preprocessor_config.json`, else reuse the image processor's
        (transformers' video processor falls back to `preprocessor_config.json` the same way)."""
        path = Path(ckpt_dir) / "video_preprocessor_config.json"
        cfg: dict = {}
        if path.is_file():
            with open(path) as f:
                cfg = json.load(f)
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge", image_processor.size.shortest_edge))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge", image_processor.size.longest_edge))
        for key in ("patch_size", "merge_size"):
            if key in cfg and cfg[key] != getattr(image_processor, key):
                raise ValueError(f"{path}: {key}={cfg[key]} differs from the image processor's "
                                 f"{getattr(image_processor, key)}")
        return cls(image_processor, min_pixels, max_pixels, cfg.get("temporal_patch_size"))

    def __call__(self, videos, video_metadata=None, return_tensors=None, **_: object) -> BatchFeature:
        videos = [list(video) for video in videos]
        metadata = list(video_metadata) if video_metadata is not None else [None] * len(videos)
        if len(metadata) != len(videos):
            raise ValueError(f"got {len(metadata)} video_metadata for {len(videos)} videos")
        pixel_chunks, grids, metas = [], [], []
        for frames, meta in zip(videos, metadata):
            patches, grid = self._video_patches(frames)
            pixel_chunks.append(patches)
            grids.append(grid)
            if meta is None:
                meta = VideoMetadata(total_num_frames=len(frames), fps=DEFAULT_VIDEO_FPS)
            elif isinstance(meta, dict):
                meta = VideoMetadata(**meta)
            metas.append(meta)
        return BatchFeature(
            data={"pixel_values_videos": torch.cat(pixel_chunks), "video_grid_thw": torch.tensor(grids),
                  "video_metadata": metas},
            tensor_type=return_tensors, skip_tensor_conversion=["video_metadata"])

    def _video_patches(self, frames: list) -> tuple[torch.Tensor, list[int]]:
        if not frames:
            raise ValueError("a video needs at least one frame")
        t = self.temporal_patch_size
        frames = frames + [frames[-1]] * (-len(frames) % t)
        out = self.image_processor(images=frames, size=self.size, return_tensors="pt")
        grid = out["image_grid_thw"]
        if not bool((grid == grid[0]).all()):
            raise ValueError(f"video frames resize to different grids {grid.tolist()}; frames must share one size")
        _, grid_h, grid_w = grid[0].tolist()
        channels = out["pixel_values"].shape[-1] // (t * self.patch_size ** 2)
        # Per frame: (h*w, C, T, p*p) with T identical copies; keep one copy per frame.
        per_frame = out["pixel_values"].view(len(frames), grid_h * grid_w, channels, t, -1)[:, :, :, 0]
        # Frames (k*T .. k*T+T-1) fill the T slots of temporal grid step k.
        grouped = per_frame.view(len(frames) // t, t, grid_h * grid_w, channels, -1).permute(0, 2, 3, 1, 4)
        return grouped.reshape(len(frames) // t * grid_h * grid_w, -1), [len(frames) // t, grid_h, grid_w]


class FramesQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` that accepts `FramesVideoProcessor`: the base class type-checks the video
    slot against `VideoProcessorMixin`, which transformers cannot resolve without torchvision."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and isinstance(argument, FramesVideoProcessor):
            return FramesVideoProcessor
        return super().check_argument_for_proper_class(argument_name, argument)


def _chat_template(ckpt_dir: Path, tokenizer) -> str | None:
    if tokenizer.chat_template:
        return tokenizer.chat_template
    legacy = ckpt_dir / "chat_template.json"  # older hub checkpoints keep the processor's template here
    if legacy.is_file():
        with open(legacy) as f:
            return json.load(f)["chat_template"]
    return None


def load_processor(ckpt_dir: str | Path) -> Qwen2_5_VLProcessor:
    """The checkpoint's Qwen2.5-VL processor: `AutoProcessor` when torchvision is installed, otherwise
    the same processor class assembled from AutoTokenizer, the PIL image processor and
    `FramesVideoProcessor`."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    missing = [name for name in ("tokenizer_config.json", "preprocessor_config.json") if not (path / name).is_file()]
    if not ((path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()):
        missing.append("tokenizer.json (or vocab.json + merges.txt)")
    if missing:
        raise FileNotFoundError(f"checkpoint folder {path} lacks processor files: {', '.join(missing)}")
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # the PIL class by name: transformers 5.12 (what SGLang 0.5.17 needs) makes AutoImageProcessor itself
    # require torchvision, later releases fall back to this class
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    video_processor = FramesVideoProcessor.from_pretrained(path, image_processor)
    return FramesQwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=video_processor,
                                     chat_template=_chat_template(path, tokenizer))


def build_messages(text: str, num_images: int = 0, num_videos: int = 0, system: str | None = None) -> list[dict]:
    """Chat messages for one prompt: optional system turn, then a user turn of images, videos, text."""
    content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    return messages


def encode_prompt(
    processor,
    text: str,
    images: list[Image.Image] | None = None,
    videos: list[list[Image.Image]] | None = None,
    system: str | None = None,
    video_fps: float | list[float] = DEFAULT_VIDEO_FPS,
    messages: list[dict] | None = None,
) -> PromptInputs:
    """Render the chat template (generation prompt open) and run the processor on one prompt.

    `videos` are already-sampled frame lists taken at `video_fps` frames per second, which sets
    `second_per_grid_ts` = temporal_patch_size / video_fps. With `system=None` the template's own
    default system turn is used (Qwen's is "You are a helpful assistant.").
    `video_fps` may also give one rate per video (decoded files: their sampled frames' real rate), and
    `messages` an already-built conversation (media interleaved with text, data/media.py) in place of `text`.
    """
    images = list(images or [])
    videos = [list(v) for v in videos or []]
    if messages is None:
        messages = build_messages(text, len(images), len(videos), system)
    rates = video_fps if isinstance(video_fps, list) else [video_fps] * len(videos)
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs: dict = {}
    if videos:
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v), fps=fps) for v, fps in zip(videos, rates)]
    out = processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt", **kwargs)

    def optional(key: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if key not in out:
            return None
        value = out[key] if isinstance(out[key], torch.Tensor) else torch.tensor(out[key])
        return value.to(dtype) if dtype is not None else value

    return PromptInputs(
        input_ids=out["input_ids"][0].long(),
        pixel_values=optional("pixel_values"),
        image_grid_thw=optional("image_grid_thw", torch.long),
        pixel_values_videos=optional("pixel_values_videos"),
        video_grid_thw=optional("video_grid_thw", torch.long),
        second_per_grid_ts=optional("second_per_grid_ts", torch.float32),
    )
