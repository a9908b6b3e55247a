"""A loop with a trip count per row in a static program (engine/row_trips.py): a step's stacked outputs are
written by the select itself, ``where(running, new, 0)`` into their block (no select aside and copy)."""
from __future__ import annotations

import re

from minicavs.engine.executor import RunContext

from .test_static_loops import T, _lm, _programs, _values


def test_a_per_row_loops_outputs_are_written_by_their_select():
    """The language-model loop's outputs (its cross-entropies and, for its gradient, the tanh's output and the
    logits: items 0-2 of the loop) reach their blocks through one select each, which writes the block; no
    COPY writes one."""
    params, feeds = _values([T, 3, 0, 1])
    got = _lm(per_row=True).forward_backward({}, feeds, params, RunContext())
    (program,) = _programs(got)
    text = "\n".join(program.lowered.lines())
    forward = text[text.index("LOOPN"):text.index("ENDLOOP")]
    blocks = re.findall(r"STEPCOLS dst=(r\d+)\(block\[t\]\) src=r\d+\(loop\.[012]\)", forward)
    assert len(blocks) == 3, forward
    for block in blocks:
        assert f"COPY dst={block}(" not in forward, block
        assert re.search(rf"FUSED kernel=\d+ nargs=4 .*args=r\d+\(running\[t\]\),.*,{block}\(block\[t\]\)", forward)
