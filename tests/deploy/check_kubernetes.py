"""Checks deploy/kubernetes/ without a Kubernetes (none runs here): yamllint,
a JSON schema of the fields each kind needs, and the cross-references a
cluster would only catch at run time: selectors match their pod labels,
Service target ports name container ports, every Secret referenced exists
with the key, every $(VAR) in a command is defined in the container's env,
every --flag of a troupe command is one `troupe start --help` lists, and
the session directory is not an emptyDir's mount point (mode 0777, which
troupe refuses).

    python3 tests/deploy/check_kubernetes.py --cli build-ci/launcher/troupe deploy/kubernetes
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import yaml

META = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}
CONTAINER = {
    "type": "object",
    "required": ["name", "image", "command"],
    "properties": {"command": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                   "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                   "ports": {"type": "array",
                             "items": {"type": "object", "required": ["containerPort"],
                                       "properties": {"containerPort": {"type": "integer", "minimum": 1,
                                                                        "maximum": 65535}}}}},
}
POD_TEMPLATE = {
    "type": "object",
    "required": ["metadata", "spec"],
    "properties": {"metadata": {"type": "object", "required": ["labels"]},
                   "spec": {"type": "object", "required": ["containers"],
                            "properties": {"containers": {"type": "array", "items": CONTAINER, "minItems": 1}}}},
}
WORKLOAD_SPEC = {"type": "object", "required": ["selector", "template"],
                 "properties": {"selector": {"type": "object", "required": ["matchLabels"]},
                                "template": POD_TEMPLATE}}
SCHEMAS = {
    ("apps/v1", "Deployment"): {"type": "object", "required": ["metadata", "spec"],
                                "properties": {"metadata": META, "spec": WORKLOAD_SPEC}},
    ("apps/v1", "DaemonSet"): {"type": "object", "required": ["metadata", "spec"],
                               "properties": {"metadata": META, "spec": WORKLOAD_SPEC}},
    ("apps/v1", "StatefulSet"): {"type": "object", "required": ["metadata", "spec"],
                                 "properties": {"metadata": META, "spec": WORKLOAD_SPEC}},
    ("v1", "Service"): {"type": "object", "required": ["metadata", "spec"],
                        "properties": {"metadata": META,
                                       "spec": {"type": "object", "required": ["selector", "ports"],
                                                "properties": {"ports": {"type": "array", "minItems": 1, "items": {
                                                    "type": "object", "required": ["port", "targetPort"]}}}}}},
    ("v1", "Secret"): {"type": "object", "required": ["metadata"], "properties": {"metadata": META},
                       "anyOf": [{"required": ["stringData"]}, {"required": ["data"]}]},
}


def load(directory):
    docs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    docs.append((os.path.basename(path), doc))
    return docs


def troupe_flags(cli):
    text = subprocess.run([cli, "start", "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", text))


def check(directory, cli):
    problems = []
    docs = load(directory)
    if not docs:
        return [f"no manifests in {directory}"]
    secrets = {d["metadata"]["name"]: d for _, d in docs if d.get("kind") == "Secret"}
    pods = {}  # workload name -> pod template
    flags = troupe_flags(cli)
    for path, d in docs:
        where = f"{path}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
        schema = SCHEMAS.get((d.get("apiVersion"), d.get("kind")))
        if schema is None:
            problems.append(f"{where}: unchecked kind {d.get('apiVersion')}/{d.get('kind')}")
            continue
        try:
            jsonschema.validate(d, schema)
        except jsonschema.ValidationError as e:
            problems.append(f"{where}: {e.message} at {'/'.join(map(str, e.absolute_path))}")
            continue
        if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            problems += check_workload(where, d, secrets, flags)
            pods[d["metadata"]["name"]] = d["spec"]["template"]
    for path, d in docs:
        if d.get("kind") == "Service":
            problems += check_service(f"{path}: Service {d['metadata']['name']}", d, pods.values())
    return problems


def check_workload(where, d, secrets, flags):
    problems = []
    labels = d["spec"]["template"]["metadata"]["labels"]
    for k, v in d["spec"]["selector"]["matchLabels"].items():
        if labels.get(k) != v:
            problems.append(f"{where}: selector {k}={v} does not match the pod labels {labels}")
    for c in d["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e for e in c.get("env", [])}
        for e in env.values():
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and (ref["name"] not in secrets or
                        ref["key"] not in {**secrets[ref["name"]].get("stringData", {}),
                                           **secrets[ref["name"]].get("data", {})}):
                problems.append(f"{where}: env {e['name']} refers to secret {ref['name']} key {ref['key']}, "
                                "which no manifest defines")
        for arg in c["command"]:
            for var in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", arg):
                if var not in env:
                    problems.append(f"{where}: command uses $({var}), not in the container's env")
        if os.path.basename(c["command"][0]) == "troupe":
            if c["command"][1] != "start" or "--block" not in c["command"]:
                problems.append(f"{where}: a container's troupe must be `troupe start ... --block` "
                                "(else the container exits at once)")
            for arg in c["command"][2:]:
                if arg.startswith("--") and arg.split("=")[0] not in flags:
                    problems.append(f"{where}: `troupe start` has no flag {arg}")
            if "TROUPE_TOKEN" not in env:
                problems.append(f"{where}: no TROUPE_TOKEN in the env: the processes cannot join")
            problems += check_session_dir(where, d["spec"]["template"]["spec"], c, env)
    return problems


def check_session_dir(where, pod, container, env):
    """troupe refuses a session directory that is not mode 0700, and the
    kubelet makes an emptyDir's mount point 0777: the session directory
    must be a directory below the mount, which troupe creates 0700."""
    session = env.get("TROUPE_SESSION_DIR", {}).get("value")
    if not session:
        return []
    empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for m in container.get("volumeMounts", []):
        if m["name"] in empty_dirs and os.path.normpath(m["mountPath"]) == os.path.normpath(session):
            return [f"{where}: TROUPE_SESSION_DIR {session} is the mount point of emptyDir {m['name']}, which the "
                    "kubelet makes mode 0777 and troupe refuses: name a directory below it "
                    f"({session.rstrip('/')}/session)"]
    return []


def check_service(where, svc, templates):
    matching = [t for t in templates
                if all(t["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
    if not matching:
        return [f"{where}: selector {svc['spec']['selector']} matches no pod template"]
    problems = []
    for t in matching:
        ports = {p.get("name"): p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            if (isinstance(target, str) and target not in ports) or \
                    (isinstance(target, int) and target not in ports.values()):
                problems.append(f"{where}: targetPort {target} is no container port ({ports})")
    return problems


def lint(directory):
    if not shutil.which("yamllint"):
        print("check_kubernetes: yamllint missing (Debian package yamllint): lint skipped")
        return []
    config = "{extends: default, rules: {line-length: {max: 120}, document-start: disable, truthy: disable}}"
    out = subprocess.run(["yamllint", "-f", "parsable", "-d", config, directory], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cli", required=True, help="the troupe binary (its --help is the list of flags)")
    p.add_argument("--expect", action="append", default=[],
                   help="(for the test of this checker) a problem that must be reported; then success means "
                        "every expected problem was found")
    p.add_argument("directory")
    a = p.parse_args()
    problems = lint(a.directory) + check(a.directory, a.cli)
    if a.expect:
        missed = [e for e in a.expect if not any(e in line for line in problems)]
        for e in missed:
            print(f"check_kubernetes: expected a problem containing {e!r}; got: {problems}")
        return 1 if missed else 0
    for line in problems:
        print(f"check_kubernetes: {line}")
    if problems:
        return 1
    print(f"check_kubernetes: {len(load(a.directory))} manifests in {a.directory} are consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
