"""The pieces of a training run that train.py's loop is built from, one concept per module: the set-up, in the order
main() calls it (setup.py), the run folder's files (run_folder.py), the learning rate and the per-step hooks
(schedules.py), the validation loss (evaluation.py), metrics.jsonl, wandb and the step's log line (metrics.py), RNG
states for an exact resume (rng.py), one-line errors and exit statuses (failures.py) and SIGTERM/SIGINT as a request
to stop (stop_signals.py)."""
