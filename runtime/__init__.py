"""What a run needs beside the model, its config and its data, shared by train.py, sample.py, export.py and the
evaluation: checkpoints and provenance (checkpoint.py), parallelism and compilation (parallelize.py), pretrained
weights (pretrained.py), this project's GPT and a run's tokenizer as transformers' (hf_gpt.py, hf_tokenizer.py),
memory planning (memory_plan.py) and wandb (wandb_run.py)."""
