#!/usr/bin/env bash
# Isolated environments for the benchmark's peers (never dependencies of minicavs):
#   DyNet 2.2 with autobatching (PyPI dynet38) and PyTorch 2.13 for the CPU.
# Usage: tools/setup_peers.sh [DIR]   (default /tmp/minicavs-peers); then pass
#   --dynet-python DIR/dynet/bin/python --torch-python DIR/torch/bin/python to `minicavs bench`.
# Two environments, so neither peer's numpy pin constrains the other.
set -euo pipefail
dir=${1:-/tmp/minicavs-peers}
python3 -m venv "$dir/dynet" && "$dir/dynet/bin/pip" install -q dynet38
python3 -m venv "$dir/torch" && "$dir/torch/bin/pip" install -q numpy torch==2.13.0
"$dir/dynet/bin/python" -c "import dynet_config, numpy; print('dynet ok, numpy', numpy.__version__)"
"$dir/torch/bin/python" -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"
echo "peers ready: --dynet-python $dir/dynet/bin/python --torch-python $dir/torch/bin/python"
