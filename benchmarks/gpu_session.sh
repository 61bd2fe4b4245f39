#!/usr/bin/env bash
# Step 3 of the H200 recipe, the same in every session: unpack the vLLM bundle (once per warm
# machine), then run one named batch of GPU work, logging to $OUT and printing a short table last.
# A call carries at most 64 MiB with the tree (24 MB in session 56), and build.sh's parts are 60
# MiB: carry four smaller ones (`cd .bundle && cat part-* > /tmp/b.xz && rm part-* && split -b 36M
# -d /tmp/b.xz part- && sha256sum part-* > SHA256SUMS`); this script joins whatever parts came.
#   bash benchmarks/gpu_session.sh SET [MODEL | SCENARIOS]
#   SET: dense | verify | v1-v2 | last-rows | eager | aligned | stop-token | moe | tp | profile | ablation | first-steps | fused-store | client-copies | step-alternation | after-capture | slow-state | extract | extract-last | extract-profile | extract-write | fetch | reduction | replay | step-host | eager-launch | nodes | startup | open-targets | bench-1b-eager | bench-quick | bench-full | bench-8b-decode | bench-8b-prefill | bench-8b-idle | bench-1b-paired | bench-1b-control | bench-moe | bench-moe-eager   (tp needs 2 GPUs and the dense+moe runs'
#   /tmp/*.pt files of the same warm machine; MODEL, for bench-full, replay and startup: 8b | 1b | moe | tiny |
#   tiny-moe; SCENARIOS, for profile: a comma list, default idle,hidden-last,hidden-4l)
set -uo pipefail
SET=${1:-dense}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/parts/part-* | xz -d | tar -x -C /tmp || { echo "bundle unpack failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_CAPTURE_TINY_DIR=/tmp/tiny
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt"
# The host's CPUs: the 1B's step waits on them, and its capture cost moved from run to run.
python3 benchmarks/host_cpu.py | tee -a "$OUT/gpu.txt"
# PACKAGE_AT=COMMIT runs the set with vllm_capture/ as of COMMIT and everything else (harness,
# checks) from this tree: a point of a bisection over the package's history. The set runs in a
# copy of the tree in /tmp whose vllm_capture/ comes from .bisect/COMMIT/ where the call carried
# it (made here: `mkdir -p .bisect/C && git archive C vllm_capture | tar -x -C .bisect/C`, then
# `carry: [".bisect"]`; git-ignored), else from this tree's git objects, whose history the device
# may not hold.
# PACKAGE_BEFORE=COMMIT (startup only): start a third kind, the capture engine with the package
# carried in .bisect/COMMIT/, in the same rounds (startup.py --package-before).
BEFORE_ARGS=
if [ -n "${PACKAGE_BEFORE:-}" ]; then
  [ -d "$PWD/.bisect/$PACKAGE_BEFORE/vllm_capture" ] || { echo "PACKAGE_BEFORE=$PACKAGE_BEFORE: .bisect/$PACKAGE_BEFORE/vllm_capture not carried"; exit 1; }
  BEFORE_ARGS="--package-before $PWD/.bisect/$PACKAGE_BEFORE"
fi
if [ -n "${PACKAGE_AT:-}" ]; then
  T=/tmp/tree-$PACKAGE_AT; rm -rf "$T" && mkdir -p "$T"
  tar --exclude=./.git --exclude=./.bundle --exclude=./.bisect --exclude=./.venv -cf - . | tar -xf - -C "$T"
  rm -rf "$T/vllm_capture"
  if [ -d ".bisect/$PACKAGE_AT/vllm_capture" ]; then
    cp -r ".bisect/$PACKAGE_AT/vllm_capture" "$T/" && echo "vllm_capture/ as of $PACKAGE_AT (carried)" | tee -a "$OUT/gpu.txt"
  else
    git cat-file -e "$PACKAGE_AT^{commit}" 2>/dev/null || { echo "PACKAGE_AT=$PACKAGE_AT: not carried in .bisect/ and not in this tree's git objects"; exit 1; }
    git archive "$PACKAGE_AT" vllm_capture | tar -x -C "$T" || exit 1
    echo "vllm_capture/ as of $(git log -1 --format='%h %s' "$PACKAGE_AT" | cut -c1-100)" | tee -a "$OUT/gpu.txt"
  fi
  cd "$T"; export PYTHONPATH=/tmp/site:$PWD
fi
G=tests/gpu/gpu_checks.py
# The 8B's control (vanilla-b) makes three engines side by side: they fit an H200's memory, not
# an H100's (session 55: the capture engine's start failed; run.py now says so and starts none).
# On a card under 100 GiB the 8B sets leave the control out.
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
CONTROL_8B=vanilla-b,; [ "${GPU_MIB:-0}" -lt 100000 ] && CONTROL_8B=
run() { local name=$1; shift; echo "== $name"; timeout ${RUN_TIMEOUT:-300} python3 $G run "$@" --out /tmp/$name.pt >"$OUT/$name.log" 2>&1; echo "rc=$? $(grep -E '^\{' "$OUT/$name.log" | tail -1 | cut -c1-300)"; }
compare() { local name=$1 model=$2; shift 2; python3 $G compare --run /tmp/$name.pt --model-dir /tmp/tiny/$model --report "$OUT/${name}_report.json" "$@" >"$OUT/${name}_compare.log" 2>&1; echo "compare $name rc=$?"; }
# Rows of the same steps from two engine starts (graphs and none, V1 and V2) can sit a bf16 step
# apart whatever captures them: vLLM's default kernels round by batch shape (under graphs a decode
# step is padded to a captured size and FlashAttention's split count is the one set for graphs),
# and Inductor may pick a reduction's config anew. Session 65's H100 read graph and no-graph rows
# up to 0.03125 apart; session 66's H100 0.015625 under TORCHINDUCTOR_DETERMINISTIC=1, and bit for
# bit under vLLM's batch-invariant kernels, V1 against V2 too. So the checks that are bit for bit
# (dense's, v2_then_v1's) run under them; VLLM_BATCH_INVARIANT=0 runs them on vLLM's defaults.
# gpu_checks.py records each run's mode, and a failed --identical says when the modes explain it.
batch_invariant() {
  export VLLM_BATCH_INVARIANT=${VLLM_BATCH_INVARIANT:-1}
  echo "VLLM_BATCH_INVARIANT=$VLLM_BATCH_INVARIANT" | tee -a "$OUT/gpu.txt"
}
# The tiny Llama under graphs on the V2 runner, then the same prompts through the V1 runner's
# wrapper: each run's rows against HF fp32, its last/mean reductions against its own all-row
# capture (last bit for bit), and V1's rows against V2's (--identical: bit for bit). Session 52
# read V1 equal to V2 (every generate first queues all its requests, generate_together); before
# that sessions 15, 19, 49 and 50 read them one bf16 step apart, and so did session 54, with the
# traced last-row stores; session 55 read them equal on one machine with the package before the
# stores and after (so the stores do not make that step).
v2_then_v1() {
  batch_invariant
  run llama_graph --model llama --mode graph
  compare llama_graph llama --max-rel 0.1
  run llama_v1_graph --model llama --mode graph --v1
  compare llama_v1_graph llama --max-rel 0.1 --against v2_graph=/tmp/llama_graph.pt --identical v2_graph
}
# fused_store_probe.py in a fresh process a mode, in the order given, on MODEL: its JSON lines to
# $OUT/fused_store.log, each mode's whole Inductor log (stderr) gzipped beside it.
store_probes() {
  local model=$1 m; shift
  for m in "$@"; do
    timeout 140 python3 benchmarks/fused_store_probe.py --store $m --model $model 2>/tmp/fused_store_$m.err \
      | tee -a "$OUT/fused_store.log" | grep -E "^\{" | cut -c1-400
    gzip -c /tmp/fused_store_$m.err >"$OUT/fused_store_$m.err.gz"
  done
}
# startup.py's rounds, vanilla and capture (and PACKAGE_BEFORE's), under a time limit:
# startup_rounds LIMIT_S MODEL ROUNDS (STARTUP_ARGS after them, e.g. an --order). Prints each
# start's line, SEGMENTS and the checks.
# startup.py's share of 0.4 (every 1B reading's) leaves the 8B's capture engine no KV cache on a
# card under 100 GiB (session 62's H100: -1.44 GiB; weights 15.0 GiB, its default buffers 16.1 GiB
# at vLLM's 16,384 batched tokens): 0.8 there.
startup_rounds() {
  local share=
  [ "$2" = 8b ] && [ "${GPU_MIB:-0}" -lt 100000 ] && share="--gpu-memory-utilization 0.8"
  timeout $1 python3 benchmarks/startup.py --model $2 --rounds $3 $BEFORE_ARGS $share ${STARTUP_ARGS:-} --out "$OUT" 2>&1 \
    | grep -E "^\{|^SEGMENTS|PASS|FAIL" | cut -c1-400
}
# The 1B's graph targets beside a second vanilla engine (see bench-1b-control):
# bench_1b_control REPS BUDGET_S (BENCH_ARGS after them, so a --budget-s there wins).
bench_1b_control() {
  python3 benchmarks/run.py --suite quick --scenarios vanilla,vanilla-b,idle,hidden-last,hidden-4l \
    --reps $1 --block 2 --budget-s $2 --grace-s 30 ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 35
}
case "$SET" in
  dense)
    batch_invariant
    run llama_vanilla --model llama --no-capture
    run llama_graph --model llama --mode graph
    run llama_eager --model llama --mode eager
    # Same compiled model without graphs: the op's eager path, whose rows must equal the graph
    # run's bit for bit (--identical; both runs take the same steps, see verify).
    run llama_nograph --model llama --mode nograph
    compare llama_graph llama --max-rel 0.1 --against eager=/tmp/llama_eager.pt --against nograph=/tmp/llama_nograph.pt --identical nograph
    ;;
  verify)
    # After a kernel, upload or step-path change: graph-mode rows of the tiny Llama against HF
    # fp32 (what `dense` checks first, in a fifth of its time), on the V2 runner and then the V1
    # runner, with last/mean reductions against each run's all-row capture (the run's "reduced"),
    # idle capture nodes switched off in a real CUDA graph, and a drain's gather (no engine).
    timeout 120 python3 $G graph-nodes --report "$OUT/graph_nodes_report.json" >"$OUT/graph_nodes.log" 2>&1
    echo "graph-nodes rc=$? $(tail -1 "$OUT/graph_nodes.log" | cut -c1-400)"
    # A drain's gather on the device, in the store's order and as the ring holds them (no engine).
    timeout 120 python3 $G drain-order --report "$OUT/drain_order_report.json" >"$OUT/drain_order.log" 2>&1
    echo "drain-order rc=$? $(tail -1 "$OUT/drain_order.log" | cut -c1-400)"
    v2_then_v1
    ;;
  v1-v2)
    # v2_then_v1 alone (about 3 minutes on an H100), for one package against another on the
    # same machine: e.g. `PACKAGE_AT=90a8f89 OUT=$OUT/before bash benchmarks/gpu_session.sh
    # v1-v2` (carrying .bisect/90a8f89, see PACKAGE_AT above), then without PACKAGE_AT.
    v2_then_v1
    ;;
  last-rows)
    # Last-token hidden states stored by traced torch ops (vllm_capture/capture_graph/
    # last_rows.py), the capture kernel left at one layer: the tiny Llama's last and mean
    # reductions against each run's all-row capture (last bit for bit) on the V2 runner, then
    # the V1 runner (--identical: its rows equal V2's); then the 1B in the fused-store probe,
    # vanilla (none) against capture's hidden-last (op): tokens_sha (the stores leave the
    # model's arithmetic alone), compiled_modules (the layers still share one piece) and the
    # launch sites (one capture op in the shared piece). About 5 minutes; over 400 s on session
    # 58's H100 (the V2 engine's first start took 79 s), where a 400 s limit ended before `op`.
    v2_then_v1
    # (Session 54 read 34 launch sites for op against none's 30; on the CPU VM,
    # launches_by_module shows op adding the capture op's calls (hidden states' and heads') and
    # no kernel: on a GPU, 4 calls in the 2 modules with layer outputs would make those 4.)
    store_probes 1b none op
    ;;
  eager)
    # The eager path alone (enforce_eager): the tiny Llama's rows against HF fp32, and its last
    # and mean reductions against its own all-row capture (last bit for bit; since session 54 the
    # last rows come from the layers' eager stores, capture_graph/last_rows.py). About 2 minutes.
    run llama_eager --model llama --mode eager
    compare llama_eager llama --max-rel 0.1
    ;;
  aligned)
    # Ring and slot counts whose rows are not 16-byte multiples (251 tokens a step, 50 slots):
    # every site's buffers must still start aligned, so no capture kernel compiles inside graph
    # capture or after load (counted in-process by a Triton compile hook), and the rows are
    # checked against HF. With PACKAGE_AT=f5caefa, the package before the alignment padding.
    run llama_aligned --model llama --mode graph --inproc --max-num-seqs 50 --batched-tokens 251
    python3 -c "
import torch; c = torch.load('/tmp/llama_aligned.pt', weights_only=False)['capture_kernel_compiles']
print('compiles', c, 'PASS' if c['load_in_graph_capture'] == c['after_load'] == 0 else 'FAIL')"
    [ -z "${PACKAGE_AT:-}" ] && compare llama_aligned llama --max-rel 0.1
    ;;
  stop-token)
    # Requests that stop on a stop token (async scheduling on, vLLM's GPU default): the rows
    # each feeds past its output, and capture()'s rows.
    timeout 200 python3 $G stop-token --report "$OUT/stop_token_report.json" >"$OUT/stop_token.log" 2>&1
    echo "stop-token rc=$? $(grep -E '^\{' "$OUT/stop_token.log" | tail -1 | cut -c1-500)"
    ;;
  moe)
    # Qwen3-MoE and Mixtral run on the V1 runner; Qwen3-MoE's gate runs inside vLLM's fused-MoE op.
    run qwen3_moe_graph --model qwen3_moe --mode graph
    run qwen3_moe_eager --model qwen3_moe --mode eager
    compare qwen3_moe_graph qwen3_moe --against eager=/tmp/qwen3_moe_eager.pt
    # The dense model on the V1 runner too.
    run llama_v1_graph --model llama --mode graph --v1
    compare llama_v1_graph llama --max-rel 0.1 --against v2_graph=/tmp/llama_graph.pt
    # The tiny Mixtral hung at checkpoint load on 2026-11-30: in-process, with a stack dump.
    RUN_TIMEOUT=200 run mixtral_graph --model mixtral --mode graph --inproc --stack-dump-s 170
    [ -f /tmp/mixtral_graph.pt ] && compare mixtral_graph mixtral
    ;;
  tp)
    run llama_tp2_vanilla --model llama --no-capture --tp 2
    run llama_tp2_graph --model llama --mode graph --tp 2
    compare llama_tp2_graph llama --max-rel 0.1 --against tp1=/tmp/llama_graph.pt
    run qwen3_moe_tp2_graph --model qwen3_moe --mode graph --tp 2
    compare qwen3_moe_tp2_graph qwen3_moe --against tp1=/tmp/qwen3_moe_graph.pt
    ;;
  profile)
    # Where a step's host time goes (torch.profiler tables, then cProfile's by function), a
    # vanilla engine's and then the capture engine's, each in its own process; one file back.
    # (CPROFILE_REPS: generates under cProfile per scenario, 1 by default; session 27 used 3.)
    timeout 200 python3 benchmarks/profile_step.py --model 1b --out /tmp/profile --engine vanilla \
      ${CPROFILE_REPS:+--cprofile-reps $CPROFILE_REPS} >"$OUT/profile_vanilla.log" 2>&1; echo "profile vanilla rc=$?"
    timeout 300 python3 benchmarks/profile_step.py --model 1b --out /tmp/profile \
      --scenarios ${2:-idle,hidden-last,hidden-4l} ${CPROFILE_REPS:+--cprofile-reps $CPROFILE_REPS} \
      >"$OUT/profile.log" 2>&1; echo "profile rc=$?"
    grep -hE "^(vanilla|idle|hidden|heads|heavy|router)" "$OUT/profile_vanilla.log" "$OUT/profile.log" | cut -c1-700
    mv "$OUT/profile_vanilla.log" /tmp/profile/ 2>/dev/null
    cp "$OUT/profile.log" /tmp/profile/ 2>/dev/null; tar czf "$OUT/profile.tgz" -C /tmp profile && rm -f "$OUT/profile.log"
    ;;
  ablation)
    # A row stream's step time split between the step path and the harvest thread's store
    # (benchmarks/harvest_ablation.py: idle, hidden-last, hidden-4l, hidden-4l with its drained
    # rows dropped), one engine as the benchmark runs it (engine core on CPUs 4-7, the client on
    # 0-3). (REPS, the second argument: 16 by default; about 3 minutes. CASES: the script's
    # --cases, e.g. idle,hidden-last,hidden-last-nohost,hidden-last-nonodes,hidden-last-bare: a
    # last-token capture without its host step path on steady decode, without its capture nodes
    # in the graphs launched (-nonodes; -nogpu keeps the nodes, their kernels exiting), and
    # without both. SWITCH_INTERVAL: the processes' GIL switch interval in seconds (Python's
    # 0.005 by default), for begin_step's waits on the GIL (session 36's README).
    # BUDGET_S: seconds of reps, 420 by default, so that the summary and its table
    # of step phases get written. Where the host has hardware counters, "counted" lines give the
    # engine step's user-mode instructions and cycles. After the phase table, a generate's first
    # iterations by phase, each case's difference from idle's.)
    timeout 560 python3 benchmarks/harvest_ablation.py --model 1b --out "$OUT" \
      --reps ${2:-16} --budget-s ${BUDGET_S:-420} ${CASES:+--cases $CASES} \
      ${SWITCH_INTERVAL:+--switch-interval $SWITCH_INTERVAL} >"$OUT/ablation.log" 2>&1
    echo "ablation rc=$?"
    grep -E "^(idle|hidden)" "$OUT/ablation.log" | cut -c1-700
    sed -n '/^phase (ms\/step)/,$p' "$OUT/ablation.log" | grep -v "^counted"
    ;;
  after-capture)
    # What a capture leaves in the engine (benchmarks/after_capture.py): one capture engine's idle
    # generates before and after CAPTURES captures, then after each release of what it held (a
    # wait, a device synchronize, the decode graph's replays alone, the client's files, the
    # worker's mappings, the device and host caches, the graph copies, another process's GPU
    # work, a vanilla generate, a heads-4l capture). The benchmark's 8B idle runs about 2.5%
    # slower once it has run hidden-4l (sessions 23-25, the package back to e7f71b2 alike); this
    # script, with a vanilla generate before each of the capture engine's, never reproduced it
    # (sessions 24-25), and the benchmark's idle ran slow after the capture engine's own generates
    # only: "--vanilla-between none" leaves the vanilla engine idle but for the vanilla-generate
    # release. A vanilla engine runs beside it, one generate before each of its own unless
    # AFTER_ARGS says none; BESIDE_VANILLA=0 starts none (the capture engine alone on the GPU, as
    # users run it; no vanilla-generate release then). (MODEL, the second argument:
    # 8b by default; CAPTURE: the scenario, hidden-4l; CAPTURES, 2; IDLE generates after each
    # event, 3; ROUNDS, 2; about 7 minutes for the 8B, two engine starts included. AFTER_ARGS:
    # more of after_capture.py's options, e.g. "--suite full --releases graph-copies,replays".)
    [ "${BESIDE_VANILLA:-1}" = 0 ] && BESIDE="" || BESIDE="--beside-vanilla"
    timeout 560 python3 benchmarks/after_capture.py --model ${2:-8b} --capture ${CAPTURE:-hidden-4l} $BESIDE \
      --idle ${IDLE:-3} --captures ${CAPTURES:-2} --rounds ${ROUNDS:-2} ${AFTER_ARGS:-} --out "$OUT" >"$OUT/after_capture.log" 2>&1
    echo "after-capture rc=$?"
    grep -E "^[0-9] |^median|^[a-z0-9-]+ +[0-9]+ \(|failed" "$OUT/after_capture.log" | tail -100
    ;;
  slow-state)
    # What puts the capture engine's GPU work into its slow state and what takes it out
    # (benchmarks/slow_state.py): after each step, triggers (a capture, pinned blocks, copies to
    # the host, a device gather) and resets (another process's matmuls, a bare context, a second
    # context in the worker), the FULL decode graph replayed alone and an idle generate. (MODEL,
    # the second argument: 8b by default; STEPS: the script's --steps; about 4 minutes.)
    timeout 560 python3 benchmarks/slow_state.py --model ${2:-8b} ${STEPS:+--steps $STEPS} \
      --out "$OUT" >"$OUT/slow_state.log" 2>&1
    echo "slow-state rc=$?"
    grep -E "^ ?[0-9]+ " "$OUT/slow_state.log" | tail -40
    ;;
  extract|extract-last|extract-profile|extract-write)
    # The main job's throughput (issue 6): Llama-3.2-1B shape (dummy weights), 4,096 prompts of
    # 20-120 words, last prompt token of every layer, then every prompt row of 4 layers, then the
    # last token of both hidden states and attention heads. extract-last runs the first alone
    # (about 80 s): with PACKAGE_AT, a point of a comparison with an earlier package on one host.
    # extract-profile runs it in one process under cProfile (benchmarks/extract_profile.py), its
    # ninth batch also under torch.profiler (device time by kernel).
    # EXTRACT_ARGS are added to every extract command (engine options: --max-num-seqs 256).
    python3 benchmarks/extract_inputs.py --out /tmp/extract || exit 1
    X="python3 -m vllm_capture.cli extract /tmp/extract/models/1b /tmp/extract/prompts.txt --load-format dummy --dtype bfloat16 --max-model-len 512 --batch-size 256 --no-progress ${EXTRACT_ARGS:-}"
    L=extract_last${PACKAGE_AT:+_$PACKAGE_AT}; rm -rf /tmp/extract/last
    if [ "$SET" = extract-profile ]; then
      VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 280 python3 benchmarks/extract_profile.py \
        --trace-batch 8 --report "$OUT/${L/last/profile}.txt" -- ${X#python3 -m vllm_capture.cli extract} \
        -o /tmp/extract/last -l all -s last >"$OUT/${L/last/profile}.log" 2>&1
      echo "extract profile rc=$?"; grep -E "prompts/s" "$OUT/${L/last/profile}.log"; exit 0
    fi
    if [ "$SET" = extract-write ]; then
      # What writing shards costs: the last token in 64 MiB shards (four, the first three
      # written while later batches run since 0dc6665), then every prompt row of 4 layers
      # (4.4 GiB, 16 shards). With PACKAGE_AT=0622019: the package that wrote them in line.
      timeout 280 $X --shard-mb 64 -o /tmp/extract/last -l all -s last >"$OUT/$L.log" 2>&1
      echo "extract last rc=$? $(grep -oE "in [0-9.]+ s \([0-9.]+ prompts/s" "$OUT/$L.log")"
      rm -rf /tmp/extract/all4
      timeout 280 $X -o /tmp/extract/all4 -l 0,5,10,15 -s all >"$OUT/${L/last/all4}.log" 2>&1
      echo "extract all4 rc=$? $(grep -oE "in [0-9.]+ s \([0-9.]+ prompts/s" "$OUT/${L/last/all4}.log")"
      exit 0
    fi
    timeout 280 $X -o /tmp/extract/last -l all -s last >"$OUT/$L.log" 2>&1; echo "extract last rc=$?"; grep -E "prompts/s" "$OUT/$L.log"
    [ "$SET" = extract-last ] && { echo "== done"; exit 0; }
    timeout 280 $X -o /tmp/extract/all4 -l 0,5,10,15 -s all >"$OUT/extract_all4.log" 2>&1; echo "extract all4 rc=$?"; grep -E "prompts/s" "$OUT/extract_all4.log"
    # Two components in one generate a batch (capture_streams): against extract_last's speed.
    timeout 280 $X -o /tmp/extract/two -c hidden_states,attention_heads -l all -s last >"$OUT/extract_two.log" 2>&1; echo "extract two rc=$?"; grep -E "prompts/s" "$OUT/extract_two.log"
    python3 -m vllm_capture.cli inspect /tmp/extract/all4 --verify >"$OUT/extract_inspect.log" 2>&1; echo "inspect rc=$?"; head -20 "$OUT/extract_inspect.log"
    ;;
  fetch)
    # The fetch path alone (no engine, no GPU): one writer thread vs the default, fresh vs pooled
    # /dev/shm files vs the spare populated while rows arrive, a 16-layer hidden-state shape, a
    # 48-layer router-logit shape drained 82 steps at a time, and the 1B's hidden-4l shape.
    (uname -r; nproc; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; df -h /dev/shm) | tee "$OUT/fetch_path.txt"
    for args in "--write-threads 1 --fresh" "--fresh" "" "--spare"; do
      python3 benchmarks/fetch_path.py --runs 3 $args 2>&1 | grep -v -E "Warn|Capture enabled" | tee -a "$OUT/fetch_path.txt"
    done
    python3 benchmarks/fetch_path.py --layers 48 --width 128 --steps 287 --steps-per-drain 82 --runs 3 \
      2>&1 | grep -v -E "Warn|Capture enabled" | tee -a "$OUT/fetch_path.txt"
    # The 1B's hidden-4l fetch (4 layers of 64 requests' 287 rows): on 4 threads each layer is
    # one thread's share, as before a layer could be cut between threads; on 8, half a layer each.
    for threads in 4 8; do
      python3 benchmarks/fetch_path.py --layers 4 --rows 64 --steps 287 --runs 5 --write-threads $threads \
        2>&1 | grep -v -E "Warn|Capture enabled" | tee -a "$OUT/fetch_path.txt"
    done
    ;;
  reduction)
    # A last-token capture's fetch without an engine (benchmarks/reduction_fetch.py, 8B's shape:
    # 32 layers x 64 requests x 4096, bf16), one line per run: do hidden-last's stalls happen
    # outside vLLM? (RUNS, the second argument: 40 by default.)
    timeout 300 python3 benchmarks/reduction_fetch.py --runs ${2:-40} 2>&1 \
      | grep -v -E "INFO|WARNING|W12" | tee "$OUT/reduction_fetch.txt" | tail -n 14
    ;;
  replay)
    # One decode step's graph replayed alone (benchmarks/graph_replay.py): the capture engine's
    # graph in its idle states and stripped of capture nodes, then a vanilla engine's
    # (ENGINES, the third argument: "capture vanilla" by default).
    for e in ${3:-capture vanilla}; do
      timeout 280 python3 benchmarks/graph_replay.py --model ${2:-8b} --engine $e --out "$OUT" >"$OUT/replay_$e.log" 2>&1
      echo "replay $e rc=$? $(grep -E '^\{' "$OUT/replay_$e.log" | tail -1 | cut -c1-1500)"
    done
    ;;
  step-alternation)
    # A last-token capture's cost per engine iteration, iteration against neighbouring iteration
    # (benchmarks/step_alternation.py: idle and hidden-last generates in turn; in a hidden-last
    # generate, the step path and the capture nodes switch on and off from one iteration to the
    # next). REPS, the second argument: generates of each kind, 60 by default; BUDGET_S: seconds
    # of generates, 240 by default (about 5 minutes with the engine's start); SWITCH: what
    # alternates, a comma list the capture generates take in turn (both, host, nodes; none:
    # capture generates as shipped, timed the same way); PERIOD: iterations the step path's
    # switch stays on, then off (2 by default); SAMPLE_MS: sample the engine's main thread every
    # that many ms of its CPU time (cpu_samples.jsonl; the "cpu" lines: a capture generate's CPU
    # by function against the idle generates beside it; the "wall" lines: whole generates as
    # the client timed them, and the time outside the engine's iterations).
    timeout 420 python3 benchmarks/step_alternation.py --model 1b --out "$OUT" \
      --generates ${2:-60} --budget-s ${BUDGET_S:-240} --switch ${SWITCH:-both} --period ${PERIOD:-2} \
      ${SAMPLE_MS:+--sample-ms $SAMPLE_MS} >"$OUT/step_alternation.log" 2>&1
    echo "step-alternation rc=$?"; grep -E "^\{" "$OUT/step_alternation.log" | tail -1 | cut -c1-1500
    [ -f "$OUT/cpu_samples.jsonl" ] && gzip -f "$OUT/cpu_samples.jsonl"  # a file back: 16 MiB at most
    grep -E "^(wall|cpu) " "$OUT/step_alternation.log" | cut -c1-300
    ;;
  step-host)
    # Capture's step-path host time without an engine (seconds): on this host's CPU, with the
    # plan buffers on the GPU and on the CPU, hot and with 64 MiB read before each step (the
    # caches emptied, as vLLM's work between two steps empties them).
    for d in cuda cpu; do
      for mb in 0 64; do
        timeout 120 python3 benchmarks/step_host.py --device $d --evict-mb $mb 2>&1 | tee -a "$OUT/step_host.log" | grep -E "^\{"
      done
    done
    ;;
  client-copies)
    # The extract client's copies of a batch on this host's CPU (benchmarks/client_copies.py:
    # group_rows and a shard's concatenation, into huge pages and not); no GPU, no engine.
    timeout 300 python3 benchmarks/client_copies.py 2>&1 | tee "$OUT/client_copies.log" | grep -E "^\{"
    ;;
  first-steps)
    # A generate's first steps' begin_step without an engine (step_host.py --first-steps): on the
    # GPU idle and kept busy before each step (a wait for the device shows there), then on the
    # host's CPU; then each step's functions under cProfile with the GPU busy.
    for a in "--device cuda" "--device cuda --busy-ms 20" "--device cpu"; do
      timeout 120 python3 benchmarks/step_host.py --first-steps ${2:-40} $a 2>&1 | tee -a "$OUT/first_steps.log" | grep -E "^\{"
    done
    for s in prefill0 prefill1 decode0 decode1; do
      echo "== $s" >>"$OUT/first_steps.log"
      timeout 120 python3 benchmarks/step_host.py --first-steps ${2:-40} --device cuda --busy-ms 20 --cprofile $s >>"$OUT/first_steps.log" 2>&1
    done
    ;;
  fused-store)
    # Whether capture could add no kernel (benchmarks/fused_store_probe.py): the 1B with each
    # layer's residual stream stored by a traced index_put, which Inductor may fuse into the
    # next layer's add + RMSNorm (into a ring a layer, or into one shared fp32 tensor as capture's
    # accumulators are laid out), against the same engine without it and against the capture op
    # (hidden-last); two of each, alternated, each a fresh process (about 7 minutes on an H100;
    # session 53's six took 5). Compare tok/s, kernel_launches and compiled_modules (none's where
    # every store fused and the layers still share one compiled piece), rings_hold_rows, and
    # tokens_sha (one value for every mode, else a store changed the model's arithmetic: the
    # shared tensor did on the CPU VM).
    store_probes ${2:-1b} none fused shared op none fused shared op
    ;;
  eager-launch)
    # One eager capture launch's host time (no engine, seconds): the whole launch, its layout
    # checks, the op's dispatch; at the 1B's prefill shape (2,048 tokens, 64 requests) and one
    # decode step's (64 tokens). With PACKAGE_AT, the same for an earlier package.
    for t in 2048 64; do
      timeout 120 python3 benchmarks/eager_launch.py --tokens $t 2>&1 | tee -a "$OUT/eager_launch.log" | grep -E "^\{"
    done
    ;;
  nodes)
    # What one capture kernel adds to a CUDA graph per launch configuration (no engine, seconds):
    # a decode batch of 64, and 256 (the most tokens whose rows load alongside the plan).
    # NODES_ARGS adds capture_nodes.py options, e.g. "--width 2048 --layers 16" for the 1B's shape,
    # and "--forked" for the last-token kernel on the critical path and forked beside a matmul.
    for t in 64 256; do
      timeout 150 python3 benchmarks/capture_nodes.py --tokens $t ${NODES_ARGS:-} 2>&1 | tee -a "$OUT/capture_nodes.log" | grep -E "^\{"
    done
    ;;
  startup)
    # Engine start-up, vanilla vs capture, each kind from its own empty compile cache, then warm.
    # (ROUNDS, the third argument: 1 by default; a round of the 1B shape takes about 4.5 minutes,
    # 3.7 on session 55's H100, half as long again with PACKAGE_BEFORE: 300 s on session 56's
    # H200. Each start's whole log lands in $OUT/startup-logs/.) Session 55 read cold 1.129 on an
    # H100, the extra in torch.compile: `PACKAGE_BEFORE=90a8f89 ... startup 1b` tells whether the
    # traced stores brought it. Session 56's H200: cold 1.013, warm 1.143 (one round); session
    # 57's: cold 1.101, warm 1.045 (one round, 190 s; SEGMENTS places each extra between vLLM's steps).
    # Session 58's H100: cold 1.046, warm 1.055 (one round, 317 s); session 61's: cold 1.030, warm
    # 1.177 (one round, 193 s); session 62's: cold 1.020, warm 1.017 (two rounds, 492 s with the
    # unpack), the 8B cold 0.941, warm 1.095 (one round, 279 s with the unpack). Session 64's
    # H100, PACKAGE_BEFORE=86ae859 (the compile child on a warm cache): one round a call, 360 s.
    startup_rounds 580 ${2:-1b} ${3:-1}
    ;;
  bench-1b-paired)
    # The 1B's last-token target: 80 reps of vanilla, idle and hidden-last side by side (about 8
    # minutes). A 1B pair spreads by 11-16% on the H200 host, so the paired ratio's 95% interval
    # (in the check line) is about +-4% after 80 reps; the target is decided where it clears 0.97.
    # The engine started later reads faster (session 31: a second vanilla engine 0.964 of vanilla
    # started first, 1.114 started last): BENCH_ARGS=--baseline-first starts vanilla first, so
    # that the pool's "both orders" weighs runs of either order. (On the H200 with the traced
    # stores: 1.001 capture first, session 56; 1.014 vanilla first, session 57; 60 reps each,
    # about 260 s with BENCH_ARGS="--reps 60 --budget-s 290".)
    python3 benchmarks/run.py --suite quick --scenarios vanilla,idle,hidden-last --reps 80 \
      --budget-s 500 --grace-s 30 ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 22
    ;;
  bench-1b-alone)
    # bench-1b-paired without the vanilla engine: the capture engine alone in the benchmark's
    # client (idle and hidden-last in turn, not pinned: one engine), read as hidden-last against
    # idle of the same rep (`pool.py RUN`). Whether the benchmark's last-token cost against idle
    # (0.950 pooled) needs a second engine beside it: session 29 read 0.934 without one, where
    # step_alternation.py's whole generates read 1.022. (REPS: 80 by default, about 5 minutes
    # with the engine's start. BUDGET_S counts the engine's start and warm-ups: on a fresh
    # machine the start alone took 76 s in session 32, and BUDGET_S=95 measured nothing.)
    python3 benchmarks/run.py --suite quick --engines capture-graph --scenarios idle,hidden-last \
      --reps ${2:-80} --budget-s ${BUDGET_S:-260} --grace-s 30 --out "$OUT" 2>&1 | tail -n 18
    ;;
  bench-1b-control)
    # The 1B's graph targets with a second vanilla engine (vanilla-b, started first): how far
    # two engines of one kind sit apart in one run, against which idle's, hidden-last's and
    # hidden-4l's ratios are read. The engines move one CPU group every two reps; results.md
    # gives each scenario's tok/s by group. Each scenario runs two generates in a row (--block
    # 2): a generate right after a capture's fetch ran up to 11% slower, whichever engine it was
    # on (session 17), and a block puts most of that on the capture's own generates. (REPS, the
    # second argument: 25 by default, 50 generates a scenario; about 5.5 minutes. BENCH_ARGS=--settle
    # waits after each fetch until the client has let go of its memory; BENCH_ARGS=--baseline-first
    # starts vanilla first and the control last, the reverse of the default order;
    # BENCH_ARGS=--warm-cache starts and stops a vanilla and a capture engine first, so that every
    # timed engine loads its compiled model from the cache: by default the capture engine and the
    # control compile in their own processes and vanilla loads, about 15 s more in all.)
    bench_1b_control ${2:-25} 470
    ;;
  bench-1b-eager)
    # The 1B's ">= 3x eager capture" target with the current code: hidden-last under graphs
    # against the same capture with enforce_eager=True (report.py's check), vanilla beside them;
    # the full suite's 1B at decode-c64 (the quick suite has no eager engine). Last read in
    # session 14 (4.80x, 3 reps, 216 s on the H200), before the eager path's last-row stores
    # (session 54). (REPS, the second argument: 4 by default; about 5 minutes.)
    python3 benchmarks/run.py --suite full --model 1b --workloads decode-c64 \
      --scenarios vanilla,hidden-last,eager-hidden-last --reps ${2:-4} --budget-s 260 --grace-s 30 \
      ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 22
    ;;
  open-targets)
    # The two targets still open on the H200 in one 600 s call, for a session likely to get one
    # work call: bench-1b-control (the 4-layer capture; 25 reps planned, run.py's budget cut to
    # 260 s, which it ends its reps in and writes its results by, where a timeout would lose
    # them), then one round of startup 1b (about 190 s on the H200; 317 s on session 58's H100,
    # past this set's limit). About 520 s, and the bundle's unpack in the call that carried it.
    bench_1b_control 25 260
    startup_rounds 250 1b 1
    ;;
  bench-moe)
    # Router logits need the MoE shape, whose 61 GB of weights cannot load twice: the two graph
    # engines run one after the other, so one workload with 5 reps fits one 10-minute call.
    python3 benchmarks/run.py --suite full --model moe --engines vanilla-graph,capture-graph \
      --workloads decode-c64 --reps 5 --budget-s 480 --grace-s 60 ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 46
    ;;
  bench-moe-eager)
    # The MoE captures with enforce_eager=True (eager-router-all is only here), against vanilla
    # with graphs in the same run: what an eager-only tool pays for router logits.
    python3 benchmarks/run.py --suite full --model moe --engines vanilla-graph,capture-eager \
      --workloads decode-c64 --reps 2 --budget-s 480 --grace-s 60 ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 34
    ;;
  bench-8b-decode)
    # The 8B's decode-c64 targets in one run (idle; last token; 4 layers of hidden states and of
    # heads) and heavy (hidden states of every layer and position, 4.8 GB a generate: past the
    # store's ADOPT_BYTES, so copied as before 58a15b9 from there), with the control (a second
    # vanilla engine, started first): session 20 read idle 0.980 and 0.973 where session 15 read
    # 1.001, vanilla unchanged, and the 8B's step waits on the GPU, not the host, so whether
    # two engines of one kind sit 2% apart here too is the first question. 6 reps; about 4.5 minutes
    # (session 21: 260 s; the control read 0.998, idle 0.990 paired, 0 idle nodes run). Session
    # 58's H100, no control: 280 s; idle 0.993, last token 0.984, 4 layers 0.949, all PASS.
    python3 benchmarks/run.py --suite full --model 8b --workloads decode-c64 \
      --scenarios vanilla,${CONTROL_8B}idle,hidden-last,hidden-4l,heads-4l,heavy --reps 6 --budget-s 420 \
      --grace-s 20 ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 36
    ;;
  bench-8b-prefill)
    # The traced last-row stores run in every compiled forward of a capture engine, idle
    # included: a prefill step writes each token's row of every layer (to sink rows). The 8B's
    # prefill-c64 (64 prompts of 2,048 tokens, 8 new; 8,192-token steps): idle and hidden-last
    # against vanilla, the control where the card holds three 8B engines. The capture engine's
    # KV cache is smaller by its buffers (8.1 GiB), and the 64 prompts need 16 GiB of it at once:
    # where it holds fewer of them than vanilla's (the report's engines table gives both), that
    # is part of the reading (session 61's H100: 75,456 tokens against 141,856, 36 of the 64
    # prompts; idle 0.993, hidden-last 0.984). (REPS, the second argument: 6 by default; 207 s
    # with the unpack.)
    python3 benchmarks/run.py --suite full --model 8b --workloads prefill-c64 \
      --scenarios vanilla,${CONTROL_8B}idle,hidden-last --reps ${2:-6} --budget-s 420 --grace-s 20 \
      ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 20
    ;;
  bench-8b-idle)
    # The 8B's idle engine against vanilla and the control: idle read 0.990-1.014 (session 10)
    # and 1.001 (session 15, e7f71b2), then 0.973-0.990 in sessions 20-21 (the control 0.998),
    # so with PACKAGE_AT a point of a bisection over the package's history. (REPS, the second
    # argument: 12, for an interval of about +-1.5% on idle; about 4 minutes, so two points fit
    # one 10-minute call: `PACKAGE_AT=e7f71b2 bash ... bench-8b-idle; bash ... bench-8b-idle`.)
    python3 benchmarks/run.py --suite full --model 8b --workloads decode-c64 \
      --scenarios vanilla,${CONTROL_8B}idle --reps ${2:-12} --budget-s 300 --grace-s 20 ${BENCH_ARGS:-} \
      --out "$OUT" 2>&1 | tail -n 14
    # Its generates in order, with the GPU's NVML readings: the first idle against the later ones.
    RUN_DIR=$(ls -d "$OUT"/results/*-full-8b 2>/dev/null | tail -1)
    [ -n "$RUN_DIR" ] && python3 benchmarks/sequence.py "$RUN_DIR" \
      && python3 benchmarks/sequence.py --by-predecessor idle "$RUN_DIR"
    ;;
  bench-quick|bench-full)
    if [ "$SET" = bench-full ]; then MODEL_ARGS="--model ${2:-8b}"; else MODEL_ARGS=""; fi
    python3 benchmarks/run.py --suite "${SET#bench-}" $MODEL_ARGS ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tail -n 60
    ;;
esac
echo "== summary"
for f in "$OUT"/*_report.json; do [ -f "$f" ] && python3 -c "
import json; r=json.load(open('$f'))
for k,v in r.items():
    print('$f'.split('/')[-1][:-12], k, json.dumps(v)[:600])"; done
for f in "$OUT"/*.log; do [ -f "$f" ] && grep -q "Traceback" "$f" && { echo "-- $f"; grep -B2 -A0 -E "^[A-Za-z.]*(Error|Exception)" "$f" | tail -6; }; done
# The device tool brings back at most 8 files from one command: each benchmark run's folder (four
# files) travels as one archive, added to any left by an earlier set of the same command. A
# command that calls this must not pack results-N.tgz itself: in session 32 a `tar` after it
# wrote results-0.tgz over this one, and three runs' folders were lost.
if [ -d "$OUT/results" ]; then
  n=$(ls "$OUT"/results-*.tgz 2>/dev/null | wc -l)
  tar czf "$OUT/results-$n.tgz" -C "$OUT" results && rm -rf "$OUT/results" && echo "packed: results-$n.tgz"
fi
exit 0
