"""Video files -> sampled RGB frames with their real timestamps, under Qwen's frame and pixel budgets.

Decoding is PyAV's (`av` on PyPI). Why PyAV: its wheels bundle FFmpeg, so it works on a bare machine and in CI
without system libraries; it does not depend on the torch version (torchcodec wheels are built against one torch
release and need a system FFmpeg; transformers' `load_video` defaults to PyAV itself, and its torchvision backend
is deprecated); and it exposes every frame's presentation time, which `second_per_grid_ts` is computed from.
Measured here on CPU, decoding is not the bottleneck of a rollout step (the vision tower is).

The budgets follow qwen-vl-utils' published rules (QwenLM/Qwen2.5-VL, qwen-vl-utils/src/qwen_vl_utils/
vision_process.py): `smart_nframes` picks the number of frames from fps, min/max frames and the frame factor 2;
frames are taken at `linspace(0, total - 1, n).round()`; the per-frame pixel cap is
`max(min(VIDEO_MAX_PIXELS, total_pixels / n * 2), min_pixels * 1.05)` and `smart_resize` rounds the frame to
multiples of patch x merge (28) within [min_pixels, max_pixels].

One deliberate difference: qwen-vl-utils derives the sampled fps as `n / total * video_fps` (container metadata);
here the seconds between sampled frames come from the frames' own timestamps, `(t_last - t_first) / (n - 1)`, so
variable-frame-rate files and wrong container rates get the true spacing. For a constant-rate file the two differ
by the factor `(total - 1) / total * n / (n - 1)` (sampling from the first to the last frame spans total-1 frame
intervals, not total).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

# qwen-vl-utils' defaults (vision_process.py)
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
IMAGE_FACTOR = 28
MAX_RATIO = 200


class VideoDecodeError(Exception):
    """A video file is missing, unreadable, or has too few frames; the caller skips the sample."""


@dataclass(frozen=True)
class VideoBudget:
    """How many frames and how many pixels per frame one video may use (qwen-vl-utils' knobs)."""

    fps: float = FPS
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS  # summed over the sampled frames: the video-token budget x 28^2 x 2
    factor: int = IMAGE_FACTOR  # patch_size x merge_size of the vision tower


@dataclass
class SampledVideo:
    frames: list[Image.Image]  # RGB, resized to (height, width)
    timestamps: list[float]  # seconds, of each sampled frame
    total_frames: int
    video_fps: float  # the container's average rate
    height: int
    width: int

    @property
    def seconds_per_frame(self) -> float:
        """Mean spacing of the sampled frames from their timestamps (1 / video_fps for a single frame)."""
        if len(self.timestamps) < 2:
            return 1.0 / self.video_fps
        return (self.timestamps[-1] - self.timestamps[0]) / (len(self.timestamps) - 1)

    @property
    def sampled_fps(self) -> float:
        return 1.0 / self.seconds_per_frame if self.seconds_per_frame > 0 else self.video_fps


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_nframes(total_frames: int, video_fps: float, budget: VideoBudget) -> int:
    """Number of frames to sample: `total / video_fps * fps` clamped to [min_frames, max_frames] and the video's
    length, floored to a multiple of FRAME_FACTOR (qwen-vl-utils' rule)."""
    min_frames = ceil_by_factor(budget.min_frames, FRAME_FACTOR)
    max_frames = floor_by_factor(min(budget.max_frames, total_frames), FRAME_FACTOR)
    nframes = total_frames / video_fps * budget.fps
    nframes = floor_by_factor(min(min(max(nframes, min_frames), max_frames), total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise VideoDecodeError(f"{total_frames} frame(s) cannot give the {FRAME_FACTOR} frames a video needs")
    return nframes


def frame_indices(total_frames: int, nframes: int) -> list[int]:
    """`torch.linspace(0, total - 1, n).round()` without torch: evenly spaced, first and last frame included.
    Python's round() is round-half-even like torch.round."""
    if nframes == 1:
        return [0]
    step = (total_frames - 1) / (nframes - 1)
    return [int(round(i * step)) for i in range(nframes)]


def frame_max_pixels(nframes: int, budget: VideoBudget) -> int:
    """Per-frame pixel cap: the total budget shared by the frames (two frames make one temporal patch)."""
    cap = max(min(VIDEO_MAX_PIXELS, budget.total_pixels / nframes * FRAME_FACTOR), int(budget.min_pixels * 1.05))
    return int(min(budget.max_pixels, cap))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the area in [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise VideoDecodeError(f"aspect ratio of {height}x{width} is over {MAX_RATIO}")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, floor_by_factor(height / beta, factor))
        w_bar = max(factor, floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def _count_frames(path: str) -> tuple[int, float]:
    """Frame count by demuxing (cheap: no decoding); container metadata is often missing or wrong."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0) or FPS
        count = sum(1 for packet in container.demux(stream) if packet.size > 0)
    return count, rate


def decode_video(path: str, budget: VideoBudget = VideoBudget()) -> SampledVideo:
    """Sample and resize the frames of a video file; raises VideoDecodeError for anything unreadable."""
    try:
        import av
    except ImportError as e:  # declared in pyproject; a clear message if someone removed it
        raise VideoDecodeError("video files need PyAV: pip install av") from e
    try:
        total, video_fps = _count_frames(path)
        nframes = smart_nframes(total, video_fps, budget)
        wanted = frame_indices(total, nframes)
        picked: dict[int, tuple[Image.Image, float]] = {}
        targets = set(wanted)
        with av.open(path) as container:
            stream = container.streams.video[0]
            for index, frame in enumerate(container.decode(stream)):
                if index in targets:
                    time = frame.time if frame.time is not None else index / video_fps
                    picked[index] = (frame.to_image().convert("RGB"), float(time))
                if index >= wanted[-1]:
                    break
    except VideoDecodeError:
        raise
    except FileNotFoundError:
        raise VideoDecodeError(f"{path}: file not found") from None
    except (OSError, ValueError, IndexError, av.FFmpegError) as e:  # IndexError: no video stream
        raise VideoDecodeError(f"{path}: {type(e).__name__}: {e}") from None
    if len(picked) != len(wanted):
        raise VideoDecodeError(f"{path}: decoded {len(picked)} of the {len(wanted)} sampled frames (truncated file?)")
    width, height = picked[wanted[0]][0].size
    h, w = smart_resize(height, width, budget.factor, budget.min_pixels, frame_max_pixels(nframes, budget))
    frames = [picked[i][0].resize((w, h), Image.Resampling.BICUBIC) for i in wanted]
    return SampledVideo(frames=frames, timestamps=[picked[i][1] for i in wanted], total_frames=total,
                        video_fps=video_fps, height=h, width=w)


def write_video(path: str, frames: list[Image.Image], fps: int, codec: str = "mpeg4") -> None:
    """Encode RGB frames into a video file (synthetic tasks and tests). mpeg4 ships with every PyAV wheel."""
    import av

    with av.open(path, mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_image(image.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
