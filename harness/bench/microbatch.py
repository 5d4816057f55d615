"""``dcp-harness bench microbatch``: host time against device time of one micro-batch.

One process and one device. For each token shape (``KxL``: K sequences of L tokens in one THD pack,
no CP) and each variant (``<compile>/<backend>``: ``off`` (eager), ``inductor`` or ``aot_eager``
for the blocks' per-token segments (``TinyLM.compile_blocks``; ``inductor-chain`` /
``aot_eager-chain``: the whole model as one compiled call), and an attention backend of
``harness.runtime.attention``), it times the forward + backward of the model - ``gpt-12l-h2048`` on
CUDA in bf16 autocast, ``tiny-gpt`` in fp32 on the CPU - with the gradients accumulated into one
fp32 buffer, as ``bench step`` runs a micro-batch:

- ``enqueue ms``: host time of the call, without device synchronisation - what the host pays;
- ``total ms``: until the device has finished (synchronised) - what a lone micro-batch costs;
- ``device ms`` and ``kernels`` (CUDA): the GPU's kernel time and launches in one profiled call.

A micro-batch is host-bound when its enqueue time is at least its device time: faster kernels do not
help it, fewer or cheaper launches do (``bench step``'s arms run many micro-batches back to back, so
the slower of the two sets their pace). Variants are interleaved in every repetition (drift hits them
alike) and medians are reported. Every variant of a shape computes the same loss on the same tokens;
the loss column and ``loss_spread`` (largest relative difference between variants) show it, and the
command fails if the spread passes ``LOSS_SPREAD_MAX``.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.bench import host
from harness.bench.common import table, write_report
from harness.plan.errors import PlanInputError
from harness.plan.thd import whole_chunks
from harness.runtime.model_config import MODELS

COMPILES = ("off", "inductor", "aot_eager", "inductor-chain", "aot_eager-chain")
"""``-chain``: the whole model as one compiled call, attentions opaque (``TinyLM.compile_blocks(scope="chain")``)."""
LOSS_SPREAD_MAX = 1e-3
"""Largest relative loss difference allowed between the variants of one shape (bf16 fusion rounding
measured 2e-6..3e-5 on an H200; a wrong variant is off by far more)."""


class MicrobatchConfigError(PlanInputError):
    """A ``bench microbatch`` option is invalid (names the value and the fix)."""


@dataclass(frozen=True)
class MicrobatchConfig:
    device: str = "cpu"
    """``cuda`` or ``cpu``."""
    model: str = ""
    """Model key of ``harness.runtime.model.MODELS`` ('' = gpt-12l-h2048 on CUDA, tiny-gpt on the CPU)."""
    shapes: tuple[str, ...] = ()
    """``KxL`` token shapes ('' = the device's defaults, ``DEFAULT_SHAPES``)."""
    variants: tuple[str, ...] = ()
    """``<compile>/<backend>`` ('' = the device's defaults, ``DEFAULT_VARIANTS``)."""
    reps: int = 12
    """Timed repetitions per shape and variant (interleaved)."""
    warmup: int = 2
    """Untimed calls per shape and variant first (compilation happens here)."""
    seed: int = 0

    def resolved(self) -> MicrobatchConfig:
        cuda = self.device == "cuda"
        return MicrobatchConfig(device=self.device, model=self.model or ("gpt-12l-h2048" if cuda else "tiny-gpt"),
                                shapes=self.shapes or DEFAULT_SHAPES[self.device],
                                variants=self.variants or DEFAULT_VARIANTS[self.device], reps=self.reps,
                                warmup=self.warmup, seed=self.seed)

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise MicrobatchConfigError(f"device must be cpu or cuda, got {self.device!r}")
        c = self.resolved()
        if c.model not in MODELS:
            raise MicrobatchConfigError(f"unknown model {c.model!r}; choose from {', '.join(MODELS)}")
        for name in ("reps", "warmup"):
            v = getattr(c, name)
            if not isinstance(v, int) or v < (1 if name == "reps" else 0):
                raise MicrobatchConfigError(f"{name} must be an int >= {1 if name == 'reps' else 0}, got {v!r}")
        for s in c.shapes:
            parse_shape(s)
        if len(set(c.variants)) != len(c.variants):
            raise MicrobatchConfigError(f"variants repeat: {list(c.variants)}; list each once")
        for v in c.variants:
            parse_variant(v, c.device)


DEFAULT_SHAPES = {"cuda": ("1x2048", "1x1024", "4x512", "16x128"), "cpu": ("1x128", "4x32")}
DEFAULT_VARIANTS = {"cuda": ("off/auto", "inductor/varlen", "inductor/auto", "inductor-chain/auto"), "cpu": ("off/sdpa",)}


def parse_shape(text: str) -> list[int]:
    """``"4x512"`` -> ``[512, 512, 512, 512]`` (K sequences of L tokens)."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 2:
        raise MicrobatchConfigError(f"shape {text!r} is not KxL with K >= 1 sequences of L >= 2 tokens "
                                    f"(e.g. 4x512)")
    return [int(m.group(2))] * int(m.group(1))


def parse_variant(text: str, device: str) -> tuple[str, str]:
    """``"inductor/flash"`` -> ``("inductor", "flash")``, checked on ``device``."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.runtime.attention import BACKENDS, resolve_backend

    parts = str(text).split("/")
    if len(parts) != 2 or parts[0] not in COMPILES or parts[1] not in ("auto", *BACKENDS):
        raise MicrobatchConfigError(f"variant {text!r} is not <compile>/<backend> with compile in "
                                    f"{', '.join(COMPILES)} and backend in auto, {', '.join(BACKENDS)} "
                                    f"(e.g. inductor/auto)")
    try:
        resolve_backend(parts[1], device)
    except ValueError as e:
        raise MicrobatchConfigError(f"variant {text!r}: {e}; pick a backend this device has") from None
    return parts[0], parts[1]


def measure(cfg: MicrobatchConfig) -> dict:
    """Time every (shape, variant); returns ``{"rows": [...], "device_name": ...}``."""
    from dataclasses import replace

    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.runtime.attention import DeviceChunks, chunk_attention, resolve_backend
    from harness.runtime.model import MODELS, TinyLM  # lazy: torch, as above

    cfg.validate()
    cfg = cfg.resolved()
    cuda = cfg.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise MicrobatchConfigError("device cuda was asked for but no CUDA GPU is visible; use --cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = TinyLM(replace(MODELS[cfg.model], seed=cfg.seed), device=dev if cuda else None)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=dev)
    off = 0
    for p in params:  # gradients accumulate in place into one fp32 buffer, as in bench step
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    variants = [parse_variant(v, cfg.device) for v in cfg.variants]
    gen = torch.Generator().manual_seed(cfg.seed)
    probed = host.probe(dev)  # before anything is compiled or profiled

    def runner(lengths: list[int], backend: str):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        T = cu[-1]
        toks = torch.randint(0, model.c.vocab, (T,), generator=gen).to(dev)
        labels = toks.roll(-1)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        mask = torch.ones(T, dtype=torch.int64, device=dev)
        chunks = DeviceChunks.build(whole_chunks(cu), dev)
        be = resolve_backend(backend, dev)

        def attention(q, k, v):
            return chunk_attention(q, k, v, chunks, backend=be)

        def run() -> torch.Tensor:  # the summed loss
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                ce, _ = model.token_losses(toks, labels, mask, pos, attention)
            (ce / T).backward()
            return ce

        return run

    def use(compile_: str) -> None:  # outside every timed window
        backend, _, chain = compile_.partition("-")
        model.compile_blocks(None if compile_ == "off" else backend, scope="chain" if chain else "segments")

    rows = []
    for shape in cfg.shapes:
        lengths = parse_shape(shape)
        runs, first, losses = {}, {}, {}
        tokens_seed = cfg.seed + len(rows)
        for compile_, backend in variants:
            gen.manual_seed(tokens_seed)  # every variant of a shape gets the same tokens
            key = f"{compile_}/{backend}"
            runs[key] = (compile_, runner(lengths, backend))
            use(compile_)
            t0 = time.perf_counter()
            losses[key] = float(runs[key][1]().detach())
            sync()
            first[key] = time.perf_counter() - t0
            for _ in range(cfg.warmup):
                runs[key][1]()
            sync()
        enq: dict[str, list[float]] = {k: [] for k in runs}
        tot: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for rep in range(cfg.reps):
            for key in order[rep % len(order):] + order[:rep % len(order)]:  # rotate the order
                compile_, run = runs[key]
                use(compile_)
                sync()
                t0 = time.perf_counter()
                run()
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                enq[key].append(1e3 * (t1 - t0))
                tot[key].append(1e3 * (t2 - t0))
        print(f"bench microbatch: {shape} timed ("
              + ", ".join(f"{k} {statistics.median(enq[k]):.2f} ms enqueue, first call {first[k]:.1f} s" for k in order)
              + ")", flush=True)
        ref = losses[order[0]]
        spread = max(abs(x - ref) / max(abs(ref), 1e-30) for x in losses.values())
        for key in order:
            compile_, run = runs[key]
            device_ms = kernels = None
            if cuda:
                device_ms, kernels = _profiled(run, lambda c=compile_: use(c), sync)
            e, t = statistics.median(enq[key]), statistics.median(tot[key])
            rows.append({"shape": shape, "sequences": len(lengths), "tokens": sum(lengths), "variant": key,
                         "enqueue_ms": e, "total_ms": t, "device_ms": device_ms, "kernels": kernels,
                         "host_bound": None if device_ms is None else e >= device_ms,
                         "first_call_s": first[key], "loss": losses[key], "loss_spread": spread,
                         "enqueue_ms_all": enq[key], "total_ms_all": tot[key]})
    model.compile_blocks(None)
    flat.zero_()
    return {"rows": rows, "host": probed, "device_name": torch.cuda.get_device_name(dev) if cuda else "CPU",
            "torch": torch.__version__, "config": asdict(cfg)}


def _profiled(run, prepare, sync) -> tuple[float, int]:
    from torch.profiler import ProfilerActivity, profile

    prepare()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events)


COLUMNS = [("shape", "shape", "s"), ("variant", "variant", "s"), ("enqueue_ms", "enqueue ms", ".2f"),
           ("total_ms", "total ms", ".2f"), ("device_ms", "device ms", ".2f"), ("kernels", "kernels", "d"),
           ("host_bound", "host-bound", ""), ("first_call_s", "first call s", ".1f"), ("loss", "loss", ".6g")]


def main(*, cpu: bool = False, out: Path | None = None, overrides: dict | None = None) -> int:
    """Run, print the table, write ``reports/bench_microbatch.json`` (or ``out``); 1 if the
    variants of a shape disagree on the loss by more than ``LOSS_SPREAD_MAX``."""
    import torch

    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if not cpu and device == "cpu":
        raise MicrobatchConfigError("no CUDA GPU is visible: run on a GPU node, or pass --cpu for the CPU variant")
    cfg = MicrobatchConfig(device=device, **(overrides or {}))
    cfg.validate()
    cfg = cfg.resolved()
    print(f"bench microbatch: {cfg.model} on {device}, shapes {', '.join(cfg.shapes)}, variants "
          f"{', '.join(cfg.variants)}, {cfg.reps} interleaved repetitions", flush=True)
    res = measure(cfg)
    print(f"bench microbatch: {host.describe([res['host']])}")
    print(table(res["rows"], COLUMNS))
    bad = sorted({r["shape"] for r in res["rows"] if r["loss_spread"] > LOSS_SPREAD_MAX})
    for shape in bad:
        print(f"  [FAIL] shape {shape}: the variants' losses differ by "
              f"{max(r['loss_spread'] for r in res['rows'] if r['shape'] == shape):.2e} relative "
              f"(> {LOSS_SPREAD_MAX:g})")
    path = write_report("microbatch", res["config"], res["rows"], out, device_name=res["device_name"],
                        torch=res["torch"])
    print(f"wrote {path}")
    return 1 if bad else 0


def opaque_overhead(variants: dict | None = None, *, reps: int = 300, layers: int = 12, inner: int = 20,
                    device: str = "cpu") -> dict:
    """Host overhead of the opaque attention operator (``harness.runtime.opaque``) per call, in µs
    (medians of ``reps`` interleaved repetitions of ``inner`` calls; the order flips every repetition).

    The attention is trivial (``q * k * v`` on ``[4, 1, 4]`` fp32 tensors), so what is timed is the
    operator's own machinery. Two cases per variant:

    - ``eager``: ``opaque_attention`` forward + ``torch.autograd.grad``, less the same with the
      attention called directly (``eager_us``) = overhead per call;
    - ``chain``: a ``torch.compile(fullgraph=True, backend="aot_eager")`` chain of ``layers``
      ``h = tanh(h + attention(h * y, h, h))``, forward + backward, less the same chain with the
      attention traced inline, divided by ``layers`` = overhead per layer as the compiled chain pays it.

    ``variants``: name -> a module with ``attending`` and ``opaque_attention`` (default: this
    checkout's), or the path of a copy of one whose operator namespace is renamed (two variants cannot
    register the same operator), e.g. an older ``opaque.py`` for an A/B. Every variant's gradients
    must equal the first's bit for bit; the benchmark refuses otherwise."""
    import contextlib
    import gc
    import hashlib
    import importlib.util
    import sys

    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.runtime import opaque

    mods = {}
    for name, m in (variants or {"current": opaque}).items():
        if isinstance(m, str | Path):  # dynamo resolves a compiled function's globals through sys.modules
            modname = f"_opaque_variant_{hashlib.sha1(Path(m).read_bytes()).hexdigest()[:12]}"
            if modname in sys.modules:  # loaded before in this process: its operators are registered already
                m = sys.modules[modname]
            else:
                spec = importlib.util.spec_from_file_location(modname, m)
                m = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = m
                spec.loader.exec_module(m)
        mods[name] = m
    if len(mods) > 6:  # every chain is one code object: dynamo keeps 8 compilations of it, then runs eager
        raise ValueError(f"at most 6 variants, got {len(mods)}")

    def att(q, k, v):
        return q * k * v

    g = torch.Generator().manual_seed(0)  # drawn on the CPU (the same values on every device), then moved
    qkv = [torch.randn(4, 1, 4, generator=g).to(device).requires_grad_() for _ in range(3)]
    x, y, w = (torch.randn(4, 1, 4, generator=g).to(device).requires_grad_(i < 2) for i in range(3))

    def fwd_bwd(fn, inputs, *args):
        return lambda: torch.autograd.grad(fn(*args or inputs), inputs, w)

    def chain(a):
        def f(h, y):
            for _ in range(layers):
                h = (h + a(h * y, h, h)).tanh()
            return h
        return torch.compile(f, backend="aot_eager", fullgraph=True)

    eager = {"attention": fwd_bwd(att, qkv), **{n: fwd_bwd(m.opaque_attention, qkv) for n, m in mods.items()}}
    chains = {"inline": fwd_bwd(chain(att), (x, y)), **{n: fwd_bwd(chain(m.opaque_attention), (x, y))
                                                        for n, m in mods.items()}}

    def timed(fns: dict, reps: int, inner: int) -> dict:
        """Per-repetition times (us per call); the order rotates so every function takes every slot."""
        ts: dict = {k: [] for k in fns}
        names = list(fns)
        for r in range(reps):
            for k in names[r % len(names):] + names[:r % len(names)]:
                f = fns[k]
                t0 = time.perf_counter()
                for _ in range(inner):
                    f()
                ts[k].append((time.perf_counter() - t0) / inner * 1e6)
        return ts

    def paired(ts: dict, name: str, base: str, per: int = 1) -> tuple[float, float, float]:
        """Median and quartiles of ``name`` minus ``base`` within each repetition, over ``per``."""
        d = sorted((a - b) / per for a, b in zip(ts[name], ts[base]))
        q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
        return statistics.median(d), q[0], q[2]

    with contextlib.ExitStack() as stack:
        for m in mods.values():
            stack.enter_context(m.attending(att))
        first = next(iter(mods))
        for fns in (eager, chains):  # the same gradients, bit for bit; then warm up (compiles here)
            ref = fns[first]()
            for n in mods:
                if not all(torch.equal(a, b) for a, b in zip(ref, fns[n]())):
                    raise ValueError(f"variant {n!r} computes other gradients than {first!r}: an A/B of the "
                                     "operator's overhead needs variants that compute the same thing")
            for f in fns.values():
                for _ in range(20):
                    f()
        gc.collect()
        gc.disable()
        try:
            e = timed(eager, reps, inner)
            c = timed(chains, max(reps // 4, 10), max(inner // 4, 1))
        finally:
            gc.enable()
    rows = []
    for n in mods:
        eo, eq1, eq3 = paired(e, n, "attention")
        co, cq1, cq3 = paired(c, n, "inline", layers)
        rows.append({"variant": n, "eager_us": statistics.median(e[n]), "eager_overhead_us": eo,
                     "eager_overhead_iqr_us": [eq1, eq3], "chain_us": statistics.median(c[n]),
                     "chain_overhead_us_per_layer": co, "chain_overhead_iqr_us_per_layer": [cq1, cq3],
                     "eager_iqr": f"{eq1:.1f}..{eq3:.1f}", "chain_iqr": f"{cq1:.1f}..{cq3:.1f}"})
    e, c = {k: statistics.median(v) for k, v in e.items()}, {k: statistics.median(v) for k, v in c.items()}
    print(f"opaque operator overhead ({device}, torch {torch.__version__}): attention alone "
          f"{e['attention']:.1f} us fwd+bwd, inline {layers}-layer chain {c['inline']:.1f} us")
    print(table(rows, [("variant", "variant", "s"), ("eager_us", "eager us", ".1f"),
                       ("eager_overhead_us", "overhead us/call", ".1f"), ("eager_iqr", "IQR", "s"),
                       ("chain_us", "chain us", ".1f"), ("chain_overhead_us_per_layer", "overhead us/layer", ".1f"),
                       ("chain_iqr", "IQR", "s")]))
    print("  overheads: medians (and interquartile ranges) of the paired differences within each repetition; "
          "differences between variants smaller than the IQRs are noise")
    return {"attention_us": e["attention"], "inline_chain_us": c["inline"], "rows": rows}


OPAQUE_NAMESPACE_AB = "dcp_harness_ab"
"""The prefix of the operator namespace an older ``opaque.py`` is renamed to for ``opaque_main``'s
A/B (``dcp_harness_ab_<hash of the file>``: two different files never share operators, and loading
the same file again reuses its module)."""


def renamed_opaque_copy(source: Path, dest_dir: Path) -> Path:
    """A copy of an ``opaque.py`` (e.g. ``git show REV:harness/runtime/opaque.py``) whose operators are
    registered under ``OPAQUE_NAMESPACE_AB``_<hash> instead of ``dcp_harness``, so it can load next to this
    checkout's; raises ``MicrobatchConfigError`` for a file that defines no ``dcp_harness`` operator."""
    import hashlib

    text = Path(source).read_text()
    namespace = f"{OPAQUE_NAMESPACE_AB}_{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    renamed = re.sub(r'dcp_harness(?=::|"|\.attention)', namespace, text)
    if renamed == text or "def opaque_attention" not in text:
        raise MicrobatchConfigError(f"{source} is not an opaque.py (no dcp_harness operator and opaque_attention "
                                    f"in it); pass a copy of harness/runtime/opaque.py from another revision")
    out = Path(dest_dir) / "opaque_against.py"
    out.write_text(renamed)
    return out


def opaque_main(*, against: Path | None = None, device: str = "cpu", reps: int = 300,
                out: Path | None = None) -> int:
    """``dcp-harness bench opaque``: ``opaque_overhead`` of this checkout's operator (and of
    ``against``, an older ``opaque.py``, interleaved with it); writes ``reports/bench_opaque.json``."""
    import tempfile

    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.runtime import opaque

    if device == "cuda" and not torch.cuda.is_available():
        raise MicrobatchConfigError("device cuda: no CUDA GPU is visible; use --device cpu")
    if not isinstance(reps, int) or reps < 1:
        raise MicrobatchConfigError(f"reps must be an int >= 1, got {reps!r}")
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"current": opaque}
        if against is not None:
            variants = {"against": renamed_opaque_copy(against, Path(tmp)), **variants}
        print(f"bench opaque: {', '.join(variants)} on {device}, {reps} interleaved repetitions (compiles first; "
              f"~1 min at the default)", flush=True)
        res = opaque_overhead(variants, reps=reps, device=device)
    config = {"against": str(against) if against else None, "device": device, "reps": reps}
    path = write_report("opaque", config, res, out, torch=torch.__version__)
    print(f"wrote {path}")
    return 0
