"""The README's Tree-LSTM headline (minicavs/bench/headline.py) from a results.json: minicavs over DyNet per core
and on the machine, as a user's machine runs it and with the machine's BLAS variables, each column named by the
kernel its records name; the command line. The rates are made-up numbers; nothing here is timed."""
from __future__ import annotations

import json

from minicavs.bench import headline
from minicavs.bench.report import FORCED, MINICAVS
from minicavs.bench.targets import DYNET


def _system(kernel: str, train: float, infer: float) -> dict:
    return {"rates": [train, 3 * train, 2 * train], "infer_rates": [infer], "per_core": {"rates": [train / 2],
            "infer_rates": [infer / 2]}, "machine": {"blas": [{"library": "openblas", "kernel": kernel}]}}


RECORDED = {"forced": {"OPENBLAS_CORETYPE": "Haswell"}, "points": {
    "tree_lstm-h64-b64": {MINICAVS: _system("SkylakeX", 100.0, 0.0), FORCED: _system("Haswell", 60.0, 0.0),
                          DYNET: _system("", 10.0, 0.0)},
    "tree_lstm-h128-b1": {MINICAVS: _system("SkylakeX", 1.0, 300.0), DYNET: _system("", 1.0, 100.0)},
    "tree_lstm-h512-b64": {MINICAVS: _system("SkylakeX", 9.0, 0.0)}}}   # no DyNet: no row


def test_both_kernels_side_by_side_per_core_and_on_the_machine():
    table = headline.markdown(RECORDED)
    lines = table.splitlines()
    assert lines[0] == ("| Tree-LSTM, minicavs / DyNet autobatching | per core, as a user's machine runs it (SkylakeX)"
                        " | machine, as a user's machine runs it (SkylakeX) | per core, machine's BLAS variables "
                        "(Haswell: OPENBLAS_CORETYPE=Haswell) | machine, machine's BLAS variables (Haswell: "
                        "OPENBLAS_CORETYPE=Haswell) |")
    # medians of the rounds: 200 / 20 on the machine, 50 / 5 per core
    assert lines[2] == "| training, batch 64, hidden 64 | 10.00x | 10.00x | 6.00x | 6.00x |"
    assert lines[3] == "| forward, batch 1, hidden 128 | 3.00x | 3.00x | - | - |"
    assert len(lines) == 4


def test_a_run_without_forced_runs_has_the_users_columns_alone_and_none_without_dynet():
    users = {"points": {k: {s: r for s, r in v.items() if s != FORCED} for k, v in RECORDED["points"].items()}}
    assert "machine's BLAS variables" not in headline.markdown(users)
    assert headline.markdown({"points": {"tree_lstm-h512-b64": RECORDED["points"]["tree_lstm-h512-b64"]}}) == ""


def test_the_command_prints_the_table_and_refuses_what_is_not_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RECORDED))
    assert headline.main([str(path)]) == 0 and "| training, batch 64, hidden 64 |" in capsys.readouterr().out
    for text in ("[1, 2]", "{", '{"points": 3}'):
        path.write_text(text)
        assert headline.main([str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"minicavs.bench.headline: {path}: "), err
    assert headline.main([]) == 2
