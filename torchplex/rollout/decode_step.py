"""The decode step: one token for each of B rows of the KV pool, B a rung of the ladder (rollout/ladder.py).

The step is a few pieces (gpt-fast's `decode_one_token`, cut where the shapes change):
  step_in    embeddings, M-RoPE, write positions; the attention's lengths and masks in the pool's layout
  layer_in   a decoder layer's `attention_inputs` (norm, q/k/v, rotary)              } each of the model's
  attend     the new k/v into the pool, attention in the pool's layout (decode_attention) } layers
  layer_out  a decoder layer's `attention_outputs` (output projection, MLP, residuals) }
  step_out   final norm, LM head, sampling, the rows' next state
What is compiled, and how often (CUDA; `DecodePieces`): every piece with torch.compile(dynamic=False) and its row
dimension marked dynamic, so one graph of a piece serves every ladder size. The layer pieces see no pool tensor,
so their graphs serve every pool geometry, sampling params and layer (the layer is an argument: its weights are
inputs); `attend` and `step_in` are compiled once per pool geometry (their pool shapes are static, which the flex
kernels need), `step_out` once per sampling params (temperature, top-k/p, greedy, max_new_tokens). An evaluation
on the training pool (rollout/engine.py reuses it) thus compiles only its own `step_out`.
What is captured: one CUDA graph of the whole step per ladder size, lazily, the first time a rollout decodes at that
size, and replayed until the pool's storage changes (each `release`/`reserve` between rollouts: the graphs hold its
addresses). A rollout after a release therefore costs one capture per ladder size it reaches, each two warm-up runs
and one captured run of the step (`RolloutStats.captures`, `capture_s`); the graphs of one storage share one memory
pool, so together they hold about what the largest one does. A step is then: six small input copies, one replay,
and two index writes of the sampled tokens and log-probs (DecodeState.advance); no host sync.
The price of the split is fusion across the pieces' borders (a few more small kernels per layer). `whole_layer`
compiles each layer's three as one graph instead (`layer_step`: fused borders, compiled once per pool geometry,
the layer pieces then no longer shared across geometries); benchmarks/decode_bench.py --whole-layer times it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..components.captured_step import CapturedStep
from ..models.qwen2_5_vl.model import mrope_cos_sin
from .decode_attention import PoolShape, attend, attention_masks, slot_lengths
from .sampling import SamplingParams, sample


@dataclass
class Rows:
    """A step's rows (B,) each: the slot each decodes, its last token, tokens generated so far (its first was
    sampled in the prefill), whether it still decodes, its prompt's next RoPE position and its seed."""

    slot_of_row: torch.Tensor
    last_token: torch.Tensor
    gen_count: torch.Tensor
    active: torch.Tensor
    start_pos: torch.Tensor
    seeds: torch.Tensor

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.slot_of_row, self.last_token, self.gen_count, self.active, self.start_pos, self.seeds


def step_in(model, shape: PoolShape, slot_of_row, tokens, gen_count, start_pos, prompt_len):
    """(embeddings (B, 1, hidden), cos, sin, where each row writes its new k/v, the attention's masks)."""
    # The new token's k/v go after the tokens generated before it; a finished row keeps rewriting its last place.
    write_at = (gen_count - 1).clamp(0, max(shape.max_new - 2, 0))
    positions = (start_pos + write_at).view(1, -1, 1).expand(3, -1, 1)
    h = model.tok_embeddings(tokens[:, None])
    cos, sin = mrope_cos_sin(model.args.text, positions, h.dtype)
    masks = attention_masks(shape, *slot_lengths(shape, slot_of_row, write_at, prompt_len))
    return h, cos, sin, write_at, masks


def layer_in(layer, h, cos, sin, fused_qkv: bool):
    return layer.attention_inputs(h, cos, sin, fused_qkv)


def layer_out(layer, h, out):
    return layer.attention_outputs(h, out)


def layer_step(shape: PoolShape, layer, h, cos, sin, fused_qkv: bool, prefix_k, prefix_v, suffix_k, suffix_v,
               slot_of_row, write_at, masks):
    """layer_in, attend and layer_out of one layer, as one function (DecodePieces(whole_layer=True))."""
    q, k, v = layer_in(layer, h, cos, sin, fused_qkv)
    out = attend(shape, q, k, v, prefix_k, prefix_v, suffix_k, suffix_v, slot_of_row, write_at, masks)
    return layer_out(layer, h, out)


def step_out(model, params: SamplingParams, h, seeds, gen_count, active, last_token, stop_ids):
    """(token, its log-prob, the output column it goes to, and the rows' next last token, count and activity).
    A finished row's token goes to the dummy column `max_new_tokens`, so writing it needs no read of the old value."""
    tokens, logprobs = sample(model.logits(model.norm(h)[:, 0]), params, seeds, gen_count)
    count = gen_count + active.long()
    still = active & ~torch.isin(tokens, stop_ids) & (count < params.max_new_tokens)
    column = torch.where(active, gen_count, params.max_new_tokens)
    return tokens, logprobs, column, torch.where(active, tokens, last_token), count, still


class DecodePieces:
    """The step's pieces, eager or compiled (module docstring). One object per engine; dynamo keeps each piece's
    graphs on its code object, so engines with the same options share them."""

    def __init__(self, compiled: bool, options: dict | None = None, backend: str = "inductor",
                 whole_layer: bool = False):
        self.compiled, self.whole_layer = compiled, whole_layer
        wrap = ((lambda fn: torch.compile(fn, backend=backend, dynamic=False, options=options)) if compiled
                else (lambda fn: fn))
        self.step_in, self.layer_in, self.attend = wrap(step_in), wrap(layer_in), wrap(attend)
        self.layer_out, self.step_out, self.layer_step = wrap(layer_out), wrap(step_out), wrap(layer_step)

    def layer(self, shape, layer, h, cos, sin, fused_qkv, pool_kv, slot_of_row, write_at, masks):
        """One decoder layer over the rows: three pieces, or one (whole_layer)."""
        rows = self.rows
        if self.whole_layer:
            return self.layer_step(shape, layer, *rows(h, cos, sin), fused_qkv, *pool_kv,
                                   *rows(slot_of_row, write_at), masks)
        q, k, v = self.layer_in(layer, *rows(h, cos, sin), fused_qkv)
        out = self.attend(shape, *rows(q, k, v), *pool_kv, *rows(slot_of_row, write_at), masks)
        return self.layer_out(layer, *rows(h, out))

    def rows(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors, their first (row) dimension marked dynamic for the compiler: one graph for every B."""
        if self.compiled:
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return tensors


def decode_rows(pieces: DecodePieces, model, pool, shape: PoolShape, params: SamplingParams, stop_ids, fused_qkv,
                slot_of_row, last_token, gen_count, active, start_pos, seeds):
    """One decode step of the rows (Rows.inputs) on `pool`: the outputs of `step_out`."""
    rows = pieces.rows
    h, cos, sin, write_at, masks = pieces.step_in(model, shape, *rows(slot_of_row, last_token, gen_count, start_pos),
                                                  pool.prompt_len)
    for i, layer in enumerate(model.layers):
        pool_kv = pool.prefix_k[i], pool.prefix_v[i], pool.suffix_k[i], pool.suffix_v[i]
        h = pieces.layer(shape, layer, h, cos, sin, fused_qkv, pool_kv, slot_of_row, write_at, masks)
    return pieces.step_out(model, params, *rows(h, seeds, gen_count, active, last_token), stop_ids)


class DecodeStep:
    """The decode step of one sampling params on an engine's pool, at any ladder size: eager, compiled, or (CUDA)
    replayed from the captured graph of its size (`graphs`, dropped with the pool's storage by the engine)."""

    def __init__(self, engine, params: SamplingParams, capture: Callable[[Callable], CapturedStep] | None):
        self.engine, self.params, self.capture = engine, params, capture
        self.stop_ids = torch.tensor(params.stop_token_ids or [-1], device=engine.device)
        self.graphs: dict[int, CapturedStep] = {}

    def shape(self) -> PoolShape:
        pool, e = self.engine.pool, self.engine
        options = e.flex_options
        if options is None and e.decode_kernel == "flex":
            options = e.default_flex_options(pool)
        return PoolShape(pool.num_groups, pool.n, pool.max_prompt, pool.max_new, pool.dtype, e.decode_kernel,
                         tuple(sorted(options.items())) if options else None)

    def step_fn(self) -> Callable:
        """The step on the engine's current pool, as a function of Rows.inputs."""
        e = self.engine
        return functools.partial(decode_rows, e.pieces, e.model, e.pool, self.shape(), self.params, self.stop_ids,
                                 e.fused_qkv)

    def __call__(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        size = rows.slot_of_row.shape[0]
        graph = self.graphs.get(size)
        if graph is None:
            if self.capture is None:
                return self.step_fn()(*rows.inputs)
            graph = self.graphs[size] = self.capture(self.step_fn())
        return graph(*rows.inputs)
