#!/usr/bin/env bash
# Arctic Inference's suffix tree (PyPI arctic-inference, the one vLLM 0.32's
# speculative method "suffix" imports), built from its source distribution for
# this CPU: its wheels on PyPI are built against CUDA torch. Only the bench's
# vllm_suffix system needs it (`make arctic`); specserve's own suffix draft does
# not (specserve/draft/suffix_tree.py says why).
#
#   scripts/install_arctic.sh PYTHON
#
# Needs cmake and a C++ compiler. Builds without isolation against the venv's
# torch (isolation would fetch a CUDA torch), with nanobind, the one build
# requirement a venv lacks, on PYTHONPATH only for the build. Its vLLM plugin
# stays inactive unless ARCTIC_INFERENCE_ENABLED=1 (it patches vLLM 0.26 only).
set -euo pipefail

PY=$(realpath -s "${1:?usage: scripts/install_arctic.sh PYTHON}")
VERSION=0.3.0
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "install_arctic: $tool is missing (apt-get install cmake g++)" >&2; exit 2; }
done
if "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null \
   && [ "$("$PY" -m pip show arctic-inference | sed -n 's/^Version: //p')" = "$VERSION" ]; then
  echo "arctic-inference $VERSION is installed"; exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "install_arctic: building arctic-inference $VERSION from source (about 20 s)"
"$PY" -m pip install -q --target "$WORK/buildtools" --no-deps nanobind==2.9.2 wheel
PYTHONPATH="$WORK/buildtools" "$PY" -m pip download -q --no-deps --no-binary :all: \
  --no-build-isolation -d "$WORK" "arctic-inference==$VERSION"
tar -xzf "$WORK/arctic_inference-$VERSION.tar.gz" -C "$WORK"
( cd "$WORK/arctic_inference-$VERSION" \
  && PYTHONPATH="$WORK/buildtools" CMAKE_BUILD_PARALLEL_LEVEL=2 MAX_JOBS=2 \
     "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" . )
"$PY" -m pip install -q --no-deps "$WORK"/wheels/arctic_inference-*.whl
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('arctic-inference', '$VERSION', 'installed')"
