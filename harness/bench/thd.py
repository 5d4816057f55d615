"""``dcp-harness bench thd`` (CPU): zig-zag index computation speed.

For packs of about 1M and 4M tokens (lognormal sequence lengths padded to 2 * cp) and cp 2, 4, 8:
the median time to compute one rank's indices and all ranks' indices. Target: every rank of a pack
of >= 1M tokens in <= 20 ms.
"""

from __future__ import annotations

from pathlib import Path

from harness.bench.common import table, time_call, write_report
from harness.data.workloads import sample
from harness.finite import within
from harness.plan.thd import pack, padding_divisor, zigzag_index_array

TARGET_MS = 20.0


def run(sizes=(1 << 20, 1 << 22), cps=(2, 4, 8)) -> list[dict]:
    rows = []
    for target in sizes:
        for cp in cps:
            lengths, total, seed = [], 0, 0
            while total < target:
                batch = sample("lognormal:mean=1024,sigma=1.5,min=16,max=32768", 1024, seed)
                lengths += batch
                total += sum(batch)
                seed += 1
            p = pack(lengths, padding_divisor(cp_size=cp))
            one, _ = time_call(lambda: zigzag_index_array(p.cu_seqlens_padded, cp, 0), min_total_s=0.3, max_reps=20)
            every, _ = time_call(lambda: [zigzag_index_array(p.cu_seqlens_padded, cp, r) for r in range(cp)],
                                 min_total_s=0.3, max_reps=20)
            rows.append({"tokens": p.total_tokens, "sequences": len(lengths), "cp": cp, "one_rank_ms": one * 1e3,
                         "all_ranks_ms": every * 1e3, "mtokens_per_s": p.total_tokens / every / 1e6})
    return rows


def main(out: Path | None = None) -> int:
    rows = run()
    print(table(rows, [("tokens", "tokens", "d"), ("sequences", "seqs", "d"), ("cp", "cp", "d"),
                       ("one_rank_ms", "one rank ms", ".2f"), ("all_ranks_ms", "all ranks ms", ".2f"),
                       ("mtokens_per_s", "Mtok/s", ".0f")]))
    first = [r for r in rows if r["tokens"] >= 1 << 20 and r["tokens"] < 1 << 21]
    checks = [{"target": f"all ranks of a {r['tokens']}-token pack at cp {r['cp']} in <= {TARGET_MS:g} ms",
               "value": r["all_ranks_ms"], "pass": within(r["all_ranks_ms"], TARGET_MS)} for r in first]
    for c in checks:
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['value']:.2f}")
    print(f"wrote {write_report('thd', {'target_ms': TARGET_MS}, rows, out=out, checks=checks)}")
    return 0 if all(c["pass"] for c in checks) else 1
