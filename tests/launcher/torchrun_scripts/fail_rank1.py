# Rank 1 exits 3 at once; the other ranks wait to be stopped (at most 120 s).
# Each writes OUT/pid-RANK-RESTART with its pid, so the test can tell that
# no script outlives `troupe torchrun`.
import os
import sys
import time

out = sys.argv[1]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"pid-{rank}-{restart}"), "w") as f:
    # The pid and its start time, which tells this process from a later one
    # that takes the same pid.
    with open("/proc/self/stat") as stat:
        started = stat.read().rsplit(")", 1)[1].split()[19]
    f.write(f"{os.getpid()} {started}")
if rank == "1":
    sys.exit(3)
time.sleep(120)
sys.exit(9)
