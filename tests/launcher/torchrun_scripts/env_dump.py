# Writes this rank's environment to OUT/env-RANK-RESTART.json and prints a
# line on stdout and one on stderr (the launcher test reads both).
import json
import os
import sys

out = sys.argv[1]
env = dict(os.environ)
name = f"env-{env['RANK']}-{env['TORCHELASTIC_RESTART_COUNT']}.json"
with open(os.path.join(out, name + ".tmp"), "w") as f:
    json.dump({"env": env, "cwd": os.getcwd(), "argv": sys.argv}, f)
os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
print(f"hello from {env['RANK']}", flush=True)
print(f"oops from {env['RANK']}", file=sys.stderr, flush=True)
