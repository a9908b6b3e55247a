"""minicavs predict: outputs equal an independent per-sample computation; bad lines and targets are clear errors."""
from __future__ import annotations

import io
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.train.cli import main
from minicavs.data.sst import parse_any_tree
from minicavs.core.errors import DataError
from minicavs.train.predict import PredictError, predict_lines
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"


def tiny(tmp_path, model: str, **model_cfg) -> Path:
    cfg = yaml.safe_load((MODELS / f"{model}.yaml").read_text())
    cfg["model"]["name"] = str(MODELS / f"{model}.py")
    cfg["model"].update(model_cfg)
    cfg["data"]["synthetic"] = {"train": 60, "dev": 10, "test": 10, "seed": 7}
    if model != "tree_fc":   # tree_fc draws random vectors: no vocabulary
        cfg["data"]["synthetic"]["vocab"] = 40
    cfg["train"]["epochs"] = 1
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_parse_any_tree_labelled_and_unlabelled():
    t = parse_any_tree("((the movie) (was great))")
    assert t.children == [[], [], [0, 1], [], [], [3, 4], [2, 5]]
    assert t.words == ["the", "movie", None, "was", "great", None, None] and (t.labels == -1).all()
    t = parse_any_tree("(3 (2 it) (4 works))")
    assert t.labels.tolist() == [2, 4, 3] and t.words == ["it", "works", None]
    assert parse_any_tree("((great))").words == ["great"]
    assert parse_any_tree("(1 (2 3))").labels.tolist() == [2, 1]   # labelled: every node starts with an integer


@pytest.mark.parametrize("line, match", [
    ("(a b c)", r"x:7: a node with 3 children; this model's trees have at most 2"),
    ("(3 (2 a) (2 b) (2 c))", r"x:7: a node with 3 children"),
    ("((a b)", r"x:7: unbalanced '\(' \(missing 1"),
    ("(a b))", r"x:7: unbalanced '\)'"),
    ("", r"x:7: no tree"),
    ("a b", r"x:7: 2 trees or words side by side"),
    ("(a ())", r"x:7: an empty node"),
    ("(9 (2 a) (2 b))", r"x:7: label 9 out of range 0..4"),
])
def test_bad_trees_name_the_line(line, match):
    with pytest.raises(DataError, match=match):
        parse_any_tree(line, "x:7")


@pytest.fixture(scope="module", params=["tree_lstm", "tree_gru", "tree_lstm_2type"])
def tree_trainer(tmp_path_factory, request):
    """The tree classifiers (their subclasses give vertices other cells and kinds: predict builds the graphs
    the same way training does)."""
    return Trainer(tiny(tmp_path_factory.mktemp("t"), request.param, embed=8, hidden=8))


def test_tree_predictions_equal_the_trained_model_one_tree_at_a_time(tree_trainer):
    """Batched predict == the training model's own probs (its outputs), each tree run alone."""
    task = tree_trainer.task
    trees = task.data["dev"][:6]
    lines = [t.to_bracket() for t in trees] + ["((" + " ".join(trees[0].sentence()[:2]) + ") unseenword)"]
    rows = predict_lines(task, lines, batch_size=4)
    assert len(rows) == len(lines)
    for line, row in zip(lines, rows):
        tree = parse_any_tree(line)
        ref_tree = type(tree)(tree.children, np.maximum(tree.labels, 0), tree.words)
        graphs, feeds = task.batch([ref_tree])
        probs = task.model.infer(graphs, feeds, task.params).outputs["probs"]
        np.testing.assert_allclose(row["probs"], probs[-1], atol=1e-5)
        back = parse_any_tree(row["text"])          # every node labelled with its argmax, words unchanged
        assert back.words == tree.words and back.children == tree.children
        top2 = np.sort(probs, 1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-5       # batched and serial float32 may round a near tie apart
        assert clear.sum() > len(clear) // 2
        assert back.labels[clear].tolist() == probs.argmax(1)[clear].tolist()
        assert back.labels[-1] == row["label"] and (not clear[-1] or row["label"] == int(probs[-1].argmax()))
    assert rows[0]["gold"] == int(trees[0].labels[-1]) and "gold" not in rows[-1]


@pytest.fixture(scope="module")
def lm_trainer(tmp_path_factory):
    return Trainer(tiny(tmp_path_factory.mktemp("lm"), "var_lstm", embed=8, hidden=8))


def test_lm_predictions_equal_a_numpy_reference(lm_trainer):
    """Per-line log-likelihood == the model's own eval loss of that one sentence; next-word probabilities ==
    softmax(h_last W_o + b_o) in numpy from the pushed h."""
    task = lm_trainer.task
    vocab = task.vocab
    sentences = [[vocab.words[i] for i in x[1:]] for x, _ in task.data["dev"][:4]] + [["never", "seen"]]
    rows = predict_lines(task, [" ".join(s) for s in sentences], batch_size=3)
    p = {k: np.asarray(v.value, np.float64) for k, v in task.params.items()}
    for s, row in zip(sentences, rows):
        sample = task.make_samples([s])
        nll = task.evaluate(sample, 1)["loss"]
        assert row["predictions"] == len(s) + 1
        assert math.isclose(row["log_likelihood"], -nll, rel_tol=1e-5, abs_tol=1e-4)
        assert math.isclose(row["perplexity"], math.exp(nll / (len(s) + 1)), rel_tol=1e-5)
        graphs, feeds = task.batch(sample)
        h = task.model.infer(graphs, feeds, task.params).pushes["chain"]["h"][-1].astype(np.float64)
        ref = softmax(h @ p["W_o"] + p["b_o"])
        top = np.argsort(-ref)[:3]
        assert [n["word"] for n in row["next"]][:1] == [vocab.words[top[0]]]
        np.testing.assert_allclose([n["prob"] for n in row["next"]], ref[top], rtol=1e-4, atol=1e-6)
        assert row["unknown_words"] == sum(w not in vocab.index for w in s)
    assert rows[-1]["unknown_words"] == 2


def test_cli_predict_config_and_checkpoint(tmp_path, capsys):
    config = tiny(tmp_path, "tree_lstm", embed=8, hidden=8)
    trainer = Trainer(config)
    trainer.save(tmp_path / "w.npz")
    (tmp_path / "in.txt").write_text("((a b) c)\n(2 (1 x) (3 y))\n")
    assert main(["predict", str(config), "--checkpoint", str(tmp_path / "w.npz"), str(tmp_path / "in.txt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(parse_any_tree(line).labels.min() >= 0 for line in out)
    assert main(["predict", str(config), "--checkpoint", str(tmp_path / "w.npz"), str(tmp_path / "in.txt"),
                 "--json", "-o", str(tmp_path / "out.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == out and rows[1]["gold"] == 2
    assert not list(tmp_path.glob(".*.tmp*"))


@pytest.mark.parametrize("args, match", [
    (["{config}", "{input}"], r"is not a run dir: give the checkpoint to use with --checkpoint"),
    (["{tmp}", "{input}"], r"holds no checkpoint"),
    (["{tmp}/nothing", "{input}"], r"nothing is not a run dir"),
    (["{config}", "--checkpoint", "{tmp}/missing.npz", "{input}"], r"missing.npz"),
    (["{config}", "--checkpoint", "{tmp}/w.npz", "{tmp}/missing.txt"], r"input file not found"),
    (["{config}", "--checkpoint", "{tmp}/w.npz", "{bad}"], r"bad.txt:2: a node with 3 children"),
])
def test_cli_predict_errors(tmp_path, capsys, args, match):
    config = tiny(tmp_path, "tree_lstm", embed=8, hidden=8)
    Trainer(config).save(tmp_path / "w.npz")
    (tmp_path / "in.txt").write_text("(a b)\n")
    (tmp_path / "bad.txt").write_text("(a b)\n(a b c)\n")
    fill = dict(config=config, input=tmp_path / "in.txt", tmp=tmp_path, bad=tmp_path / "bad.txt")
    assert main(["predict"] + [a.format(**fill) for a in args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert re.search(match, captured.err), captured.err


def test_tree_fc_does_not_predict(tmp_path):
    trainer = Trainer(tiny(tmp_path, "tree_fc", hidden=4, leaves=4))
    with pytest.raises(PredictError, match="does not predict from text input"):
        predict_lines(trainer.task, ["x"])


def test_cli_predict_run_dir_uses_its_config_and_best_checkpoint(tmp_path, capsys):
    """A run dir alone is enough (its config.yaml and checkpoints); the output equals predicting with the
    config and the best checkpoint given explicitly."""
    config = tiny(tmp_path, "tree_lstm", embed=8, hidden=8)
    Trainer(config, run_dir=tmp_path / "run").fit(progress=False, log=lambda line: None)
    (tmp_path / "in.txt").write_text("((a b) c)\n(2 (1 x) (3 y))\n")
    assert main(["predict", str(tmp_path / "run"), str(tmp_path / "in.txt"), "--json"]) == 0
    from_run = capsys.readouterr().out
    assert main(["predict", str(config), "--checkpoint", str(tmp_path / "run" / "best.npz"),
                 str(tmp_path / "in.txt"), "--json"]) == 0
    assert capsys.readouterr().out == from_run and len(from_run.splitlines()) == 2


def test_tree_cache_is_not_fooled_by_a_reused_id(tree_trainer):
    """TreeLSTM caches prepared trees by id(); a freed tree's id can come back for another tree."""
    task = tree_trainer.task
    a, b = parse_any_tree("(2 (2 a) (2 b))"), parse_any_tree("(1 (1 x) (1 (1 y) (1 z)))")
    task.batch([a])
    task.samples[id(b)] = task.samples[id(a)]          # what id reuse after freeing ``a`` looks like
    graphs, feeds = task.batch([b])
    assert graphs[0].num_vertices == 5 and feeds["labels"].tolist() == [1, 1, 1, 1, 1]


def deep_tree_line(depth: int) -> str:
    """Unlabelled: ``depth`` internal nodes, each a leaf word on the left and the rest of the tree on the right."""
    return "(a " * depth + "b" + ")" * depth



@pytest.fixture(scope="module")
def runner_trainers(tmp_path_factory):
    """A tiny Tree-LSTM per runner, made when first asked for."""
    config = tiny(tmp_path_factory.mktemp("deep"), "tree_lstm", embed=2, hidden=2, dropout=0.0)
    made: dict = {}

    def trainer(runner: str) -> Trainer:
        if runner not in made:
            made[runner] = Trainer(config, [f"train.engine.runner={runner}"])
        return made[runner]
    return trainer


@pytest.mark.parametrize("runner, depth", [
    *((runner, depth) for runner in ("device", "reference") for depth in (1, 2, 500, 5_000)),
    ("device", 100_000),
    pytest.param("reference", 100_000, marks=pytest.mark.slow),   # ~30 s: a Python loop step per level
])
def test_deep_trees_train_predict_and_render_on_every_runner(runner_trainers, runner, depth):
    """No walk over a tree recurses: a tree of any depth parses, trains one step, predicts and renders back,
    with the device's runner (the C runner) and the reference runner."""
    trainer = runner_trainers(runner)
    assert trainer.model.options.runner == runner
    line = deep_tree_line(depth)
    tree = trainer.task.parse_input(line, "<stdin>:1")
    assert tree.num_vertices == 2 * depth + 1
    train = trainer.task.data["train"]
    trainer.task.data["train"] = [type(tree)(tree.children, np.full(tree.num_vertices, 2), tree.words)]
    try:
        loss, units = trainer.train_step(np.array([0]))
    finally:
        trainer.task.data["train"] = train
    assert math.isfinite(loss) and units == 1
    [row] = predict_lines(trainer.task, [line], "<stdin>")
    back = parse_any_tree(row["text"])
    assert back.children == tree.children and back.words == tree.words
    assert 0 <= back.labels.min() and back.labels.max() < 5 and back.labels[-1] == row["label"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(config, checkpoint) of a tiny Tree-LSTM and of a tiny language model."""
    tmp = tmp_path_factory.mktemp("weights")
    out = {}
    for model in ("tree_lstm", "var_lstm"):
        config = tiny(tmp, model, embed=4, hidden=4)
        Trainer(config).save(tmp / f"{model}.npz")
        out[model] = (config, tmp / f"{model}.npz")
    return out


def predict_cli(weights, model: str, data: bytes, tmp_path, monkeypatch, capsys, *flags, stdin: str = "file"):
    """``minicavs predict`` on ``data`` given as a file, as standard input (bytes under a text wrapper, as
    Python's own stdin) or as an already decoded text stream: (exit status, stdout, stderr)."""
    config, ck = weights[model]
    if stdin == "file":
        (tmp_path / "in.txt").write_bytes(data)
        source = str(tmp_path / "in.txt")
    else:
        source = "-"
        stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape") \
            if stdin == "stdin" else io.StringIO(data.decode("utf-8", "surrogateescape"))
        monkeypatch.setattr(sys, "stdin", stream)
    capsys.readouterr()
    status = main(["predict", str(config), "--checkpoint", str(ck), source, *flags])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("stdin", ["file", "stdin", "decoded stdin"])
@pytest.mark.parametrize("data, lineno, why", [
    (b"\xff\xfe\n", 1, "invalid start byte"),
    (b"(a b)\n(caf\xe9 x)\n", 2, "invalid continuation byte"),
    (b"(a b)\n\n\xed\xa0\x80\n", 3, "invalid continuation byte"),     # an encoded surrogate
    (b"(a \xc0\xaf)\n", 1, "invalid start byte"),                      # an overlong '/'
    (b"(a b)\n(x y)\xff", 2, "invalid start byte"),                    # no final newline
])
def test_input_that_is_not_utf8_is_refused_alike_from_a_file_or_stdin(weights, tmp_path, monkeypatch, capsys,
                                                                      stdin, data, lineno, why):
    status, out, err = predict_cli(weights, "tree_lstm", data, tmp_path, monkeypatch, capsys,
                                   "-o", str(tmp_path / "out.txt"), stdin=stdin)
    name = str(tmp_path / "in.txt") if stdin == "file" else "<stdin>"
    assert status == 2 and out == "" and not (tmp_path / "out.txt").exists()
    assert err.startswith(f"minicavs predict: error: {name}:{lineno}: not UTF-8 (") and err.count("\n") == 1, err
    if stdin != "decoded stdin":    # (a decoded stream names the character, Python's reason differs)
        assert why in err


BLANKS = ["", "   ", "\t", "\r", " \t \r"]


@pytest.mark.parametrize("blank", BLANKS)
@pytest.mark.parametrize("model, lines", [("tree_lstm", ["((a b) c)", "(2 (1 x) (3 y))"]),
                                          ("var_lstm", ["t1 t2 t3", "t4"])])
def test_predict_skips_blank_lines_as_the_data_readers_do(weights, tmp_path, monkeypatch, capsys, model, lines,
                                                          blank):
    data = f"{blank}\n{lines[0]}\n{blank}\n{blank}\n{lines[1]}\n{blank}\n".encode()
    status, out, err = predict_cli(weights, model, data, tmp_path, monkeypatch, capsys, "--json", stdin="stdin")
    assert (status, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["line"] for r in rows] == [2, 5]
    for line, row in zip(lines, rows):    # each as predicted alone
        status, alone, _ = predict_cli(weights, model, f"{line}\n".encode(), tmp_path, monkeypatch, capsys, "--json")
        assert json.loads(alone) == {**row, "line": 1}


BAD_TREES = [("(a b c)", "a node with 3 children"), ("(3 (2 a) (2 b) (2 c))", "a node with 3 children"),
             ("((a b)", "unbalanced '('"), ("(a b))", "unbalanced ')'"), ("a b", "2 trees or words side by side"),
             ("(a ())", "an empty node"), ("(9 (2 a) (2 b))", "label 9 out of range 0..4"),
             ("()", "an empty node"), (")(", "unbalanced ')'")]


@pytest.mark.parametrize("stdin", ["file", "stdin"])
@pytest.mark.parametrize("bad, why", BAD_TREES + [("caf\udcff", "not UTF-8")])
def test_skip_bad_reports_each_bad_line_and_predicts_the_rest(weights, tmp_path, monkeypatch, capsys, stdin,
                                                              bad, why):
    data = f"((a b) c)\n{bad}\n\n(x y)\n{bad}\n".encode("utf-8", "surrogateescape")
    name = str(tmp_path / "in.txt") if stdin == "file" else "<stdin>"
    status, out, err = predict_cli(weights, "tree_lstm", data, tmp_path, monkeypatch, capsys, stdin=stdin)
    assert status == 2 and out == "" and err.startswith(f"minicavs predict: error: {name}:2: ") and why in err, err
    status, out, err = predict_cli(weights, "tree_lstm", data, tmp_path, monkeypatch, capsys, "--skip-bad",
                                   stdin=stdin)
    assert status == 0
    assert err.splitlines() == [f"minicavs predict: skipped {name}:2: " + err.splitlines()[0].split(":2: ", 1)[1],
                                f"minicavs predict: skipped {name}:5: " + err.splitlines()[1].split(":5: ", 1)[1],
                                "minicavs predict: skipped 2 bad lines, predicted 2"]
    assert all(why in line for line in err.splitlines()[:2])
    _, good, _ = predict_cli(weights, "tree_lstm", b"((a b) c)\n(x y)\n", tmp_path, monkeypatch, capsys)
    assert out == good and len(out.splitlines()) == 2


@pytest.mark.parametrize("data, flags, why", [
    (b"", (), "it is empty or blank"), (b"\n", (), "it is empty or blank"),
    (b" \n\t\n\r\n", (), "it is empty or blank"),
    (b"(a b c)\n\n(a\n", ("--skip-bad",), "2 bad lines skipped, the others blank"),
])
@pytest.mark.parametrize("stdin", ["file", "stdin"])
def test_no_line_to_predict_is_a_warning(weights, tmp_path, monkeypatch, capsys, data, flags, why, stdin):
    status, out, err = predict_cli(weights, "tree_lstm", data, tmp_path, monkeypatch, capsys, *flags,
                                   "-o", str(tmp_path / "out.txt"), stdin=stdin)
    name = str(tmp_path / "in.txt") if stdin == "file" else "<stdin>"
    assert status == 0 and out == "" and (tmp_path / "out.txt").read_text() == ""
    assert err.splitlines()[-1] == f"minicavs predict: warning: {name} holds no line to predict ({why})"


def test_a_directory_as_input_says_so(weights, tmp_path, capsys):
    config, ck = weights["tree_lstm"]
    assert main(["predict", str(config), "--checkpoint", str(ck), str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"minicavs predict: error: input {tmp_path} is a directory, not a file\n"


@pytest.mark.parametrize("runner, words", [
    *((runner, words) for runner in ("device", "reference") for words in (1, 2, 500, 5_000)),
    ("device", 100_000),
    pytest.param("reference", 100_000, marks=pytest.mark.slow),
])
def test_long_sentences_train_and_predict_on_every_runner(tmp_path_factory, runner, words):
    """A sentence is a chain as deep as it is long: 100,000 words train a step and predict like 5."""
    config = tiny(tmp_path_factory.mktemp("long"), "var_lstm", embed=2, hidden=2, dropout=0.0)
    trainer = Trainer(config, [f"train.engine.runner={runner}"])
    vocab = trainer.task.vocab.words[2:]
    line = " ".join(vocab[i % len(vocab)] for i in range(words))
    trainer.task.data["train"] = trainer.task.make_samples([line.split()])
    loss, units = trainer.train_step(np.array([0]))
    assert math.isfinite(loss) and units == words + 1
    [row] = predict_lines(trainer.task, [line, ""], "<stdin>")
    assert row["predictions"] == words + 1 and math.isfinite(row["log_likelihood"]) and row["line"] == 1


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "utf-8"])
def test_output_is_utf8_whatever_the_locale(weights, tmp_path, encoding):
    """Input words come back in the output: UTF-8 on standard output as in ``-o FILE``, even where the
    locale's encoding cannot write them."""
    import os
    import subprocess
    config, ck = weights["tree_lstm"]
    line = "((café ünïcode) 日本)"
    (tmp_path / "in.txt").write_bytes(f"{line}\n".encode())
    env = {**os.environ, "PYTHONIOENCODING": encoding, "PYTHONPATH": str(MODELS.parent)}
    proc = subprocess.run([sys.executable, "-m", "minicavs", "predict", str(config), "--checkpoint", str(ck),
                           str(tmp_path / "in.txt")], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    assert parse_any_tree(proc.stdout.decode("utf-8")).sentence() == ["café", "ünïcode", "日本"]
