"""passes/alias.py's concat elision: a concat whose parts come out of kernels (fused groups, or lone elementwise
steps that fusion left alone) is no step of its own; the kernels write its column blocks, so the runners copy
no part into it, with the reference runner's numbers (tests/engine/test_instructions.py runs every model)."""
from __future__ import annotations

import numpy as np

from minicavs.cpu import CPU
from minicavs.engine import instructions
from minicavs.engine.compile import TASK, EngineOptions
from minicavs.engine.passes import alias

from ... import cells


def test_gradient_concats_with_a_lone_kernel_part_are_written_in_place():
    """A Tree-LSTM ∂F's per-child gradients [dc; dh]: dh comes out of the fused group, dc out of a lone add
    (d(c) + f·d(c_parent)); both concats are elided and ∂F's task template copies nothing."""
    internal = cells.binary_tree_lstm(np.random.default_rng(0)).model.structures[0].compiled["internal"]
    opts = EngineOptions()
    _, bwd = internal.phases(opts, CPU)
    steps = bwd.programs[TASK]
    assert not [st for st in steps if alias.column_blocks(st.outputs[0]) and not st.fused], "a concat step is left"
    lone = {st.outputs[0] for st in steps if alias._lone_elementwise(st)}
    with_lone_part = [c for c, parts in bwd.concats[TASK] if any(m in lone for m, _, _ in parts)]
    assert len(with_lone_part) == 2, bwd.concats[TASK]   # (one per child: the check is not vacuous)
    template = instructions.template(internal, opts, CPU, backward=True)
    assert [row for row in template.code if row[0] == "COPY"] == []
