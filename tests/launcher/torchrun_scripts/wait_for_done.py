# Writes OUT/up-RESTART-RANK-WORLD (with its pid) and waits until OUT/done
# exists (at most 120 s): the elastic test kills a node while it waits.
import os
import sys
import time

from pid_file import write_pid_file

out = sys.argv[1]
e = os.environ
write_pid_file(os.path.join(out, f"up-{e['TORCHELASTIC_RESTART_COUNT']}-{e['RANK']}-{e['WORLD_SIZE']}"))
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "done")):
    if time.time() > deadline:
        sys.exit(9)
    time.sleep(0.05)
