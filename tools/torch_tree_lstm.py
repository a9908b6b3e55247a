"""The bench's binary Tree-LSTM in PyTorch (CPU, or the spec's ``device``), two ways, for `minicavs bench --torch-python`:

- ``recursive``: one tree at a time, vertex by vertex, as a user would write it (the paper's PyTorch baseline);
- ``level``: hand-batched by level: all vertices of one height across the batch in one matmul, children's
  states gathered with index_select from the levels below.

Same function as minicavs' tree_lstm (rows @ W; gates [i, o, u]): leaf [i, o, u] = x·W + b_l,
c = σ(i)⊙tanh(u); internal [i, o, u] = [h1; h2]·U + b_i, f_k = σ(h_k·U_fk + b_f),
c = σ(i)⊙tanh(u) + f1⊙c1 + f2⊙c2; h = σ(o)⊙tanh(c); softmax(h·W_o + b_o) at every vertex; loss = summed
cross-entropy / trees. Runs in its own environment (tools/setup_peers.sh), imports nothing from minicavs.
Input: one JSON spec (trees as children lists, leaf word ids and labels; weights as .npz); output: one JSON
line (the protocol of minicavs/bench/peers.py; units are trees; optimizer: tools/torch_peer.py, the embedding
rows a batch looks up updated lazily when minicavs does).

    python tools/torch_tree_lstm.py SPEC.json
"""
import numpy as np
from peer_common import read_spec
from torch_peer import check_loss, device, lazy_rows, set_threads, train_and_report


def main():
    import torch
    F = torch.nn.functional
    spec = read_spec()
    if spec["mode"] not in ("recursive", "level"):
        raise ValueError(f"mode {spec['mode']!r}: torch_tree_lstm.py runs 'recursive' or 'level'")
    set_threads(torch, spec)
    dev = device(torch, spec)
    w = np.load(spec["weights"])
    names = ("E", "W", "b_l", "U", "b_i", "U_f1", "U_f2", "b_f", "W_o", "b_o")
    P = {k: torch.nn.Parameter(torch.from_numpy(np.array(w[k])).to(dev)) for k in names}
    H = P["U_f1"].shape[0]
    lazy = lazy_rows(spec)   # lookups with sparse gradients: only the rows looked up are updated

    def embed(ids):
        return F.embedding(torch.as_tensor(ids, device=dev), P["E"], sparse=lazy)
    trees = spec["trees"]
    for t in trees:   # children before parents (as minicavs and the DyNet peer number them)
        t["height"] = height = [0] * len(t["children"])
        for v, ch in enumerate(t["children"]):
            height[v] = 1 + max(height[c] for c in ch) if ch else 0

    def cell(iou, c_in):
        i, o, u = iou[..., :H], iou[..., H:2 * H], iou[..., 2 * H:]
        c = torch.sigmoid(i) * torch.tanh(u) + c_in
        return torch.sigmoid(o) * torch.tanh(c), c

    def recursive_loss(batch):
        total = 0.0
        for t in batch:
            h, c, losses = {}, {}, []
            for v, ch in enumerate(t["children"]):
                if not ch:
                    x = embed([t["words"][str(v)]])[0]
                    h[v], c[v] = cell(x @ P["W"] + P["b_l"], 0.0)
                else:
                    a, b = ch
                    f1 = torch.sigmoid(h[a] @ P["U_f1"] + P["b_f"])
                    f2 = torch.sigmoid(h[b] @ P["U_f2"] + P["b_f"])
                    h[v], c[v] = cell(torch.cat([h[a], h[b]]) @ P["U"] + P["b_i"], f1 * c[a] + f2 * c[b])
                gold = torch.tensor([t["labels"][v]], device=dev)
                losses.append(F.cross_entropy((h[v] @ P["W_o"] + P["b_o"])[None], gold, reduction="sum"))
            total = total + torch.stack(losses).sum()
        return total / len(batch)

    def level_loss(batch):
        # global row of every vertex, level by level; row n (last) stands for "no child" and stays unused
        verts = [(k, v) for k, t in enumerate(batch) for v in range(len(t["children"]))]
        by_level = {}
        for k, v in verts:
            by_level.setdefault(batch[k]["height"][v], []).append((k, v))
        row, order = {}, []
        for lvl in sorted(by_level):
            for kv in by_level[lvl]:
                row[kv] = len(order)
                order.append(kv)
        hs, cs = [], []
        for lvl in sorted(by_level):
            group = by_level[lvl]
            if lvl == 0:
                h, c = cell(embed([batch[k]["words"][str(v)] for k, v in group]) @ P["W"] + P["b_l"], 0.0)
            else:
                h_all, c_all = torch.cat(hs), torch.cat(cs)
                left = torch.tensor([row[(k, batch[k]["children"][v][0])] for k, v in group], device=dev)
                right = torch.tensor([row[(k, batch[k]["children"][v][1])] for k, v in group], device=dev)
                h1, h2 = h_all[left], h_all[right]
                f1 = torch.sigmoid(h1 @ P["U_f1"] + P["b_f"])
                f2 = torch.sigmoid(h2 @ P["U_f2"] + P["b_f"])
                h, c = cell(torch.cat([h1, h2], 1) @ P["U"] + P["b_i"], f1 * c_all[left] + f2 * c_all[right])
            hs.append(h)
            cs.append(c)
        labels = torch.tensor([batch[k]["labels"][v] for k, v in order], device=dev)
        logits = torch.cat(hs) @ P["W_o"] + P["b_o"]
        return F.cross_entropy(logits, labels, reduction="sum") / len(batch)

    loss_fn = recursive_loss if spec["mode"] == "recursive" else level_loss
    check = check_loss(torch, loss_fn, trees[:spec["check"]])
    train_and_report(torch, P.values(), loss_fn, lambda i, j: (trees[i:j],), [1] * len(trees), spec, check,
                     sparse=[P["E"]] if lazy else (), named={k: (lambda k=k: P[k]) for k in names})


if __name__ == "__main__":
    main()
