"""A custom dynamic model from scratch: a Tree-RNN that tells whether a phrase is positive.

Run it from the repository root: ``python examples/custom_tree_model.py`` (a few seconds). It walks through
everything a new model needs, without a config file or the trainer:

1. parameters, and two vertex functions (F) declared with symbolic ops and gather / scatter / pull / push:
   a leaf pulls its word's embedding, an internal vertex gathers its two children;
2. input graphs (G) built from nested tuples of words, one per sample, different in every sample;
3. a static graph on top (a classifier of the root's pushed state and a loss), feeds, a forward and
   backward pass over the whole batch at once;
4. a few optimizer steps;
5. ``explain`` (tasks, rows copied, tensor bytes) and ``check`` (the batch rerun one vertex at a time: the
   largest differences to the batched run, float64 so the difference is rounding only).

The rule to learn: a phrase is positive (label 1) when it has more "good" than "bad" words.
"""
from __future__ import annotations

import numpy as np

from minicavs import (Adam, InputGraph, Model, ParameterSet, RunContext, Structure, VertexFunction, check,
                      explain, leaf_internal, ops)

H, D = 16, 8                                   # hidden state and embedding sizes
VOCAB = ["good", "bad", "movie", "plot", "very", "the"]
DTYPE = "float64"                              # float64 so check() compares rounding only

# --- 1. parameters and the vertex functions --------------------------------------------------------------
p = ParameterSet()
p.new("E", (len(VOCAB), D), init="uniform(0.5)", dtype=DTYPE, rng=0)
p.new("W_leaf", (D, H), dtype=DTYPE, rng=0)
p.new("W_kids", (2 * H, H), dtype=DTYPE, rng=0)
p.new("b", (H,), init="zeros", dtype=DTYPE, rng=0)
p.new("W_out", (H, 2), dtype=DTYPE, rng=0)
p.new("b_out", (2,), init="zeros", dtype=DTYPE, rng=0)

leaf = VertexFunction("leaf", arity=0, message=(H,), dtype=DTYPE)
with leaf:                                     # h = tanh(x W_leaf + b): x is this leaf's row of the embeddings
    h = ops.tanh(ops.linear(leaf.pull((D,), "x"), p["W_leaf"].node, p["b"].node))
    leaf.scatter(h)                            # what the parent gathers
    leaf.push(h)                               # this vertex's row of the push buffer 'h'

internal = VertexFunction("internal", arity=2, message=(H,), dtype=DTYPE)
with internal:                                 # h = tanh([h_left; h_right] W_kids + b)
    kids = ops.concat([internal.gather(0), internal.gather(1)])
    h = ops.tanh(ops.linear(kids, p["W_kids"].node, p["b"].node))
    internal.scatter(h)
    internal.push(h)

# --- 2. the static graphs around F: the embedding lookup feeds the pull, the classifier reads the pushes ----
words = ops.input((None,), "int64", name="words")        # one word id per leaf, batch vertex order
roots = ops.input((None,), "int64", name="roots")        # the row of each sample's root in the push buffer
labels = ops.input((None,), "int64", name="labels")      # one label per sample
tree = Structure({"leaf": leaf, "internal": internal}, pulls={"x": ops.lookup(p["E"].node, words)},
                 kinds=leaf_internal, name="tree")
logits = ops.linear(ops.lookup(tree.pushed("h"), roots), p["W_out"].node, p["b_out"].node)
loss = ops.mean(ops.softmax_cross_entropy(logits, labels))
model = Model(tree, loss=loss, outputs={"probs": ops.softmax(logits)})


def label(phrase) -> int:
    flat = str(phrase)
    return int(flat.count("'good'") > flat.count("'bad'"))


def batch(phrases):
    """Input graphs from nested tuples and the feeds that go with them."""
    graphs, ids, root_rows = [], [], []
    offset = 0
    for phrase in phrases:
        g, payloads = InputGraph.from_nested(phrase)     # children before parents, the root last
        graphs.append(g)
        ids += [VOCAB.index(w) for w in payloads if w is not None]   # leaves in vertex order
        offset += g.num_vertices                          # every vertex pushes: one row each
        root_rows.append(offset - 1)
    feeds = {"words": np.array(ids), "roots": np.array(root_rows), "labels": np.array([label(s) for s in phrases])}
    return graphs, feeds


def random_phrase(rng, depth=0):
    if depth > 2 or rng.random() < 0.3:
        return VOCAB[rng.integers(len(VOCAB))]
    return (random_phrase(rng, depth + 1), random_phrase(rng, depth + 1))


rng = np.random.default_rng(1)
train = [random_phrase(rng) for _ in range(64)]
train = [s if isinstance(s, tuple) else (s, "movie") for s in train]   # at least two words each
graphs, feeds = batch(train)

# --- 3 and 4. forward, backward and a few Adam steps over the whole batch ----------------------------------
optimizer = Adam(p.values(), lr=0.05)
first = model.forward_backward(graphs, feeds, p).loss
for step in range(30):
    result = model.forward_backward(graphs, feeds, p, RunContext(step=step))
    optimizer.step(result.grads, loss=result.loss)
last = model.forward_backward(graphs, feeds, p).loss
accuracy = np.mean(model.infer(graphs, feeds, p).outputs["probs"].argmax(1) == feeds["labels"])
print(f"loss {first:.4f} -> {last:.4f} after 30 steps; training accuracy {accuracy:.0%}")

# --- 5. what the batching did, and batched == one vertex at a time ------------------------------------------
print(explain(model, graphs[:8], batch(train[:8])[1], p))
report = check(model, graphs[:8], batch(train[:8])[1], p)
print(f"batched vs serial, largest difference: {report['max']:.2e}")
assert last < first and report["max"] < 1e-10
