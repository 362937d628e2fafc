"""The `troupe` console script of the Python package: execs the C++ CLI
(`troupe start`, `status`, `stop`, `torchrun`, `train`, ...) that the
package carries in troupe/_bin, or, in a build tree, the one the build made.
For `troupe torchrun` the script's interpreter defaults to this one (the
interpreter the package is installed for), as torchrun's would."""
import os
import shutil
import sys


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def find_binary(name, env_var):
    """The path of the C++ binary `name`: $env_var, the package's _bin/, the
    build tree's launcher/ (the package in <build>/python/troupe), or PATH.
    FileNotFoundError naming every place looked at otherwise."""
    looked = []
    given = os.environ.get(env_var)
    if given:
        if os.access(given, os.X_OK):
            return given
        raise FileNotFoundError(f"{env_var}={given} is not an executable file")
    looked.append(f"${env_var} (unset)")
    package = _package_dir()
    for candidate in (os.path.join(package, "_bin", name),
                      os.path.join(os.path.dirname(os.path.dirname(package)), "launcher", name)):
        if os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
        looked.append(candidate)
    on_path = shutil.which(name)
    if on_path and os.path.realpath(on_path) != os.path.realpath(sys.argv[0]):
        return on_path
    looked.append(f"{name} on PATH")
    raise FileNotFoundError(f"cannot find the {name} binary; looked at: {', '.join(looked)}")


def command_line(binary, args):
    """argv for the C++ CLI. `torchrun` gets --python of this interpreter
    first: a --python the user gives later wins (the CLI keeps the last)."""
    argv = [binary] + list(args)
    if args and args[0] == "torchrun":
        argv[2:2] = ["--python", sys.executable]
    return argv


def main():
    try:
        binary = find_binary("troupe", "TROUPE_CLI")
    except FileNotFoundError as e:
        print(f"troupe: {e}", file=sys.stderr)
        return 2
    argv = command_line(binary, sys.argv[1:])
    os.execv(binary, argv)


if __name__ == "__main__":
    sys.exit(main())
