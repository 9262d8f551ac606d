#!/bin/bash
# What a session lent an NVIDIA GPU measures for our attention kernel and the two steps (issue 47),
# most needed first, as one run of the kit's on_gpu.sh: each command's output goes to $OUT/NN.txt as
# it finishes, so a run its deadline cuts still returns what was measured.
#
#   bash ../shared/gpu/prepare.sh              # here, once: the kit into .gpu/ (git-ignored)
#   device run, carry [".gpu"], timeout_s 600:  bash peers/gpu_session.sh
#
# 1-3: the kernels against the same function in XLA ops (the mask bit for bit, the gradients),
#      with the opt-in changes that wait for this check; one layer's call timed; and the same call
#      kernel by kernel (CUDA graphs off: inside one, the trace shows no kernel);
# 4-7: our steps, with the opt-in changes that 1 found right and 2 faster (`settings`), and the
#      torch.compile peers, one machine, one go; 8-9: XLA's attention at the same seed, for the
#      loss curves' comparison (the check the issue asks for before the speed; with the counted
#      dropout masks the two paths drop the same elements: only rounding parts them); 10: the
#      step's profile, its top kernels beside aot.py's estimate (CUDA graphs off, so this step's
#      time is not the others'); 11: the kernels at other tiles and warps (each variant's line as
#      it comes: tuning, which a deadline may cut); 12: our kernel under scan_layers; 13: the GPT-1
#      peer with the library's unfused attention, as the sessions before 2026-12-02 measured it
#      (7 is the fair peer since: torch's fused SDPA with its dropout inside).
set -u
cd "$(dirname "$0")/.."
[ -f .gpu/on_gpu.sh ] || { echo "no .gpu/: run bash ../shared/gpu/prepare.sh and carry .gpu"; exit 2; }
export OUT=${OUT:-/tmp/out}
# The kernels' runs wait on the check's JSON line (a kernel that fails it is not worth timing).
checked="grep -q '\"check\"' $OUT/01.txt &&"
git log --oneline -1 2>/dev/null || true
CURVE="python3 peers/attention_dropout_gpu.py curve"
BERT="configs/bert_base.py:base 200 --config.train.batch_size=256"
GPT="configs/gpt.py 200 --config.train.batch_size=64"
# Evaluated when the command runs (bash -c), after the check's and the time's outputs exist.
SETTINGS='$(python3 peers/flash_dropout_gpu.py settings $OUT/01.txt $OUT/02.txt)'
DEADLINE=${DEADLINE:-550} exec bash .gpu/on_gpu.sh \
  "python3 peers/flash_dropout_gpu.py check" \
  "$checked python3 peers/flash_dropout_gpu.py time" \
  "$checked XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 peers/flash_dropout_gpu.py profile" \
  "$checked $CURVE $BERT --config.model.attention=triton $SETTINGS" \
  "$checked $CURVE $GPT --config.model.attention=triton $SETTINGS" \
  "python3 .gpu/peer_torch_bert_gpu.py 12 768 12 3072 256 128 20 0.1 compile" \
  "python3 peers/gpt_torch_gpu.py --batch_size=64 --mode=compile" \
  "$CURVE $BERT --config.model.attention=xla" \
  "$CURVE $GPT --config.model.attention=xla" \
  "$checked XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 bench.py --config=configs/bert_base.py:base --config.train.batch_size=256 --input_seconds=0 --steps=10 --profile=/tmp/profile_bert" \
  "$checked python3 peers/flash_dropout_gpu.py variants" \
  "$checked $CURVE configs/bert_base.py:base 100 --config.train.batch_size=256 --config.model.attention=triton --config.model.scan_layers=True $SETTINGS" \
  "python3 peers/gpt_torch_gpu.py --batch_size=64 --mode=compile --attention=eager"
