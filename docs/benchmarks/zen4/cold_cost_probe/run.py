import sys, torch
import prefixkv.model.runner as r
if sys.argv[1] == "zeroed":
    r.lazily_zeroed = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)
from prefixkv.cli import main
sys.argv = ["prefixkv", "bench", "system-prompt", "--dtype", "bfloat16", "--num-threads", "2", "--repeats", "4", "--output-dir", f"/tmp/fault_{sys.argv[1]}"]
main()
