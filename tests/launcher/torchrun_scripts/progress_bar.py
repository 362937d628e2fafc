# Draws a progress bar as tqdm does (frames after '\r', one '\n' at the
# end) on stderr: frame 0, then waits (at most 120 s) until OUT/go exists,
# which the test makes once frame 0 has reached the launcher's output; then
# the last frames, the line's end, and one plain line.
import os
import sys
import time

out = sys.argv[1]
sys.stderr.write("\rtraining   0/3")
sys.stderr.flush()
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "go")):
    if time.time() > deadline:
        sys.exit(9)
    time.sleep(0.05)
for i in (1, 2, 3):
    sys.stderr.write(f"\rtraining   {i}/3")
    sys.stderr.flush()
sys.stderr.write("\n")
print("finished", flush=True)
