#!/usr/bin/env bash
# Issue 27 on the lent H200, one step per device call, back to back (the stash lives in the device's temp dir
# only while the machine stays warm). bench/gpu/README.md has the calls.
#   bash bench/gpu/h200.sh stash    carry .gpu-stage/call-NN: copy its part into the stash
#   bash bench/gpu/h200.sh run      carry the last call folder: install, GPU-release test, `eagle3 run`
#   bash bench/gpu/h200.sh finish   the flow again (resumes or returns Cached), hf extraction, cosines
#   bash bench/gpu/h200.sh kimi     (staged with --moe) the Kimi-shaped W4A16 MLA target written with random
#                                   weights, the flow on it with each draft of KIMI_DRAFTS in turn (default
#                                   "llama mla": the Llama-shaped draft, then the MLA draft; "mla llama" puts the
#                                   MLA draft first; a cut flow resumes in the next call, its phases Cached)
#   bash bench/gpu/h200.sh limit    the 8B-shaped target, extraction throughput against the plain engine; the
#                                   connector's files on the disk and on a tmpfs (/dev/shm, or one mounted
#                                   under $T when /dev/shm has < 8 GB free), several shard sizes and
#                                   requests in flight; LIMIT_HF=1 adds the hf backend and its cosines;
#                                   LIMIT_ROUND=writers the shard writer's threads instead, LIMIT_ROUND=fp8 fp8
#                                   quantised in the engine beside bf16, LIMIT_ROUND=stream the shard loop
#                                   with no barrier at shard boundaries; LIMIT_PLAIN_RATE=N skips the plain
#                                   engine (its rate measured before); LIMIT_SAMPLES=N samples (128)
#   bash bench/gpu/h200.sh quality  (vLLM and SGLang staged) issue 28's screening, bench/gpu/quality_runs.py:
#                                   sample sets, variants, served acceptance in vLLM, then SGLang beside it
#                                   (STAGES=samples,training,served,sglang adds the last, off by default)
#   bash bench/gpu/h200.sh sglang   (after run/finish, SGLang staged) `eagle3 evaluate` of the run's draft with
#                                   evaluation.engine=sglang, measurement (b) alone, in a run folder of its own
#   bash bench/gpu/h200.sh both     (SGLang staged) the flow, and `sglang`'s evaluation beside it on the same
#                                   GPU as soon as the draft is exported: vLLM's and SGLang's (b) in one call
#   bash bench/gpu/h200.sh hub      (issue 52) the embedded target written as the Hub id
#                                   HuggingFaceTB/SmolLM2-135M-Instruct in a local Hub cache, HF_HUB_OFFLINE=1:
#                                   `eagle3 doctor`, `eagle3 plan`, then the demo flow (configs/demo.yaml, every
#                                   `auto` as it ships), and the plan's bytes and steps beside the run's
#                                   (bench/gpu/hub_plan.py); hub-*.txt/json/md in the output
#   bash bench/gpu/h200.sh turns    (issue 55) bench/turns_by_position.py: HumanEval made into three-turn
#                                   conversations, trained with sampling.turns last and all at the same compute
#                                   (400 steps each), then each draft served at k=3 and the 32 held-out
#                                   conversations replayed turn by turn: τ per turn position. Two calls: repeat
#                                   it, it resumes in $T/turns (TURNS_ARGS="--steps 300" etc. change the run,
#                                   then with a fresh $T/turns); turns.json and turns.md in the output
# On nvidia-h200-x2 (issue 29; staged with --moe):
#   bash bench/gpu/h200.sh pair       DDP throughput (one GPU, then both), then the SmolLM2 flow's training on
#                                     both GPUs (training.processes auto) against two hand-run `torchrun
#                                     --nproc-per-node 2 eagle3 train`, and a SIGKILL of `eagle3 run` mid-training
#   bash bench/gpu/h200.sh pair-kimi  the Kimi-shaped target's flow with vLLM at tensor parallelism 2, then its
#                                     samples extracted at tensor parallelism 1 (cosines against 2); repeat it to
#                                     resume a cut flow
# Each step ends by $CALL_S (default 570) seconds after it started; a cut flow resumes in the next step.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/eagle3-gpu
OUT=${OUT:-$T/out}
mkdir -p "$OUT" "$T"
export PYTHONPATH=$T/site:$PWD PREFECT_HOME=$T/prefect HF_HOME=$T/hf
CONFIG=bench/gpu/configs/h200-smollm2.yaml
SETS=(--set "run_dir=$T/run" --set "target.cache_dir=$T/cache")
read -ra EXTRA <<<"${EXTRA_SETS:-}"  # e.g. EXTRA_SETS="--set evaluation.max_prompts=8"
SETS+=("${EXTRA[@]}")
END=$((SECONDS + ${CALL_S:-570}))

timed() {
  local start=$SECONDS
  "$@"
  local rc=$?
  echo "[h200.sh] $* -> rc $rc in $((SECONDS - start)) s" | tee -a "$OUT/steps.log" >&2  # not in captured output
  return $rc
}

WATCH=
on_exit() {  # the GPU watcher stops (it would hold the step's output open); the device tool returns at most 8
  # files, so more are packed into out.tgz beside steps.log
  [ -z "$WATCH" ] || kill "$WATCH" 2>/dev/null
  if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -czf "$T/out.tgz" -C "$OUT" --exclude ./steps.log . && find "$OUT" -type f ! -name steps.log -delete &&
      mv "$T/out.tgz" "$OUT/"
  fi
}
trap on_exit EXIT

flow() {  # the whole flow until 60 s before the step's end; SIGTERM makes it stop its engines (Crashed)
  timed timeout -s TERM -k 20 $((END - SECONDS - 60)) python3 -m cli run -c $CONFIG "${SETS[@]}" 2>&1 | tee "$OUT/$1.log" | grep -v " | DEBUG"
}

collect() {
  local run=$T/run
  cp "$run/events.jsonl" "$OUT/" 2>/dev/null
  tar -czf "$OUT/run.tgz" -C "$run" --ignore-failed-read eval server samples/sample_set.json \
    hidden_states/hidden_state_set.json draft/curves.jsonl draft/draft_checkpoint.json draft/launch 2>/dev/null
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$OUT/steps.log"
}

tokenizer() {  # the embedded target's tokenizer, read from its GGUF (no conversion of the weights)
  [ -f "$T/tokenizer/tokenizer.json" ] || timed python3 -c "
import sys; from transformers import AutoTokenizer; from eagle3_core.target.prepare import embedded_gguf
g = embedded_gguf('smollm2-135m-instruct'); AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(sys.argv[1])
" "$T/tokenizer"
}

random_target() {  # $1 shape, $2 folder
  [ -f "$2/model.safetensors.index.json" ] || timed python3 -m bench.gpu.random_targets "$1" "$2" --tokenizer "$T/tokenizer"
}

backends() {  # which attention, MoE and quantization kernels vLLM chose, per server log of run $1
  local log
  for log in "$1"/server/*.log; do
    [ -f "$log" ] || continue
    echo "== $(basename "$log")"
    grep -hE "backend|Marlin|MoE|moe|quantiz|Using|block size|CUDA graph|[Ee]agle|[Dd]raft|[Ss]peculative" "$log" |
      grep -vE "DEBUG|Avg prompt throughput|Avg Draft|SpecDecoding metrics" | sed -E 's/^.*(INFO|WARNING|ERROR)/\1/' |
      cut -c1-400 | sort | uniq -c | sort -rn | head -40
  done
}

sglang_evaluate() {  # `eagle3 evaluate` of $T/run's draft with evaluation.engine=sglang, in $T/run-sglang; $@: more --set
  local site
  site=$(python3 -m bench.gpu.device site --engine sglang)
  mkdir -p "$T/run-sglang" && ln -sfn "$T/run/samples" "$T/run-sglang/samples"
  # SGLang's own site first on its PYTHONPATH; triton attention and PyTorch sampling (the staged kernels have
  # no FlashAttention, no flashinfer); no CUDA graphs and 16 prompts a set, what fits one call (EXTRA_SETS wins).
  timed timeout -s TERM -k 20 $((END - SECONDS - 30)) python3 -m cli evaluate -c $CONFIG --draft "$T/run/draft" \
    "${SETS[@]}" --set "run_dir=$T/run-sglang" --set evaluation.engine=sglang \
    --set evaluation.with_transformers=false --set server.enforce_eager=true --set evaluation.max_prompts=16 \
    --set "evaluation.sglang_env={\"PYTHONPATH\": \"$site:$PYTHONPATH\"}" \
    --set "evaluation.sglang_args=[--attention-backend, triton, --sampling-backend, pytorch]" "$@" "${EXTRA[@]}" \
    2>&1 | grep -v " | DEBUG" | tail -40
  cp -r "$T/run-sglang/eval" "$OUT/sglang-eval" 2>/dev/null
  cp "$T/run-sglang/events.jsonl" "$OUT/sglang-events.jsonl" 2>/dev/null
  tail -n 80 "$T"/run-sglang/server/evaluation*.log >"$OUT/sglang-server-log-tails.txt" 2>/dev/null
}

draft_exported() {  # wait until $T/run's flow reaches evaluation (its draft exported), or $1 s before the end
  until grep -q '"phase": "evaluation"' "$T/run/events.jsonl" 2>/dev/null; do
    [ $SECONDS -lt $((END - $1)) ] || break
    sleep 2
  done
}

eagle3_on_path() {  # training.processes > 1 launches the `eagle3` command under torchrun: what pip would install
  mkdir -p "$T/bin"
  printf '#!%s\nfrom cli.main import app\n\napp(prog_name="eagle3")\n' "$(command -v python3)" >"$T/bin/eagle3"
  chmod +x "$T/bin/eagle3"
  export PATH=$T/bin:$PATH
}

gpu_watch() {  # every GPU's load and memory every 2 s into $OUT/gpus.csv, in the background
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader -l 2 >>"$OUT/gpus.csv" &
  WATCH=$!
}

extract_tp1() {  # $1 run folder, $2 output name, $@: more --set; the run's samples extracted again at tensor
  # parallelism 1, cosines against the run's
  local run=$1 name=$2
  shift 2
  timed timeout -s TERM -k 20 $((END - SECONDS - 20)) python3 -m cli extract -c $CONFIG \
    "${SETS[@]}" --set "run_dir=$run-tp1" --samples "$run/samples" --set server.tensor_parallel_size=1 "$@" \
    2>&1 | grep -v " | DEBUG" | tail -5
  timed python3 -m bench.gpu.compare_extraction "$run/hidden_states" "$run-tp1/hidden_states" | tee "$OUT/$name"
}

ranks() {  # processes of `eagle3 train` that are not torchrun's agent
  ps -eo args | grep "eagle3 train" | grep -v grep | grep -vc torch.distributed.run
}

killed_mid_training() {  # `eagle3 run` again with another training seed (sampling and extraction Cached), SIGKILLed
  # once both ranks train; then every process of it that is left, and what holds GPU memory
  python3 -m cli run -c $CONFIG "${SETS[@]}" --set training.seed=7 >"$OUT/killed.log" 2>&1 &
  local flow=$! waited=0
  until [ "$(ranks)" -ge 2 ] || [ $waited -ge 240 ]; do sleep 1; waited=$((waited + 1)); done
  sleep 20  # past compile, into the steps
  ps -eo pid,ppid,etimes,args | grep -E "eagle3 train|torch.distributed.run|cli run" | grep -v grep >"$OUT/killed-before.txt"
  kill -9 $flow
  sleep 15
  ps -eo pid,ppid,etimes,args | grep -E "eagle3 train|torch.distributed.run|cli run|prefect" | grep -v grep \
    >"$OUT/killed-after.txt"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$OUT/killed-after.txt"
  echo "[h200.sh] SIGKILL of the flow after ${waited} s waiting for 2 ranks: $(wc -l <"$OUT/killed-before.txt") processes" \
    "before, $(grep -cE 'eagle3 train|torch.distributed.run' "$OUT/killed-after.txt") ranks or agents after" | tee -a "$OUT/steps.log"
}

case ${1:-} in
  stash)
    timed python3 -m bench.gpu.device stash
    [ -d .gpu-stage/sglang ] && timed python3 -m bench.gpu.device stash --engine sglang
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    python3 -m pip list --format=freeze >"$OUT/device-pip-freeze.txt" 2>/dev/null
    ;;
  run)
    timed python3 -m bench.gpu.device install || exit 1
    timed python3 -m pytest --noconftest -p no:cacheprovider -q -s tests/unit/eagle3_core/serving/test_gpu_release.py 2>&1 | tail -5
    timed python3 -c "import vllm, prefect, pydantic; print('vllm', vllm.__version__, 'prefect', prefect.__version__)"
    flow run1
    collect
    ;;
  finish)
    timed python3 -m bench.gpu.device install || exit 1
    flow run2
    if [ -f "$T/run/hidden_states/hidden_state_set.json" ] && [ ! -f "$OUT/cosines.json" ]; then
      timed python3 -m cli extract -c $CONFIG --set "run_dir=$T/run-hf" --set "target.cache_dir=$T/cache" \
        --samples "$T/run/samples" --set extraction.backend=hf 2>&1 | tail -5
      timed python3 -m bench.gpu.compare_extraction "$T/run/hidden_states" "$T/run-hf/hidden_states" \
        | tee "$OUT/cosines.json"
    fi
    collect
    ;;
  hub)
    timed python3 -m bench.gpu.device install || exit 1
    eagle3_on_path
    timed python3 -m bench.gpu.hub_plan cache "$T/hub" "$T/cache" || exit 1
    export HF_HUB_CACHE=$T/hub HF_HUB_OFFLINE=1
    # The staged vLLM carries no flashinfer: its sampler is told so (bench/gpu/configs/h200-smollm2.yaml); no auto set.
    HUB=(-c configs/demo.yaml --set "run_dir=$T/run-hub" --set "target.cache_dir=$T/cache"
      --set target.model=HuggingFaceTB/SmolLM2-135M-Instruct --set 'server.env={"VLLM_USE_FLASHINFER_SAMPLER": "0"}'
      "${EXTRA[@]}")
    timed python3 -m cli doctor "${HUB[@]}" 2>&1 | tee "$OUT/hub-doctor.txt"
    timed python3 -m cli plan "${HUB[@]}" 2>&1 | tee "$OUT/hub-plan.md"
    timed python3 -m bench.gpu.hub_plan plan "$OUT/hub-plan.json" "${HUB[@]}" >/dev/null
    timed timeout -s TERM -k 20 $((END - SECONDS - 40)) python3 -m cli run "${HUB[@]}" 2>&1 |
      tee "$OUT/hub-run.log" | grep -v " | DEBUG" | tail -30
    timed python3 -m bench.gpu.hub_plan compare "$OUT/hub-plan.json" "$T/run-hub" | tee "$OUT/hub-measured.json"
    cp "$T/run-hub/events.jsonl" "$OUT/hub-events.jsonl" 2>/dev/null
    ;;
  turns)
    # The embedded target, configs/demo.yaml as bench/turns_by_position.py sets it, and: no flashinfer (the staged
    # vLLM has none); float32, so greedy with either draft is the target's own greedy and both modes are asked
    # the same served histories; no CUDA graphs (four engine starts, each shorter for it; τ does not depend on it).
    timed python3 -m bench.gpu.device install || exit 1
    eagle3_on_path
    export HF_HUB_OFFLINE=1
    read -ra TURNS_ARGS <<<"${TURNS_ARGS:-}"
    timed timeout -s TERM -k 20 $((END - SECONDS - 30)) python3 bench/turns_by_position.py --work "$T/turns" \
      --set "target.cache_dir=$T/cache" --set 'server.env={"VLLM_USE_FLASHINFER_SAMPLER": "0"}' \
      --set server.dtype=float32 --set server.enforce_eager=true --set sampling.concurrency=64 \
      "${TURNS_ARGS[@]}" "${EXTRA[@]}" 2>&1 | grep -v " | DEBUG" | tail -60
    cp "$T/turns/turns.json" "$T/turns/turns.md" "$OUT/" 2>/dev/null
    tail -n 30 "$T"/turns/*.log "$T"/turns/*/server/*.log >"$OUT/turns-log-tails.txt" 2>/dev/null
    ;;
  kimi)
    timed python3 -m bench.gpu.device install || exit 1
    tokenizer
    random_target kimi "$T/kimi-w4a16"
    CONFIG=bench/gpu/configs/h200-kimi-w4a16.yaml
    BASE=(--set "run_dir=$T/run-kimi" --set "target.model=$T/kimi-w4a16" "${EXTRA[@]}")
    for draft in ${KIMI_DRAFTS:-llama mla}; do
      [ $((END - SECONDS)) -gt 90 ] || { echo "[h200.sh] no time left for the $draft draft" | tee -a "$OUT/steps.log"; break; }
      SETS=("${BASE[@]}")
      [ "$draft" = mla ] && SETS+=(--set training.draft_architecture=deepseek_mla)
      flow "kimi-$draft"
      backends "$T/run-kimi" >"$OUT/kimi-$draft-backends.txt"  # before the next run's starts rotate the logs
      mkdir -p "$T/kimi-servers/$draft" && cp -r "$T/run-kimi/server/." "$T/kimi-servers/$draft/"
      cp -r "$T/run-kimi/eval" "$T/kimi-servers/$draft/eval" 2>/dev/null
    done
    cp "$T/run-kimi/events.jsonl" "$OUT/kimi-events.jsonl"
    tar -czf "$OUT/kimi-run.tgz" -C "$T" --ignore-failed-read kimi-servers 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$OUT/steps.log"
    ;;
  limit)
    timed python3 -m bench.gpu.device install || exit 1
    tokenizer
    random_target llama8b "$T/llama8b"
    SHM=/dev/shm
    df -h /dev/shm "$T" | tee -a "$OUT/steps.log"
    if [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -lt 8 ] 2>/dev/null || [ ! -d /dev/shm ]; then
      mkdir -p "$T/shm" && mount -t tmpfs -o size=16g tmpfs "$T/shm" && SHM=$T/shm
      df -h "$T/shm" | tee -a "$OUT/steps.log"
    fi
    echo "[h200.sh] connector tmpfs: $SHM" | tee -a "$OUT/steps.log"
    timed timeout -s TERM -k 20 $((END - SECONDS - 30)) python3 -m bench.gpu.extraction_limit --target "$T/llama8b" \
      --work "$T/limit" --out "$OUT/limit.json" --shm "$SHM" ${LIMIT_HF:+--hf} ${LIMIT_ROUND:+--round "$LIMIT_ROUND"} \
      ${LIMIT_PLAIN_RATE:+--plain-rate "$LIMIT_PLAIN_RATE"} ${LIMIT_SAMPLES:+--samples "$LIMIT_SAMPLES"} 2>&1 | grep -v " | DEBUG" | tail -60
    backends "$T/limit/extract" | tee "$OUT/limit-backends.txt"
    tail -c 300000 "$T/limit/extract/server/extraction.log" >"$OUT/limit-extraction.log" 2>/dev/null
    rm -rf "$T/limit"
    ;;
  quality)
    timed python3 -m bench.gpu.device install || exit 1
    [[ ${STAGES:-} != *sglang* ]] || timed python3 -m bench.gpu.device install --engine sglang || exit 1
    timed timeout -s TERM -k 20 $((END - SECONDS - 30)) python3 -m bench.gpu.quality_runs --work "$T/quality" \
      --out "$OUT/quality" --sglang-site "$(python3 -m bench.gpu.device site --engine sglang)" \
      --set "target.cache_dir=$T/cache" ${STAGES:+--stages "$STAGES"} "${EXTRA[@]}" 2>&1 | grep -v " | DEBUG" | tail -60
    tail -n 40 "$OUT"/quality/*.log >"$OUT/quality-log-tails.txt" 2>/dev/null
    ;;
  sglang)
    timed python3 -m bench.gpu.device install || exit 1
    timed python3 -m bench.gpu.device install --engine sglang || exit 1
    sglang_evaluate
    ;;
  both)
    # The flow and SGLang's measurement (b) of its draft in one call (sixth session: `run`, `finish` and `sglang`
    # in turn did not fit what was left of the budget): the flow on one server shared by sampling and extraction,
    # vLLM's KV cache given in bytes (its start-up profiling counts another process's GPU memory as its own), and
    # SGLang started beside it with 0.3 of the GPU as soon as the draft is exported.
    timed python3 -m bench.gpu.device install || exit 1
    timed python3 -m bench.gpu.device install --engine sglang || exit 1
    SETS+=(--set "extraction.reuse_sampling_server='on'" --set evaluation.with_transformers=false
      --set 'server.extra_args=["--max-num-seqs", "64", "--kv-cache-memory-bytes", "17179869184"]')
    flow run1 &
    draft_exported 120
    sglang_evaluate --set server.gpu_memory_utilization=0.3 --set 'server.extra_args=[]'
    wait
    collect
    ;;
  pair)
    # DDP throughput (bench/train_speed.py: one GPU, then both; compiled, both shapes), then the SmolLM2 flow with
    # training in one process per GPU (stopped once the draft is exported; no CUDA graphs, only training is under
    # test), two hand-run `torchrun --nproc-per-node 2 eagle3 train` of the same data (their weights against the
    # flow's and each other's: GPU training's own spread), and a SIGKILL of `eagle3 run` mid-training.
    timed python3 -m bench.gpu.device install || exit 1
    eagle3_on_path
    optimizers=${DDP_OPTIMIZERS:-adamw,muon}
    CUDA_VISIBLE_DEVICES=0 timed python3 bench/train_speed.py --no-profile --skip-checks --optimizers "$optimizers" \
      --out "$OUT/single.json" --budget-s 150 >"$OUT/train-speed-single.log" 2>&1
    timed torchrun --nproc_per_node 2 bench/train_speed.py --ddp --optimizers "$optimizers" \
      --compare "$OUT/single.json" --out "$OUT/ddp.json" >"$OUT/train-speed-ddp.log" 2>&1
    tail -n 8 "$OUT/train-speed-ddp.log"
    gpu_watch
    SETS+=(--set training.processes=auto --set "extraction.reuse_sampling_server='on'" --set server.enforce_eager=true)
    flow run1 &
    flowing=$!
    draft_exported 130
    pkill -TERM -f "cli run -c $CONFIG"
    wait $flowing
    collect
    for hand in run-hand run-hand2; do
      timed timeout -s TERM -k 20 100 torchrun --standalone --nproc-per-node 2 "$T/bin/eagle3" train \
        -c "$T/run/draft/launch/config.yaml" --set "run_dir=$T/$hand" --hidden-states "$T/run/hidden_states" \
        --vocab "$T/run/vocab" >"$OUT/$hand.log" 2>&1
    done
    timed python3 -m bench.gpu.compare_drafts "$T/run/draft" "$T/run-hand/draft" >"$OUT/drafts.json"
    timed python3 -m bench.gpu.compare_drafts "$T/run-hand/draft" "$T/run-hand2/draft" >"$OUT/drafts-hand.json"
    killed_mid_training
    ;;
  pair-kimi)
    # The Kimi-shaped target's flow with vLLM at tensor parallelism 2 (one server for sampling and extraction),
    # the Llama-shaped draft trained in one process per GPU and served at tensor parallelism 2; then, with time
    # left, its samples extracted at tensor parallelism 1 (cosines against 2). A cut flow resumes in the next
    # call (its finished phases Cached).
    timed python3 -m bench.gpu.device install || exit 1
    eagle3_on_path
    gpu_watch
    tokenizer
    random_target kimi "$T/kimi-w4a16"
    CONFIG=bench/gpu/configs/h200-kimi-w4a16.yaml
    SETS=(--set "run_dir=$T/run-kimi" --set "target.model=$T/kimi-w4a16" --set server.tensor_parallel_size=2
      --set "extraction.reuse_sampling_server='on'" "${EXTRA[@]}")
    flow kimi-tp2
    backends "$T/run-kimi" >"$OUT/kimi-tp2-backends.txt"
    cp "$T/run-kimi/events.jsonl" "$OUT/kimi-events.jsonl"
    tar -czf "$OUT/kimi-run.tgz" -C "$T/run-kimi" --ignore-failed-read server eval 2>/dev/null
    if [ -f "$T/run-kimi/hidden_states/hidden_state_set.json" ] && [ $((END - SECONDS)) -gt 150 ]; then
      SETS=(--set "target.model=$T/kimi-w4a16" "${EXTRA[@]}")
      extract_tp1 "$T/run-kimi" kimi-tp-cosines.json
    fi
    ;;
  *)
    echo "usage: bash bench/gpu/h200.sh stash|run|finish|kimi|limit|quality|sglang|both|pair|pair-kimi" >&2
    exit 2
    ;;
esac
