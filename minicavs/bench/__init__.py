"""``minicavs bench``: training throughput against peers measured in the same run, and the switch ablation.

Workloads (float32, Adam, forward + backward + update; medians over the timed epochs after a warm-up):
- ``tree_lstm``: binary Tree-LSTM on the first 1024 SST train trees, embeddings 128, batch 64, sparse
  embedding updates (as DyNet updates lookup parameters); peers: DyNet with autobatching
  (tools/dynet_tree_lstm.py, ``--dynet-python``), PyTorch batched by level and PyTorch per-sample recursion
  on the first ``--recursive-trees`` trees (tools/torch_tree_lstm.py, ``--torch-python``).
- ``tree_fc``: Tree-FC on complete binary trees of 256 leaves, hidden 256, batch 64; peer: PyTorch batched
  by level by hand (tools/torch_tree_fc.py, ``--torch-python``).
- ``var_lstm``: LSTM LM on the first 2000 sentences of PTB's ptb.valid.txt (vocabulary from that file),
  hidden 512, embeddings 256, batch 64; peer: PyTorch ``nn.LSTM`` on packed sequences (tools/torch_lstm_lm.py).
Before timing, each peer computes the loss of a few samples with minicavs' weights; the check is printed.
Each model's useful matmul FLOPs (the equations' products, no rows of zeros; forward + backward = 3x forward)
give its achieved rate as a fraction of this machine's numpy float32 2048^3 matmul rate, measured here.
Peers run in their own environments: tools/setup_peers.sh. ``--ablation`` prints each engine switch's
speedup over all switches off (the paper's Fig. 10) on Tree-LSTM and Fixed-LSTM.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from ..engine import EngineOptions
from .peers import dynet, torch_lstm_lm, torch_tree_fc, torch_tree_lstm
from .workloads import (SWITCHES, WORKLOADS, fixed_lstm, lstm_lm_flops, machine_rate, throughput, tree_fc,
                        tree_fc_flops, tree_lstm, tree_lstm_flops, var_lstm)


def _check_line(name: str, k: int, unit: str, ours: float, theirs: float) -> str:
    rel = abs(ours - theirs) / max(1.0, abs(ours))
    return (f"    same loss for the same weights on {k} {unit}: {'yes' if rel < 1e-4 else 'NO'} "
            f"(minicavs {ours:.6f}, {name} {theirs:.6f})")


def _report(label: str, unit: str, rate: float, flops: float, machine: float, peer: str | None,
            ref: dict | None) -> None:
    """One line: minicavs' rate and matmul FLOP rate (% of the machine); the peer's, and the ratio."""
    line = (f"  {label:<34} minicavs {rate:9.1f} {unit}/s   matmul rate {rate * flops / 1e9:6.1f} GFLOP/s "
            f"= {100 * rate * flops / machine:4.1f}% of the machine")
    if ref is not None:
        theirs = float(np.median(ref["rates"]))
        threads = f", {ref['threads']} threads" if "threads" in ref else ""
        line += (f"   {peer}{threads} {theirs:9.1f} {unit}/s ({100 * theirs * flops / machine:4.1f}%)"
                 f"   ratio {rate / theirs:5.2f}x")
    print(line)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--sst", default="../shared/data/sst/train.txt", help="SST train file")
    p.add_argument("--ptb", default="../shared/data/ptb/ptb.valid.txt", help="text of the LM workloads")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 512], help="Tree-LSTM hidden sizes")
    p.add_argument("--embed", type=int, default=128, help="Tree-LSTM embedding size")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--trees", type=int, default=1024, help="SST trees per Tree-LSTM epoch")
    p.add_argument("--fc-trees", type=int, default=512, help="trees per Tree-FC epoch")
    p.add_argument("--sentences", type=int, default=2000, help="sentences per Var-LSTM epoch")
    p.add_argument("--recursive-trees", type=int, default=128,
                   help="trees per epoch of the (slow) per-sample PyTorch Tree-LSTM")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--dynet-python", default=None, help="a python with dynet38 (tools/setup_peers.sh)")
    p.add_argument("--torch-python", default=None, help="a python with torch (tools/setup_peers.sh)")
    p.add_argument("--ablation", action="store_true", help="speedup of each switch over all-off (Fig. 10)")


def run(args: argparse.Namespace) -> int:
    machine = machine_rate()
    print(f"machine: numpy float32 2048^3 matmul {machine / 1e9:.1f} GFLOP/s (median of 5); "
          f"medians of {args.epochs} timed epochs after a warm-up; float32, Adam")
    if "tree_lstm" in args.workloads:
        if not os.path.isfile(args.sst):
            raise FileNotFoundError(f"SST train file not found: {args.sst} (pass --sst)")
        print(f"Tree-LSTM: first {args.trees} SST trees, embeddings {args.embed}, batch {args.batch}")
        for h in args.hidden:
            t = tree_lstm(args.sst, h, args.embed, args.batch, args.trees, EngineOptions())
            ref = None
            if args.dynet_python:
                check = t.task.data["train"][:8]
                ref = dynet(args.dynet_python, t, len(check), args.epochs)
                print(_check_line("DyNet", len(check), "trees", t.loss_and_grads(check, training=False).loss,
                                  ref["check_loss"]))
            flops = 3 * tree_lstm_flops(t.task.data["train"], args.embed, h) / len(t.task.data["train"])
            rate = float(np.median(throughput(t, args.epochs)))
            _report(f"hidden {h}", "trees", rate, flops, machine, "DyNet (autobatching)", ref)
            if args.torch_python:
                for mode, limit in (("level", None), ("recursive", args.recursive_trees)):
                    ref = torch_tree_lstm(args.torch_python, t, mode, limit, args.epochs)
                    print(_check_line(f"PyTorch {mode}", 8, "trees", t.loss_and_grads(
                        t.task.data["train"][:8], training=False).loss, ref["check_loss"]))
                    label = "batched by level" if mode == "level" else f"per-sample recursion, {limit} trees"
                    _report(f"hidden {h}", "trees", rate, flops, machine, f"PyTorch ({label})", ref)
    if "tree_fc" in args.workloads:
        H, L = 256, 256
        print(f"Tree-FC: {args.fc_trees} complete binary trees of {L} leaves, hidden {H}, batch {args.batch}")
        t = tree_fc(H, L, args.batch, args.fc_trees, EngineOptions())
        ref = None
        if args.torch_python:
            check = t.task.data["train"][:4]
            ref = torch_tree_fc(args.torch_python, t, len(check), args.epochs)
            print(_check_line("PyTorch", len(check), "trees", t.loss_and_grads(check, training=False).loss,
                              ref["check_loss"]))
        _report(f"leaves {L}, hidden {H}", "trees", float(np.median(throughput(t, args.epochs))),
                3 * tree_fc_flops(1, L, H), machine, "PyTorch (by level)", ref)
    if "var_lstm" in args.workloads:
        if not os.path.isfile(args.ptb):
            raise FileNotFoundError(f"PTB text not found: {args.ptb} (pass --ptb)")
        H, D = 512, 256
        t = var_lstm(args.ptb, args.sentences, H, D, args.batch, EngineOptions())
        data = t.task.data["train"]
        V = len(t.task.vocab)
        print(f"Var-LSTM LM: first {len(data)} sentences of {os.path.basename(args.ptb)} "
              f"({t.task.units(data)} words), vocabulary {V} from that file, hidden {H}, embeddings {D}, "
              f"batch {args.batch}")
        ref = None
        if args.torch_python:
            check = data[:8]
            ref = torch_lstm_lm(args.torch_python, t, len(check), args.epochs)
            print(_check_line("PyTorch", len(check), "sentences", t.loss_and_grads(check, training=False).loss,
                              ref["check_loss"]))
        flops = 3 * lstm_lm_flops([len(x) for x, _ in data], D, H, V) / t.task.units(data)
        _report("hidden 512", "words", float(np.median(throughput(t, args.epochs))), flops, machine,
                "PyTorch nn.LSTM (packed)", ref)
    if args.ablation:
        print("\nspeedup over all switches off (Fig. 10), median epoch time ratio")
        ptb = args.ptb if os.path.isfile(args.ptb) else None
        for name in ("Tree-LSTM", "Fixed-LSTM"):
            for h in (64, 128, 256, 512):
                rates = {}
                for label, opts in SWITCHES.items():
                    t = (tree_lstm(args.sst, h, args.embed, args.batch, args.trees, opts) if name == "Tree-LSTM"
                         else fixed_lstm(ptb, h, args.batch, opts))
                    rates[label] = float(np.median(throughput(t, args.epochs)))
                base = rates["all off"]
                print(f"  {name:<10} hidden {h:>3}: " + "  ".join(
                    f"{k} {v / base:4.2f}x" for k, v in rates.items() if k != "all off")
                    + f"   (all off {base:.1f}/s)")
    return 0
