"""Metric names draftline publishes, the exporter's and the inference server's; alerts, dashboards and tests
refer to these.

Conventions: a ``draftline_`` prefix, base units in the name (``_bytes``, ``_seconds``, ``_celsius``,
``_watts``), ``_total`` on counters, ratios in 0..1.
"""

from __future__ import annotations

# ---- health of the exporter's own sources ---------------------------------------------------------
REDIS_UP = "draftline_redis_up"  # 1 when Redis answered this scrape, else 0

# ---- per run and stage: labels run, stage --------------------------------------------------------
STAGE_EXPECTED = "draftline_stage_expected"  # samples (generate, extract) or steps (train, evaluate)
STAGE_DONE = "draftline_stage_done_total"  # per-sample stages only; online, extractions of every epoch
STAGE_RETRIED = "draftline_stage_retried_total"  # attempts repeated after a transient error or a lost job
# Failed and dropped are gauges, not counters: a sample that succeeds on a later attempt leaves the failed
# set (RunState.mark_done clears it), and a counter that goes down reads to Prometheus as a reset.
STAGE_FAILED = "draftline_stage_failed"  # samples whose latest attempt failed with a named error
STAGE_DROPPED = "draftline_stage_dropped"  # filtered on purpose (e.g. a reply that is too short)
STAGE_REMAINING = "draftline_stage_remaining"  # expected minus done, failed and dropped
STAGE_PROGRESS = "draftline_stage_progress_ratio"  # settled share of expected, 0..1
STAGE_IN_FLIGHT = "draftline_stage_jobs_in_flight"  # RQ jobs of this run being worked on now
STAGE_ETA = "draftline_stage_eta_seconds"  # remaining / recent rate; absent while the ETA is unknown

# ---- per run: label run ---------------------------------------------------------------------------
RUN_HIDDEN_BYTES = "draftline_run_hidden_state_bytes"
TRAIN_STEP = "draftline_train_step"  # a gauge: resuming from a checkpoint may step back
TRAIN_EPOCH = "draftline_train_epoch"  # 0-indexed epoch of the latest logged step
TRAIN_LOSS = "draftline_train_loss"
TRAIN_ACCURACY = "draftline_train_accuracy_ratio"  # label k: draft position of the training-time-test unroll
# label k: draft tokens a pass; the one-pass acceptance length over held-out files at the latest checkpoint
TRAIN_VALIDATION_ACCEPTANCE = "draftline_train_validation_acceptance_length"
TRAIN_LEARNING_RATE = "draftline_train_learning_rate"
TRAIN_TOKENS_PER_SECOND = "draftline_train_tokens_per_second"  # loss-mask tokens trained on per second
ACCEPTANCE_LENGTH = "draftline_acceptance_length"  # mean tokens accepted per verification step
# Labels set, method (drafter, lookup, no_drafter) and k (draft tokens per pass; 0 for no drafter).
ACCEPTANCE_CURVE = "draftline_acceptance_length_by_k"
# The headline's margin over prompt lookup (same k, same prompts), label bound: difference, low, high (its interval).
ACCEPTANCE_OVER_LOOKUP = "draftline_acceptance_over_lookup"
RUN_DISK_PAUSED = "draftline_run_disk_paused"  # 1 while the run's extraction waits for disk space
RUN_PROJECTED_BYTES = "draftline_run_projected_bytes"  # bytes the rest of the run still needs on the volume
# Label stage: 1 while a disk pause holds it (generate, extract) or its writer waits for space (train, evaluate).
RUN_STAGE_HELD = "draftline_run_stage_held"
# An online run (runtime.spool): its hidden-state files on the volume against its byte budget, and the trainer.
ONLINE_SPOOL_BYTES = "draftline_online_spool_bytes"
ONLINE_SPOOL_FILES = "draftline_online_spool_files"
ONLINE_BUDGET_BYTES = "draftline_online_budget_bytes"
ONLINE_TRAIN_WAIT_SECONDS = "draftline_online_train_wait_seconds_total"  # the trainer waiting for files
ONLINE_TRAIN_SECONDS = "draftline_online_train_seconds_total"  # the trainer running, its waits included
ONLINE_EXTRACT_BLOCKED_SECONDS = "draftline_online_extract_blocked_seconds_total"  # extractions waiting on the budget
ONLINE_EXTRACT_SECONDS = "draftline_online_extract_seconds_total"  # extractions working, once the budget granted them
ONLINE_EPOCH_TRAINED = "draftline_online_epoch_trained_samples"  # samples trained in the current epoch
ONLINE_WINDOW_FILES = "draftline_online_window_files"  # samples the trainer has asked for ahead
ONLINE_WINDOW_STEPS = "draftline_online_window_steps"  # the global batches they reach into
ONLINE_WINDOW_BYTES = "draftline_online_window_bytes"  # their files' estimated bytes

# ---- queues and workers: labels queue[, state] ----------------------------------------------------
QUEUE_JOBS = "draftline_queue_jobs"  # jobs waiting in the queue
QUEUE_WORKERS = "draftline_queue_workers"

# ---- the data volume -----------------------------------------------------------------------------
VOLUME_USED = "draftline_volume_used_bytes"
VOLUME_FREE = "draftline_volume_free_bytes"

# ---- GPUs through NVML: labels gpu (index) and name -----------------------------------------------
GPUS = "draftline_gpus"  # GPUs NVML sees; 0 without a driver or without GPUs
GPU_UTILIZATION = "draftline_gpu_utilization_ratio"
GPU_MEMORY_USED = "draftline_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "draftline_gpu_memory_total_bytes"
GPU_TEMPERATURE = "draftline_gpu_temperature_celsius"
GPU_POWER = "draftline_gpu_power_watts"

# ---- run meta fields the services write (RunState.set_meta / incr / set_progress) -----------------
META_HIDDEN_BYTES = "hidden_bytes"
META_TRAIN_STEP = "train_done"
META_TRAIN_LOSS = "train_loss"
META_TRAIN_EPOCH = "train_epoch"
META_TRAIN_LR = "train_lr"
META_TRAIN_TOKENS_PER_SECOND = "train_tokens_per_s"
META_TRAIN_ACCURACY_PREFIX = "train_acc"  # train_acc0, train_acc1, …: one field per draft position k
META_TRAIN_VALIDATION_PREFIX = "train_val_accept"  # train_val_accept1, …: one field per k (train.validation_files)
META_ACCEPTANCE_LENGTH = "acceptance_length"
META_ACCEPTANCE_CURVE_PREFIX = "evaluate_accept"  # evaluate_accept.<set>.<method>.<k>, one field per point
# The headline's margin over prompt lookup: <prefix> (the difference), <prefix>_low, _high, _prompts, _level; with
# the headline's k and lookup's figure there.
META_OVER_LOOKUP = "evaluate_over_lookup"
META_EVALUATE_K = "evaluate_k"
META_LOOKUP_ACCEPTANCE = "evaluate_lookup_acceptance"

# ---- the built-in inference server's own /metrics (services/inference/metrics.py) -------------------------
INFERENCE_REQUEST_DURATION = "draftline_inference_request_duration_seconds"  # histogram, label endpoint
INFERENCE_REQUESTS = "draftline_inference_requests_total"  # labels endpoint, status
INFERENCE_GENERATED_TOKENS = "draftline_inference_generated_tokens_total"
INFERENCE_BATCH_SIZE = "draftline_inference_batch_size"  # histogram, label endpoint
INFERENCE_HIDDEN_STATE_BYTES = "draftline_inference_hidden_state_bytes_total"
