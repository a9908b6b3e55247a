#!/usr/bin/env bash
# One isolated environment for the benchmark's peers (never dependencies of minicavs):
#   DyNet 2.2 with autobatching (PyPI dynet38) and PyTorch 2.13.0 for the CPU.
# Usage: tools/setup_peers.sh [DIR]   (default /tmp/peervenv); then
#   minicavs bench --dynet-python DIR/bin/python --torch-python DIR/bin/python
# and, to test the peers (tests/bench/test_peers.py: each computes minicavs' loss for minicavs' weights),
#   MINICAVS_TORCH_PYTHON=DIR/bin/python MINICAVS_DYNET_PYTHON=DIR/bin/python python -m pytest tests/bench/test_peers.py
# dynet38 and torch 2.13.0 coexist in one environment (both import and train in one process: checked at the
# end); set PEERS_TWO_VENVS=1 to get DIR/dynet and DIR/torch instead if a future version clashes.
# torch is pinned to the CPU build 2.13.0+cpu, what the benchmark was measured with: PyPI's Linux torch wheel
# is a CUDA build with gigabytes of dependencies, so the CPU build comes from PyTorch's CPU index
# (PEERS_TORCH_INDEX, default https://download.pytorch.org/whl/cpu; set it empty to use only pip's own
# configuration, e.g. a local wheel directory).
set -euo pipefail
dir=${1:-/tmp/peervenv}
tools=$(cd "$(dirname "$0")" && pwd)
torch_index=${PEERS_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
torch_pkgs=(numpy "torch==2.13.0+cpu")
[[ -n $torch_index ]] && torch_pkgs+=(--extra-index-url "$torch_index")
if [[ ${PEERS_TWO_VENVS:-0} == 1 ]]; then
  python3 -m venv "$dir/dynet" && "$dir/dynet/bin/pip" install -q numpy dynet38
  python3 -m venv "$dir/torch" && "$dir/torch/bin/pip" install -q "${torch_pkgs[@]}"
  dynet_py=$dir/dynet/bin/python torch_py=$dir/torch/bin/python
else
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q "${torch_pkgs[@]}"
  "$dir/bin/pip" install -q dynet38
  dynet_py=$dir/bin/python torch_py=$dir/bin/python
fi
# A forward/backward step in each; in one environment, both in the same process.
"$dynet_py" - <<'PY'
import dynet_config
dynet_config.set(autobatch=1, mem=64, random_seed=1)
import dynet as dy, numpy
pc = dy.ParameterCollection()
W = pc.add_parameters((3, 3))
dy.renew_cg()
loss = dy.sum_elems(W * dy.inputVector([1.0, 2.0, 3.0]))
loss.backward()
print("dynet38 ok, numpy", numpy.__version__)
PY
"$torch_py" - <<'PY'
import torch
a = torch.randn(8, 8, requires_grad=True)
(a @ a).sum().backward()
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("torch", torch.__version__, "ok, threads", torch.get_num_threads())
PY
if [[ $dynet_py == "$torch_py" ]]; then
  "$dynet_py" -c "import dynet_config; dynet_config.set(mem=64); import dynet, torch; print('dynet and torch in one process ok')"
fi
# The peer scripts' shared modules import in their environments (they run there, never in minicavs').
(cd "$tools" && "$dynet_py" -c "import peer_common, dynet_peer" && "$torch_py" -c "import peer_common, torch_peer")
echo "peer scripts ok"
echo "peers ready: --dynet-python $dynet_py --torch-python $torch_py"
