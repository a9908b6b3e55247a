"""The program (minicavs/engine/lowered.py's Lowered) holds its templates as its parts: each made for it while it
is linked and placed in it (its template id and kind id; a block is one of its templates, not a wrapper around
one), never shared with another program, so a template is not a stage of its own between the steps and the
program."""
from __future__ import annotations

from minicavs.engine import instructions

from ..models.test_models import trainer


def test_a_programs_templates_are_its_own_parts(tmp_path):
    t = trainer("tree_lstm", tmp_path)
    result = t.loss_and_grads(t.task.data["train"][:6])
    state = next(iter(result.states.values()))
    compiled, ran = next(iter(state.workspace.programs.values()))
    for backward in (False, True):
        programs = [instructions.link(compiled, state.active, state.opts, state.device, backward, cache={})
                    for _ in range(2)]   # (two workspaces' programs of the same functions)
        first, second = programs
        assert not {id(x) for x in first.templates} & {id(x) for x in second.templates}
        for lowered in programs:
            assert lowered.blocks, "tree_lstm's passes have blocks before or after the task loop"
            for tid, template in zip(lowered.template_ids, lowered.templates):
                assert (template.tid, template.kind_id) == (tid, tid % lowered.n_kinds)
            for block in lowered.blocks:
                assert any(block is template for template in lowered.templates)
                assert block.scratch == lowered.block_scratch[block.tid]
    assert ran.title in ("F", "∂F")
