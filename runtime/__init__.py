"""What a run needs beside the model and its config: writing outputs (outputs.py), the machine (machine.py), GPUs'
peak FLOP/s (flops.py), progress bars (progress.py), run folders (run_folder.py), checkpoints and provenance
(checkpoint.py), parallelism and compilation (parallelize.py), pretrained weights (pretrained.py), this project's
GPT and a run's tokenizer as transformers' (hf_gpt.py, hf_tokenizer.py), memory planning (memory_plan.py) and
wandb (wandb_run.py)."""
