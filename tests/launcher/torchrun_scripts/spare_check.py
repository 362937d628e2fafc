# Attempt 0: rank 1 fails after 4 s (longer than the slot waits before it
# starts a spare interpreter, 3 s); the other ranks wait to be stopped.
# Attempt 1: each rank writes OUT/attempt1-RANK.json with what a script can
# tell about how it was started, and exits 0.
import json
import os
import sys
import time

out = sys.argv[1]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if restart == "0":
    if rank == "1":
        time.sleep(4)
        sys.exit(1)
    time.sleep(120)
    sys.exit(9)
with open(os.path.join(out, f"attempt1-{rank}.json"), "w") as f:
    json.dump({"torch_preloaded": "torch" in sys.modules, "argv": sys.argv, "cwd": os.getcwd(),
               "name": __name__, "path0": sys.path[0], "rank": os.environ["RANK"]}, f)
print(f"second attempt rank {rank}", flush=True)
