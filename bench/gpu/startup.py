"""First-CUDA-call time: torch.zeros(1, device='cuda') + synchronize, after import torch."""
import time

import torch

t = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(f"{time.perf_counter() - t:.4f}")
