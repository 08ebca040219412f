#!/usr/bin/env bash
# Issue 29 goal 5's three targets on one CUDA GPU, each row a fresh process, one warm-up call before the
# measured one:
#   transformer_attribution and gradient_rollout at 4096 tokens: <= 1.5x the peak memory, <= 3x the time of
#   one forward+backward pass; lrp under "attnlrp" at 8192 tokens with memory="low": <= 1.1x its memory.
# The model is memory_scaling.py's `llama_mha` (its LLaMA-style decoder with 8 key/value heads): on CUDA,
# sdpa runs no fused kernel for grouped-query attention in float32, so `llama`'s forward+backward there is
# math attention and no fair baseline.
# Run from anywhere:  bash benchmarks/long_context_gpu.sh   (needs torch with CUDA and transformers;
# relprop is taken from this checkout)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$here"
python3 -c "import torch, relprop; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(), relprop.__file__)"
python3 memory_scaling.py --device cuda --model llama_mha --tokens 4096 --what fwdbwd ta-default ta-rows gr-rows
python3 memory_scaling.py --device cuda --model llama_mha --tokens 8192 --what fwdbwd lrp-low lrp
python3 memory_scaling.py --device cuda --model llama_mha --tokens 8192 --what fwdbwd lrp-low --rows 64
