# Rank 1 exits 3 at once; the other ranks wait to be stopped (at most 120 s).
# Each writes OUT/pid-RANK-RESTART with its pid, so the test can tell that
# no script outlives `troupe torchrun`.
import os
import sys
import time

from pid_file import write_pid_file

out = sys.argv[1]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
write_pid_file(os.path.join(out, f"pid-{rank}-{restart}"))
if rank == "1":
    sys.exit(3)
time.sleep(120)
sys.exit(9)
