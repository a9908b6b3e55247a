"""The bench's LSTM language models (Var-LSTM on sentences, Fixed-LSTM on 64-word windows) in PyTorch (CPU, or
the spec's ``device``: cuDNN's LSTM on a GPU), two ways, for `minicavs bench --torch-python`:

- ``packed``: ``nn.LSTM`` over packed sequences. A batch is packed once (pack_sequence, unsorted: PyTorch
  sorts by length), embedded with one lookup on the packed ids, run through nn.LSTM and the output layer on
  the packed rows;
- ``recursive``: one sentence at a time, an ``nn.LSTMCell`` called word by word, as a user would write it
  (the paper's per-sample baseline): one embedding lookup per sentence, the cell loop, the output layer and
  the cross-entropy on the sentence's stacked states.

Same function as models/var_lstm.py (and models/fixed_lstm.py, whose samples are windows) without dropout:
sample k reads inputs x_1..x_n and predicts targets y_1..y_n (a sentence w_1..w_n reads <eos> w_1..w_n and
predicts w_1..w_n <eos>; a window reads 64 words and predicts the next 64: the host hands over the pairs);
[i, f, o, u] = x·W_x + h·W_h + b (minicavs' gate order; PyTorch's is i, f, g, o, so the weights are
permuted here; bias_hh stays zero at the start); every sample starts from a zero state (h and c), softmax
over the vocabulary at every step, loss = summed cross-entropy / samples. Runs in its own environment
(tools/setup_peers.sh), imports nothing from minicavs.

Input: one JSON spec naming an .npz of weights (rows @ W, as minicavs stores them: E, W_x, W_h, b, W_o, b_o)
and an .npz of data (inputs and targets of all samples concatenated, ptr: sample offsets). Output: one JSON
line (the protocol of minicavs/bench/peers.py; units are words, i.e. predictions; optimizer:
tools/torch_peer.py).

    python tools/torch_lstm_lm.py SPEC.json
"""
import numpy as np
from peer_common import read_spec
from torch_peer import check_loss, device, lazy_rows, set_threads, train_and_report


def main():
    import torch
    from torch.nn.utils.rnn import pack_sequence
    F = torch.nn.functional
    spec = read_spec()
    if spec["mode"] not in ("packed", "recursive"):
        raise ValueError(f"mode {spec['mode']!r}: torch_lstm_lm.py runs 'packed' or 'recursive'")
    set_threads(torch, spec)
    dev = device(torch, spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    ptr = data["ptr"]
    every_input, every_target = torch.from_numpy(data["inputs"]).to(dev), torch.from_numpy(data["targets"]).to(dev)
    inputs = [every_input[a:b] for a, b in zip(ptr[:-1], ptr[1:])]
    targets = [every_target[a:b] for a, b in zip(ptr[:-1], ptr[1:])]
    V, D = w["E"].shape
    H = w["W_h"].shape[0]
    blocks = [slice(0, H), slice(H, 2 * H), slice(3 * H, 4 * H), slice(2 * H, 3 * H)]   # i, f, u(g), o
    perm = np.concatenate([np.arange(4 * H)[s] for s in blocks])
    lazy = lazy_rows(spec)   # lookups with sparse gradients: only the rows looked up are updated
    emb = torch.nn.Embedding(V, D, sparse=lazy)
    lstm = torch.nn.LSTM(D, H) if spec["mode"] == "packed" else torch.nn.LSTMCell(D, H)
    suffix = "_l0" if spec["mode"] == "packed" else ""
    out = torch.nn.Linear(H, V)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w["E"]))
        getattr(lstm, "weight_ih" + suffix).copy_(torch.from_numpy(np.ascontiguousarray(w["W_x"][:, perm].T)))
        getattr(lstm, "weight_hh" + suffix).copy_(torch.from_numpy(np.ascontiguousarray(w["W_h"][:, perm].T)))
        getattr(lstm, "bias_ih" + suffix).copy_(torch.from_numpy(w["b"][perm]))
        getattr(lstm, "bias_hh" + suffix).zero_()
        out.weight.copy_(torch.from_numpy(np.ascontiguousarray(w["W_o"].T)))
        out.bias.copy_(torch.from_numpy(w["b_o"]))
    for module in (emb, lstm, out):
        module.to(dev)
    getattr(lstm, "bias_hh" + suffix).requires_grad_(False)   # minicavs has one bias: b_ih alone trains
    params = list(emb.parameters()) + list(lstm.parameters()) + list(out.parameters())

    def packed_loss(xs, ys):
        ids = pack_sequence(xs, enforce_sorted=False)      # time-major, sentences sorted by length
        h, _ = lstm(ids._replace(data=emb(ids.data)))      # one embedding lookup for the whole batch
        gold = pack_sequence(ys, enforce_sorted=False)     # the same lengths, so the same order as h
        return F.cross_entropy(out(h.data), gold.data, reduction="sum") / len(xs)

    def recursive_loss(xs, ys):
        total = 0.0
        for x, y in zip(xs, ys):
            e = emb(x)
            state, hs = None, []                           # None: zero h and c
            for t in range(len(x)):
                state = lstm(e[t:t + 1], state)
                hs.append(state[0])
            total = total + F.cross_entropy(out(torch.cat(hs)), y, reduction="sum")
        return total / len(xs)

    loss_fn = packed_loss if spec["mode"] == "packed" else recursive_loss
    k = spec["check"]
    check = check_loss(torch, loss_fn, inputs[:k], targets[:k])
    back = np.argsort(perm)   # torch's gate order back to minicavs'
    ih, hh, bias = (getattr(lstm, name + suffix) for name in ("weight_ih", "weight_hh", "bias_ih"))
    named = {"E": lambda: emb.weight, "W_x": lambda: ih.T[:, back], "W_h": lambda: hh.T[:, back],
             "b": lambda: bias[back], "W_o": lambda: out.weight.T, "b_o": lambda: out.bias}
    train_and_report(torch, params, loss_fn, lambda i, j: (inputs[i:j], targets[i:j]), [len(y) for y in targets],
                     spec, check, sparse=[emb.weight] if lazy else (), named=named)


if __name__ == "__main__":
    main()
