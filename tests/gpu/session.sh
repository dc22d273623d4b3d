#!/usr/bin/env bash
# One device call: install the carried wheels, then run the GPU checks and benchmarks named in
# $PARTS (default: all) with a time limit each, logging to $OUT/<part>.log.
#   run(command="bash tests/gpu/session.sh", carry=[".whl", "runs/sft_gpu_pack"])
#   (with an earlier call's $OUT/triton_autotune.tgz saved as .triton/autotune.tgz:
#    command="TRITON_CACHE_TGZ=.triton/autotune.tgz bash tests/gpu/session.sh", carry += ".triton")
# .whl holds the fla-core 0.6.0, megatron-core 0.19.2 (cp312) and transformers 5.19.0 wheels.
# With no TRITON_CACHE_TGZ the cache is seeded from kernels/tunings/<gpu>.tgz (SEED_TUNINGS=0: cold).
# KILL_AFTER: seconds a part has after its SIGINT (default 10; the science part exports then).
# Parts: actbytes (saved bytes per token vs the memory plan), model (tests/gpu/model_small.py),
# sft (tests/gpu/sft_small.py with $SFT_CONFIGS), model_check (model_small.py's bf16-vs-CPU check
# only), offload (tests/gpu/offload_check.py: activation offload on/off the copy stream, same
# gradients), dsacheck (tests/gpu/dsa_check.py with $DSA_ARGS, e.g. --kl-only: correctness, CP over every GPU
# pair/quad), indexer (tests/benchmarks/dsa_bench.py indexer: the lightning indexer end to end per score
# kernel, $INDEXER_ARGS, e.g. --score-kernels triton gluon --rounds 3 --profile), stages (dsa_bench.py stages:
# the indexer's expansion and k-pool compression kernels), bench (dsa_bench.py alone, with $BENCH_ARGS),
# dsa (dsa_check.py + dsa_bench.py), ncu (tests/gpu/ncu_indexer.sh: Nsight Compute on single indexer kernel
# launches, $NCU_CASES), profile (tests/benchmarks/sft_profile.py: whole-step profile of $PROFILE_CONFIGS,
# default 64k, with $PROFILE_ARGS; profile_base: the same from a carried earlier tree), layerbench (tests/benchmarks/layer_bench.py: one full-width layer of each kind as
# one b200-64 rank at 256k and 1M, projected to 64 B200, with $LAYERBENCH_ARGS), hcproj (the mHC projection's
# Triton kernels vs float64, and their time), hcdiag, gluonsmoke, atomics, tilings, bwdconfigs, smshare, coldstart, refresh (see their lines below). The DSA parts need no wheels: with no .whl folder the install is skipped.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Compiled kernels and autotuning results (Triton's, fla's) persist across the parts of a call.
# The autotuning results alone (*.autotune.json, kilobytes; the compiled cache of an SFT call is
# too large to come back) leave as $OUT/triton_autotune.tgz: carried into a later call as
# $TRITON_CACHE_TGZ (e.g. .triton/autotune.tgz, git-ignored), every tuned kernel compiles its
# best config only instead of benchmarking all of them (keys: Triton version, GPU, kernel source).
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
# 1M tokens on 2 H200s failed at its third step with 99 GiB allocated and 29.8 GiB reserved but
# unallocated (fragmentation by the 8 GiB reloads and recomputes): grow segments instead.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$TRITON_CACHE_DIR"
if [ -n "${TRITON_CACHE_TGZ:-}" ] && [ -f "$TRITON_CACHE_TGZ" ]; then
  tar -xzf "$TRITON_CACHE_TGZ" -C "$TRITON_CACHE_DIR" && echo "autotune cache: $(tar -tzf "$TRITON_CACHE_TGZ" | grep -c autotune.json) results from $TRITON_CACHE_TGZ"
elif [ "${SEED_TUNINGS:-1}" = 1 ]; then
  # What an SFT/RL worker does (tasks.caching.shared_kernel_cache): the package's shipped results.
  python3 -c "import sys, torch; sys.path.insert(0, 'tests/gpu'); import flyte_standin as f; f.install_flytekit_stand_in()
import tasks.caching as c; gpu = torch.cuda.get_device_name()
print('autotune cache:', c.seed_autotune_cache('$TRITON_CACHE_DIR', gpu), 'results from', c.autotune_archive(gpu), 'and its same-target siblings')"
fi
# inductor's compiled glue (model.fused): scripts load the shipped artifacts themselves when SEED_COMPILE=1
# (sft_profile.py --seed-compile-cache); TORCHINDUCTOR_CACHE_DIR keeps what a part compiles for the next part.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
save_cache() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/triton_autotune.tgz" -T -) 2>/dev/null; }
# A call brings back at most 8 files from $OUT: past that, the logs and JSON results go into one logs_<time>.tgz
# (a second session.sh in the same call packs its own) so that a trace or a compile cache is not what stays behind.
pack_logs() {
  [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ] || return 0
  local pack="logs_$(date +%H%M%S).tgz"
  (cd "$OUT" && tar -czf "$pack" --remove-files $(ls *.log *.json *.txt 2>/dev/null)) && echo "logs and JSON in $OUT/$pack"
}
trap 'save_cache; pack_logs' EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
PARTS=${PARTS:-"actbytes model sft dsa"}
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout --signal=INT --kill-after="${KILL_AFTER:-10}" "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)"
  grep -v -i "warn" "$OUT/$name.log" | tail -n "${TAIL:-25}"
}
part actbytes "${T_ACTBYTES:-60}" python3 tests/gpu/activation_bytes.py --preset small --seq 16384 \
  --mlp-chunk-tokens 65536 --out "$OUT/actbytes.json"
part model "${T_MODEL:-150}" python3 tests/gpu/model_small.py --seq 16384 65536 --check-seq 2048 \
  --out "$OUT/model_small.json"
# SFT_NPROC > 1: one torchrun rank per GPU, CP over all of them.
part sft "${T_SFT:-360}" python3 -m torch.distributed.run --nproc-per-node "${SFT_NPROC:-1}" tests/gpu/sft_small.py --pack runs/sft_gpu_pack \
  --out "$OUT" --steps 3 \
  --configs ${SFT_CONFIGS:-64k 256k-sel-off4 256k-sel 256k-full 512k-full}
part model_check "${T_MODEL:-150}" python3 tests/gpu/model_small.py --seq --check-seq 2048 \
  --out "$OUT/model_check.json"
part offload "${T_OFFLOAD:-120}" python3 tests/gpu/offload_check.py --out "$OUT/offload_check.json"
part dsacheck "${T_DSA:-200}" python3 tests/gpu/dsa_check.py ${DSA_ARGS:-} --out "$OUT/dsa_check.json"
part indexer "${T_INDEXER:-170}" python3 tests/benchmarks/dsa_bench.py indexer \
  --seq-lens ${INDEXER_SEQ:-1048576 262144} --shapes ${INDEXER_SHAPES:-full small} ${INDEXER_ARGS:-} \
  --out "$OUT/indexer.json"
part ncu "${T_NCU:-300}" bash tests/gpu/ncu_indexer.sh
part stages "${T_STAGES:-120}" python3 tests/benchmarks/dsa_bench.py stages --out "$OUT/stages.json"
part bench "${T_BENCH:-420}" python3 tests/benchmarks/dsa_bench.py ${BENCH_ARGS:-} --out "$OUT/dsa_bench.json"
part dsa "${T_DSA:-300}" bash -c "python3 tests/gpu/dsa_check.py --out $OUT/dsa_check.json && \
  python3 tests/benchmarks/dsa_bench.py --out $OUT/dsa_bench.json"
# fused (tests/gpu/fused_check.py: model.fused's inductor glue vs eager and float64, then each one's time at 64k).
part fused "${T_FUSED:-150}" python3 tests/gpu/fused_check.py --tokens "${FUSED_TOKENS:-65536}" --out "$OUT/fused_check.json"
# hcproj (tests/gpu/hc_projection_check.py: the mHC projection's Triton kernels vs float64, then their time).
part hcproj "${T_HCPROJ:-150}" python3 tests/gpu/hc_projection_check.py --out "$OUT/hc_projection.json"
# hcdiag (tests/gpu/hc_projection_diag.py: the projection's forward per rows, weight dtype and stages, where hcproj fails).
part hcdiag "${T_HCDIAG:-150}" python3 tests/gpu/hc_projection_diag.py
# gluonsmoke (tests/gpu/gluon_smoke.py ${GLUONSMOKE_ARGS}, e.g. --forward-only: the Gluon sparse MLA kernels at a
# small size vs float64, each compiled cold; a hang costs its limit).
part gluonsmoke "${T_GLUONSMOKE:-150}" python3 tests/gpu/gluon_smoke.py ${GLUONSMOKE_ARGS:-}
# smshare (tests/benchmarks/sparse_mla_sm_share.py: the Gluon dq and dkv kernels with SMs held away, $SMSHARE_ARGS).
part smshare "${T_SMSHARE:-240}" python3 tests/benchmarks/sparse_mla_sm_share.py ${SMSHARE_ARGS:-} --out "$OUT/sm_share.json"
# atomics (tests/benchmarks/sparse_mla_atomics.py: the latent gradient's float32 row adds alone, red.global vs TMA reduce, $ATOMICS_ARGS).
part atomics "${T_ATOMICS:-240}" python3 tests/benchmarks/sparse_mla_atomics.py ${ATOMICS_ARGS:-} --out "$OUT/atomics.json"
# tilings (tests/benchmarks/sparse_mla_tilings.py: sparse MLA tilings one by one outside the autotuner, $TILINGS_ARGS).
part tilings "${T_TILINGS:-300}" python3 tests/benchmarks/sparse_mla_tilings.py ${TILINGS_ARGS:-} --out "$OUT/tilings.json"
# bwdconfigs (tests/benchmarks/sparse_mla_backward_configs.py: the Gluon dq and dkv launch configurations on this GPU,
# then the op with the shipped and the fastest ones, $BWDCONFIGS_ARGS).
part bwdconfigs "${T_BWDCONFIGS:-300}" python3 tests/benchmarks/sparse_mla_backward_configs.py ${BWDCONFIGS_ARGS:-} \
  --out "$OUT/backward_configs.json"
# paths (tests/gpu/glue_paths_check.py: fla's KDA short conv and the gather MoE permutation vs the paths they replace).
part paths "${T_PATHS:-120}" python3 tests/gpu/glue_paths_check.py --tokens "${FUSED_TOKENS:-65536}" --out "$OUT/glue_paths.json"
# profile_base: the same profile run from $BASE_TREE (default .base: `git archive <rev> | tar -x -C .base`, carried),
# before profile in the same call: the before column of a change that has no switch of its own
# ($PROFILE_BASE_ARGS, default $PROFILE_ARGS: a variant the earlier tree does not know stays out of its run).
part profile_base "${T_PROFILE:-420}" bash -c "cd ${BASE_TREE:-.base} && PYTHONPATH=/tmp/site:\$PWD python3 \
  tests/benchmarks/sft_profile.py --pack \"$PWD/runs/sft_gpu_pack\" --configs ${PROFILE_CONFIGS:-64k} \
  ${PROFILE_BASE_ARGS-${PROFILE_ARGS:-}} --out \"$OUT/sft_profile_base.json\""
part profile "${T_PROFILE:-420}" python3 tests/benchmarks/sft_profile.py --pack runs/sft_gpu_pack \
  --configs ${PROFILE_CONFIGS:-64k} --trace-dir "$OUT" ${PROFILE_ARGS:-} --out "$OUT/sft_profile.json"
# coldstart: the first SFT step as a fresh worker meets it. Every compiled kernel and autotune result of earlier
# parts is removed (Triton's, inductor's, in /tmp and ~), the Triton cache is reseeded from the package's
# tunings as tasks.caching.shared_kernel_cache does, and the profile loads the shipped compile cache
# (--seed-compile-cache): its "first step" row is the cold start ($PROFILE_CONFIGS, default 64k).
coldstart() {
  rm -rf "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" ~/.triton /tmp/torchinductor_* && mkdir -p "$TRITON_CACHE_DIR"
  python3 -c "import sys, torch; sys.path.insert(0, 'tests/gpu'); import flyte_standin as f; f.install_flytekit_stand_in()
import tasks.caching as c; print('autotune cache:', c.seed_autotune_cache('$TRITON_CACHE_DIR', torch.cuda.get_device_name()))"
  python3 tests/benchmarks/sft_profile.py --pack runs/sft_gpu_pack --configs ${PROFILE_CONFIGS:-64k} --steps 2 \
    --profile-steps 1 --seed-compile-cache --out "$OUT/sft_coldstart.json"
}
export -f coldstart && export OUT
part coldstart "${T_COLDSTART:-420}" bash -c coldstart
# refresh: this GPU's shipped tunings renewed, then the cold start they give. The 64k profile ($PROFILE_CONFIGS)
# saves its compiled glue; its autotune results (with the seeded ones) and that glue replace
# kernels/tunings/<gpu>.tgz and <gpu>.torch-<version>.inductor.bin.gz in this copy of the tree, then coldstart
# runs from them. Both files also stay in $OUT (triton_autotune.tgz, inductor.bin.gz) to commit.
refresh() {
  python3 tests/benchmarks/sft_profile.py --pack runs/sft_gpu_pack --configs ${PROFILE_CONFIGS:-64k} --steps 3 \
    --profile-steps 1 --seed-compile-cache --save-compile-cache "$OUT/inductor.bin.gz" \
    --out "$OUT/sft_profile_refresh.json" || return 1
  save_cache && [ -s "$OUT/triton_autotune.tgz" ] || return 1
  python3 -c "import shutil, sys, torch; sys.path.insert(0, 'tests/gpu'); import flyte_standin as f
f.install_flytekit_stand_in(); import tasks.caching as c; gpu = torch.cuda.get_device_name()
glue = c.compile_cache_path(gpu, torch.__version__); tunings = c.autotune_archive(gpu)
shutil.copy('$OUT/inductor.bin.gz', glue); shutil.copy('$OUT/triton_autotune.tgz', tunings)
print('refreshed', tunings.name, 'and', glue.name)" || return 1
  coldstart
}
export -f refresh save_cache
part refresh "${T_REFRESH:-540}" bash -c refresh
# kdafold (tests/benchmarks/kda_cp_fold_bench.py: the KDA CP state fold, per-rank indexing vs split+unbind, full widths).
part kdafold "${T_KDAFOLD:-60}" python3 tests/benchmarks/kda_cp_fold_bench.py --out "$OUT/kda_cp_fold.json"
part layerbench "${T_LAYERBENCH:-540}" python3 tests/benchmarks/layer_bench.py ${LAYERBENCH_ARGS:-} --out "$OUT/layer_bench.json"
# engine (tests/gpu/engine_update.py: the transformers engine's weight update keeps every parameter on the GPU).
# Issue-34/28 runs: lr curves (LR_RUNS "LR:WARMUP ..."), the resumable SFT science run (SCIENCE_ARGS), and RL + verify +
# evaluate from an export (STAGES_ARGS, e.g. --init /tmp/science_64k/out/hf).
part lr "${T_LR:-420}" python3 tests/gpu/science_small.py lr --pack runs/sft_gpu_pack --out "$OUT" \
  --steps "${LR_STEPS:-20}" --eval-every "${LR_EVAL_EVERY:-10}" --runs ${LR_RUNS:-3e-4:1 1e-3:1 1e-3:10 3e-3:10}
part science "${T_SCIENCE:-420}" python3 tests/gpu/science_small.py train --pack runs/sft_gpu_pack --out "$OUT" ${SCIENCE_ARGS:-}
part engine "${T_ENGINE:-120}" python3 tests/gpu/engine_update.py
part after_sft "${T_AFTER_SFT:-300}" python3 tests/gpu/stages_small.py --pack runs/sft_gpu_pack --out "$OUT" ${STAGES_ARGS:-}
