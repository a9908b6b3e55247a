"""What a model does around its graph, by name: so that an exported model can state it as data.

An artifact (:mod:`minicavs.train.artifact`) names one entry of each table with its settings, and the model
that wrote it uses the same functions, so the two cannot drift apart:

- ``READERS``: parse one input line into a sample (``reader(line, where, **settings)``);
- ``GRAPHS``: the input graphs of a chunk of samples;
- ``FEEDS``: one feed array of a chunk (``feed(samples, vocabulary index, **settings)``);
- ``RENDERERS``: per sample its output row (``text`` and the numbers behind it) from the model's outputs.

A model whose reading, feeding or rendering is none of these exists only as Python code, and exporting it is
refused (``Task.export_spec``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import math

import numpy as np

from ..core.errors import DataError
from ..data.sst import parse_any_tree
from ..data.trees import Tree
from ..runtime.inputs import InputGraph


def read_tree(line: str, where: str, num_labels: int, max_children: int) -> Tree:
    return parse_any_tree(line, where, num_labels=num_labels, max_children=max_children)


def tree_graphs(trees: Sequence[Tree]) -> list:
    return InputGraph.many([t.children for t in trees])


def leaf_word_ids(trees: Sequence[Tree], index: dict, unknown: str) -> np.ndarray:
    """The vocabulary id of every leaf's word, tree by tree; a word not in it reads as ``unknown``."""
    unk = index[unknown]
    return np.array([index.get(t.words[v], unk) for t in trees for v, ch in enumerate(t.children) if not ch],
                    np.int64)


def tree_labels(trees: Sequence[Tree], outputs: dict, vocabulary: list, output: str) -> list[dict]:
    """Each tree with its argmax label at every node, its root's label and probabilities (and the gold
    root label when the input had one)."""
    probs = np.split(outputs[output], np.cumsum([t.num_vertices for t in trees])[:-1])
    rows = []
    for tree, p in zip(trees, probs):
        labelled = Tree(tree.children, p.argmax(1), tree.words)
        row = {"text": labelled.to_bracket(), "label": int(p[-1].argmax()),
               "probs": [round(float(q), 6) for q in p[-1]]}
        if tree.labels[tree.root] >= 0:
            row["gold"] = int(tree.labels[tree.root])
        rows.append(row)
    return rows


# --- digit sequences (the bundled seq2seq model: a foreach encoder, a while_loop greedy decoder) ----------

def read_digits(line: str, where: str, max_len: int) -> np.ndarray:
    """Digits separated by spaces or not, 1 to ``max_len`` of them."""
    digits = [ch for ch in line if not ch.isspace()]
    if not digits or not all(ch in "0123456789" for ch in digits):
        raise DataError(f"{where}: expected digits, got {line.strip()!r}")
    if len(digits) > max_len:
        raise DataError(f"{where}: {len(digits)} digits; this model reads at most {max_len} (model.max_len)")
    return np.array([int(ch) for ch in digits], np.int64)


def no_graphs(samples: Sequence) -> dict:
    """A model of static graphs only (its loops are control-flow ops): no input graphs."""
    return {}


def padded_source(samples: Sequence[np.ndarray], index: dict, max_len: int) -> np.ndarray:
    src = np.zeros((len(samples), max_len), np.int64)
    for r, s in enumerate(samples):
        src[r, :len(s)] = s
    return src


def source_mask(samples: Sequence[np.ndarray], index: dict, max_len: int, dtype: str) -> np.ndarray:
    return (np.arange(max_len) < np.array([len(s) for s in samples])[:, None]).astype(dtype)


def reversed_decoder_input(samples: Sequence[np.ndarray], index: dict, max_len: int, go: int,
                           eos: int) -> np.ndarray:
    """<go>, then the source reversed, then <eos> (teacher forcing's input; greedy decoding reads <go>)."""
    out = np.full((len(samples), max_len + 1), eos, np.int64)
    for r, s in enumerate(samples):
        out[r, 0] = go
        out[r, 1:len(s) + 1] = s[::-1]
    return out


def zero_state(samples: Sequence, index: dict, width: int, dtype: str) -> np.ndarray:
    return np.zeros((len(samples), width), dtype)


def tokens_until(samples: Sequence, outputs: dict, vocabulary, output: str, eos: int) -> list[dict]:
    """Per sample its decoded tokens (argmax of the one-hot rows) up to the first ``eos``; steps that never
    ran are zeros, whose argmax 0 comes after <eos>."""
    rows = []
    for row in np.argmax(np.asarray(outputs[output]), axis=-1):
        stop = np.flatnonzero(row == eos)
        digits = [int(d) for d in (row[:stop[0]] if stop.size else row)]
        rows.append({"text": "".join(map(str, digits)), "digits": digits})
    return rows


# --- sentences (the bundled language models on chain graphs) -------------------------------------------

def read_tokens(line: str, where: str) -> list[str]:
    return line.split()


def eos_chains(sentences: Sequence[list]) -> list:
    """One chain per sentence, a vertex per prediction: <eos> w_1..w_n predicts w_1..w_n <eos>."""
    return [InputGraph.chain(len(s) + 1) for s in sentences]


def _ids(tokens: list, index: dict, unknown: str) -> np.ndarray:
    unk = index[unknown]
    return np.array([index.get(w, unk) for w in tokens], np.int64)


def eos_then_ids(sentences: Sequence[list], index: dict, eos: str, unknown: str) -> np.ndarray:
    return np.concatenate([np.concatenate(([index[eos]], _ids(s, index, unknown))) for s in sentences])


def ids_then_eos(sentences: Sequence[list], index: dict, eos: str, unknown: str) -> np.ndarray:
    return np.concatenate([np.concatenate((_ids(s, index, unknown), [index[eos]])) for s in sentences])


def last_positions(sentences: Sequence[list], index: dict) -> np.ndarray:
    """Each sentence's last vertex in the batch's vertex order (where its next word is predicted)."""
    return np.cumsum([len(s) + 1 for s in sentences]) - 1


def perplexity(sentences: Sequence[list], outputs: dict, vocabulary: list, token_nll: str, next: str,
               top: int) -> list[dict]:
    """Per sentence its perplexity and log-likelihood (each word and the closing <eos>) and the ``top``
    likeliest next words."""
    lengths = np.array([len(s) + 1 for s in sentences])
    nll = np.add.reduceat(np.asarray(outputs[token_nll]).astype(np.float64), np.cumsum(lengths) - lengths)
    known = set(vocabulary)
    rows = []
    for tokens, n, sent_nll, logp in zip(sentences, lengths, nll, outputs[next]):
        best = np.argsort(-logp, kind="stable")[:top]
        nxt = [(vocabulary[k], float(np.exp(logp[k]))) for k in best]
        ppl = math.exp(sent_nll / n)
        rows.append({"text": f"perplexity {ppl:.2f}  log-likelihood {-sent_nll:.2f} ({n} predictions)  next: "
                             + ", ".join(f"{w} {p:.3f}" for w, p in nxt),
                     "perplexity": ppl, "log_likelihood": -float(sent_nll), "predictions": int(n),
                     "unknown_words": int(sum(w not in known for w in tokens)),
                     "next": [{"word": w, "prob": round(p, 6)} for w, p in nxt]})
    return rows


READERS: dict[str, Callable[..., Any]] = {"tree": read_tree, "digits": read_digits, "tokens": read_tokens}
# per reader, an input line every model reading it accepts: loading runs it once, so that the kernels and the C
# runner's libraries are built at load time, not in the first request
PROBES = {"tree": "((a b) c)", "digits": "12", "tokens": "a b"}
GRAPHS: dict[str, Callable[[Sequence], Any]] = {"trees": tree_graphs, "none": no_graphs, "eos_chains": eos_chains}
FEEDS: dict[str, Callable[..., np.ndarray]] = {
    "leaf_word_ids": leaf_word_ids, "padded_source": padded_source, "source_mask": source_mask,
    "reversed_decoder_input": reversed_decoder_input, "zero_state": zero_state, "eos_then_ids": eos_then_ids,
    "ids_then_eos": ids_then_eos, "last_positions": last_positions}
RENDERERS: dict[str, Callable[..., list]] = {"tree_labels": tree_labels, "tokens_until": tokens_until,
                                             "perplexity": perplexity}
TABLES = {"reader": READERS, "graphs": GRAPHS, "feed": FEEDS, "render": RENDERERS}
