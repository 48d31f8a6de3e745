"""Write a random-weight Qwen2.5-VL checkpoint in Hugging Face format, offline: tiny for tests and debug runs, or of
a published geometry (3B, 7B, ...) with Qwen2.5's real vocabulary for GPU runs of the shipped recipes.

The command line is tools/make_tiny_checkpoint.py; the trainer calls `make_tiny_checkpoint` for debug runs.

The folder loads with `AutoTokenizer`, `AutoProcessor` and `Qwen2_5_VLForConditionalGeneration`, so
tests and debug runs exercise the same loading paths as a real Qwen/Qwen2.5-VL-*-Instruct download:

- tokenizer: byte-level BPE trained here on a synthetic English corpus (counting / colour / shape /
  position questions, `<think>`/`<answer>` text, digits, punctuation), with Qwen2.5's added tokens
  appended after the BPE vocabulary exactly as in the real tokenizer (`<|endoftext|>` first, ...).
  The corpus does not depend on `--seed`, so every tiny checkpoint shares one tokenizer. `full_vocab`
  pads the BPE vocabulary with filler entries to Qwen2.5's 151,643, so the added tokens get the real ids
  (`<|im_end|>` 151645, `<|image_pad|>` 151655, ...) and the model keeps its flavor's published vocabulary.
- config: `ModelArgs.to_hf_config()` of `get_flavor(size)`, with the token ids read off the tokenizer.
- weights: transformers' own initialisation (normal std 0.02, norms one) under a fixed seed, plus
  random (not zero) biases; with `device` / `dtype` (a large geometry), the native model's initialisation
  (the same distribution) made on that device in that dtype and written by `weights.save_hf_weights`:
  seconds on a GPU where the CPU path would take minutes.
- generation_config.json: Qwen's stop tokens (`<|im_end|>`, `<|endoftext|>`). `mean_response` adds the last
  vocabulary_size / mean_response ids of the vocabulary: a random model then ends a response after a
  roughly geometric number of tokens of that mean (most short, a tail to the cap), like RL rollouts.
- processor: the PIL Qwen2-VL image processor with small pixel budgets (few vision tokens per image),
  plus a `video_preprocessor_config.json` for environments that have torchvision. Without torchvision
  transformers cannot build a video processor at all; `torchplex.data.processing.load_processor`
  then fills in a frame-based adapter (see its docstring).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .args import ModelArgs, get_flavor

# Qwen2.5's added tokens in their published order; ids are len(bpe_vocab) + position.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Added (so never split) but not "special": decoding with skip_special_tokens keeps them, as in Qwen.
NON_SPECIAL_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
INIT_STD = 0.02  # transformers' default initializer_range, also used for the biases
TARGET_VOCAB_SIZE = 2048  # BPE merges + added tokens; the model's vocab is this rounded up to 64
QWEN_BPE_SIZE = 151643  # Qwen2.5's BPE vocabulary: its added tokens start here (<|endoftext|> = 151643)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
PROCESSOR_CLASS = "Qwen2_5_VLProcessor"

# Pixel budgets: 28 = patch 14 x merge 2, so min 4 / max 64 merged vision tokens per image.
DEFAULT_MIN_PIXELS = 28 * 28 * 4
DEFAULT_MAX_PIXELS = 28 * 28 * 64
DEFAULT_VIDEO_MIN_PIXELS = 28 * 28 * 4
DEFAULT_VIDEO_MAX_PIXELS = 28 * 28 * 16
# Qwen2.5-VL's published processor budgets (preprocessor_config.json, qwen-vl-utils' video defaults)
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 16384
QWEN_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VIDEO_MAX_PIXELS = 768 * 28 * 28

# Same split rule as Qwen2's tokenizer (contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, whitespace); transformers' Qwen2Tokenizer rebuilds
# this pre-tokenizer itself on load, so training must use the identical rule.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen2.5-VL renders it: a default system turn when none is given, each image as
# <|vision_start|><|image_pad|><|vision_end|> (the processor later repeats <|image_pad|> once per
# merged patch), videos likewise with <|video_pad|>, and an open assistant turn on request.
CHAT_TEMPLATE = r"""
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\n' + default_system_prompt + '<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip().replace("default_system_prompt", repr(DEFAULT_SYSTEM_PROMPT))

_WORDS = """
red green blue yellow orange purple pink brown black white gray grey cyan magenta violet gold silver
circle circles square squares triangle triangles star stars rectangle rectangles hexagon pentagon oval
diamond cube cubes sphere spheres cylinder cone shape shapes object objects colour colours color colors
left right top bottom middle center centre above below between behind front next near far corner
corners edge side upper lower inside outside position positions row rows column columns grid cell cells
zero one two three four five six seven eight nine ten eleven twelve twenty hundred thousand first second
third last how many what which where when who why is are was were there here this that these those the
a an of in on at to from by with and or not no yes count counting counted total number numbers sum add
plus minus times divided equals equal greater less more fewer most least larger smaller biggest smallest
image images picture photo video videos frame frames scene view look looking see shown shows visible
appear appears answer answers question questions reason reasoning think thinking step steps therefore so
because since then finally let us we need find final small large big tiny huge tall short wide narrow
long round flat bright dark light heavy empty full apple apples banana bananas car cars dog dogs cat cats
bird birds tree trees house houses ball balls box boxes cup cups book books chair chairs table tables
person people man woman child children hand hands eye eyes water sky sun moon cloud clouds road street
sign signs solve compute calculate check verify correct wrong true false maybe likely probably each
every all some any problem solution equation value values point points line lines angle angles area
length width height please user assistant system helpful you are I am it its they them their has have
had do does did can could will would should move moving turn rotate rotated shift placed located
multiply multiplied subtract subtracted percent fraction half quarter double triple average difference
product quotient remainder even odd prime digit digits
""".split()

_QUESTION_TEMPLATES = (
    "How many {c} {s} are there in the image?",
    "What colour is the {s} in the {p} {p2}?",
    "Is the {c} {s} to the {p} of the {c2} {s2}?",
    "Count the {s} and give the total.",
)


def _synthetic_corpus() -> list[str]:
    """English-like text with the vocabulary RL prompts use; fixed RNG so the tokenizer never varies."""
    rng = random.Random(1234)
    colours = _WORDS[:17]
    shapes = ["circles", "squares", "triangles", "stars", "cubes", "spheres"]
    places = ["top", "bottom", "left", "right", "middle", "center"]
    lines: list[str] = []
    for _ in range(600):
        question = rng.choice(_QUESTION_TEMPLATES).format(
            c=rng.choice(colours), c2=rng.choice(colours), s=rng.choice(shapes), s2=rng.choice(shapes),
            p=rng.choice(places), p2=rng.choice(places))
        n = rng.randint(0, 20)
        lines.append(f"{question}\n<think>\nI see {n} of them, so the answer is {n}.\n</think>\n"
                     f"<answer>{n}</answer>")
    vocab = [w for word in _WORDS for w in (word, word.capitalize())]
    for _ in range(3000):
        sentence = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 16)))
        lines.append(f"{sentence}{rng.choice('.?!,:;')} {rng.randint(0, 10 ** rng.randint(1, 6))}")
    return lines


def train_tokenizer(target_vocab_size: int = TARGET_VOCAB_SIZE, full_vocab: bool = False):
    """Byte-level BPE on the synthetic corpus, wrapped as transformers' `Qwen2Tokenizer`. `full_vocab`: filler
    entries (byte-level strings no merge produces, decoding to " ~<n>") up to QWEN_BPE_SIZE, so the added tokens
    take Qwen2.5's ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    n_added = len(SPECIAL_TOKENS) + len(NON_SPECIAL_ADDED_TOKENS)
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target_vocab_size - n_added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_synthetic_corpus(), trainer)

    model_json = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model_json["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    if full_vocab:
        for filler in range(QWEN_BPE_SIZE - len(vocab)):
            vocab[f"\u0120~{filler}"] = len(vocab)  # "Ġ" is byte-level BPE's space
    for token in SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", errors="replace", model_max_length=32768)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                         special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED_TOKENS])
    # Qwen lists every special except <|endoftext|> (already eos/pad there) as "additional" specials.
    tokenizer.add_special_tokens({"extra_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_args_for(tokenizer, size: str = "debug", tie_word_embeddings: bool | None = None,
                   window_size: int | None = None, full_vocab: bool = False,
                   num_kv_heads: int | None = None) -> ModelArgs:
    """`get_flavor(size)` with token ids taken from the tokenizer and the vocab sized to it (rounded up to 64), or,
    `full_vocab`, the flavor's published vocabulary. `num_kv_heads` overrides the decoder's K/V head count (a
    divisor of its query heads): another GQA ratio at the same size, e.g. 2 K/V heads per rank under TP 2."""
    args = get_flavor(size)
    if num_kv_heads is not None:
        if num_kv_heads < 1 or args.text.num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads {num_kv_heads} must divide the {size!r} flavor's "
                             f"{args.text.num_heads} query heads")
        args.text.num_kv_heads = num_kv_heads
    if not full_vocab:
        args.text.vocab_size = -(-len(tokenizer) // 64) * 64
    elif args.text.vocab_size < len(tokenizer):
        raise ValueError(f"flavor {size!r} has a vocabulary of {args.text.vocab_size}, fewer than Qwen2.5's "
                         f"{len(tokenizer)} tokens: full_vocab is for the published geometries")
    if tie_word_embeddings is not None:
        args.text.tie_word_embeddings = tie_word_embeddings
    if window_size is not None:
        unit = args.vision.patch_size * args.vision.spatial_merge_size
        if window_size <= 0 or window_size % unit:
            raise ValueError(f"window_size {window_size} must be a positive multiple of patch*merge = {unit}")
        args.vision.window_size = window_size
    ids = tokenizer.convert_tokens_to_ids
    return args.with_token_ids(
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))


def _video_processor_config(args: ModelArgs, min_pixels: int, max_pixels: int) -> dict:
    """What `Qwen2VLVideoProcessor.save_pretrained` would write; it needs torchvision, so write it by hand."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    v = args.vision
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": PROCESSOR_CLASS,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3,  # PIL bicubic
        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
        "merge_size": v.spatial_merge_size, "do_sample_frames": False, "cap_pixels_per_frame": False,
    }


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


@dataclass
class TinyCheckpoint:
    path: Path
    num_params: int
    vocab_size: int  # model embedding rows (tokenizer size rounded up to 64, or the flavor's published vocabulary)
    tokenizer_size: int
    sharded: bool

    def summary(self) -> str:
        return (f"random Qwen2.5-VL checkpoint: {self.path} params={self.num_params:,} "
                f"vocab={self.vocab_size} (tokenizer {self.tokenizer_size}) "
                f"{'sharded' if self.sharded else 'single-file'}")


def long_tail_stops(vocab_size: int, mean_response: int) -> list[int]:
    """The last vocab_size / mean_response ids of the vocabulary: stop tokens that end a random model's response
    after a roughly geometric number of tokens of that mean (0: none)."""
    if mean_response <= 0:
        return []
    count = max(1, round(vocab_size / mean_response))
    return list(range(vocab_size - count, vocab_size))


def _write_native_weights(output: Path, args: ModelArgs, seed: int, device: str, dtype: str,
                          max_shard_size: str | int | None) -> int:
    """The native model's seeded random init (random biases too) made on `device` in `dtype`, written as HF
    safetensors; returns the parameter count."""
    import torch

    from .model import Qwen2_5_VLModel
    from .weights import save_hf_weights

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with torch.device("meta"):  # storage made once, in its dtype, on its device
        model = Qwen2_5_VLModel(args).to(torch_dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(std=INIT_STD, generator=generator)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_STD, generator=generator)
    if isinstance(max_shard_size, str):
        from transformers.utils import convert_file_size_to_int
        max_shard_size = convert_file_size_to_int(max_shard_size)
    save_hf_weights(model, output, max_shard_bytes=max_shard_size)
    return sum(p.numel() for p in model.parameters())


def _hf_configs(args: ModelArgs, dtype: str):
    """The HF `config.json` contents as a dict (kept for the top-level token ids) and as a `Qwen2_5_VLConfig`."""
    from transformers import Qwen2_5_VLConfig

    hf_config = args.to_hf_config()
    hf_config["dtype"] = dtype
    # transformers 5 validates `tokens_per_second` as int (Qwen's own configs write 2, not 2.0).
    tps = hf_config["vision_config"]["tokens_per_second"]
    if float(tps).is_integer():
        hf_config["vision_config"]["tokens_per_second"] = int(tps)
    return hf_config, Qwen2_5_VLConfig(**hf_config)


def _generation_config(args: ModelArgs, mean_response: int):
    """Qwen's stop tokens (<|im_end|>, <|endoftext|>), plus the long-tail stops of `mean_response`."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=args.bos_token_id, pad_token_id=args.pad_token_id,
        eos_token_id=[args.eos_token_id, args.bos_token_id] + long_tail_stops(args.text.vocab_size, mean_response))


def _write_transformers_weights(output: Path, config, generation, seed: int,
                                max_shard_size: str | int | None) -> int:
    """transformers' own seeded CPU float32 init plus random biases, saved with config and generation config;
    returns the parameter count. The caller's CPU RNG stream is left as it was."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
        # transformers zeroes biases; random ones make a loader that drops a bias fail its tests.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, INIT_STD)
    model.generation_config = generation
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(output, safe_serialization=True, **save_kwargs)
    return sum(p.numel() for p in model.parameters())


def _count_params(config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2_5_VLForConditionalGeneration(config).parameters())


def _add_top_level_token_ids(output: Path, hf_config: dict) -> None:
    """Copy the bos/eos/pad ids to the top level of `config.json`: transformers 5.12 (what SGLang 0.5.17 needs)
    saves them only in text_config, while Hub Qwen2.5-VL configs and later transformers releases carry them at the
    top level too."""
    saved = json.loads((output / "config.json").read_text())
    missing = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k not in saved}
    if missing:
        _write_json(output / "config.json", {**saved, **missing})


def _write_tokenizer_and_processors(output: Path, tokenizer, args: ModelArgs, min_pixels: int, max_pixels: int,
                                    video_min_pixels: int, video_max_pixels: int) -> None:
    """Tokenizer, image and video processor configs, written piecewise as a hub checkpoint ships them.

    transformers 5 cannot even construct a Qwen2_5_VLProcessor without torchvision (it type-checks the video
    slot), so there is no processor object to `save_pretrained` here."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(output)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=args.vision.patch_size,
        temporal_patch_size=args.vision.temporal_patch_size, merge_size=args.vision.spatial_merge_size)
    image_processor.save_pretrained(output)  # preprocessor_config.json
    with open(output / "preprocessor_config.json") as f:
        image_config = json.load(f)
    image_config["processor_class"] = PROCESSOR_CLASS  # lets AutoProcessor resolve the class, as on the hub
    _write_json(output / "preprocessor_config.json", image_config)
    _write_json(output / "video_preprocessor_config.json",
                _video_processor_config(args, video_min_pixels, video_max_pixels))


def make_tiny_checkpoint(
    output: str | Path,
    size: str = "debug",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    window_size: int | None = None,
    max_shard_size: str | int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
    weights: bool = True,
    full_vocab: bool = False,
    device: str | None = None,
    dtype: str = "float32",
    mean_response: int = 0,
    num_kv_heads: int | None = None,
) -> TinyCheckpoint:
    """Write tokenizer, processor, config and seeded random weights to `output`; returns a summary.

    `weights=False` writes everything but the weights: a folder for SGLang's `load_format="dummy"`.
    `full_vocab`: Qwen2.5's real vocabulary and token ids, the flavor's published vocab size, and the processors'
    published pixel budgets (unless given); for a published geometry (`size="7B"`). `device` / `dtype`
    ("float32" or "bfloat16"): the weights made there in that dtype by the native model (a 7B checkpoint in bf16
    on a GPU: seconds); without them transformers makes them on the CPU in float32. `mean_response`: stop
    tokens for long-tailed random responses (`long_tail_stops`).

    `max_shard_size` (e.g. "200KB"; bytes with `device`) writes `model.safetensors.index.json` plus shards; None
    writes a single `model.safetensors`. `tie_word_embeddings`/`window_size`/`num_kv_heads` override the flavor's
    values.
    """
    published = full_vocab  # the processors' pixel budgets: Qwen's own, or the tiny ones
    min_pixels = min_pixels or (QWEN_MIN_PIXELS if published else DEFAULT_MIN_PIXELS)
    max_pixels = max_pixels or (QWEN_MAX_PIXELS if published else DEFAULT_MAX_PIXELS)
    video_min_pixels = video_min_pixels or (QWEN_VIDEO_MIN_PIXELS if published else DEFAULT_VIDEO_MIN_PIXELS)
    video_max_pixels = video_max_pixels or (QWEN_VIDEO_MAX_PIXELS if published else DEFAULT_VIDEO_MAX_PIXELS)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(full_vocab=full_vocab)
    args = model_args_for(tokenizer, size, tie_word_embeddings, window_size, full_vocab=full_vocab,
                          num_kv_heads=num_kv_heads)
    hf_config, config = _hf_configs(args, dtype)
    generation = _generation_config(args, mean_response)

    if weights and device is None and dtype == "float32":  # transformers' CPU init, saved with both configs
        num_params = _write_transformers_weights(output, config, generation, seed, max_shard_size)
    else:
        num_params = (_write_native_weights(output, args, seed, device or "cpu", dtype, max_shard_size) if weights
                      else _count_params(config))
        config.save_pretrained(output)
        generation.save_pretrained(output)
    _add_top_level_token_ids(output, hf_config)
    _write_tokenizer_and_processors(output, tokenizer, args, min_pixels, max_pixels, video_min_pixels,
                                    video_max_pixels)
    return TinyCheckpoint(path=output, num_params=num_params,
                          vocab_size=args.text.vocab_size, tokenizer_size=len(tokenizer),
                          sharded=(output / "model.safetensors.index.json").is_file())
