"""The bench's binary Tree-LSTM in DyNet 2.2 with autobatching, for `minicavs bench --dynet-python`.

Runs in DyNet's own environment (`pip install dynet38`) and imports nothing from minicavs. minicavs hands it
the trees (children, leaf word ids, labels), the weights (rows @ W convention; transposed here for DyNet's
W * x) and the settings in one .npz/.json pair; it prints one JSON line: the loss of the first trees with
those weights (no update), then trees/s per timed epoch (forward, backward, Adam update).

    python tools/dynet_tree_lstm.py INPUT.json
"""
import json
import sys
import time

import numpy as np


def main(path):
    spec = json.load(open(path))
    import dynet_config
    dynet_config.set(autobatch=1, mem=spec.get("mem", 2048), random_seed=1)
    import dynet as dy

    w = np.load(spec["weights"])
    H = spec["hidden"]
    pc = dy.ParameterCollection()
    E = pc.lookup_parameters_from_numpy(w["E"])
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T)) for k in ("W", "U", "U_f1", "U_f2", "W_o")}
    B = {k: pc.parameters_from_numpy(w[k]) for k in ("b_l", "b_i", "b_f", "b_o")}
    trees = spec["trees"]

    def tree_loss(t):
        children, words, labels = t["children"], t["words"], t["labels"]
        state, losses = {}, []
        for v in range(len(children)):  # children come before parents
            ch = children[v]
            if not ch:
                iou = P["W"] * dy.lookup(E, words[str(v)]) + B["b_l"]
                c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
            else:
                (h1, c1), (h2, c2) = state[ch[0]], state[ch[1]]
                iou = P["U"] * dy.concatenate([h1, h2]) + B["b_i"]
                f1 = dy.logistic(P["U_f1"] * h1 + B["b_f"])
                f2 = dy.logistic(P["U_f2"] * h2 + B["b_f"])
                c = (dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
                     + dy.cmult(f1, c1) + dy.cmult(f2, c2))
            h = dy.cmult(dy.logistic(dy.pick_range(iou, H, 2 * H)), dy.tanh(c))
            state[v] = (h, c)
            losses.append(dy.pickneglogsoftmax(P["W_o"] * h + B["b_o"], labels[v]))
        return dy.esum(losses)

    dy.renew_cg()
    check = trees[:spec["check_trees"]]
    check_loss = (dy.esum([tree_loss(t) for t in check]) / len(check)).value()
    trainer = dy.AdamTrainer(pc, alpha=spec["lr"])
    bs = spec["batch"]
    rates = []
    for epoch in range(spec["epochs"] + 1):   # the first epoch warms up
        start = time.perf_counter()
        for i in range(0, len(trees), bs):
            dy.renew_cg()
            batch = trees[i:i + bs]
            loss = dy.esum([tree_loss(t) for t in batch]) / len(batch)
            loss.value()
            loss.backward()
            trainer.update()
        if epoch:
            rates.append(len(trees) / (time.perf_counter() - start))
    print(json.dumps({"check_loss": check_loss, "trees_per_s": rates}))


if __name__ == "__main__":
    main(sys.argv[1])
