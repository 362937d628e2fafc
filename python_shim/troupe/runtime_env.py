"""Ray's ``ray.runtime_env.RuntimeEnv``: a runtime_env built with keywords.

It is a dict of the fields given (None leaves a field out), so it goes
wherever a runtime_env dict goes (``troupe.init``, ``.options``,
``@troupe.remote``) and is checked there: troupe takes ``env_vars``,
``working_dir``, ``py_modules``, ``excludes`` and ``pip``, and names any
other field it is given (``conda``, ``container``, ...) in a
``ConfigError`` when the env is used.

    from troupe.runtime_env import RuntimeEnv
    env = RuntimeEnv(env_vars={"MODE": "eval"}, pip=["emoji"])
    task.options(runtime_env=env).remote()
"""

__all__ = ["RuntimeEnv"]


class RuntimeEnv(dict):
    """A runtime_env dict made from Ray's keyword fields (see the module)."""

    def __init__(self, *, py_modules=None, working_dir=None, pip=None, conda=None, container=None, env_vars=None,
                 worker_process_setup_hook=None, config=None, _validate=True, **kwargs):
        fields = {"py_modules": py_modules, "working_dir": working_dir, "pip": pip, "conda": conda,
                  "container": container, "env_vars": env_vars,
                  "worker_process_setup_hook": worker_process_setup_hook, "config": config, **kwargs}
        super().__init__({k: v for k, v in fields.items() if v is not None})

    @classmethod
    def from_dict(cls, runtime_env_dict):
        """A RuntimeEnv of a runtime_env dict's fields (Ray's
        RuntimeEnv.from_dict); checked where it is used, as any."""
        if not isinstance(runtime_env_dict, dict):
            raise TypeError(f"RuntimeEnv.from_dict takes a dict, not a {type(runtime_env_dict).__name__}")
        return cls(**runtime_env_dict)

    def to_dict(self):
        """A plain dict of the fields (Ray's RuntimeEnv.to_dict)."""
        return dict(self)

    def env_vars(self):
        return dict(self.get("env_vars") or {})

    def working_dir(self):
        return self.get("working_dir", "")

    def py_modules(self):
        return list(self.get("py_modules") or [])

    def has_working_dir(self):
        return "working_dir" in self

    def has_py_modules(self):
        return "py_modules" in self

    def has_pip(self):
        return "pip" in self
