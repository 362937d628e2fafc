# A preemption-aware script: on SIGTERM it saves its state (here a file,
# OUT/saved-RANK) and exits 0; on Ctrl-C (KeyboardInterrupt) as well. Each rank writes OUT/pid-RANK once its
# handler is in place, then waits to be stopped (at most 120 s).
import os
import signal
import sys
import time

from pid_file import write_pid_file

out = sys.argv[1]
rank = os.environ["RANK"]


def save_and_leave(signum, frame):
    path = os.path.join(out, f"saved-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"rank {rank} saved on signal {signum}")
    os.replace(path + ".tmp", path)
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_leave)
write_pid_file(os.path.join(out, f"pid-{rank}"))
try:
    time.sleep(120)
except KeyboardInterrupt:
    save_and_leave(signal.SIGINT, None)
sys.exit(9)
