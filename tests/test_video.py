"""Specification of torchplex.data.video and the synthetic video task: qwen-vl-utils' frame and pixel budgets
against hand-computed counts, transformers' smart_resize and processor output, real timestamps, bad videos."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from torchplex.data.processing import encode_prompt, load_processor
from torchplex.data.prompts import PromptEncoder
from torchplex.data.records import PromptRecord
from torchplex.data.sources import load_records
from torchplex.data.synthetic_video import generate_video_task
from torchplex.data.video import (VideoBudget, VideoDecodeError, decode_video, frame_indices, frame_max_pixels,
                                  smart_nframes, smart_resize, write_video)

TINY = VideoBudget(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)  # the tiny checkpoint's video bounds


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    return load_processor(tiny_ckpt)


def indexed_video(path, num_frames: int, fps: int, size=(64, 48)) -> None:
    """Frame i is a flat grey of level 8*i, so a decoded frame tells which source frame it was."""
    write_video(str(path), [Image.new("RGB", size, (8 * i,) * 3) for i in range(num_frames)], fps=fps)


@pytest.mark.parametrize("total, video_fps, budget, expected", [
    (30, 10.0, VideoBudget(), 6),  # 3 s at 2 fps
    (100, 25.0, VideoBudget(), 8),  # 4 s at 2 fps
    (5, 30.0, VideoBudget(), 4),  # 0.17 s: raised to min_frames 4
    (7, 30.0, VideoBudget(min_frames=6), 6),  # min 6 frames, 7 available
    (1000, 10.0, VideoBudget(max_frames=16), 16),  # 200 wanted, capped at 16
    (45, 10.0, VideoBudget(fps=1.0), 4),  # 4.5 -> floored to the frame factor 2
    (9, 1.0, VideoBudget(fps=3.0), 8),  # 27 wanted, 9 frames, floored to even
])
def test_smart_nframes_against_hand_counts(total, video_fps, budget, expected):
    assert smart_nframes(total, video_fps, budget) == expected


def test_too_short_video_is_refused():
    with pytest.raises(VideoDecodeError):
        smart_nframes(1, 30.0, VideoBudget())


def test_frame_indices_are_linspace_rounded():
    assert frame_indices(30, 6) == [0, 6, 12, 17, 23, 29]  # linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29
    assert frame_indices(8, 4) == [0, 2, 5, 7]
    assert frame_indices(10, 10) == list(range(10))
    assert frame_indices(31, 6) == torch.linspace(0, 30, 6).round().long().tolist()


def test_frame_pixel_cap_shares_the_total_budget():
    # default: min(768*784, 90316800 / 6 * 2) = 602112
    assert frame_max_pixels(6, VideoBudget()) == 768 * 28 * 28
    # total 64 merged-token units of 784 px over 8 frames: 50176 / 8 * 2 = 12544 px = 16 x 784
    assert frame_max_pixels(8, VideoBudget(total_pixels=784 * 64, min_pixels=784 * 4)) == 784 * 16
    # never below min_pixels * 1.05
    assert frame_max_pixels(512, VideoBudget(total_pixels=784 * 64, min_pixels=784 * 4)) == int(784 * 4 * 1.05)


@pytest.mark.parametrize("h, w, lo, hi", [(48, 64, 3136, 12544), (480, 640, 100352, 602112), (20, 300, 3136, 12544),
                                          (1080, 1920, 3136, 50000), (30, 30, 12544, 50176)])
def test_smart_resize_matches_transformers(h, w, lo, hi):
    assert smart_resize(h, w, 28, lo, hi) == tuple(hf_smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi))


def test_decoded_frames_are_the_sampled_ones_with_real_timestamps(tmp_path):
    indexed_video(tmp_path / "v.mp4", num_frames=30, fps=10)
    video = decode_video(str(tmp_path / "v.mp4"), TINY)
    assert (video.total_frames, video.video_fps, len(video.frames)) == (30, 10.0, 6)
    levels = [video.frames[i].resize((1, 1)).getpixel((0, 0))[0] for i in range(6)]
    assert [round(v / 8) for v in levels] == [0, 6, 12, 17, 23, 29]  # lossy codec: within a few grey levels
    assert video.timestamps == pytest.approx([0.0, 0.6, 1.2, 1.7, 2.3, 2.9])
    assert video.seconds_per_frame == pytest.approx(2.9 / 5)
    # 64x48 -> 56x56 (round to 28) is inside [4, 16] x 784 px
    assert (video.height, video.width) == (56, 56) and video.frames[0].size == (56, 56)


def test_video_file_record_matches_the_processor_on_the_same_frames(tmp_path, processor):
    """Grid, token count and second_per_grid_ts of a video record equal the processor's output for the same
    decoded frames at their real rate, and the hand-computed values."""
    indexed_video(tmp_path / "v.mp4", num_frames=30, fps=10)
    encoder = PromptEncoder(processor, max_prompt_tokens=4096, video_budget=TINY)
    record = PromptRecord(id="v", prompt="What changes? <video>", answer="x", videos=[str(tmp_path / "v.mp4")])
    got = encoder.encode(record)
    frames = decode_video(str(tmp_path / "v.mp4"), TINY).frames
    ref = encode_prompt(processor, "What changes?", videos=[frames], video_fps=1 / (2.9 / 5))
    # 6 frames -> 3 temporal steps; 56x56 px -> 4x4 patches of 14 px; 3*4*4 / merge 2^2 = 12 video tokens
    assert got.video_grid_thw.tolist() == ref.video_grid_thw.tolist() == [[3, 4, 4]]
    assert int((got.input_ids == processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum()) == 12
    torch.testing.assert_close(got.pixel_values_videos, ref.pixel_values_videos, rtol=0, atol=0)
    # two frames per temporal step, 0.58 s apart (real timestamps; qwen-vl-utils' metadata rule would say 1.0 s)
    assert got.second_per_grid_ts.tolist() == pytest.approx([2 * 0.58])


def test_bad_videos_are_skipped_and_counted(tmp_path, processor):
    indexed_video(tmp_path / "ok.mp4", num_frames=8, fps=4)
    (tmp_path / "garbage.mp4").write_bytes(b"\x00not a video" * 64)
    good_bytes = (tmp_path / "ok.mp4").read_bytes()
    (tmp_path / "truncated.mp4").write_bytes(good_bytes[: len(good_bytes) // 3])
    lines = [{"id": name, "prompt": "p", "answer": "1", "videos": [f"{name}.mp4"]}
             for name in ("ok", "garbage", "missing", "truncated")]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = load_records([str(tmp_path / "v.jsonl")])
    encoder = PromptEncoder(processor, max_prompt_tokens=4096, video_budget=TINY)
    batch = encoder.encode_batch(records)
    assert [r.id for r in batch.records] == ["ok"]
    assert sorted(e.record_id for e in batch.skipped) == ["garbage", "missing", "truncated"]
    assert encoder.skipped_total == 3


def test_synthetic_video_task_writes_decodable_videos(tmp_path):
    train, evals = generate_video_task(tmp_path, num_train=3, num_eval=2, seed=1, size=(56, 56), num_frames=8, fps=4)
    records = load_records([str(train)])
    assert len(records) == 3 and len(load_records([str(evals)])) == 2
    assert all(r.answer in {"1", "2", "3", "4"} and len(r.videos) == 1 for r in records)
    video = decode_video(records[0].videos[0], TINY)
    assert len(video.frames) == 4 and video.timestamps == pytest.approx([0.0, 0.5, 1.25, 1.75])
    stamp = (tmp_path / "manifest.json").stat().st_mtime_ns
    generate_video_task(tmp_path, num_train=3, num_eval=2, seed=1, size=(56, 56), num_frames=8, fps=4)
    assert (tmp_path / "manifest.json").stat().st_mtime_ns == stamp  # same parameters: not rewritten
