"""Checkpoint size vs K: PEC against a full checkpoint, measured and analytic.

For each model, bytes of one checkpoint (weights + Adam exp_avg + exp_avg_sq, fp32)
saving K = 1..N experts per MoE layer, for each pec_scope:
- analytic, from parameter counts (the paper configs, on the meta device);
- measured, on scaled-down models with the same proportions (hidden size, FFN,
  vocabulary and context scaled by 1/s, so every parameter group shrinks ~1/s^2):
  the tensor bytes moepec wrote (from the manifest) and the data bytes on disk
  for a checkpoint at K, against moepec's own full checkpoint of the same run
  (same on-disk format), with a plain full `dcp.save` of the same model and
  optimizer beside them. moepec stores raw tensor bytes (moepec.store.dcp_raw), so its
  bytes on disk exceed the tensor bytes only by DCP's `.metadata` file; stock
  `dcp.save` adds ~1.5 KB of torch.save framing per item.

Run: moepec bench size [--scale 8] [--out runs/bench/size.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moepec import CheckpointConfig, CheckpointManager
from moepec.models.configs import count_parameters, get_config
from moepec.models.gpt_moe import GPTMoE
from moepec.store.storage import Storage, single_process_dcp

PAPER = {"gpt-125m-8e": 0.542, "gpt-350m-16e": 0.577}
SCOPES = ("all", "optimizer", "weights")
BYTES = 4  # fp32 weights and moments


def analytic(counts, k: int, scope: str) -> tuple[int, int]:
    """(PEC bytes, full bytes) for weights + 2 Adam moments."""
    ne, pe, layers, n = counts.non_expert, counts.per_expert, counts.n_moe_layers, counts.n_experts
    full = counts.total * 3 * BYTES
    sel = layers * k * pe
    every = layers * n * pe
    if scope == "all":
        pec = (ne + sel) * 3 * BYTES
    elif scope == "optimizer":  # all weights, moments of K experts
        pec = ne * 3 * BYTES + every * BYTES + sel * 2 * BYTES
    else:  # "weights": all moments, weights of K experts
        pec = ne * 3 * BYTES + every * 2 * BYTES + sel * BYTES
    return pec, full


def scaled(name: str, s: int):
    base = get_config(name)
    return get_config(name, d_model=base.d_model // s, d_ff=base.d_ff // s,
                      vocab_size=base.vocab_size // s, seq_len=base.seq_len // s)


def trained_model(cfg) -> tuple[GPTMoE, torch.optim.Optimizer]:
    """A model and an AdamW optimizer after one step (so the Adam state exists)."""
    torch.manual_seed(0)
    model = GPTMoE(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).loss.backward()
    opt.step()
    return model, opt


def measure(cfg, ks: list[int], scopes, workdir: Path) -> list[dict]:
    model, opt = trained_model(cfg)
    full_dir = workdir / f"full-{uuid.uuid4().hex}"
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with single_process_dcp():
        dcp.save(state, checkpoint_id=str(full_dir), no_dist=True)
    full_bytes = sum(p.stat().st_size for p in full_dir.rglob("*") if p.name != ".metadata")
    rows = []
    for scope in scopes:
        path = workdir / f"pec-{scope}-{uuid.uuid4().hex}"
        cfg_c = CheckpointConfig(path=str(path), interval=1, k_persist=1, pec_scope=scope,
                                 async_snapshot=False, async_persist=False, keep_last=1)
        mgr = CheckpointManager(model, opt, cfg_c)
        mgr.save(0)  # the first checkpoint of a run is full
        st = Storage(str(path))
        first = st.committed()[-1]
        moepec_full = st.data_bytes(first)
        for k in ks if scope == "all" else ks[:1]:
            # K is changed between saves the way dynamic K does it
            mgr.set_k(k, k)
            mgr.save(k)
            name = st.committed()[-1]
            rows.append({"scope": scope, "k": k, "pec_bytes": st.data_bytes(name),
                         "payload_bytes": st.read_manifest(name).bytes,
                         "moepec_full_bytes": moepec_full, "dcp_full_bytes": full_bytes})
        mgr.close()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, nargs="+", default=[4, 8],
                    help="shrink factor of the measured model, one per --models entry")
    ap.add_argument("--models", nargs="+", default=list(PAPER))
    ap.add_argument("--scopes", nargs="+", default=list(SCOPES))
    ap.add_argument("--ks", type=int, nargs="+", default=None,
                    help="the K values measured (default: every K; the analytic rows have all)")
    ap.add_argument("--out", default="runs/bench/size.json",
                    help="where the results go, as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    result: dict = {"models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.models):
            scale = args.scale[min(i, len(args.scale) - 1)]
            counts = count_parameters(get_config(name))
            small = scaled(name, scale)
            small_counts = count_parameters(small)
            ks = list(range(1, counts.n_experts + 1))
            bad = sorted(set(args.ks or ()) - set(ks))
            if bad:
                raise SystemExit(f"--ks {' '.join(map(str, bad))}: {name} has "
                                 f"{counts.n_experts} experts; use K values from 1 to "
                                 f"{counts.n_experts}")
            measured = measure(small, args.ks or ks, args.scopes, Path(tmp))
            entry = {"params": counts.total, "expert_params": counts.expert,
                     "non_expert_params": counts.non_expert, "paper_reduction_k1": PAPER.get(name),
                     "scaled": {"scale": scale, "params": small_counts.total,
                                "rows": []},
                     "analytic": []}
            for scope in args.scopes:
                for k in ks:
                    pec, full = analytic(counts, k, scope)
                    entry["analytic"].append({"scope": scope, "k": k, "pec_bytes": pec,
                                              "full_bytes": full, "reduction": 1 - pec / full})
            for row in measured:
                pec_a, full_a = analytic(small_counts, row["k"], row["scope"])
                row.update(analytic_pec_bytes=pec_a, analytic_full_bytes=full_a,
                           reduction=1 - row["pec_bytes"] / row["moepec_full_bytes"],
                           reduction_vs_dcp_save=1 - row["pec_bytes"] / row["dcp_full_bytes"],
                           measured_vs_analytic=row["pec_bytes"] / pec_a - 1,
                           payload_vs_analytic=row["payload_bytes"] / pec_a - 1,
                           full_vs_analytic=row["dcp_full_bytes"] / full_a - 1)
                entry["scaled"]["rows"].append(row)
            result["models"][name] = entry
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    report(result)
    return result


def report(result: dict) -> None:
    for name, e in result["models"].items():
        print(f"\n{name}: {e['params'] / 1e6:.1f}M params "
              f"({e['expert_params'] / 1e6:.1f}M in experts, "
              f"{e['non_expert_params'] / 1e6:.1f}M non-expert)")
        print(f"  analytic, full checkpoint {e['analytic'][0]['full_bytes'] / 2**30:.2f} GiB")
        print(f"  {'scope':<10}{'K':>3}{'PEC GiB':>10}{'reduction':>11}")
        for r in e["analytic"]:
            print(f"  {r['scope']:<10}{r['k']:>3}{r['pec_bytes'] / 2**30:>10.3f}"
                  f"{100 * r['reduction']:>10.1f}%")
        k1 = next(r for r in e["analytic"] if r["scope"] == "all" and r["k"] == 1)
        if e["paper_reduction_k1"]:
            print(f"  K=1 (scope all): {100 * k1['reduction']:.1f}% smaller; paper reports "
                  f"{100 * e['paper_reduction_k1']:.1f}% -> "
                  f"{'meets' if k1['reduction'] >= e['paper_reduction_k1'] else 'BELOW'} it")
        s = e["scaled"]
        print(f"  measured on 1/{s['scale']} scale ({s['params'] / 1e6:.2f}M params), bytes on disk:")
        print(f"  {'scope':<10}{'K':>3}{'tensors MB':>11}{'diff':>7}{'on disk MB':>11}"
              f"{'analytic':>10}{'diff':>8}{'full MB':>9}"
              f"{'DCP full MB':>13}{'diff':>8}{'reduction':>11}")
        for r in s["rows"]:
            print(f"  {r['scope']:<10}{r['k']:>3}{r['payload_bytes'] / 1e6:>11.2f}"
                  f"{100 * r['payload_vs_analytic']:>6.2f}%{r['pec_bytes'] / 1e6:>11.2f}"
                  f"{r['analytic_pec_bytes'] / 1e6:>10.2f}{100 * r['measured_vs_analytic']:>7.2f}%"
                  f"{r['moepec_full_bytes'] / 1e6:>9.2f}{r['dcp_full_bytes'] / 1e6:>13.2f}{100 * r['full_vs_analytic']:>7.2f}%"
                  f"{100 * r['reduction']:>10.1f}%")


if __name__ == "__main__":
    main()
