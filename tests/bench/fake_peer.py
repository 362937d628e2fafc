#!/usr/bin/python3
"""A stand-in for a benchmark's PyTorch peer, for tests/bench/peer_process_test.

    fake_peer.py ok         noise, then a JSON result, exit 0
    fake_peer.py hang       starts a "rank" (prints its pid), then sleeps forever
    fake_peer.py fail       a JSON error line, exit 3
    fake_peer.py silent     exit 4 without a word
    fake_peer.py straggler  starts a rank that holds stdout and never exits
                            (as torch 1.13's ProcessGroupGloo destructor can),
                            prints its pid and a JSON result, exits
"""
import json
import os
import subprocess
import sys
import time


def rank():
    return subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(60)"])


def main(mode):
    if mode == "ok":
        print("loading...", flush=True)
        print(json.dumps({"bench": "fake", "case": "peer", "value": 42.5}), flush=True)
    elif mode == "hang":
        print(rank().pid, flush=True)
        while True:
            time.sleep(60)
    elif mode == "fail":
        print(json.dumps({"bench": "fake", "case": "peer", "error": "rank 1 exited with 1"}), flush=True)
        sys.exit(3)
    elif mode == "silent":
        sys.exit(4)
    elif mode == "straggler":
        print(rank().pid, flush=True)
        print(json.dumps({"bench": "fake", "case": "peer", "value": 7}), flush=True)
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
