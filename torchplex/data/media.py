"""A record's media opened for the processor: images from paths or bytes, frame lists, video files; the chat
messages with images and videos where the prompt's `<image>` / `<video>` placeholders put them.

Placeholders follow EasyR1/verl: a prompt "Compare <image> with <image>." puts the two images in the text at
those places; a prompt without placeholders gets its images, then its videos, before the text (the previous
layout). A prompt whose placeholder count differs from its media count is a bad sample, not a guess.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from PIL import Image

from .records import BadSampleError, PromptRecord
from .video import SampledVideo, VideoBudget, VideoDecodeError, decode_video

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def open_image(record_id: str, source: str | bytes | dict) -> Image.Image:
    """An RGB image from a path, encoded bytes, an HF `datasets` Image dict {"bytes": ..., "path": ...}, or an
    image left in its Arrow table (data/sources.py's StoredImage)."""
    if hasattr(source, "load_image_bytes"):
        source = source.load_image_bytes()
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path") or ""
    where = source if isinstance(source, str) else f"<{len(source)} bytes>"
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as im:
            return im.convert("RGB")  # the full decode happens here: a truncated file fails now
    except FileNotFoundError:
        raise BadSampleError(record_id, where, "file not found") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadSampleError(record_id, where, f"{type(e).__name__}: {e}") from None


@dataclass
class RecordMedia:
    images: list[Image.Image]
    videos: list[list[Image.Image]]
    video_seconds_per_frame: list[float]  # one per video: real spacing of its sampled frames


def load_media(record: PromptRecord, budget: VideoBudget, frames_fps: float) -> RecordMedia:
    """Open every image and video of `record`; raises BadSampleError naming the first unreadable one.

    `frames_fps` is the rate at which pre-extracted frame lists (`record.video`) were taken."""
    images = [open_image(record.id, src) for src in record.images]
    videos: list[list[Image.Image]] = []
    spacing: list[float] = []
    if record.video:
        videos.append([open_image(record.id, p) for p in record.video])
        spacing.append(1.0 / frames_fps)
    for path in record.videos:
        try:
            sampled: SampledVideo = decode_video(path, budget)
        except VideoDecodeError as e:
            raise BadSampleError(record.id, path, str(e)) from None
        videos.append(sampled.frames)
        spacing.append(sampled.seconds_per_frame)
    return RecordMedia(images, videos, spacing)


def build_interleaved_messages(text: str, num_images: int, num_videos: int, system: str | None = None,
                               record_id: str = "") -> list[dict]:
    """Chat messages with media where the text's placeholders are, or media first when it has none."""
    parts = _PLACEHOLDER_RE.split(text)
    n_img, n_vid = parts.count(IMAGE_PLACEHOLDER), parts.count(VIDEO_PLACEHOLDER)
    if n_img == 0 and n_vid == 0:
        content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": text}]
    else:
        if (n_img, n_vid) != (num_images, num_videos):
            raise BadSampleError(record_id, "", f"prompt has {n_img} {IMAGE_PLACEHOLDER} and {n_vid} "
                                                f"{VIDEO_PLACEHOLDER} placeholders for {num_images} image(s) and "
                                                f"{num_videos} video(s)")
        content = []
        for part in parts:
            if part == IMAGE_PLACEHOLDER:
                content.append({"type": "image"})
            elif part == VIDEO_PLACEHOLDER:
                content.append({"type": "video"})
            elif part:
                content.append({"type": "text", "text": part})
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    return messages
