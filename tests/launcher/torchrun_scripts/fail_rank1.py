# Rank 1 exits 3 at once; the other ranks wait to be stopped (at most 120 s).
# Each writes OUT/pid-RANK-RESTART with its pid, so the test can tell that
# no script outlives `troupe torchrun`.
import os
import sys
import time

out = sys.argv[1]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
# The pid and its start time, which tells this process from a later one
# that takes the same pid; written whole (rename), so the test never reads
# a file this process had no time to fill.
with open("/proc/self/stat") as stat:
    started = stat.read().rsplit(")", 1)[1].split()[19]
path = os.path.join(out, f"pid-{rank}-{restart}")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {started}")
os.replace(path + ".tmp", path)
if rank == "1":
    sys.exit(3)
time.sleep(120)
sys.exit(9)
