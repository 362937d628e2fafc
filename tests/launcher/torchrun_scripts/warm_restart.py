# Reports how it was started to OUT/warm-RANK-RESTART.json: whether the
# module troupe torchrun was asked to preload was imported before the
# script ran, and what a script started by `python script.py` would see.
# In attempt 0 rank 1 exits 3 and the others wait to be stopped (at most
# 120 s); in later attempts every rank exits 0. Arguments after OUT are
# only reported.
import json
import os
import sys
import time

preloaded = "email.mime.text" in sys.modules
out = sys.argv[1]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
info = {
    "preloaded": preloaded,
    "name": __name__,
    "argv": sys.argv[:2],
    # Bytes that are not UTF-8 (argument 2, WARM_TEST_BYTES) as the script
    # got them, hex: the same in a fresh interpreter and a spare.
    "argv_hex": [os.fsencode(a).hex() for a in sys.argv[2:]],
    "env_hex": os.environb.get(b"WARM_TEST_BYTES", b"").hex(),
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "pid": os.getpid(),
    "troupe_vars": sorted(k for k in os.environ if k.startswith("TROUPE_")),
    "world_size": os.environ["WORLD_SIZE"],
    "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", ""),
}
with open(os.path.join(out, f"warm-{rank}-{restart}.json.tmp"), "w") as f:
    json.dump(info, f)
os.rename(os.path.join(out, f"warm-{rank}-{restart}.json.tmp"), os.path.join(out, f"warm-{rank}-{restart}.json"))
if restart == "0":
    if rank == "1":
        sys.exit(3)
    time.sleep(120)
    sys.exit(9)
