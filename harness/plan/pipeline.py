"""Pipeline-parallel layer ranges and the layers that own MoE routers (no torch).

``layer_ranges(num_layers, pp_size, ...)[p][v] = (start, n)``: stage p (virtual chunk v) builds global
decoder layers ``start .. start + n - 1`` - Megatron-core's ``get_transformer_layer_offset`` /
``get_num_layers_to_build`` semantics without a custom layout, stated as one rule:

* Even split: the ``L`` layers, plus one pseudo-slot for the embedding and one for the loss when they
  are "accounted" in the split, are cut into ``pp_size * vpp_size`` equal chunks; virtual chunk v of
  stage p is chunk ``v * pp_size + p`` (interleaving); pseudo-slots build no layer.
* Uneven split: ``first`` / ``last`` layers on the first / last stage, the rest evenly over the middle
  stages; with VPP each stage's share is cut into ``vpp_size`` equal chunks.
* Anything that does not divide exactly raises ``ValueError`` naming the numbers (Megatron asserts
  in most such cases and silently floors in the uneven + VPP case).

>>> layer_ranges(27, 2, first=13)
[[(0, 13)], [(13, 14)]]
>>> layer_ranges(48, 4, first=10, last=10)
[[(0, 10)], [(10, 14)], [(24, 14)], [(38, 10)]]
>>> layer_ranges(8, 2, vpp_size=2)
[[(0, 2), (4, 2)], [(2, 2), (6, 2)]]
>>> layer_ranges(30, 4, account_embedding=True, account_loss=True)
[[(0, 7)], [(7, 8)], [(15, 8)], [(23, 7)]]

Routers: ``moe_layers(L, freq=..., first_dense=...)`` lists the global layers with an MoE block
(Megatron's ``moe_layer_freq``: an int N means "layer i is MoE when i % N == 0", a list is the 0/1
pattern; ``first_dense`` makes the first layers dense, as Megatron-Bridge does for DeepSeek-style
models). ``routers_on_stage`` gives the routers a stage builds, by *global* layer number.
"""

from __future__ import annotations

from harness.plan.errors import PlanInputError


def _positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanInputError(f"{name} must be a positive int, got {v!r}")


def _even(L: int, P: int, V: int, emb: bool, loss: bool) -> list[list[tuple[int, int]]]:
    slots = L + emb + loss
    if slots % (P * V):
        what = f"{L} layers" + (" + embedding" if emb else "") + (" + loss" if loss else "")
        raise PlanInputError(f"{what} = {slots} slots cannot be split evenly over pipeline_model_parallel_size={P}"
                             + (f" x virtual_pipeline_model_parallel_size={V}" if V > 1 else "")
                             + f"; use a multiple of {P * V} slots or set first/last-stage layer counts")
    per = slots // (P * V)
    out = []
    for p in range(P):
        chunks = []
        for v in range(V):
            lo = (v * P + p) * per  # slot range [lo, lo + per)
            first_layer, last_layer = max(lo, emb), min(lo + per, emb + L)
            chunks.append((first_layer - emb, max(0, last_layer - first_layer)))
        out.append(chunks)
    return out


def _uneven(L: int, P: int, V: int, first: int | None, last: int | None) -> list[list[tuple[int, int]]]:
    middle_stages = P - (first is not None) - (last is not None)
    middle = L - (first or 0) - (last or 0)
    if middle < 0 or (middle_stages == 0 and middle):
        raise PlanInputError(f"first={first} and last={last} layers do not fit {L} layers on {P} stages")
    if middle_stages and middle == 0:
        raise PlanInputError(f"first={first} / last={last} leave no layers for the {middle_stages} middle stages "
                             f"of {P}; every stage must build at least one layer")
    if middle_stages and middle % middle_stages:
        raise PlanInputError(f"{middle} layers left after first={first} / last={last} cannot be split evenly over "
                             f"{middle_stages} middle stages")
    per_stage = [first if (p == 0 and first is not None) else last if (p == P - 1 and last is not None)
                 else (middle // middle_stages if middle_stages else 0) for p in range(P)]
    bad = [(p, n) for p, n in enumerate(per_stage) if n % V]
    if bad:
        raise PlanInputError(f"stage {bad[0][0]} has {bad[0][1]} layers, not divisible by "
                             f"virtual_pipeline_model_parallel_size={V}")
    round_size = sum(per_stage) // V  # layers per virtual round
    starts = [sum(n // V for n in per_stage[:p]) for p in range(P)]
    return [[(v * round_size + starts[p], per_stage[p] // V) for v in range(V)] for p in range(P)]


def layer_ranges(num_layers: int, pp_size: int, *, first: int | None = None, last: int | None = None,
                 vpp_size: int | None = None, account_embedding: bool = False,
                 account_loss: bool = False) -> list[list[tuple[int, int]]]:
    """``[stage][virtual chunk] -> (first global layer, number of layers)`` (see module doc)."""
    _positive("num_layers", num_layers)
    _positive("pipeline_model_parallel_size", pp_size)
    V = 1 if vpp_size is None else vpp_size
    _positive("virtual_pipeline_model_parallel_size", V)
    for name, v in (("first", first), ("last", last)):
        if v is not None:
            _positive(f"{name}-stage layers", v)
    if pp_size == 1:
        if first is not None or last is not None:
            raise PlanInputError("first/last-stage layer counts need pipeline_model_parallel_size > 1")
        if V > 1:
            raise PlanInputError("virtual pipeline stages need pipeline_model_parallel_size > 1")
        return [[(0, num_layers)]]
    if first is None and last is None:
        return _even(num_layers, pp_size, V, account_embedding, account_loss)
    if account_embedding or account_loss:
        raise PlanInputError("first/last-stage layer counts cannot be combined with accounting the embedding or "
                             "loss in the split (Megatron does not support it either)")
    return _uneven(num_layers, pp_size, V, first, last)


def model_split(num_layers: int, pp: int, vpp: int = 1) -> list[list[tuple[int, int]]]:
    """The training runtime's split: ``layer_ranges`` even, else counting the embedding and / or the loss as a
    layer (Megatron's ``account_for_*_in_pipeline_split``), the first of these that divides into ``pp * vpp``
    chunks; ``PlanInputError`` when none does.

    >>> model_split(2, 2)
    [[(0, 1)], [(1, 1)]]
    >>> model_split(3, 2)
    [[(0, 1)], [(1, 2)]]
    """
    for emb, loss in ((False, False), (True, False), (False, True), (True, True)):
        if (num_layers + emb + loss) % (pp * vpp) == 0:
            return layer_ranges(num_layers, pp, vpp_size=vpp if vpp > 1 else None, account_embedding=emb,
                                account_loss=loss)
    raise PlanInputError(f"{num_layers} layers cannot be split over pp={pp} x vpp={vpp} = {pp * vpp} model "
                         f"chunks, even counting the embedding and the loss as layers; use a model whose layer "
                         f"count (+ 0, 1 or 2) is a multiple of {pp * vpp}, or fewer stages / chunks")


def stage_layers(ranges_of_stage: list[tuple[int, int]]) -> list[int]:
    """The global layers a stage builds, chunk after chunk (construction order)."""
    return [i for start, n in ranges_of_stage for i in range(start, start + n)]


def moe_layers(num_layers: int, *, freq: int | list[int] = 1, first_dense: int = 0) -> list[int]:
    """Global layers with an MoE block (Megatron ``moe_layer_freq`` / Bridge ``first_k_dense_replace``)."""
    _positive("num_layers", num_layers)
    if isinstance(freq, int):
        _positive("moe_layer_freq", freq)
        pattern = [int(i % freq == 0) for i in range(num_layers)]
    else:
        if len(freq) != num_layers or any(x not in (0, 1) for x in freq):
            raise PlanInputError(f"moe_layer_freq pattern must be {num_layers} zeros/ones, got {list(freq)}")
        pattern = list(freq)
    if not 0 <= first_dense <= num_layers:
        raise PlanInputError(f"first_dense={first_dense} must be in [0, {num_layers}]")
    return [i for i, x in enumerate(pattern) if x and i >= first_dense]


def routers_on_stage(ranges_of_stage: list[tuple[int, int]], moe: list[int]) -> list[int]:
    """Global layer numbers of the routers a stage builds, in construction order. Replay data must be
    looked up by these numbers, never by the position of a router in the stage (``[[... dense first``
    fallbacks go wrong when dense and MoE layers interleave)."""
    moe_set = set(moe)
    return [i for i in stage_layers(ranges_of_stage) if i in moe_set]
