"""The bench's Var-LSTM language model in PyTorch (CPU): nn.LSTM over packed sequences.

Same function as models/var_lstm.py without dropout: sentence w_1..w_n reads <eos> w_1..w_n and predicts
w_1..w_n <eos>; [i, f, o, u] = x·W_x + h·W_h + b (minicavs' gate order; PyTorch's is i, f, g, o, so the
weights are permuted here; bias_hh stays zero at the start), zero initial state, softmax over the vocabulary
at every step, loss = summed cross-entropy / sentences. A batch is packed once (pack_sequence, unsorted:
PyTorch sorts by length), embedded with one lookup on the packed ids, run through nn.LSTM and the output
layer on the packed rows. Runs in its own environment (tools/setup_peers.sh), imports nothing from minicavs.

Input: one JSON spec naming an .npz of weights (rows @ W, as minicavs stores them: E, W_x, W_h, b, W_o, b_o)
and an .npz of data (inputs and targets of all sentences concatenated, ptr: sentence offsets), with batch,
epochs, check_sentences, threads and optimizer (tools/torch_peer.py). Output: one JSON line with the loss of
the first check_sentences sentences for the given weights (no update) and words/s (predictions per second)
of each timed epoch after a warm-up epoch (forward, backward, update).

    python tools/torch_lstm_lm.py SPEC.json
"""
import json
import sys

import numpy as np
from torch_peer import set_threads, train_and_report


def main(path):
    import torch
    from torch.nn.utils.rnn import pack_sequence
    spec = json.load(open(path))
    set_threads(torch, spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    ptr = data["ptr"]
    inputs = [torch.from_numpy(data["inputs"][a:b]) for a, b in zip(ptr[:-1], ptr[1:])]
    targets = [torch.from_numpy(data["targets"][a:b]) for a, b in zip(ptr[:-1], ptr[1:])]
    V, D = w["E"].shape
    H = w["W_h"].shape[0]
    blocks = [slice(0, H), slice(H, 2 * H), slice(3 * H, 4 * H), slice(2 * H, 3 * H)]   # i, f, u(g), o
    perm = np.concatenate([np.arange(4 * H)[s] for s in blocks])
    emb = torch.nn.Embedding(V, D)
    lstm = torch.nn.LSTM(D, H)
    out = torch.nn.Linear(H, V)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w["E"]))
        lstm.weight_ih_l0.copy_(torch.from_numpy(np.ascontiguousarray(w["W_x"][:, perm].T)))
        lstm.weight_hh_l0.copy_(torch.from_numpy(np.ascontiguousarray(w["W_h"][:, perm].T)))
        lstm.bias_ih_l0.copy_(torch.from_numpy(w["b"][perm]))
        lstm.bias_hh_l0.zero_()
        out.weight.copy_(torch.from_numpy(np.ascontiguousarray(w["W_o"].T)))
        out.bias.copy_(torch.from_numpy(w["b_o"]))
    params = list(emb.parameters()) + list(lstm.parameters()) + list(out.parameters())

    def loss_fn(xs, ys):
        ids = pack_sequence(xs, enforce_sorted=False)      # time-major, sentences sorted by length
        h, _ = lstm(ids._replace(data=emb(ids.data)))      # one embedding lookup for the whole batch
        gold = pack_sequence(ys, enforce_sorted=False)     # the same lengths, so the same order as h
        return torch.nn.functional.cross_entropy(out(h.data), gold.data, reduction="sum") / len(xs)

    k = spec["check_sentences"]
    with torch.no_grad():
        check_loss = float(loss_fn(inputs[:k], targets[:k]))
    bs = spec["batch"]
    batches = [(inputs[i:i + bs], targets[i:i + bs]) for i in range(0, len(inputs), bs)]
    train_and_report(torch, params, loss_fn, batches, sum(len(y) for y in targets), spec, check_loss)


if __name__ == "__main__":
    main(sys.argv[1])
