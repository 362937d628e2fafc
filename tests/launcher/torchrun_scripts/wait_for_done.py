# Writes OUT/up-RESTART-RANK-WORLD (with its pid) and waits until OUT/done
# exists (at most 120 s): the elastic test kills a node while it waits.
import os
import sys
import time

out = sys.argv[1]
e = os.environ
# The pid and its start time, which tells this process from a later one
# that takes the same pid; written whole (rename), so the test never reads
# a file this process had no time to fill.
with open("/proc/self/stat") as stat:
    started = stat.read().rsplit(")", 1)[1].split()[19]
path = os.path.join(out, f"up-{e['TORCHELASTIC_RESTART_COUNT']}-{e['RANK']}-{e['WORLD_SIZE']}")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {started}")
os.replace(path + ".tmp", path)
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "done")):
    if time.time() > deadline:
        sys.exit(9)
    time.sleep(0.05)
