"""What an honest worker holds at the official batch and context, against the caps (harness/worker/limits.py):
train.py's load_for_eval of a preset's random checkpoint and one eval forward of 8 x 1,024 tokens, fp32 on
the CPU, in a process of its own: peak RSS and threads.

    python benchmarks/honest_worker_use.py d10
    python benchmarks/honest_worker_use.py phase2 --preset phase2
"""
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train as T  # noqa: E402
from harness.config import EVAL_BATCH_SIZE, EVAL_SEQ_LEN  # noqa: E402

if sys.argv[1] == "measure":
    path = sys.argv[2]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = T.load_for_eval(path, torch.device("cpu"))
    t0 = time.time()
    with torch.no_grad():
        m(torch.randint(0, 8000, (EVAL_BATCH_SIZE, EVAL_SEQ_LEN)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"batch {EVAL_BATCH_SIZE} x {EVAL_SEQ_LEN}: peak RSS {peak/1024:.0f} MiB (after imports {base/1024:.0f} MiB), "
          f"{len(os.listdir('/proc/self/task'))} threads, forward {time.time()-t0:.1f} s")
else:
    name, argv = sys.argv[1], sys.argv[2:]
    model = T.build_model(T.model_config(T.parse_command_line(argv)[0]))
    n = sum(p.numel() for p in model.parameters())
    path = os.path.join(tempfile.mkdtemp(prefix="use-"), "final.pt")
    T.save_checkpoint(Path(path), model, {})
    del model
    out = subprocess.run([sys.executable, __file__, "measure", path], capture_output=True, text=True)
    print(f"{name}: {n/1e6:.0f}M params, checkpoint {os.path.getsize(path)/2**20:.0f} MiB;", out.stdout.strip(), out.stderr[-500:])
