import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach the network
os.environ.setdefault("OMP_NUM_THREADS", "1")  # several test subprocesses share 2 cores
